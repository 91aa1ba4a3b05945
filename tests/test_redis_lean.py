"""The Redis backend's fast paths on a real server: the lean connection, fair hand-offs
confirmed by the wake-up, and watches that need no second read.

Each test uses a key prefix of its own on the shared test server and deletes its keys.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis_support import delete_under, new_prefix

import aiolease
from aiolease import AsyncLock
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends._redis_resp import Endpoint, LeanClient
from aiolease.backends._redis_scripts import Keys
from aiolease.backends.redis import RedisBackend
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.proxy import FaultProxy

pytestmark = pytest.mark.anyio
asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])
LONG = 30.0


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test alone; its keys are deleted afterwards."""
    prefix = new_prefix("lean")
    yield prefix
    delete_under(prefix, (redis.Redis.from_url(redis_url, db=db) for db in (0, 5)))


@asynccontextmanager
async def lean(url: str, **options: Any) -> AsyncIterator[LeanClient]:
    """A lean client configured as the backend would configure it from ``url``."""
    made = redis.asyncio.Redis.from_url(url, **options)
    pool = made.connection_pool
    endpoint = Endpoint.of(pool.connection_class.__name__, pool.connection_kwargs)
    assert endpoint is not None
    client = LeanClient(endpoint)
    try:
        yield client
    finally:
        await client.aclose()
        await made.aclose()


def counted(backend: Backend) -> Counter[str]:
    """Count the scripts the RedisBackend behind ``backend`` runs, by name."""
    found = getattr(backend, "inner", backend)
    assert isinstance(found, RedisBackend)
    calls: Counter[str] = Counter()
    original = found._eval

    async def _eval(name: str, script: Any, keys: Any, *args: Any) -> Any:
        calls[script.name] += 1
        return await original(name, script, keys, *args)

    found._eval = _eval  # type: ignore[method-assign]
    return calls


def test_only_what_a_lean_connection_can_do_gets_one() -> None:
    plain = redis.asyncio.Redis.from_url("redis://h:1/2?client_name=x", socket_timeout=3)
    endpoint = Endpoint.of(
        plain.connection_pool.connection_class.__name__, plain.connection_pool.connection_kwargs
    )
    assert endpoint is not None and (endpoint.host, endpoint.db, endpoint.timeout) == ("h", 2, 3)
    tls = redis.asyncio.Redis.from_url("rediss://h:1/0")
    pool = tls.connection_pool
    assert Endpoint.of(pool.connection_class.__name__, pool.connection_kwargs) is None
    resp3 = redis.asyncio.Redis.from_url("redis://h:1/0", protocol=3)
    pool = resp3.connection_pool
    assert Endpoint.of(pool.connection_class.__name__, pool.connection_kwargs) is None


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
    url = redis_url.rsplit("/", 1)[0] + "/5"
    async with aiolease.open_backend(url, prefix=prefix) as backend:
        granted = await backend.try_acquire("db", "me", LONG, "me", {})
        assert isinstance(granted, Grant)
    lease_key = Keys.of(prefix, "db").lease
    with redis.Redis.from_url(url) as in_5, redis.Redis.from_url(redis_url, db=0) as in_0:
        assert in_5.exists(lease_key) and not in_0.exists(lease_key)


async def test_a_fair_hand_off_is_confirmed_by_the_wake_up(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        calls = counted(backend)
        holder = await AsyncLock(backend, "fair", ttl=LONG).acquire()
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo)
        attempted = anyio.current_time()  # the attempt was sent before this
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.wait_turn, "fair", "waiter", LONG, refused)
            await holder.release()  # hands the lease to the waiter, and wakes it
        acquires = calls["acquire"]
        granted = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(granted, Grant) and granted.token == holder.token + 1
        assert calls["acquire"] == acquires, "the wake-up should have confirmed the grant"
        # counted from the attempt: the hand-off came later, so the deadline is safe
        assert granted.sent_at is not None and granted.sent_at <= attempted
        assert 0 < granted.ttl <= LONG
        current = await backend.read("fair")
        assert current is not None and (current.owner, current.token) == ("waiter", granted.token)


async def test_a_watch_from_the_latest_read_reads_no_more_and_misses_no_change(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix) as backend:
        calls = counted(backend)
        granted = await backend.try_acquire("watched", "x", LONG, "x", {})
        assert isinstance(granted, Grant)
        await backend.wait_changed("watched", None)  # held: returns at once, and subscribes
        seen = await backend.read("watched")
        reads = calls["read"]
        with anyio.move_on_after(0.2):  # nothing changes: it waits, and reads nothing
            await backend.wait_changed("watched", seen)
        assert calls["read"] == reads
        seen = await backend.read("watched")
        assert await backend.release("watched", "x", granted.token)  # a change after the read
        with anyio.fail_after(LONG / 3):  # it would wait out the holder's ttl otherwise
            await backend.wait_changed("watched", seen)


async def test_renewals_slower_than_a_third_of_the_ttl_still_confirm(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    host, port = redis_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    async with FaultProxy(host, int(port)) as proxy:
        async with aiolease.open_backend(proxy.url_for(redis_url), prefix=prefix) as backend:
            # Round trips of about 2.4 s: longer than ttl / 3 (2 s), which a batch is
            # allowed to be old when a renewal joins it, shorter than the renew interval.
            faulty = FaultyBackend(backend)
            lock = AsyncLock(faulty, "slow", ttl=6.0, renew_interval=2.9, margin=0.05)
            async with lock as lease:
                await proxy.delay(1.2)
                with anyio.fail_after(30):
                    for _ in range(3):  # the third renewal starts when the second has ended
                        await faulty.wait_called("renew")
                assert lock.statistics().renewals >= 2
                assert lease.lost is None
                await proxy.pass_through()
