"""Redlock URLs and clients: ``redis+redlock://host:port,host:port,host:port[/db]``.

``rediss+redlock://`` uses TLS to every instance. A user and password in the URL
apply to every instance. Query options (also accepted as keyword arguments of
:meth:`~aiolease.backends.redlock.RedlockBackend.from_url`): ``prefix``,
``request_timeout``, ``timeout``, ``drift_factor``, ``drift_floor``, ``fair``
(only ``0``: Redlock has no queue) and ``client_name``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ..._exceptions import InvalidArgument
from ..._urls import redact, scrub, split_url
from ..redis._shared import query_pairs

__all__ = [
    "OPTIONS",
    "SCHEMES",
    "Endpoint",
    "RedlockURL",
    "check_unique",
    "endpoint_of",
    "parse_url",
]

SCHEMES = ("redis+redlock", "rediss+redlock")
#: Options of aiolease's own in the query.
OPTIONS = ("prefix", "request_timeout", "timeout", "drift_factor", "drift_floor", "fair")
#: What the query passes to redis-py.
CLIENT_OPTIONS = ("client_name",)

#: Where an instance is: ``(host, port, db)``, or ``(path, 0, db)`` for a unix socket.
Endpoint = tuple[str, int, int]


@dataclass(frozen=True)
class RedlockURL:
    """A parsed Redlock URL."""

    endpoints: list[tuple[str, int]]
    db: int
    tls: bool
    credentials: dict[str, str] = field(default_factory=dict, repr=False)
    options: dict[str, str] = field(default_factory=dict)
    client_options: dict[str, str] = field(default_factory=dict)

    def clients(self, timeout: float) -> list[Redis]:
        """One redis-py client per instance (commands and connects time out after
        ``timeout`` seconds). A failed command is retried once, at once: the quorum,
        not redis-py's backoff (seconds by default), rides out an instance that is down."""
        options: dict[str, Any] = {**self.credentials, **self.client_options}
        return [
            Redis(
                host=host,
                port=port,
                db=self.db,
                ssl=self.tls,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 1),
                **options,
            )
            for host, port in self.endpoints
        ]


def _endpoints(url: str, hosts: str) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(
                scrub(f"Redlock URL {redact(url)!r}: {item!r} is not host:port", url)
            )
        found.append((host.lower(), int(port)))
    return found


def parse_url(url: str) -> RedlockURL:
    """:raises InvalidArgument: another scheme, no instance, a duplicate instance, a bad
    database or an unknown or repeated option"""
    parts = split_url(url, "Redlock")
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or parts.fragment:
        raise InvalidArgument(
            f"a Redlock URL is redis+redlock://host:port,host:port,...[/db], got {redact(url)!r}"
        )
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise InvalidArgument(f"Redlock URL {redact(url)!r} names no instance")
    endpoints = _endpoints(url, hosts)
    check_unique(f"Redlock URL {redact(url)!r}", [(h, p, 0) for h, p in endpoints])
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise InvalidArgument(f"Redlock URL {redact(url)!r}: the path must be a database number")
    query = query_pairs(url, parts.query, "Redlock URL")
    ours: dict[str, str] = {}
    theirs: dict[str, str] = {}
    for key, value in query:
        if key in ours or key in theirs or key not in OPTIONS + CLIENT_OPTIONS:
            raise InvalidArgument(
                f"Redlock URL option {key!r} is unknown or repeated; known:"
                f" {', '.join(OPTIONS + CLIENT_OPTIONS)}"
            )
        (ours if key in OPTIONS else theirs)[key] = value
    credentials: dict[str, str] = {}
    if at:
        user, _, password = userinfo.partition(":")
        if user:
            credentials["username"] = unquote(user)
        if password:
            credentials["password"] = unquote(password)
    return RedlockURL(
        endpoints, int(db or 0), scheme.startswith("rediss"), credentials, ours, theirs
    )


def endpoint_of(client: object) -> Endpoint:
    """Where a redis-py client connects.

    :raises InvalidArgument: not a ``redis.asyncio.Redis`` client of one server
    """
    if not isinstance(client, Redis):
        raise InvalidArgument(
            f"a Redlock instance must be a redis.asyncio.Redis client, not {type(client).__name__}"
        )
    pool = client.connection_pool
    if getattr(pool, "service_name", None) is not None:
        raise InvalidArgument("a Redlock instance must be one server, not a Sentinel's master")
    kwargs: dict[str, Any] = pool.connection_kwargs
    db = int(kwargs.get("db") or 0)
    if kwargs.get("path"):
        return (str(kwargs["path"]), 0, db)
    return (str(kwargs.get("host", "localhost")).lower(), int(kwargs.get("port", 6379)), db)


def check_unique(what: str, endpoints: Sequence[Endpoint]) -> None:
    """:raises InvalidArgument: no endpoint, or one named twice"""
    if not endpoints:
        raise InvalidArgument(f"{what}: a Redlock needs at least one instance (best 3 or 5)")
    seen: set[Endpoint] = set()
    for endpoint in endpoints:
        if endpoint in seen:
            host, port, db = endpoint
            raise InvalidArgument(
                f"{what}: instance {host}:{port} (db {db}) is named twice; the instances"
                " of a Redlock must be independent servers"
            )
        seen.add(endpoint)
