"""Backend URLs in messages, reprs and log lines: a password never shows.

Every error about a URL, and every repr or log line that shows one, formats it with
:func:`redact`; text that may quote a URL's parts (a driver's own message) goes
through :func:`scrub`. Both work on any text, a malformed URL included: they never
raise, so an error about a URL never turns into another error.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from ._exceptions import InvalidArgument

__all__ = [
    "MASK",
    "EndpointsUrl",
    "endpoints",
    "parse_endpoints_url",
    "redact",
    "scrub",
    "split_url",
]

#: What a password is replaced by.
MASK = "***"

#: A query parameter that carries a secret (``password``, ``sentinel_password``,
#: ``ssl_password``, ...): its value is masked.
_SECRET_PARAM = re.compile(r"(?i)((?:^|[?&;])[^=&;#]*(?:password|passwd|secret)[^=&;#]*=)[^&;#]*")


#: Where :func:`urllib.parse.urlsplit` may cut a password that holds them unescaped.
_CUTS = re.compile(r"[/?#@]")


def _split(url: str) -> tuple[str, str, str, str]:
    """``(head, user, password, rest)`` of ``url``; ``password`` is ``""`` when it has none.

    The user information runs from ``//`` to the *last* ``@`` anywhere after it: a
    password may hold an unescaped ``/``, ``?``, ``#`` or ``@``, which a stricter
    parser would cut short and so show in part. An ``@`` later in a URL without a
    password masks too much, never too little.
    """
    start = url.find("//")
    at = url.rfind("@")
    if start < 0 or at < start:
        return url, "", "", ""
    userinfo = url[start + 2 : at]
    user, colon, password = userinfo.partition(":")
    if not colon:
        return url, "", "", ""
    return url[: start + 2], user, password, url[at:]


def redact(url: object) -> str:
    """``url`` fit to show: its password (and any ``...password=`` in the query) is
    replaced by :data:`MASK`. Anything that is not a str is shown as its type."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    head, user, password, rest = _split(url)
    if password:
        url = f"{head}{user}:{MASK}{rest}"
    query = url.find("?")
    if query >= 0:
        url = url[:query] + _SECRET_PARAM.sub(rf"\1{MASK}", url[query:])
    return url


def _secrets(url: str) -> list[str]:
    """The passwords in ``url`` as written and decoded, and the pieces of them that a
    stricter parser may have cut apart at ``/``, ``?``, ``#`` or ``@``; longest first."""
    found = {_split(url)[2]}
    query = url.find("?")
    if query >= 0:
        found.update(m.group(0)[len(m.group(1)) :] for m in _SECRET_PARAM.finditer(url[query:]))
    found |= {unquote(s) for s in found}
    found |= {piece for s in found for piece in _CUTS.split(s)}
    found.discard("")
    return sorted(found, key=len, reverse=True)


def scrub(text: str, url: object) -> str:
    """``text`` (a message that may quote ``url`` or its parts) with ``url`` shown by
    :func:`redact` and each of its passwords replaced by :data:`MASK`."""
    if not isinstance(url, str) or not url:
        return text
    text = text.replace(url, redact(url))
    for secret in _secrets(url):
        text = text.replace(secret, MASK)
    return text


def split_url(url: object, what: str) -> SplitResult:
    """``urlsplit(url)``, for a parser of ``what`` URLs (``"Redis"``, ...).

    :raises InvalidArgument: ``url`` is not a str, or is malformed (an unclosed ``[``)
    """
    if not isinstance(url, str):
        raise InvalidArgument(f"a {what} URL must be a str, not {type(url).__name__}")
    try:
        return urlsplit(url)
    except ValueError as exc:
        raise InvalidArgument(f"malformed {what} URL {redact(url)!r}: {exc}") from None


def endpoints(url: str, hosts: str, *, what: str, default_port: int) -> tuple[tuple[str, int], ...]:
    """The ``(host, port)`` of each comma-separated ``host[:port]`` of ``hosts`` (the
    netloc of ``url`` after any user part); an IPv6 address bare or in brackets; the
    port ``default_port`` where none is given.

    :raises InvalidArgument: a part without a host, or with a bad port, naming it as a
        ``what`` (``"etcd endpoint"``, say) of ``url``, the password masked
    """
    return tuple(_endpoint(url, part.strip(), what, default_port) for part in hosts.split(","))


def _endpoint(url: str, part: str, what: str, default_port: int) -> tuple[str, int]:
    if part.startswith("["):  # [v6]:port
        host, _, rest = part[1:].partition("]")
        port = rest.removeprefix(":")
    elif part.count(":") > 1:  # a bare IPv6 address
        host, port = part, ""
    else:
        host, _, port = part.partition(":")
    why = None
    if not host:
        why = "has no host"
    elif port and not port.isdigit():
        why = "has a bad port"
    elif not 0 < (int(port) if port else default_port) < 65536:
        why = "has a port out of range"
    if why is not None:
        raise InvalidArgument(scrub(f"{what} {part!r} of {redact(url)!r} {why}", url))
    return host, int(port) if port else default_port


@dataclass(frozen=True)
class EndpointsUrl:
    """A parsed ``scheme://[user[:password]@]host[:port][,host[:port]...][?options]``.

    :param endpoints: ``(host, port)`` of every server given
    :param user: user and password, if given
    :param options: the query options (strings) and keyword options, merged
    """

    endpoints: tuple[tuple[str, int], ...]
    user: tuple[str, str] | None = field(repr=False)
    options: Mapping[str, Any]

    def described(self) -> str:
        """The endpoints, for messages (never the password)."""
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)


def parse_endpoints_url(
    url: str,
    options: Mapping[str, Any],
    *,
    scheme: str,
    what: str,
    server: str,
    known: Collection[str],
    default_port: int,
    path_hint: str,
) -> EndpointsUrl:
    """Split a URL of a list of servers (etcd's, Kafka's) and merge keyword ``options`` in.

    :param what: the URL kind in messages, with its article (``"an etcd"``)
    :param server: what one server is called in messages (``"etcd endpoint"``)
    :param known: the option names the backend takes
    :param path_hint: what to say to a URL with a path
    :raises InvalidArgument: a malformed URL, an unknown option, or one given twice;
        the password masked in every message
    """
    kind = what.partition(" ")[2]
    parts = split_url(url, kind)
    if parts.scheme != scheme:
        raise InvalidArgument(f"{what} URL starts with '{scheme}://', got {redact(url)!r}")
    if parts.path not in ("", "/") or parts.fragment:
        raise InvalidArgument(f"{what} URL has no path ({path_hint}), got {redact(url)!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise InvalidArgument(f"{kind} URL {redact(url)!r} names no {server.rpartition(' ')[2]}")
    servers = endpoints(url, hosts, what=server, default_port=default_port)
    user = None
    if userinfo:
        name, _, password = userinfo.partition(":")
        user = (unquote(name), unquote(password))
    try:
        query = dict(
            parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
        )
    except ValueError:
        raise InvalidArgument(f"{kind} URL {redact(url)!r} has a malformed query") from None
    for key in (*query, *options):
        if key not in known:
            raise InvalidArgument(
                f"unknown {kind} option {key!r}; known: {', '.join(sorted(known))}"
            )
    twice = set(query) & set(options)
    if twice:
        raise InvalidArgument(f"{kind} options given in the URL and as arguments: {sorted(twice)}")
    return EndpointsUrl(servers, user, {**query, **options})
