"""The MySQL/MariaDB bells on the real server: a waiter in another backend object (a
stand-in for another process) is woken by its predecessor's release, not by its
poll, for a lock as for a permit; a bell whose session is killed still lets the
waiter through; a cancelled wait leaves no session blocked and no bell held; the
uncontended path sends no bell statement.

Every run works in a database of its own (dropped at the end).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, AsyncSemaphore, Lease
from aiolease.abc import Backend, Grant, HolderInfo, permit_owner
from aiolease.backends.mysql import MySQLBackend
from aiolease.backends.mysql._bell import Bells
from aiolease.backends.sql._handed import turn_key
from tests.backends.mysql.support import raw
from tests.support import eventually, inner, unique, with_query

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def backends(*urls: str) -> AsyncIterator[list[Backend]]:
    """A backend object of its own per URL: stand-ins for as many processes."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(aiolease.open_backend(url)) for url in urls]


def bells(b: Backend) -> Bells:
    found = inner(b, MySQLBackend)._queue.bells
    assert found is not None
    return found


def polls(b: Backend) -> int:
    return inner(b, MySQLBackend).statistics().polls


async def has_blocked(url: str, sessions: list[int]) -> bool:
    """Whether the server has every one of ``sessions`` blocked in ``GET_LOCK``."""
    return await blocked(url, sessions) == len(sessions)


async def blocked(url: str, sessions: list[int]) -> int:
    """How many of ``sessions`` the server has blocked in ``GET_LOCK``."""
    if not sessions:
        return 0
    marks = ", ".join(["%s"] * len(sessions))
    rows = await raw(
        url,
        "SELECT COUNT(*) FROM information_schema.processlist WHERE state = 'User lock'"
        f" AND id IN ({marks})",
        *sessions,
    )
    return int(rows[0][0])


@dataclass
class Queued:
    """``first`` held (it never queued: no bell); ``holder``, queued behind it, was
    handed the name and holds it with a bell; ``waiter``, queued behind ``holder``,
    waits on that bell. ``go`` makes ``holder`` release; ``done`` is set once the
    waiter had its turn (its lease in ``got``) and released."""

    holder: Backend
    waiter: Backend
    name: str
    lease: Lease
    go: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    got: list[Lease] = field(default_factory=list)


@asynccontextmanager
async def queued_behind_a_bell(url: str, waiter_url: str) -> AsyncIterator[Queued]:
    async with backends(url, url, waiter_url) as (first, holder, waiter):
        name = unique("bell")
        lease = await AsyncLock(first, name, ttl=120).acquire()
        held: list[Lease] = []

        async def hold() -> None:
            held.append(await AsyncLock(holder, name, ttl=120).acquire())

        with anyio.fail_after(60):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                await eventually(lambda: inner(holder, MySQLBackend).statistics().waiting > 0, "h")
                assert await lease.release()  # to ``holder``, which finds out by polling
                await eventually(lambda: bool(held), "the holder's turn")
                queued = Queued(holder, waiter, name, held[0])

                async def wait() -> None:
                    queued.got.append(await AsyncLock(waiter, name, ttl=120).acquire())
                    assert await queued.got[0].release()
                    queued.done.set()

                async def release() -> None:
                    await queued.go.wait()
                    assert await queued.lease.release()

                tg.start_soon(wait)
                tg.start_soon(release)
                await eventually(lambda: bells(waiter).in_flight == 1, "the waiter on the bell")
                yield queued
                queued.go.set()


async def test_a_waiter_elsewhere_is_woken_by_the_bell_not_its_poll(table_url: str) -> None:
    # The waiter polls at most every 30 s: only the bell brings its turn this soon.
    slow = with_query(table_url, poll_interval=30)
    async with queued_behind_a_bell(table_url, slow) as q:
        assert await blocked(table_url, bells(q.waiter).sessions) == 1
        looked, rung = polls(q.waiter), bells(q.waiter).rings
        q.go.set()
        await q.done.wait()
        assert q.got[0].token == q.lease.token + 1
        assert bells(q.waiter).rings == rung + 1
        assert polls(q.waiter) == looked  # the look that came with the ring sufficed
        assert await q.waiter.read(q.name) is None


async def test_a_waiter_gets_its_turn_when_the_bell_s_session_is_killed(table_url: str) -> None:
    async with queued_behind_a_bell(table_url, table_url) as q:
        rung = bells(q.waiter).rings
        keeper = bells(q.holder).keeper
        assert keeper is not None
        await raw(table_url, f"KILL {keeper}")  # the server frees the bells it held
        await eventually(lambda: bells(q.waiter).rings > rung, "the waiter woken")
        assert not q.got  # woken, but it is not its turn: it polls now
        q.go.set()  # the release hands the name on; its ring fails quietly
        await q.done.wait()
        assert q.got[0].token == q.lease.token + 1
        assert await q.waiter.read(q.name) is None


