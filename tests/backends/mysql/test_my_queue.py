"""The MySQL/MariaDB waiter queue on the real server: fair hand-offs across backend
objects (stand-ins for processes), dead and cancelled waiters, the handed grant's
deadline.

Every run works in a database of its own (dropped at the end).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest

import aiolease
from aiolease import (
    AsyncLock,
    InvalidArgument,
    Lease,
)
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends._asyncio import now
from aiolease.backends.mysql import MySQLBackend
from tests.backends.mysql.support import raw
from tests.backends.sql.support import (
    check_oldest_waiter_gets_it,
)
from tests.support import eventually, inner, on_asyncio, unique

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def backends(url: str, count: int) -> AsyncIterator[list[Backend]]:
    """``count`` backend objects of their own: stand-ins for as many processes."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(aiolease.open_backend(url)) for _ in range(count)]


async def entries(url: str, database: str, table: str, name: str) -> list[tuple[Any, ...]]:
    """The waiters table's entries for ``name`` (owner, live), oldest first."""
    return await raw(
        url,
        f"SELECT owner, expires_at > UTC_TIMESTAMP(6) FROM `{database}`.`{table}_waiters`"
        " WHERE name = %s ORDER BY seq",
        name.encode(),
    )


def waiting(b: Backend) -> Callable[[], bool]:
    return lambda: inner(b, MySQLBackend).statistics().waiting > 0


async def test_waiters_are_served_in_order_across_backends(table_url: str) -> None:
    # Three waiters queue in order, then a newcomer; each release hands the name to
    # the oldest, and the first, asking again at once after its turn, comes last.
    async with backends(table_url, 5) as (holder, *others):
        name = unique("fifo")
        first = await AsyncLock(holder, name, ttl=30).acquire()
        order: list[str] = []
        tokens: list[int] = []

        async def take(label: str, b: Backend, again: bool = False) -> None:
            lease = await AsyncLock(b, name, ttl=30).acquire()
            order.append(label)
            tokens.append(lease.token)
            assert await lease.release()
            if again:
                await take(f"{label} again", b)

        with anyio.fail_after(30):  # a hang guard
            async with anyio.create_task_group() as tg:
                for label, b in zip("abcn", others, strict=True):
                    tg.start_soon(take, label, b, label == "a")
                    await eventually(waiting(b), f"waiter {label} queued")
                assert await first.release()
        assert order == ["a", "b", "c", "n", "a again"]
        assert tokens == [first.token + i for i in range(1, 6)]
        assert sum(inner(b, MySQLBackend).statistics().hand_offs for b in [holder, *others]) >= 4
        assert await holder.read(name) is None


async def test_a_dead_waiter_holds_up_the_queue_for_its_ttl_only(
    table_url: str, database: str, table: str
) -> None:
    async with backends(table_url, 2) as (holder, waiter):
        name = unique("dead")
        first = await AsyncLock(holder, name, ttl=30).acquire()
        # A waiter whose process died: its entry (ttl 1 s) is older than anyone's.
        await raw(
            table_url,
            f"INSERT INTO `{database}`.`{table}_waiters` (name, owner, identity, metadata,"
            " ttl, us, expires_at) VALUES (%s, 'dead', 'dead', '{}', 1.0, 1000000,"
            " UTC_TIMESTAMP(6) + INTERVAL 1 SECOND)",
            name.encode(),
        )
        # The live waiter's own refresh and the holder's ttl are far off: the guard
        # fails unless the end of the dead waiter's grant wakes the live one.
        with anyio.fail_after(20):  # a hang guard: the dead waiter's ttl is 1 s
            async with anyio.create_task_group() as tg:

                async def wait() -> None:
                    lease = await AsyncLock(waiter, name, ttl=600).acquire()
                    assert lease.token == first.token + 2  # after the dead one's grant
                    assert await lease.release()

                tg.start_soon(wait)
                await eventually(waiting(waiter), "the live waiter queued")
                assert await first.release()
                held = await holder.read(name)  # handed to the oldest: the dead one
                assert held is None or held.owner in ("dead", "")
        assert await holder.read(name) is None
        assert await entries(table_url, database, table, name) in ([], [(b"dead", 0)])


