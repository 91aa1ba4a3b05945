"""Takeover watches by callback on the Redis backend (``on_taken``), on a real server.

A lease granted while its name's channel is subscribed is watched from the pub/sub
messages the backend already receives: no watch task and no read per held lease.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import redis

import aiolease
from aiolease import AsyncLock, LeaseLostError, LossReason
from aiolease._bridge import adapt
from aiolease.abc import Backend, HolderInfo
from aiolease.backends.redis import RedisBackend
from tests.backends.redis.support import new_name, subscribe

pytestmark = pytest.mark.anyio

LONG = 30.0
#: A ttl whose renewals never come during a test: only a pub/sub message can end it.
NO_RENEWALS = 600.0


@asynccontextmanager
async def counted(url: str, **options: Any) -> AsyncIterator[tuple[Backend, Counter[str]]]:
    """A backend, and how often its ``wait_taken`` and ``read`` were called."""
    async with aiolease.open_backend(url, **options) as backend:
        found = getattr(backend, "inner", backend)
        assert isinstance(found, RedisBackend)
        calls: Counter[str] = Counter()
        wait_taken, read = found.wait_taken, found.read

        async def counted_wait_taken(name: str, held: HolderInfo) -> None:
            calls["wait_taken"] += 1
            await wait_taken(name, held)

        async def counted_read(name: str) -> HolderInfo | None:
            calls["read"] += 1
            return await read(name)

        found.wait_taken = counted_wait_taken  # type: ignore[method-assign]
        found.read = counted_read  # type: ignore[method-assign]
        yield backend, calls


async def steal(backend: Backend, name: str, owner: str) -> None:
    """Free ``name`` as ``owner`` would, and grant it to a thief."""
    with anyio.CancelScope(shield=True):
        inner = adapt(getattr(backend, "inner", backend))
        assert await inner.release(name, owner, None)
        await inner.try_acquire(name, "thief", LONG, "thief", {})


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_a_takeover_ends_a_lease_granted_while_subscribed(
    anyio_backend: str, redis_url: str, prefix: str, fair: bool
) -> None:
    async with counted(redis_url, prefix=prefix, fair=fair) as (backend, calls):
        name = new_name()
        await subscribe(backend, name)
        calls.clear()
        with anyio.fail_after(LONG), pytest.raises(LeaseLostError) as info:
            async with AsyncLock(backend, name, ttl=NO_RENEWALS) as lease:
                await steal(backend, name, lease.owner)
                await anyio.sleep_forever()
        assert info.value.reason is LossReason.STOLEN
        assert calls == Counter()  # no watch task, no read: the thief's message ended it
        await adapt(backend).release(name, "thief", None)


async def test_a_takeover_ends_a_lease_handed_off_while_subscribed(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """A hand-off's message names its owner with the grant's token and ttl: the new
    holder's watch counts it as its own grant, and the thief's after it ends the lease."""
    async with counted(redis_url, prefix=prefix, fair=True) as (backend, calls):
        name = new_name()
        await subscribe(backend, name)
        first = await AsyncLock(backend, name, ttl=NO_RENEWALS).acquire()
        calls.clear()
        handed, waiting = anyio.Event(), anyio.Event()
        found = getattr(backend, "inner", backend)
        wait_turn = found.wait_turn

        async def noted_wait_turn(name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
            waiting.set()
            await wait_turn(name, owner, ttl, seen)

        found.wait_turn = noted_wait_turn  # type: ignore[method-assign]

        async def second() -> None:
            with pytest.raises(LeaseLostError) as info:
                async with AsyncLock(backend, name, ttl=NO_RENEWALS) as lease:
                    handed.set()
                    await steal(backend, name, lease.owner)
                    await anyio.sleep_forever()
            assert info.value.reason is LossReason.STOLEN

        with anyio.fail_after(LONG):
            async with anyio.create_task_group() as tg:
                tg.start_soon(second)
                await waiting.wait()
                await first.release()
        assert handed.is_set()
        assert calls == Counter()  # no watch task, no read: the thief's message ended it
        await adapt(backend).release(name, "thief", None)


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_older_messages_end_no_lease(
    anyio_backend: str, redis_url: str, prefix: str, fair: bool
) -> None:
    """Many hand-offs: each holder hears messages of grants before its own (in fair
    mode, those since its first attempt), which must not end its lease."""
    async with counted(redis_url, prefix=prefix, fair=fair) as (backend, calls):
        name = new_name()
        await subscribe(backend, name)
        calls.clear()
        holds = 0

        async def contend() -> None:
            nonlocal holds
            for _ in range(15):
                async with AsyncLock(backend, name, ttl=LONG):
                    holds += 1
                    await anyio.sleep(0.001)

        with anyio.fail_after(LONG):
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(contend)
        assert holds == 75
        assert calls["wait_taken"] == 0


def subscribers(url: str, client_name: str) -> list[str]:
    """The ids of the pub/sub connections called ``client_name`` subscribed to a channel."""
    with redis.Redis.from_url(url) as admin:
        return [
            c["id"]
            for c in admin.client_list(_type="pubsub")
            if c.get("name") == client_name and int(c.get("sub", 0)) > 0
        ]


async def test_a_takeover_after_the_pubsub_connection_failed_ends_the_lease(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """Once the channel is subscribed again, later messages count."""
    client_name = f"aiolease-takeover-{uuid.uuid4().hex[:8]}"
    url = f"{redis_url}?client_name={client_name}"
    async with counted(url, prefix=prefix) as (backend, calls):
        name = new_name()
        await subscribe(backend, name)
        with anyio.fail_after(LONG), pytest.raises(LeaseLostError) as info:
            async with AsyncLock(backend, name, ttl=NO_RENEWALS) as lease:
                (killed,) = await anyio.to_thread.run_sync(subscribers, redis_url, client_name)
                with redis.Redis.from_url(redis_url) as admin:
                    admin.client_kill_filter(_id=killed)
                # The backend connects again and subscribes (no event tells the test) ...
                while True:
                    found = await anyio.to_thread.run_sync(subscribers, redis_url, client_name)
                    if found not in ([], [killed]):
                        break
                    await anyio.sleep(0.01)
                # ... and this watch returns once it has confirmed the subscription.
                await backend.wait_changed(name, None)
                await steal(backend, name, lease.owner)
                await anyio.sleep_forever()
        assert info.value.reason is LossReason.STOLEN
        assert calls["wait_taken"] == 0
        await adapt(backend).release(name, "thief", None)
