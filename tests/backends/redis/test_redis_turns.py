"""Fair hand-offs wake only the waiters they concern, on a real server.

A release hands the lease to the queue's head and tells it on its backend's turns
channel; the waiter behind it is told how long that grant lasts, in case the head
is dead. Nobody else hears of it, unless somebody watches the name
(``wait_changed``), which the release then announces it to.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import anyio
import pytest
import redis

import aiolease
from aiolease import AsyncLock, Lease
from aiolease._bridge import adapt
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.redis._keys import Keys
from aiolease.backends.redis._tickets import handed, next_in_line
from tests.backends.redis.support import Tap, inner, new_name, subscribe
from tests.support import eventually

pytestmark = pytest.mark.anyio

LONG = 30.0


def heard(backend: Backend, channel: bytes) -> list[bytes]:
    """The messages of ``channel`` that ``backend`` received lately (oldest first)."""
    entry = inner(backend)._subscriptions._channels.get(channel)
    return [] if entry is None else list(entry.recent)


def turns(backend: Backend) -> bytes:
    """The channel on which ``backend``'s waiters are told of their turn."""
    channel = inner(backend)._turns
    assert channel
    return channel


async def fair_backends(stack: AsyncExitStack, url: str, prefix: str, count: int) -> list[Backend]:
    """``count`` fair backends, stand-ins for as many processes."""
    return [
        await stack.enter_async_context(aiolease.open_backend(url, prefix=prefix, fair=True))
        for _ in range(count)
    ]


async def queued(backend: Backend, name: str, owner: str, ttl: float = LONG) -> HolderInfo:
    """``owner`` refused and queued on ``name``, with ``backend`` subscribed since."""
    refused = await backend.try_acquire(name, owner, ttl, owner, {})
    assert isinstance(refused, HolderInfo)
    with anyio.fail_after(5):  # not subscribed at the attempt: it subscribes, waits not
        await backend.wait_turn(name, owner, ttl, refused)
    refused = await backend.try_acquire(name, owner, ttl, owner, {})
    assert isinstance(refused, HolderInfo)
    return refused


async def test_a_hand_off_wakes_only_the_waiters_it_concerns(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    name = new_name()
    channel = Keys.of(prefix, name).channel
    async with AsyncExitStack() as stack:
        a, b, c, d = await fair_backends(stack, redis_url, prefix, 4)
        holder = await a.try_acquire(name, "a", LONG, "a", {})
        assert isinstance(holder, Grant)
        refused = {
            owner: await queued(bk, name, owner) for owner, bk in zip("bcd", (b, c, d), strict=True)
        }
        with anyio.fail_after(LONG / 6):  # far below the retries (ttl / 3)
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.wait_turn, name, "b", LONG, refused["b"])
                assert await a.release(name, "a", holder.token)
        granted = await b.try_acquire(name, "b", LONG, "b", {})
        assert isinstance(granted, Grant) and granted.token == holder.token + 1
        # Messages come in publishing order: once each backend has the one published
        # after the release, it has all the release published.
        with redis.Redis.from_url(redis_url) as admin:
            admin.publish(channel, b"")
        for backend in (b, c, d):

            def got_it(bk: Backend = backend) -> bool:
                return b"" in heard(bk, channel)

            await eventually(got_it, "the last message")
        for backend in (b, c, d):
            assert heard(backend, channel) == [b""], "the hand-off was announced to everybody"
        told = handed(heard(b, turns(b))[-1])
        assert told is not None and (told.owner, told.token) == (b"b", granted.token)
        (after,) = heard(c, turns(c))  # the waiter next in line: how long the grant lasts
        assert next_in_line(after) == (b"c", told.px)
        assert heard(d, turns(d)) == []
        assert await b.release(name, "b", granted.token)  # hands it on to c
        assert await c.release(name, "c", None)
        assert await d.release(name, "d", None)


