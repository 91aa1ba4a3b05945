"""``etcd://`` URLs and connection options.

::

    etcd://[user[:password]@]host[:port][,host[:port]...][?option=value&...]

A host without a port gets 2379. Options (in the query, or as keyword arguments to
``from_url``, not both): ``prefix``, ``fair``, ``timeout``, ``session_idle``, and for
TLS ``tls`` (``1``/``0``), ``ca_file``, ``cert_file``, ``key_file`` (giving any of
the files turns TLS on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

from ..._exceptions import InvalidArgument
from ..._urls import endpoints as parse_endpoints
from ..._urls import redact, split_url

__all__ = ["DEFAULT_PORT", "EtcdUrl", "parse_bool", "parse_url"]

#: etcd's client port.
DEFAULT_PORT = 2379
#: Options taken by :meth:`EtcdBackend.from_url <aiolease.backends.etcd.EtcdBackend.from_url>`.
OPTIONS = frozenset(
    {"prefix", "fair", "timeout", "session_idle", "tls", "ca_file", "cert_file", "key_file"}
)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class EtcdUrl:
    """A parsed ``etcd://`` URL.

    :param endpoints: ``(host, port)`` of every member given
    :param user: user and password, if given
    :param options: the query options (strings) and keyword options, merged
    """

    endpoints: tuple[tuple[str, int], ...]
    user: tuple[str, str] | None = field(repr=False)
    options: Mapping[str, Any]

    def described(self) -> str:
        """The endpoints, for messages (never the password)."""
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)


def parse_bool(what: str, value: object) -> bool:
    """:raises InvalidArgument: ``value`` is neither a bool nor a yes/no string"""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidArgument(f"etcd option {what}={value!r} is not a yes/no value")


def parse_url(url: str, options: Mapping[str, Any]) -> EtcdUrl:
    """Split ``url`` and merge the keyword ``options`` in.

    :raises InvalidArgument: a malformed URL, an unknown option, or one given twice
    """
    parts = split_url(url, "etcd")
    if parts.scheme != "etcd":
        raise InvalidArgument(f"an etcd URL starts with 'etcd://', got {redact(url)!r}")
    if parts.path not in ("", "/") or parts.fragment:
        raise InvalidArgument(
            f"an etcd URL has no path (give the key prefix as ?prefix=...), got {redact(url)!r}"
        )
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise InvalidArgument(f"etcd URL {redact(url)!r} names no endpoint")
    endpoints = parse_endpoints(url, hosts, what="etcd endpoint", default_port=DEFAULT_PORT)
    user = None
    if userinfo:
        name, _, password = userinfo.partition(":")
        user = (unquote(name), unquote(password))
    try:
        query = dict(
            parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
        )
    except ValueError:
        raise InvalidArgument(f"etcd URL {redact(url)!r} has a malformed query") from None
    for key in (*query, *options):
        if key not in OPTIONS:
            raise InvalidArgument(
                f"unknown etcd option {key!r}; known: {', '.join(sorted(OPTIONS))}"
            )
    twice = set(query) & set(options)
    if twice:
        raise InvalidArgument(f"etcd options given in the URL and as arguments: {sorted(twice)}")
    return EtcdUrl(endpoints, user, {**query, **options})
