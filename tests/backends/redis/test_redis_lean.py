"""The Redis backend's transports on a real server: which one a URL gets, the lean
connection (replies in step under cancellation, timeouts, reconnects, the URL's
database), and a release written before ``async with`` returns.

Each test uses a key prefix of its own on the shared test server and deletes its keys.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

import aiolease
from aiolease import AsyncLock, LossReason
from aiolease.abc import Grant
from aiolease.backends.redis import RedisBackend
from aiolease.backends.redis._keys import Keys
from aiolease.backends.redis._resp import LeanClient
from aiolease.backends.redis._transport import LeanTransport, RedisPyTransport
from aiolease.backends.redis._url import lean_endpoint
from tests.backends.redis.support import asyncio_only, in_database, inner, requests

pytestmark = pytest.mark.anyio
LONG = 30.0


@asynccontextmanager
async def lean(url: str, **options: Any) -> AsyncIterator[LeanClient]:
    """A lean client configured as the backend would configure it from ``url`` with
    ``options`` in its query."""
    query = "&".join(f"{key}={value}" for key, value in options.items())
    endpoint = lean_endpoint(f"{url}{'&' if '?' in url else '?'}{query}" if query else url, 5.0)
    assert endpoint is not None
    client = LeanClient(endpoint)
    try:
        yield client
    finally:
        await client.aclose()


def test_only_what_a_lean_connection_can_do_gets_one() -> None:
    endpoint = lean_endpoint("redis://u:p%40ss@h:1/2?client_name=x&socket_timeout=3", 5.0)
    assert endpoint is not None
    assert (endpoint.host, endpoint.port, endpoint.db, endpoint.timeout) == ("h", 1, 2, 3)
    assert (endpoint.username, endpoint.password, endpoint.client_name) == ("u", "p@ss", "x")
    assert endpoint.connect_timeout == 5.0
    sock = lean_endpoint("unix:///tmp/r.sock?db=4", 1.0)
    assert sock is not None and (sock.path, sock.db, sock.host) == ("/tmp/r.sock", 4, None)
    assert lean_endpoint("redis://h:1/2?db=3", 5.0) == lean_endpoint("redis://h:1/3", 5.0)
    assert lean_endpoint("rediss://h:1/0", 5.0) is None
    assert lean_endpoint("redis://h:1/0?protocol=3", 5.0) is None
    assert lean_endpoint("redis+cluster://h:1", 5.0) is None


async def test_the_transport_option_chooses_how_commands_travel(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    for choice, kind in (("auto", LeanTransport), ("lean", LeanTransport)):
        async with aiolease.open_backend(redis_url, prefix=prefix, transport=choice) as backend:
            assert isinstance(inner(backend)._wire, kind)
    async with aiolease.open_backend(redis_url, prefix=prefix, transport="redis-py") as backend:
        assert isinstance(inner(backend)._wire, RedisPyTransport)
        assert inner(backend).release_now("x", "me", 1) is None  # redis-py writes when awaited
    async with aiolease.open_backend(redis_url, prefix=prefix, wait_replicas=0) as backend:
        assert isinstance(inner(backend)._wire, LeanTransport)
    for bad in ("lean&wait_replicas=1", "tcp"):
        with pytest.raises(aiolease.InvalidArgument, match="transport"):
            await aiolease.open_backend(f"{redis_url}?transport={bad}").__aenter__()


@asyncio_only
async def test_replies_stay_in_step_when_callers_are_cancelled(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with lean(redis_url) as client:
        names = [f"{prefix}k{i}" for i in range(40)]
        for i, name in enumerate(names):
            await client.execute("SET", name, i)
        tasks = [asyncio.ensure_future(client.execute("GET", name)) for name in names]
        await asyncio.sleep(0)  # every GET is written
        for task in tasks[::2]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for i, (task, result) in enumerate(zip(tasks, results, strict=True)):
            assert task.cancelled() or result == str(i).encode(), (i, result)
        assert sum(task.cancelled() for task in tasks) > 0
        # the replies of the cancelled ones were dropped, not handed to later callers
        for i, name in enumerate(names):
            assert await client.execute("GET", name) == str(i).encode()


@asyncio_only
async def test_a_timeout_closes_the_connection_and_the_next_command_connects(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with lean(redis_url, socket_timeout=0.2) as client:
        with pytest.raises(RedisTimeoutError):
            await client.execute("BLPOP", f"{prefix}never", 30)
        assert await client.execute("PING") == b"PONG"


@asyncio_only
async def test_a_connection_the_server_closed_is_replaced(
    anyio_backend: str, redis_url: str
) -> None:
    name = f"aiolease-lean-{uuid.uuid4().hex[:8]}"
    async with lean(redis_url, client_name=name) as client:
        assert await client.execute("PING") == b"PONG"
        with redis.Redis.from_url(redis_url) as admin:
            (first,) = [c["id"] for c in admin.client_list() if c["name"] == name]
            admin.client_kill_filter(_id=first)
            with suppress(RedisConnectionError):  # the loss may be seen only now
                await client.execute("PING")
            assert await client.execute("PING") == b"PONG"
            (second,) = [c["id"] for c in admin.client_list() if c["name"] == name]
        assert second != first


async def test_the_lean_connection_uses_the_urls_database(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    url = in_database(redis_url, 5)
    async with aiolease.open_backend(url, prefix=prefix) as backend:
        granted = await backend.try_acquire("db", "me", LONG, "me", {})
        assert isinstance(granted, Grant)
    lease_key = Keys.of(prefix, "db").lease
    with redis.Redis.from_url(url) as in_5, redis.Redis.from_url(in_database(redis_url, 0)) as in_0:
        assert in_5.exists(lease_key) and not in_0.exists(lease_key)


@asyncio_only
async def test_a_block_sends_its_release_before_its_own_bookkeeping(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """Leaving ``async with`` writes the release first: the lease is ended, and its
    guards dropped, with the request on its way (a waiter that the release serves
    waits for the request, not for them). (Under trio, the asyncio bridge releases
    as :meth:`Lease.release` does.)"""
    async with aiolease.open_backend(redis_url, prefix=prefix) as backend:
        sent = requests(backend)
        ended: list[tuple[LossReason, int]] = []
        async with AsyncLock(backend, "first", ttl=LONG) as lease:
            assert sent["EVALSHA"] == 1
            lease._on_end(lambda reason: ended.append((reason, sent["EVALSHA"])))
        assert ended == [(LossReason.RELEASED, 2)]
        assert await backend.read("first") is None


@asyncio_only  # made directly: under trio, only open_backend() bridges it
async def test_a_subclass_with_a_release_of_its_own_has_it_called(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    class Noting(RedisBackend):
        releases = 0

        async def release(self, name: str, owner: str, token: int | None) -> bool:
            self.releases += 1
            return await super().release(name, owner, token)

    backend = await Noting.from_url(redis_url, prefix=prefix)
    try:
        async with AsyncLock(backend, "own", ttl=LONG):
            pass
        assert backend.releases == 1 and await backend.read("own") is None
    finally:
        await backend.aclose()
