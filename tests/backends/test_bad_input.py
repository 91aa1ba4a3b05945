"""Bad input to public calls raises a typed aiolease error, and changes nothing.

On every backend, against the real servers and under both loops: a lock is held,
then bad calls are made (a ttl that overflowed MySQL's and etcd's integers, names
that raised ``AttributeError`` or read as free); each raises
:class:`InvalidArgument`, and the lock is still held, by the same grant, afterwards.
Then the options that used to fail late or not at all: an empty etcd prefix, and
Redis socket timeouts and pool sizes out of range.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

import aiolease
from aiolease import AsyncLock, Elector, InvalidArgument
from aiolease._validate import MAX_TTL
from aiolease.abc import Backend, Grant
from aiolease.backends.memory import MemoryBackend
from aiolease.backends.redis import RedisBackend

pytestmark = pytest.mark.anyio

#: Every backend's test server (memory and SQLite need none).
SERVICES = [
    "memory",
    "sqlite",
    "redis",
    "redis-cluster",
    "redis-sentinel",
    "redis-redlock",
    "postgres",
    "mariadb",
    "etcd",
    "mongo",
    "zookeeper",
]
BAD_NAMES: list[Any] = [123, "", "a\x00", "x" * 10240]


@pytest.fixture
def backend_url(
    request: pytest.FixtureRequest, aiolease_server: Callable[[str], str], tmp_path: Path
) -> str:
    service = str(request.param)
    if service == "memory":
        return "memory://"
    if service == "sqlite":
        return f"sqlite:///{tmp_path.as_posix()}/leases.db"
    return aiolease_server(service)


async def _refused(pending: Awaitable[object]) -> None:
    with pytest.raises(InvalidArgument):
        await pending


@pytest.mark.parametrize("backend_url", SERVICES, indirect=True)
async def test_bad_calls_raise_and_leave_a_held_lease_alone(
    anyio_backend: str, backend_url: str
) -> None:
    name = f"bad-input/{uuid.uuid4().hex}"
    async with aiolease.open_backend(backend_url) as backend:
        async with AsyncLock(backend, name, ttl=30) as lease:
            for ttl in (1e300, MAX_TTL * 2):
                with pytest.raises(InvalidArgument, match="ttl"):
                    AsyncLock(backend, name, ttl=ttl)
                with pytest.raises(InvalidArgument, match="ttl"):
                    Elector(backend, name, ttl=ttl)
                await _refused(backend.try_acquire(name, "other", ttl, "x", {}))
                await _refused(backend.renew(name, lease.owner, lease.token, ttl))
            for bad in BAD_NAMES:
                await _refused(backend.read(bad))
                await _refused(backend.try_acquire(bad, lease.owner, 30, "x", {}))
                await _refused(backend.release(bad, lease.owner, lease.token))
            holder = await backend.read(name)
            assert holder is not None
            assert (holder.owner, holder.token) == (lease.owner, lease.token)
            await lease.renew()
            assert lease.lost is None
        assert lease.lost is aiolease.LossReason.RELEASED
        assert await backend.read(name) is None


async def test_the_longest_ttl_is_accepted(anyio_backend: str) -> None:
    async with aiolease.open_backend("memory://") as backend:
        async with AsyncLock(backend, "year", ttl=MAX_TTL) as lease:
            assert lease.ttl == MAX_TTL
            grant = await backend.renew("year", lease.owner, lease.token, MAX_TTL)
            assert grant == Grant(lease.token, MAX_TTL)


async def test_release_now_with_a_bad_name_sends_nothing(anyio_backend: str) -> None:
    """``release_now`` must never raise: a bad name makes it decline (``None``)."""
    calls: list[str] = []

    class Eager(MemoryBackend):
        def release_now(self, name: str, owner: str, token: int) -> Any:
            calls.append(name)
            return self.release(name, owner, token)

    backend = Eager()
    assert backend.release_now("", "o", 1) is None
    assert calls == []
    assert await backend.release_now("n", "o", 1) is False
    assert calls == ["n"]


def test_wrapped_methods_keep_their_names_and_signatures() -> None:
    assert MemoryBackend.read.__name__ == "read"
    assert MemoryBackend.read.__wrapped__.__qualname__ == "MemoryBackend.read"  # type: ignore[attr-defined]
    assert Backend.__abstractmethods__ >= {"try_acquire", "renew", "release", "read"}


# -- options that failed late, or never ------------------------------------------------


@pytest.mark.parametrize("query", ["?prefix=", None])
async def test_an_empty_etcd_prefix_is_invalid(
    anyio_backend: str, aiolease_server: Callable[[str], str], query: str | None
) -> None:
    url = aiolease_server("etcd")
    options: dict[str, Any] = {"prefix": ""} if query is None else {}
    with pytest.raises(InvalidArgument, match="prefix must not be empty"):
        async with aiolease.open_backend(url + (query or ""), **options):
            pass  # pragma: no cover


@pytest.mark.parametrize(
    "query",
    [
        "socket_timeout=-1",
        "socket_timeout=0",
        "socket_connect_timeout=-1",
        "socket_timeout=nan",
        "timeout=inf",
        "max_connections=0",
        "max_connections=-3",
        "socket_read_size=0",
        "max_connections=many",
    ],
)
async def test_redis_timeouts_and_pool_sizes_out_of_range_are_invalid(
    anyio_backend: str, aiolease_server: Callable[[str], str], query: str
) -> None:
    url = aiolease_server("redis")
    with pytest.raises(InvalidArgument, match=query.partition("=")[0]):
        async with aiolease.open_backend(f"{url}?{query}"):
            pass  # pragma: no cover
    key = query.partition("=")[0]
    if key in ("socket_timeout", "socket_connect_timeout"):  # a Cluster URL takes these
        cluster = aiolease_server("redis-cluster")
        with pytest.raises(InvalidArgument, match=key):
            async with aiolease.open_backend(f"{cluster}?{query}"):
                pass  # pragma: no cover


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the client is redis-py's
async def test_redis_timeouts_and_pool_sizes_in_range_are_taken(
    anyio_backend: str, aiolease_server: Callable[[str], str]
) -> None:
    url = aiolease_server("redis")
    query = "socket_timeout=2.5&socket_connect_timeout=3&max_connections=7"
    async with await RedisBackend.from_url(f"{url}?{query}") as backend:
        assert isinstance(backend.client, Redis)
        pool = backend.client.connection_pool
        assert pool.connection_kwargs["socket_timeout"] == 2.5
        assert pool.max_connections == 7
