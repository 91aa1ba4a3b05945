"""The redis-py clients the Redis backend talks through: one server, a Cluster, or
a master that Sentinel names.

URLs (aiolease's own options, ``prefix``, ``fair``, ``wait_replicas`` and
``wait_timeout``, are taken out before this module sees the query)::

    redis://host[:port][/db]                 one server (redis-py's own URL)
    redis+cluster://host:port[,host:port...] Redis Cluster: any of its nodes
    redis+sentinel://host:port[,host:port...]/service[/db]
                                             the master Sentinel knows as ``service``

``rediss+cluster`` and ``rediss+sentinel`` use TLS to the servers (a Sentinel
itself is reached without TLS, as redis-py does). A password in the URL is the
servers' (for Sentinel, also the sentinels'). Query options: ``socket_timeout``,
``socket_connect_timeout``, ``client_name``, and for Sentinel ``sentinel_password``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel

from ..._exceptions import InvalidArgument
from ..._urls import redact, scrub

__all__ = [
    "Client",
    "Made",
    "Replication",
    "connection_kwargs",
    "make_multi",
    "single_server",
    "where",
]

#: A client the backend accepts.
Client: TypeAlias = "Redis | RedisCluster"

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_FLOATS = ("socket_timeout", "socket_connect_timeout")
_TEXTS = ("client_name", "sentinel_password")


@dataclass
class Made:
    """A client made from a URL, and what else to close with it."""

    client: Client
    also_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


def connection_kwargs(client: Client) -> dict[str, Any]:
    """The keyword arguments the client opens its connections with."""
    if isinstance(client, RedisCluster):
        return dict(client.get_connection_kwargs())
    return dict(client.connection_pool.connection_kwargs)


def single_server(client: Client) -> bool:
    """Whether the client talks to one fixed server (not a Cluster, not via Sentinel)."""
    if isinstance(client, RedisCluster):
        return False
    return getattr(client.connection_pool, "service_name", None) is None


def where(client: Client) -> str:
    """Where the client connects, for a repr."""
    if isinstance(client, RedisCluster):
        nodes = ",".join(f"{n.host}:{n.port}" for n in client.get_nodes()[:3])
        return f"cluster {nodes or '?'}"
    kwargs = client.connection_pool.connection_kwargs
    service = getattr(client.connection_pool, "service_name", None)
    if service is not None:
        return f"sentinel service {service!r}"
    return str(kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}")


def _addresses(url: str, parts: SplitResult) -> list[tuple[str, int]]:
    hosts = parts.netloc.rpartition("@")[2]
    found: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(
                scrub(f"Redis URL {redact(url)!r}: {item!r} is not host:port", url)
            )
        found.append((host.strip("[]"), int(port)))
    return found


def _options(url: str, query: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in allowed or key in options:
            raise InvalidArgument(
                f"Redis URL option {key!r} is unknown or repeated here; known: {', '.join(allowed)}"
            )
        if key in _FLOATS:
            try:
                options[key] = float(value)
            except ValueError:
                raise InvalidArgument(f"Redis URL {redact(url)!r}: {key} must be seconds") from None
        else:
            options[key] = value
    return options


def _credentials(parts: SplitResult) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if parts.username:
        found["username"] = unquote(parts.username)
    if parts.password:
        found["password"] = unquote(parts.password)
    return found


def make_multi(url: str, defaults: dict[str, Any]) -> Made:
    """Make a Cluster or Sentinel client from ``url`` (see the module docstring).

    :param defaults: connection options the URL's query may override
    :raises InvalidArgument: a malformed URL
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    addresses = _addresses(url, parts)
    tls = scheme.startswith("rediss")
    common = {**defaults, **_credentials(parts)}
    if scheme in CLUSTER_SCHEMES:
        if parts.path not in ("", "/"):
            raise InvalidArgument(f"Redis Cluster URL {redact(url)!r}: a cluster has no databases")
        options = {**common, **_options(url, parts.query, (*_FLOATS, "client_name"))}
        nodes = [ClusterNode(host, port) for host, port in addresses]
        return Made(RedisCluster(startup_nodes=nodes, ssl=tls, **options))
    service, _, db = parts.path.strip("/").partition("/")
    if not service or (db and not db.isdigit()):
        raise InvalidArgument(
            "a Sentinel URL is redis+sentinel://host:port[,host:port]/service[/db],"
            f" got {redact(url)!r}"
        )
    options = {**common, **_options(url, parts.query, (*_FLOATS, *_TEXTS))}
    sentinel_kwargs = {k: options[k] for k in _FLOATS if k in options}
    if "sentinel_password" in options:
        sentinel_kwargs["password"] = options.pop("sentinel_password")
    sentinel = Sentinel(addresses, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
    client = sentinel.master_for(unquote(service), db=int(db or 0), ssl=tls, **options)
    closers: list[Callable[[], Awaitable[None]]] = [s.aclose for s in sentinel.sentinels]
    return Made(client, closers)


@dataclass(frozen=True)
class Replication:
    """The ``WAIT`` that follows each grant and renewal (``replicas=0``: none).

    :param replicas: how many replicas must have the write
    :param timeout_ms: how long ``WAIT`` may block for them
    """

    replicas: int
    timeout_ms: int

    @classmethod
    def of(cls, client: Client, replicas: object, timeout: object) -> Replication:
        """:raises InvalidArgument: a negative count, a bad timeout, or a Cluster client
        (there ``WAIT`` would reach a random node, not the one that took the write)"""
        try:
            count = int(str(replicas))
            seconds = float(str(timeout))
        except ValueError:
            raise InvalidArgument(
                f"wait_replicas must be an int and wait_timeout seconds, got {replicas!r}"
                f" and {timeout!r}"
            ) from None
        if count < 0 or not 0 < seconds < 3600:
            raise InvalidArgument(
                f"wait_replicas must be >= 0 and wait_timeout in (0, 3600) s, got {replicas!r}"
                f" and {timeout!r}"
            )
        if count and isinstance(client, RedisCluster):
            raise InvalidArgument("wait_replicas is not supported with Redis Cluster")
        return cls(count, max(int(seconds * 1000), 1))
