"""What the Redis backend's pub/sub messages spare it, on a real server: fair hand-offs
confirmed by their message, a dropped subscription that still serves its waiter, and
watches that need no second read.

Each test uses a key prefix of its own on the shared test server and deletes its keys.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import anyio
import pytest
import redis

import aiolease
from aiolease import AsyncLock
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.redis._keys import Keys
from tests.backends.redis.support import (
    connections,
    inner,
    noting_waits,
    requests,
    subscribe,
    take_once,
)

pytestmark = pytest.mark.anyio
LONG = 30.0


def counted(backend: Backend) -> Counter[str]:
    """Count the scripts the RedisBackend behind ``backend`` runs, by name."""
    found = inner(backend)
    calls: Counter[str] = Counter()
    original = found._eval

    async def _eval(name: str, script: Any, keys: Any, *args: Any) -> Any:
        calls[script.name] += 1
        return await original(name, script, keys, *args)

    found._eval = _eval  # type: ignore[method-assign]
    return calls


def released_alone(sent: Counter[str]) -> bool:
    """Whether ``sent`` is one RELEASE script (and the ``PING`` it may start with)."""
    return sent["requests"] == sent["EVALSHA"] == 1 and set(sent) <= {"requests", "EVALSHA", "PING"}


async def test_a_fair_hand_off_is_confirmed_by_its_message(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        await subscribe(backend, "fair")
        holder = await AsyncLock(backend, "fair", ttl=LONG).acquire()
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo)
        attempted = anyio.current_time()  # the attempt was sent before this
        sent = requests(backend)
        with anyio.fail_after(LONG / 6):  # far below the waiter's retry (ttl / 3)
            async with anyio.create_task_group() as tg:
                tg.start_soon(backend.wait_turn, "fair", "waiter", LONG, refused)
                await holder.release()  # hands the lease to the waiter, and announces it
        granted = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(granted, Grant) and granted.token == holder.token + 1
        # the release alone: no wake-up list to wait on, no attempt to confirm the grant
        assert released_alone(sent), "the message should have confirmed the grant"
        # counted from the attempt: the hand-off came later, so the deadline is safe
        assert granted.sent_at is not None and granted.sent_at <= attempted
        assert 0 < granted.ttl <= LONG
        current = await backend.read("fair")
        assert current is not None and (current.owner, current.token) == ("waiter", granted.token)


async def test_an_older_hand_off_message_confirms_nothing(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """A message naming the waiter counts only if its token is newer than the holder its
    latest attempt was refused with; an older one only makes it look again."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        channel = Keys.of(prefix, "fair").channel
        await subscribe(backend, "fair")
        holder = await backend.try_acquire("fair", "holder", LONG, "holder", {})
        assert isinstance(holder, Grant)
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo)
        with redis.Redis.from_url(redis_url) as admin:  # as if a stale one arrived late
            admin.publish(channel, b"waiter\n%d:%d" % (holder.token, LONG * 1000))
        with anyio.fail_after(LONG / 6):
            await backend.wait_turn("fair", "waiter", LONG, refused)
        again = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(again, HolderInfo) and again.owner == "holder"
        assert await backend.release("fair", "holder", holder.token)
        assert await backend.release("fair", "waiter", None)


async def test_a_waiter_not_subscribed_since_its_attempt_subscribes_and_tries_again(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        holder = await backend.try_acquire("fair", "holder", LONG, "holder", {})
        assert isinstance(holder, Grant)  # no lock: nobody subscribed the channel
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo)
        with anyio.fail_after(LONG / 6):  # a hand-off might have come unheard: no wait
            await backend.wait_turn("fair", "waiter", LONG, refused)
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo)
        sent = requests(backend)
        with anyio.fail_after(LONG / 6):  # subscribed since this attempt: the message counts
            async with anyio.create_task_group() as tg:
                tg.start_soon(backend.wait_turn, "fair", "waiter", LONG, refused)
                assert await backend.release("fair", "holder", holder.token)
        granted = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(granted, Grant) and granted.token == holder.token + 1
        assert released_alone(sent)
        assert await backend.release("fair", "waiter", granted.token)


async def test_a_waiter_whose_subscription_dropped_still_gets_its_turn(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """The hand-off's message is lost with the connection: the waiter looks again once
    the channel is subscribed again, long before its own retry (ttl / 3)."""
    client_name = f"aiolease-dropped-{uuid.uuid4().hex[:8]}"
    url = f"{redis_url}?client_name={client_name}"
    async with aiolease.open_backend(url, prefix=prefix, fair=True) as backend:
        found = inner(backend)
        await subscribe(backend, "fair")
        holder = await backend.try_acquire("fair", "holder", LONG, "holder", {})
        assert isinstance(holder, Grant)
        waiting = noting_waits(found)  # set as it listens, before it first awaits
        got: list[int] = []

        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(take_once, backend, "fair", got)
                await waiting.wait()
                (killed,) = await anyio.to_thread.run_sync(
                    connections, redis_url, client_name, "pubsub"
                )
                with redis.Redis.from_url(redis_url) as admin:
                    admin.client_kill_filter(_id=killed)  # unsubscribed before it returns
                assert await backend.release("fair", "holder", holder.token)
        assert got == [holder.token + 1]


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