async def test_a_cancelled_wait_leaves_no_session_blocked_and_no_bell_held(
    table_url: str,
) -> None:
    async with backends(table_url, table_url, table_url) as (first, holder, waiter):
        name = unique("cancel")
        lease = await AsyncLock(first, name, ttl=120).acquire()
        with anyio.fail_after(60):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(AsyncLock(holder, name, ttl=120).acquire)
                await eventually(lambda: bells(holder).kept > 0, "the holder's bell")
                async with anyio.create_task_group() as inner_tg:
                    inner_tg.start_soon(AsyncLock(waiter, name, ttl=120).acquire)
                    await eventually(lambda: bells(waiter).in_flight == 1, "the waiter's wait")
                    sessions = bells(waiter).sessions
                    # (in flight here, the wait may not have reached the server yet)
                    await eventually(
                        lambda: has_blocked(table_url, sessions), "the waiter's session blocked"
                    )
                    inner_tg.cancel_scope.cancel()  # the holder's bell stays held
                assert bells(waiter).in_flight == 0
                assert await blocked(table_url, sessions) == 0
                assert bells(waiter).held == 0  # it left the queue: its bell let go
                tg.cancel_scope.cancel()
        assert bells(holder).held == 0
        assert await lease.release()
        assert await first.read(name) is None


async def test_the_uncontended_path_sends_no_bell_statement(table_url: str) -> None:
    async with backends(table_url) as (b,):
        lock = AsyncLock(b, unique("alone"), ttl=30)
        for _ in range(3):
            async with lock:
                pass
        assert (bells(b).kept, bells(b).waits, bells(b).keeper) == (0, 0, None)


# -- permits ----------------------------------------------------------------------------------


async def granted_after_queueing(first: Backend, holder: Backend, name: str) -> Lease:
    """``first`` takes the one permit of ``name`` (it never queues: no bell);
    ``holder``'s request queues behind it (its entry's bell held) and is granted at
    ``first``'s release: the lease it holds, its bell still held."""
    lease = await AsyncSemaphore(first, name, limit=1, ttl=120).acquire()
    held: list[Lease] = []

    async def hold() -> None:
        held.append(await AsyncSemaphore(holder, name, limit=1, ttl=120).acquire())

    with anyio.fail_after(60):  # a hang guard
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await eventually(lambda: bells(holder).held == 1, "the holder's bell")
            assert await lease.release()  # to ``holder``, which polls for it
    assert bells(holder).held == 1  # kept while it holds the permit
    return held[0]


async def test_a_permit_waiter_elsewhere_is_woken_by_the_bell_not_its_poll(
    table_url: str,
) -> None:
    # ``first`` holds the one permit (it never queued: no bell); ``holder``'s request
    # queues behind it, gets it, and holds its entry's bell; the waiter, in a backend of
    # its own that polls at most every 30 s (and asks again a third of its 120 s ttl
    # after its refusal), waits on that bell. Only the bell brings its turn this soon.
    slow = with_query(table_url, poll_interval=30)
    async with backends(table_url, table_url, slow) as (first, holder, waiter):
        name = unique("sem")
        held = [await granted_after_queueing(first, holder, name)]
        got: list[Lease] = []

        async def wait() -> None:
            got.append(await AsyncSemaphore(waiter, name, limit=1, ttl=120).acquire())

        with anyio.fail_after(15):  # the waiter's poll would take 30 s, its retry 40 s
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await eventually(lambda: bells(waiter).in_flight == 1, "the waiter on the bell")
                await eventually(
                    lambda: has_blocked(table_url, bells(waiter).sessions), "its session blocked"
                )
                rung = bells(waiter).rings
                assert await held[0].release()  # lets go of the bell: rings the waiter
        assert got and got[0].token == held[0].token + 1
        assert bells(waiter).rings == rung + 1
        assert bells(holder).held == 0
        assert await got[0].release()
        assert await waiter.read_permits(name) is None


async def test_a_cancelled_permit_wait_leaves_no_session_blocked_and_no_bell_held(
    table_url: str,
) -> None:
    async with backends(table_url, table_url, table_url) as (first, holder, waiter):
        name = unique("sem-cancel")
        held = [await granted_after_queueing(first, holder, name)]
        with anyio.fail_after(60):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(AsyncSemaphore(waiter, name, limit=1, ttl=120).acquire)
                await eventually(lambda: bells(waiter).in_flight == 1, "the waiter's wait")
                sessions = bells(waiter).sessions
                await eventually(
                    lambda: has_blocked(table_url, sessions), "the waiter's session blocked"
                )
                tg.cancel_scope.cancel()
        assert bells(waiter).in_flight == 0
        assert await blocked(table_url, sessions) == 0
        assert bells(waiter).held == 0  # it left the queue: its bell let go
        assert bells(holder).held == 1  # the holder's stays held
        assert await held[0].release()
        assert bells(holder).held == 0
        assert await first.read_permits(name) is None


