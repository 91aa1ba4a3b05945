"""``zookeeper://`` URLs and connection options.

::

    zookeeper://host[:port][,host[:port]...][/chroot][?option=value&...]

``zk://`` is the same. A host without a port gets 2181. The path, if any, is a chroot:
every node of the backend lives under it. Options (in the query, or as keyword
arguments to ``from_url``, not both): ``prefix`` (the node under the chroot that
holds the leases, default ``aiolease``), ``session_timeout`` (seconds asked of the
server for the backend's one session, default 10; the server clamps it into its
``[minSessionTimeout, maxSessionTimeout]``) and ``timeout`` (seconds one request may
take, default 5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

from ..._exceptions import InvalidArgument
from ..._urls import endpoints as parse_endpoints
from ..._urls import redact, split_url

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_SESSION_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "OPTIONS",
    "ZooKeeperUrl",
    "check_path",
    "client_of",
    "number_option",
    "parse_url",
]

#: ZooKeeper's client port.
DEFAULT_PORT = 2181
#: Seconds asked of the server for the session, unless ``session_timeout`` says otherwise.
DEFAULT_SESSION_TIMEOUT = 10.0
#: Seconds one request may take, unless ``timeout`` says otherwise.
DEFAULT_TIMEOUT = 5.0
#: Options taken by :meth:`ZooKeeperBackend.from_url
#: <aiolease.backends.zookeeper.ZooKeeperBackend.from_url>`.
OPTIONS = frozenset({"prefix", "session_timeout", "timeout"})
#: Characters ZooKeeper refuses in a path (besides the rules on ``.`` and ``..``).
_BAD_CHARS = {chr(c) for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))}


@dataclass(frozen=True)
class ZooKeeperUrl:
    """A parsed ``zookeeper://`` URL.

    :param endpoints: ``(host, port)`` of every server given
    :param chroot: the path every node lives under (``""``: the root)
    :param options: the query options (strings) and keyword options, merged
    """

    endpoints: tuple[tuple[str, int], ...]
    chroot: str
    options: Mapping[str, Any]

    def described(self) -> str:
        """The servers and chroot, for messages."""
        hosts = ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.endpoints
        )
        return hosts + self.chroot

    def connect_string(self) -> str:
        """The servers as the client takes them (``host:port,...``)."""
        return ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.endpoints
        )


def check_path(what: str, path: str) -> str:
    """``path`` as ZooKeeper takes it: ``/a/b`` components, no empty, ``.`` or ``..`` one,
    no control characters; ``""`` and ``"/"`` are the root (returned as ``""``).

    :raises InvalidArgument: it breaks one of those rules
    """
    if not isinstance(path, str):
        raise InvalidArgument(f"ZooKeeper {what} must be a str, not {type(path).__name__}")
    stripped = path.strip("/")
    if not stripped:
        return ""
    parts = stripped.split("/")
    for part in parts:
        if part in ("", ".", "..") or _BAD_CHARS & set(part):
            raise InvalidArgument(f"ZooKeeper {what} {path!r} is not a valid node path")
    return "/" + "/".join(parts)


def parse_url(url: str, options: Mapping[str, Any]) -> ZooKeeperUrl:
    """Split ``url`` and merge the keyword ``options`` in.

    :raises InvalidArgument: a malformed URL, an unknown option, or one given twice
    """
    parts = split_url(url, "ZooKeeper")
    if parts.scheme not in ("zookeeper", "zk"):
        raise InvalidArgument(f"a ZooKeeper URL starts with 'zookeeper://', got {redact(url)!r}")
    if parts.fragment:
        raise InvalidArgument(f"a ZooKeeper URL has no fragment, got {redact(url)!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if userinfo:
        raise InvalidArgument(
            f"ZooKeeper URL {redact(url)!r} has a user: this backend does not log in"
        )
    if not hosts:
        raise InvalidArgument(f"ZooKeeper URL {redact(url)!r} names no server")
    endpoints = parse_endpoints(url, hosts, what="ZooKeeper server", default_port=DEFAULT_PORT)
    chroot = check_path("chroot", unquote(parts.path))
    try:
        query = dict(
            parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
        )
    except ValueError:
        raise InvalidArgument(f"ZooKeeper URL {redact(url)!r} has a malformed query") from None
    for key in (*query, *options):
        if key not in OPTIONS:
            raise InvalidArgument(
                f"unknown ZooKeeper option {key!r}; known: {', '.join(sorted(OPTIONS))}"
            )
    twice = set(query) & set(options)
    if twice:
        raise InvalidArgument(
            f"ZooKeeper options given in the URL and as arguments: {sorted(twice)}"
        )
    return ZooKeeperUrl(endpoints, chroot, {**query, **options})


def client_of(connect: str, session_timeout: float, timeout: float) -> Any:
    """An ``aiozk.ZKClient`` of the backend's own for ``connect`` (its requests sent
    once each, its replies read by :mod:`._frames`)."""
    from aiozk import RetryPolicy, ZKClient

    from ._frames import install as install_frames

    # No retries inside aiozk: a request is sent once (see ._wire).
    client = ZKClient(
        connect,
        session_timeout=session_timeout,
        retry_policy=RetryPolicy(try_limit=1, sleep_func=lambda timings: 0),
        read_timeout=timeout,
    )
    install_frames(client)
    return client


def number_option(what: str, value: object) -> object:
    """A URL option's number (``None``: the default)."""
    if value is None:
        return DEFAULT_TIMEOUT if what == "timeout" else DEFAULT_SESSION_TIMEOUT
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise InvalidArgument(f"ZooKeeper option {what}={value!r} is not a number") from None
    return value
