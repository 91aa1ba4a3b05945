"""Attempts that ride with a local holder's release, on a real Redis server: sent with
it in one request, settled by its reply, and what happens when the release hands the
lease elsewhere, fails, or finds its script gone.

Each test uses a key prefix of its own on the shared test server and deletes its keys.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import redis

import aiolease
from aiolease import AsyncLock, Lease
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.redis import ForeignDataError, RedisBackend
from aiolease.backends.redis._keys import Keys
from tests.backends.redis.support import (
    asyncio_only,
    inner,
    noting_waits,
    requests,
    subscribe,
    take_once,
)

pytestmark = pytest.mark.anyio
LONG = 30.0


def noting_rides(found: RedisBackend) -> anyio.Event:
    """An event set when an attempt through ``found`` starts to wait for a release to
    ride with."""
    riding = anyio.Event()
    ride = found._riders.ride

    async def noted_ride(name: str, args: Any, alone: Any) -> Any:
        riding.set()
        return await ride(name, args, alone)

    found._riders.ride = noted_ride  # type: ignore[method-assign]
    return riding


@asynccontextmanager
async def holding_here(
    redis_url: str, prefix: str
) -> AsyncIterator[tuple[Backend, Lease, anyio.Event]]:
    """A fair backend, a lease on "fair" held through it, and an event set when an
    attempt through it starts to wait for the lease's release, which alone sends it."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        found = inner(backend)
        await subscribe(backend, "fair")
        holder = await AsyncLock(backend, "fair", ttl=LONG).acquire()
        found._riders._wait = LONG
        yield backend, holder, noting_rides(found)