async def test_an_uncontended_permit_sends_no_bell_statement(table_url: str) -> None:
    async with backends(table_url) as (b,):
        semaphore = AsyncSemaphore(b, unique("alone"), limit=2, ttl=30)
        for _ in range(3):
            async with semaphore:
                pass
        assert (bells(b).kept, bells(b).waits, bells(b).keeper) == (0, 0, None)


async def test_a_permit_waiter_whose_blocker_was_released_here_waits_for_the_hand_off(
    table_url: str,
) -> None:
    # ``holder`` queued (its entry's bell held here) and was handed the one permit; the
    # waiter, refused behind it, starts waiting only after the release of ``holder``'s
    # permit granted the next entry: its blocker's bell is free by then. That release
    # went through this backend, which hands its grants here: the waiter waits for them
    # (the next one's release hands it the permit), with no bell wait and no second
    # request (it used to find the bell free, and ask again).
    slow = with_query(table_url, poll_interval=60)
    async with backends(slow) as (b,):
        name = unique("sem-gone")
        sem = AsyncSemaphore(b, name, limit=1, ttl=120)
        first = await sem.acquire()
        held: list[Lease] = []

        async def take() -> None:
            held.append(await sem.acquire())

        owner = permit_owner()
        with anyio.fail_after(60):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(take)
                await eventually(lambda: bells(b).held == 1, "the holder's bell")
                tg.start_soon(take)
                await eventually(lambda: bells(b).held == 2, "the next one's bell")
                assert await first.release()
                await eventually(lambda: len(held) == 1, "the holder's turn")
                seen = await b.try_acquire_permit(name, owner, 120, "w", {}, 1, 1)
                assert isinstance(seen, HolderInfo) and seen.owner == held[0].owner
                assert await held[0].release()  # grants the next one
                await eventually(lambda: len(held) == 2, "the next one's turn")
                waits = bells(b).waits
                tg.start_soon(b.wait_permit_turn, name, owner, 120.0, seen)
                permits = inner(b, MySQLBackend)._permits
                await eventually(lambda: permits.waiting == 1 or bells(b).waits > waits, "the wait")
                assert await held[1].release()  # hands the permit to the waiter
        assert bells(b).waits == waits  # (it used to wait on the free bell, and ask again)
        mine = await b.try_acquire_permit(name, owner, 120, "w", {}, 1, 1)
        assert isinstance(mine, Grant)  # taken from the release's answer
        assert await b.release(name, owner, mine.token)
        assert await b.read_permits(name) is None


async def test_a_permit_request_given_up_between_waits_leaves_no_session_blocked(
    table_url: str,
) -> None:
    # The core's acquire loop gives a request up (cancelled, timed out) with
    # ``release(name, owner, None)`` wherever it is: also between two waits, while the
    # bell wait that an early wake-up cut short is still in flight on the server. That
    # release ends it (it used to stay blocked until its own timeout: up to a third of
    # the ttl; CI once caught it right after a cancel).
    slow = with_query(table_url, poll_interval=60)
    async with backends(table_url, table_url, slow) as (first, holder, waiter):
        name = unique("sem-give-up")
        held = [await granted_after_queueing(first, holder, name)]  # (the bell waited on)
        owner = permit_owner()
        permits = inner(waiter, MySQLBackend)._permits
        with anyio.fail_after(60):  # a hang guard
            async with anyio.create_task_group() as tg:
                seen = await waiter.try_acquire_permit(name, owner, 120, "w", {}, 1, 1)
                assert isinstance(seen, HolderInfo) and seen.owner == held[0].owner
                tg.start_soon(waiter.wait_permit_turn, name, owner, 120.0, seen)
                await eventually(lambda: bells(waiter).in_flight == 1, "the waiter's wait")
                sessions = bells(waiter).sessions
                await eventually(
                    lambda: has_blocked(table_url, sessions), "the waiter's session blocked"
                )
                permits._wakeups.wake(turn_key(name, owner))  # it returns; the wait stays
        assert bells(waiter).in_flight == 1
        assert await waiter.release(name, owner, None) is False  # given up
        assert bells(waiter).in_flight == 0
        assert await blocked(table_url, sessions) == 0
        assert bells(waiter).held == 0  # nor a bell of its own left held
        assert await held[0].release()
        assert await first.read_permits(name) is None
