"""Redis URLs: what goes to redis-py, the options that are aiolease's own, and where
a lean connection goes (:func:`lean_endpoint`).

See :mod:`aiolease.backends.redis` for the URL forms, and
:mod:`aiolease.backends.redis._clients` for the Cluster and Sentinel ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS

from ..._exceptions import InvalidArgument
from ..._urls import redact, scrub, split_url
from ..._validate import check_count, check_seconds
from ._clients import CLUSTER_SCHEMES, SENTINEL_SCHEMES

__all__ = [
    "OUR_OPTIONS",
    "SCHEMES",
    "Endpoint",
    "flag",
    "lean_endpoint",
    "parse_url",
    "query_pairs",
]

SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
#: Query options that redis-py takes as strings.
_REDIS_TEXT_OPTIONS = {
    "client_name",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_ca_data",
    "ssl_password",
}
OUR_OPTIONS = ("prefix", "fair", "wait_replicas", "wait_timeout", "transport")
#: redis-py's query options that are seconds (> 0), and counts (>= 1): checked here,
#: as redis-py takes -1 or 0 and fails later, or never.
_SECONDS = ("socket_timeout", "socket_connect_timeout", "timeout")
_COUNTS = ("max_connections", "socket_read_size")
#: What the query of a Cluster or Sentinel URL may also hold.
_MULTI_OPTIONS = {"socket_timeout", "socket_connect_timeout", "client_name", "sentinel_password"}
#: redis-py's query options that a lean connection honours (``max_connections`` sizes
#: redis-py's pool only); any other makes the URL redis-py's alone.
_LEAN_OPTIONS = {"db", "client_name", "socket_timeout", "socket_connect_timeout", "max_connections"}


@dataclass(frozen=True)
class Endpoint:
    """Where and how a lean connection connects (:mod:`aiolease.backends.redis._resp`)."""

    host: str | None
    port: int
    path: str | None
    db: int
    username: str | None
    password: str | None
    client_name: str | None
    timeout: float | None
    connect_timeout: float | None


def flag(key: str, value: object) -> bool:
    """``value`` as a bool (a bool, or ``1``/``0``, ``true``/``false``, ...).

    :raises InvalidArgument: anything else
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise InvalidArgument(f"Redis option {key} must be a bool (1/0, true/false), got {value!r}")


def query_pairs(url: str, query: str, what: str = "Redis URL") -> list[tuple[str, str]]:
    """The ``(key, value)`` pairs of ``url``'s query, blank values kept.

    :raises InvalidArgument: a malformed query
    """
    try:
        return parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise InvalidArgument(f"{what} {redact(url)!r} has a malformed query: {exc}") from None


def _check_number(key: str, value: str) -> None:
    """:raises InvalidArgument: ``value`` of a seconds or count option is out of range"""
    if key not in _SECONDS + _COUNTS:
        return
    try:
        number = float(value) if key in _SECONDS else int(value)
    except ValueError:
        raise InvalidArgument(f"Redis URL option {key} must be a number, got {value!r}") from None
    if key in _SECONDS:
        check_seconds(f"Redis URL option {key}", number)
    else:
        check_count(f"Redis URL option {key}", number)


def parse_url(url: str) -> tuple[str, dict[str, str]]:
    """Split a Redis URL into the URL redis-py gets and aiolease's own options.

    :raises InvalidArgument: another scheme, a malformed URL, or an unknown option
    """
    parts = split_url(url, "Redis")
    multi = parts.scheme.lower() in CLUSTER_SCHEMES + SENTINEL_SCHEMES
    try:
        if not multi:
            parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError as exc:
        raise InvalidArgument(scrub(f"malformed Redis URL {redact(url)!r}: {exc}", url)) from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or parts.fragment:
        raise InvalidArgument(
            "a Redis URL is redis://host[:port][/db], rediss://..., unix:///path,"
            f" redis+cluster://host:port,... or redis+sentinel://host:port,.../service,"
            f" got {redact(url)!r}"
        )
    if scheme == "unix" and parts.path in ("", "/"):
        raise InvalidArgument(f"Redis URL {redact(url)!r} names no socket path")
    if not multi and scheme != "unix" and parts.path not in ("", "/"):
        if not parts.path[1:].isdigit():
            raise InvalidArgument(f"Redis URL {redact(url)!r}: the path must be a database number")
    query = query_pairs(url, parts.query)
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    known = _MULTI_OPTIONS if multi else set(URL_QUERY_ARGUMENT_PARSERS) | _REDIS_TEXT_OPTIONS
    seen: set[str] = set()
    for key, value in query:
        if key in seen or (key not in known and key not in OUR_OPTIONS):
            raise InvalidArgument(
                f"Redis URL option {key!r} is unknown or repeated; aiolease's are "
                f"{', '.join(OUR_OPTIONS)}, redis-py's {', '.join(sorted(known))}"
            )
        if key.startswith("ssl") and not scheme.startswith("rediss"):
            raise InvalidArgument(
                f"Redis URL option {key!r} is a TLS option: it needs a rediss:// URL"
            )
        seen.add(key)
        _check_number(key, value)
        if key in OUR_OPTIONS:
            ours[key] = value
        else:
            theirs.append((key, value))
    rebuilt = f"{parts.scheme}://{parts.netloc}{parts.path}"
    if theirs:
        rebuilt += f"?{urlencode(theirs)}"
    return rebuilt, ours


def lean_endpoint(url: str, timeout: float) -> Endpoint | None:
    """Where a lean connection for ``url`` (as :func:`parse_url` gives it to redis-py)
    connects, read as redis-py reads it; ``None`` if only redis-py can do what the URL
    asks (TLS, Cluster, Sentinel, RESP3, or another option of redis-py's).

    :param timeout: the seconds a command and a connect take, unless the URL says
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = dict(parse_qsl(parts.query))
    if scheme not in ("redis", "unix") or not set(query) <= _LEAN_OPTIONS:
        return None
    # As redis-py: the query's db comes before the path's.
    db = query.get("db") or (parts.path.strip("/") if scheme == "redis" else "") or "0"
    return Endpoint(
        host=unquote(parts.hostname) if scheme == "redis" and parts.hostname else None,
        port=(parts.port or 6379) if scheme == "redis" else 6379,
        path=unquote(parts.path) if scheme == "unix" else None,
        db=int(db),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        client_name=query.get("client_name") or None,
        timeout=float(query.get("socket_timeout", timeout)),
        connect_timeout=float(query.get("socket_connect_timeout", timeout)),
    )