async def test_an_attempt_rides_with_the_release_of_a_local_holder(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """A waiter's attempt while a task of the same backend holds the lease goes with the
    holder's release, which runs it right after: no request, and no reply, during the
    hold."""
    async with holding_here(redis_url, prefix) as (backend, holder, riding):
        sent = requests(backend)
        got: list[int] = []

        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(take_once, backend, "fair", got)
                await riding.wait()
                assert sent["requests"] == 0
                await holder.release()
        # the queue was empty: the attempt right after the release was granted
        assert got == [holder.token + 1]
        # the holder's release, which ran the waiter's attempt, then the waiter's release
        assert (sent["requests"], sent["EVALSHA"]) == (2, 2)


async def attempt_into(backend: Backend, name: str, outcome: list[object]) -> None:
    """Acquire ``name`` (waiting as long as it takes) and release it; what happened
    into ``outcome``: the token, or the backend error raised."""
    try:
        await take_once(backend, name, outcome)
    except aiolease.BackendError as exc:
        outcome.append(exc)


async def test_an_attempt_that_fails_in_the_release_it_rode_with_fails_alone(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """The release script runs a riding attempt under ``pcall``: its error is its own
    reply, and the release stands."""
    async with holding_here(redis_url, prefix) as (backend, holder, riding):
        with redis.Redis.from_url(redis_url) as admin:  # the grant's INCR will fail
            admin.set(Keys.of(prefix, "fair").token, "not a counter")
        outcome: list[object] = []
        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(attempt_into, backend, "fair", outcome)
                await riding.wait()
                assert await holder.release()
        (error,) = outcome
        assert isinstance(error, ForeignDataError)
        assert await backend.read("fair") is None


async def test_a_riding_attempt_of_the_waiter_the_release_hands_off_to_picks_it_up(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """A queued waiter that tries again while the holder here holds rides with the
    release; the release hands the lease to it, and its attempt picks it up."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        found = inner(backend)
        await subscribe(backend, "fair")
        holder = await AsyncLock(backend, "fair", ttl=LONG).acquire()
        found._riders._wait = 0  # the waiter's first attempt goes alone: it is queued
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo) and refused.owner == holder.owner
        found._riders._wait = LONG  # its next one rides with the release
        riding = noting_rides(found)
        granted: list[object] = []

        async def try_again() -> None:
            granted.append(await backend.try_acquire("fair", "waiter", LONG, "waiter", {}))

        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(try_again)
                await riding.wait()
                assert await holder.release()
        (grant,) = granted
        assert isinstance(grant, Grant) and grant.token == holder.token + 1
        assert await backend.release("fair", "waiter", grant.token)


async def test_riders_of_a_release_whose_script_is_gone_go_alone(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """``SCRIPT FLUSH`` (a restart, a failover) during a hold: the release and the
    attempt riding with it load their scripts and run on their own."""
    async with holding_here(redis_url, prefix) as (backend, holder, riding):
        outcome: list[object] = []
        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(attempt_into, backend, "fair", outcome)
                await riding.wait()
                with redis.Redis.from_url(redis_url) as admin:
                    admin.script_flush()
                assert await holder.release()
        assert outcome == [holder.token + 1]


async def test_an_attempt_goes_alone_when_the_local_holder_keeps_the_lease(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        found = inner(backend)
        await subscribe(backend, "fair")
        holder = await AsyncLock(backend, "fair", ttl=LONG).acquire()
        waiting = noting_waits(found)
        got: list[int] = []

        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(take_once, backend, "fair", got)
                await waiting.wait()  # refused and queued without the holder's release
                await holder.release()
        assert got == [holder.token + 1]


class Order:
    """The releases that a RedisBackend writes (``release``) and the waits for a turn
    that start (``wait``), in order."""

    def __init__(self, found: RedisBackend) -> None:
        self.seen: list[str] = []
        self._changed = anyio.Event()
        release, release_now, wait_turn = found.release, found.release_now, found.wait_turn

        async def noted_release(name: str, owner: str, token: int | None) -> bool:
            self._note("release")
            return await release(name, owner, token)

        def noted_release_now(name: str, owner: str, token: int) -> Any:
            self._note("release")
            return release_now(name, owner, token)

        async def noted_wait_turn(name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
            self._note("wait")
            await wait_turn(name, owner, ttl, seen)

        found.release = noted_release  # type: ignore[method-assign]
        found.release_now = noted_release_now  # type: ignore[method-assign]
        found.wait_turn = noted_wait_turn  # type: ignore[method-assign]

    def _note(self, what: str) -> None:
        self.seen.append(what)
        self._changed.set()
        self._changed = anyio.Event()

    async def reach(self, count: int) -> None:
        """Until ``count`` are noted."""
        while len(self.seen) < count:
            await self._changed.wait()


async def hold_until(backend: Backend, name: str, held: anyio.Event, go: anyio.Event) -> None:
    """Acquire ``name`` (waiting as long as it takes), set ``held``, release on ``go``."""
    async with AsyncLock(backend, name, ttl=LONG):
        held.set()
        await go.wait()


@dataclass
class Riding:
    """A lease held here (``first``), a waiter queued behind it that holds the lease
    once it is handed over (``held``) until told to release it (``go``), and an
    attempt riding with ``first``'s release, which takes the lease once (token into
    ``got``); ``order`` notes the releases and the waits."""

    first: Lease
    order: Order
    held: anyio.Event = field(default_factory=anyio.Event)
    go: anyio.Event = field(default_factory=anyio.Event)
    got: list[int] = field(default_factory=list)


async def queue_then_ride(backend: Backend, tg: anyio.abc.TaskGroup) -> Riding:
    """:class:`Riding` on "fair": ``first``'s release will hand the lease to the waiter
    and refuse the riding attempt."""
    found = inner(backend)
    await subscribe(backend, "fair")
    riding = Riding(await AsyncLock(backend, "fair", ttl=LONG).acquire(), Order(found))
    found._riders._wait = 0  # the waiter's attempt goes alone: it is queued
    tg.start_soon(hold_until, backend, "fair", riding.held, riding.go)
    await riding.order.reach(1)
    found._riders._wait = LONG  # the next attempt rides with the release
    started = noting_rides(found)
    tg.start_soon(take_once, backend, "fair", riding.got)
    await started.wait()
    return riding


@asyncio_only  # the riders are asyncio's: under trio the test cannot reach them
async def test_a_refusal_handed_back_with_a_local_hand_off_waits_for_the_next_release(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """An attempt that rode with a release handing the lease to a waiter here, and was
    refused, starts waiting for its turn once the new holder's release is written
    (in that request's round trip), not during the new holder's hold."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                riding = await queue_then_ride(backend, tg)
                await riding.first.release()  # its reply settled the riders
                await riding.held.wait()
                assert len(inner(backend)._riders._kept) == 1  # the refusal is kept
                assert riding.order.seen == ["wait", "release"]
                riding.go.set()
        assert riding.got == [riding.first.token + 2]
        # the new holder's release, the rider's wait for its turn, the rider's release
        assert riding.order.seen == ["wait", "release", "release", "wait", "release"]


@asyncio_only
async def test_a_kept_refusal_reaches_its_waiter_while_the_new_holder_holds_on(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """A refusal is kept for the riders' wait at most: a holder that keeps the lease
    does not hold up its waiters."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                riding = await queue_then_ride(backend, tg)
                inner(backend)._riders._wait = 0.01
                await riding.first.release()
                await riding.held.wait()
                await riding.order.reach(3)
                assert riding.order.seen == ["wait", "release", "wait"]  # the lease still held
                riding.go.set()
        assert riding.got == [riding.first.token + 2]