async def test_a_cancelled_waiter_leaves_no_entry_and_holds_nothing(
    table_url: str, database: str, table: str
) -> None:
    async with backends(table_url, 2) as (holder, waiter):
        name = unique("cancelled")
        first = await AsyncLock(holder, name, ttl=30).acquire()
        with anyio.fail_after(30):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(AsyncLock(waiter, name, ttl=30).acquire)
                await eventually(waiting(waiter), "the waiter queued")
                assert len(await entries(table_url, database, table, name)) == 1
                tg.cancel_scope.cancel()
        assert await entries(table_url, database, table, name) == []
        assert await first.release()
        assert await holder.read(name) is None  # not handed to the waiter that left


async def test_a_handed_grant_counts_from_before_the_hand_off(table_url: str) -> None:
    # The waiter finds the hand-off by a read sent after it, and the server's expiry
    # counts from the releasing statement: the grant's ``sent_at`` must come before
    # that statement's end (the read that found the row not yet its own qualifies).
    async with backends(table_url, 2) as (holder_b, waiter_b):
        holder, waiter = inner(holder_b, MySQLBackend), inner(waiter_b, MySQLBackend)
        name = unique("deadline")

        async def scenario() -> tuple[Grant, float, int]:
            first = await holder.try_acquire(name, "first", 30, "first", {})
            assert isinstance(first, Grant)
            seen = await waiter.try_acquire(name, "second", 30, "second", {})
            assert isinstance(seen, HolderInfo)
            wait = asyncio.ensure_future(waiter.wait_turn(name, "second", 30, seen))
            with anyio.fail_after(30):  # a hang guard
                while waiter.statistics().polls < 20:  # noqa: ASYNC110 - it looks less often by now
                    await asyncio.sleep(0.001)
                assert await holder.release(name, "first", first.token)
                released = now()
                await wait
            granted = await waiter.try_acquire(name, "second", 30, "second", {})
            assert isinstance(granted, Grant)
            return granted, released, first.token

        granted, released, token = await on_asyncio(scenario)
        assert granted.token == token + 1
        assert granted.sent_at is not None and granted.sent_at <= released
        seen = await waiter_b.read(name)
        assert seen is not None and seen.owner == "second"
        assert seen.remaining is not None and seen.remaining <= 30


async def test_a_table_made_by_an_older_version_gains_the_queue(
    table_url: str, database: str, table: str
) -> None:
    await raw(
        table_url,
        f"CREATE TABLE `{database}`.`{table}` (name VARBINARY(255) NOT NULL PRIMARY KEY,"
        " token BIGINT UNSIGNED NOT NULL, owner VARBINARY(255) NULL,"
        " identity VARBINARY(1024) NULL, metadata BLOB NULL, ttl DOUBLE NULL,"
        " acquired_at DATETIME(6) NULL, expires_at DATETIME(6) NULL) ENGINE=InnoDB",
    )
    await raw(table_url, f"INSERT INTO `{database}`.`{table}` (name, token) VALUES ('old', 41)")
    async with backends(table_url, 2) as (first, second):
        lease = await AsyncLock(first, "old", ttl=30).acquire()  # adds the column
        assert lease.token == 42
        columns = await raw(
            table_url,
            "SELECT column_name FROM information_schema.columns WHERE table_schema = %s"
            " AND table_name = %s AND column_name = 'queued'",
            database,
            table,
        )
        assert len(columns) == 1
        tokens: list[int] = []

        async def wait() -> None:
            handed = await AsyncLock(second, "old", ttl=30).acquire()
            tokens.append(handed.token)
            assert await handed.release()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await eventually(waiting(second), "the waiter queued")
            assert await lease.release()  # handed to the waiter
        assert tokens == [43]
        assert await first.read("old") is None