async def test_the_waits_of_one_backend_share_one_listener_of_its_turns_channel(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """Each hand-off on a backend's turns channel goes to the one wait it names (not
    to every wait of the backend), and the waits get the lease in their order."""
    name = new_name()
    async with AsyncExitStack() as stack:
        a, w = await fair_backends(stack, redis_url, prefix, 2)
        holder = await a.try_acquire(name, "a", LONG, "a", {})
        assert isinstance(holder, Grant)
        owners = ["w1", "w2", "w3"]
        refused = {"w1": await queued(w, name, "w1")}  # subscribed now
        for owner in owners[1:]:
            seen = await w.try_acquire(name, owner, LONG, owner, {})
            assert isinstance(seen, HolderInfo)
            refused[owner] = seen
        order: list[str] = []
        ended = {owner: anyio.Event() for owner in owners}

        async def wait_then_pass_on(owner: str) -> None:
            await w.wait_turn(name, owner, LONG, refused[owner])
            granted = await w.try_acquire(name, owner, LONG, owner, {})
            assert isinstance(granted, Grant)
            order.append(owner)
            ended[owner].set()
            assert await w.release(name, owner, granted.token)

        entry = inner(w)._subscriptions._channels[turns(w)]
        with anyio.fail_after(LONG / 6):  # far below the retries (ttl / 3)
            async with anyio.create_task_group() as tg:
                for owner in owners:
                    tg.start_soon(wait_then_pass_on, owner)
                await eventually(lambda: len(inner(w)._tickets._routes) == 3, "three waits")
                assert len(entry.listeners) == 1
                assert await a.release(name, "a", holder.token)
                await ended["w3"].wait()
        assert order == owners
        assert entry.listeners == []  # the last wait stopped listening


async def test_a_waiter_behind_a_head_of_its_own_backend_is_not_told_how_long_it_lasts(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """The head's process is alive while the waiter behind it is (a head that gives
    up there releases its grant): the release publishes only the head's message."""
    name = new_name()
    async with AsyncExitStack() as stack:
        a, w = await fair_backends(stack, redis_url, prefix, 2)
        holder = await a.try_acquire(name, "a", LONG, "a", {})
        assert isinstance(holder, Grant)
        refused = await queued(w, name, "w1")
        assert isinstance(await w.try_acquire(name, "w2", LONG, "w2", {}), HolderInfo)
        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.wait_turn, name, "w1", LONG, refused)
                assert await a.release(name, "a", holder.token)
        with redis.Redis.from_url(redis_url) as admin:  # after all the release published
            admin.publish(turns(w), b"end")
        await eventually(lambda: b"end" in heard(w, turns(w)), "the last message")
        told = [handed(m) for m in heard(w, turns(w))[:-1]]
        assert [(t.owner, t.token) for t in told if t] == [(b"w1", holder.token + 1)]
        assert len(told) == 1  # nothing for w2
        granted = await w.try_acquire(name, "w1", LONG, "w1", {})
        assert isinstance(granted, Grant)
        assert await w.release(name, "w1", granted.token)  # hands it on to w2
        assert await w.release(name, "w2", None)


async def test_a_watched_name_has_its_hand_offs_announced(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """An observer in another process (here a plain backend) sees a fair hand-off as
    it happens, not when the old holder's ttl would have run out."""
    name = new_name()
    async with AsyncExitStack() as stack:
        fair, waiter = await fair_backends(stack, redis_url, prefix, 2)
        observer = await stack.enter_async_context(aiolease.open_backend(redis_url, prefix=prefix))
        holder = await AsyncLock(fair, name, ttl=LONG).acquire_nowait()
        refused = await queued(waiter, name, "waiter")
        seen = await observer.read(name)
        assert seen is not None and seen.owner == holder.owner
        reads: list[HolderInfo | None] = []
        found = inner(observer)
        read = found.read

        async def counted_read(name: str) -> HolderInfo | None:
            reads.append(await read(name))
            return reads[-1]

        found.read = counted_read  # type: ignore[method-assign]
        with anyio.fail_after(LONG / 6):  # far below the holder's ttl
            async with anyio.create_task_group() as tg:
                tg.start_soon(observer.wait_changed, name, seen)
                tg.start_soon(waiter.wait_turn, name, "waiter", LONG, refused)
                # the observer marked the name watched, then read it: it waits now
                await eventually(lambda: len(reads) == 1, "the observer's read")
                assert reads[0] is not None and reads[0].owner == holder.owner
                await holder.release()
        current = await observer.read(name)
        assert current is not None and current.owner == "waiter"
        assert await waiter.release(name, "waiter", None)


async def test_the_waiter_behind_a_dead_head_takes_over_when_its_grant_ends(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """Nobody watches the name: the waiter next in line is told how long the dead
    head's grant lasts, and retries then, not at its own retry (ttl / 3)."""
    dead_ttl = 1.0
    name = new_name()
    async with AsyncExitStack() as stack:
        held, dead, live = await fair_backends(stack, redis_url, prefix, 3)
        holder = await AsyncLock(held, name, ttl=LONG).acquire_nowait()
        await queued(dead, name, "dead", dead_ttl)  # and never waits again
        tap = Tap(inner(live))
        got: list[Lease] = []

        async def live_waiter() -> None:
            got.append(await AsyncLock(tap, name, ttl=LONG, identity="live").acquire())

        with anyio.fail_after(dead_ttl + 3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(live_waiter)
                # its first wait only subscribed; in its second it listens
                await tap.wait_for(lambda: tap.calls["wait_turn"] == 2)
                await holder.release()
                handed_to = await adapt(live).read(name)
                assert handed_to is not None and handed_to.owner == "dead"
        assert handed_to is not None and got[0].token > handed_to.token
        assert tap.calls["try_acquire"] == 3  # refused, refused, granted: no timer woke it
        await got[0].release()


async def test_observers_mark_a_name_watched_for_a_while(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    name = new_name()
    watched = Keys.of(prefix, name).watched
    async with aiolease.open_backend(redis_url, prefix=prefix) as backend:
        with redis.Redis.from_url(redis_url) as admin:
            assert not admin.exists(watched)
            await subscribe(backend, name)  # a wait_changed
            ttl = admin.pttl(watched)
            assert 30_000 < ttl <= 60_000
            await subscribe(backend, name)  # marked for long enough yet: no request
            assert admin.pttl(watched) <= ttl


async def test_stale_entries_at_the_front_are_passed_over_and_dropped(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    name = new_name()
    keys = Keys.of(prefix, name)
    async with AsyncExitStack() as stack:
        held, stale, first, second = await fair_backends(stack, redis_url, prefix, 4)
        holder = await held.try_acquire(name, "holder", LONG, "holder", {})
        assert isinstance(holder, Grant)
        await queued(stale, name, "stale", 0.05)  # its entry lapses 50 ms later
        await queued(first, name, "first")
        await queued(second, name, "second")
        with redis.Redis.from_url(redis_url) as admin:

            def lapsed() -> bool:
                raw = admin.hget(keys.waiters, "stale")
                seconds, micros = admin.time()
                return raw is not None and json.loads(raw)["e"] < seconds * 1000 + micros // 1000

            await eventually(lapsed, "the stale entry's expiry")
            assert await held.release(name, "holder", holder.token)
            assert admin.zscore(keys.queue, "stale") is None  # dropped
        current = await held.read(name)
        assert current is not None and current.owner == "first"

        def told() -> bool:
            return any(next_in_line(m) is not None for m in heard(second, turns(second)))

        await eventually(told, "the waiter next in line's message")
        (message,) = heard(second, turns(second))
        after = next_in_line(message)
        assert after is not None and after[0] == b"second" and 0 < after[1] <= LONG * 1000
        assert await first.release(name, "first", None)
        assert await second.release(name, "second", None)
