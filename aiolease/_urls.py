"""Backend URLs in messages, reprs and log lines: a password never shows.

Every error about a URL, and every repr or log line that shows one, formats it with
:func:`redact`; text that may quote a URL's parts (a driver's own message) goes
through :func:`scrub`. Both work on any text, a malformed URL included: they never
raise, so an error about a URL never turns into another error.
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, unquote, urlsplit

from ._exceptions import InvalidArgument

__all__ = ["MASK", "endpoints", "redact", "scrub", "split_url"]

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