async def test_a_waiter_sweeps_expired_entries_of_every_name(
    table_url: str, database: str, table: str
) -> None:
    # Entries of waiters that died, of a name nobody queues for again, expire but are
    # deleted by nobody: the first wait in a queue of a backend sweeps them, and
    # leaves live entries alone.
    async with backends(table_url, 1) as (b,):
        name, idle = unique("busy"), unique("idle")
        first = await AsyncLock(b, name, ttl=30).acquire()  # (makes the tables)
        for owner, seconds in (("dead-1", -60), ("dead-2", -2), ("alive", 3600)):
            await raw(
                table_url,
                f"INSERT INTO `{database}`.`{table}_waiters`"
                " (name, owner, identity, metadata, ttl, us, expires_at)"
                " VALUES (%s, %s, '', '', 30, 30000000,"
                " UTC_TIMESTAMP(6) + INTERVAL %s SECOND)",
                idle.encode(),
                owner.encode(),
                seconds,
            )
        got: list[Lease] = []

        async def take() -> None:
            got.append(await AsyncLock(b, name, ttl=30).acquire())

        with anyio.fail_after(20):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(take)
                await eventually(waiting(b), "the waiter queued")  # it swept first
                left = await entries(table_url, database, table, idle)
                assert [bytes(owner) for owner, _ in left] == [b"alive"]
                assert await first.release()
        assert await got[0].release()
        assert await entries(table_url, database, table, name) == []


def test_the_waiters_table_name_must_fit() -> None:
    with pytest.raises(InvalidArgument, match="pool"):  # the table name passed
        MySQLBackend(None, table="t" * 56)
    with pytest.raises(InvalidArgument, match="waiters"):
        MySQLBackend(None, table="t" * 57)


@asynccontextmanager
async def backend(url: str, **options: Any) -> AsyncIterator[Backend]:
    async with aiolease.open_backend(url, **options) as b:
        yield b


# -- hand-offs -----------------------------------------------------------------------------------


async def _waiting(b: Backend, count: int = 1) -> None:
    my_backend = inner(b, MySQLBackend)
    await eventually(lambda: my_backend.statistics().waiting >= count, "a blocked wait")


async def test_a_release_hands_the_name_to_the_oldest_waiter(my_url: str) -> None:
    async with backend(my_url, poll_interval=60) as b:
        await check_oldest_waiter_gets_it(b, lambda n: _waiting(b, n))
        assert inner(b, MySQLBackend).statistics().hand_offs == 4


@pytest.mark.parametrize("seed", [1, 2])
async def test_waiters_cancelled_at_random_points_never_keep_a_grant(
    my_url: str, database: str, seed: int
) -> None:
    # Tasks take turns on one name while others give up after random delays: while
    # queued, while a hand-off to them is in flight, after it, or in their retry.
    rng = random.Random(seed)
    async with backend(my_url, poll_interval=60) as b:
        name = unique("giveup")
        holding: set[str] = set()
        held = gave_up = 0

        async def task(i: int) -> None:
            nonlocal held, gave_up
            for _ in range(40):
                lease = None
                draw = rng.random()
                # Mostly impatient; one in ten waits out a stalled server (a loaded CI
                # machine stalled MySQL past every 50 ms patience of one run: none held).
                patience = 5.0 if draw < 0.1 else rng.uniform(0, 0.005 if draw < 0.55 else 0.05)
                with anyio.move_on_after(patience) as scope:
                    lease = await AsyncLock(b, name, ttl=30).acquire()
                if lease is None:
                    assert scope.cancelled_caught
                    gave_up += 1
                    continue
                holding.add(lease.owner)
                seen = await b.read(name)  # held: by this live owner, none other
                assert seen is not None and seen.owner == lease.owner
                held += 1
                holding.discard(lease.owner)
                assert await lease.release()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(task, i)
        assert held > 0 and gave_up > 0, (held, gave_up)
        assert inner(b, MySQLBackend).statistics().hand_offs > 0
        # Nobody holds it any more: a grant left to a waiter that gave up would show.
        # (On failure: whether the holder still has a queue entry tells a grant from
        # a release to a stale entry from one by a hand-off or its own statement.)
        left = await b.read(name)
        if left is not None:
            queue = await entries(my_url, database, "aiolease_leases", name)
            pytest.fail(f"{left!r} held; entries {queue!r}; {inner(b, MySQLBackend).statistics()}")
