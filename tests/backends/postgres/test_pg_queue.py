"""PostgreSQL's waiter queue in the database: FIFO hand-offs across backend objects
(stand-ins for processes), hand-offs taken from the notification, dead and cancelled
waiters, and the races between a hand-off and a waiter that leaves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import asyncpg
import pytest

import aiolease
from aiolease import AsyncLock, Lease
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.postgres import PostgresBackend
from tests.backends.postgres.support import raw
from tests.support import eventually, grant, inner, refused, unique, with_query

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def backend(url: str, **options: Any) -> AsyncIterator[Backend]:
    async with aiolease.open_backend(url, **options) as b:
        yield b


def pg_of(b: Backend) -> PostgresBackend:
    return inner(b, PostgresBackend)


async def waiting(b: Backend, count: int = 1) -> None:
    await eventually(lambda: pg_of(b).statistics().waiting >= count, "a blocked wait_turn")


async def waiter_rows(pg: str, schema: str, table: str, name: str) -> list[str]:
    rows = await raw(
        pg,
        f'SELECT owner FROM "{schema}"."{table}_waiters" WHERE name = $1 ORDER BY seq',
        name,
    )
    return [row["owner"] for row in rows]


async def test_waiters_of_different_backends_are_served_in_arrival_order(
    table_url: tuple[str, str],
) -> None:
    url, _ = table_url
    async with (
        backend(url) as holder_side,
        backend(url) as b1,
        backend(url) as b2,
        backend(url) as b3,
        backend(url) as late,
    ):
        name = unique("fifo")
        first = await AsyncLock(holder_side, name, ttl=30).acquire()
        order: list[str] = []
        tokens: list[int] = []

        async def take(label: str, b: Backend) -> None:
            lease = await AsyncLock(b, name, ttl=30).acquire()
            order.append(label)
            tokens.append(lease.token)
            assert await lease.release()

        with anyio.fail_after(20):  # a hang guard
            async with anyio.create_task_group() as tg:
                for label, b in (("b1", b1), ("b2", b2), ("b3", b3)):
                    tg.start_soon(take, label, b)
                    await waiting(b)  # queued before the next one asks
                # A newcomer while they wait: refused although nobody holds it at
                # the moment of each release, and served after them.
                tg.start_soon(take, "late", late)
                await waiting(late)
                assert await first.release()
        assert order == ["b1", "b2", "b3", "late"]
        assert tokens == [first.token + i for i in (1, 2, 3, 4)]
        assert await holder_side.read(name) is None
        for b in (b1, b2, b3, late):  # each took its hand-off from the notification
            assert pg_of(b).statistics().handoffs_taken == 1


async def test_a_handed_waiter_takes_the_grant_without_a_statement(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    url, table = table_url
    async with backend(url) as holder_side, backend(url, poll_interval=60) as waiter_side:
        name = unique("handed")
        first = await AsyncLock(holder_side, name, ttl=30).acquire()
        got: list[Lease] = []

        async def take() -> None:
            got.append(await AsyncLock(waiter_side, name, ttl=30, margin=0.05).acquire())

        with anyio.fail_after(20):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(take)
                await waiting(waiter_side)
                asked = pg_of(waiter_side).statistics().acquire_statements
                # Let time pass between the waiter's ask and the hand-off: a deadline
                # counted from the notification (not from the ask) would then end later
                # than the server's expiry by more than the margin.
                await anyio.sleep(0.3)
                assert await first.release()
        (lease,) = got
        stats = pg_of(waiter_side).statistics()
        assert stats.acquire_statements == asked  # no statement after the hand-off
        assert stats.handoffs_taken == 1
        assert lease.token == first.token + 1
        before = anyio.current_time()
        (row,) = await raw(
            pg,
            "SELECT owner, token, extract(epoch FROM expires_at - clock_timestamp())::float8"
            f' AS remaining FROM "{schema}"."{table}" WHERE name = $1',
            name,
        )
        assert (row["owner"], row["token"]) == (lease.owner, lease.token)
        assert lease.deadline <= before + row["remaining"]  # never after the server's expiry
        assert await lease.release()


async def test_a_dead_waiter_holds_the_queue_up_for_at_most_its_own_ttl(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    url, table = table_url
    name = unique("dead")
    async with backend(url) as holder_side, backend(url) as live:
        first = await grant(holder_side, name, "holder", ttl=60)
        async with backend(url) as dead:  # refused, queued, then gone without a word
            result = await dead.try_acquire(name, "dead", 1.0, "dead", {})
            assert not isinstance(result, Grant)
        got: list[Lease] = []

        async def take() -> None:
            got.append(await AsyncLock(live, name, ttl=30).acquire())

        with anyio.fail_after(20):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(take)
                await waiting(live)
                rows = await waiter_rows(pg, schema, table, name)
                assert len(rows) == 2 and rows[0] == "dead"  # first in line
                assert await holder_side.release(name, "holder", first.token)
                # Unless its row ran out already, the dead waiter got the lease, for no
                # longer than what was left of its row (its own ttl after its ask).
                handed = await holder_side.read(name)
                if handed is not None and handed.owner == "dead":
                    assert handed.token == first.token + 1
                    assert handed.remaining is not None and handed.remaining <= 1.0
        (lease,) = got
        assert lease.token in (first.token + 1, first.token + 2)
        assert await lease.release()
        assert await waiter_rows(pg, schema, table, name) == []


async def test_a_cancelled_waiter_leaves_no_row_and_holds_nothing(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    url, table = table_url
    async with backend(url) as holder_side, backend(url) as waiter_side:
        name = unique("cancelled")
        first = await grant(holder_side, name, "holder", ttl=60)
        with anyio.fail_after(20):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(AsyncLock(waiter_side, name, ttl=30).acquire)
                await waiting(waiter_side)
                assert len(await waiter_rows(pg, schema, table, name)) == 1
                tg.cancel_scope.cancel()
        assert await waiter_rows(pg, schema, table, name) == []
        assert await holder_side.release(name, "holder", first.token)
        assert await holder_side.read(name) is None  # nothing was handed to it


async def test_a_refused_acquire_nowait_leaves_no_row(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    url, table = table_url
    async with backend(url) as b:
        name = unique("nowait")
        held = await AsyncLock(b, name, ttl=30).acquire()
        with pytest.raises(aiolease.LeaseHeldError):
            await AsyncLock(b, name, ttl=30).acquire_nowait()
        assert await waiter_rows(pg, schema, table, name) == []
        assert await held.release()
        assert await b.read(name) is None


async def test_a_newcomer_is_refused_while_an_older_waiter_waits_for_a_free_name(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    url, table = table_url
    async with backend(url) as b:
        name = unique("expired")
        await grant(b, name, "holder", ttl=60)
        await refused(b, name, "older")  # queued
        await raw(  # the holder's lease runs out (no release: nobody is handed it)
            pg,
            f'UPDATE "{schema}"."{table}" SET expires_at = clock_timestamp() WHERE name = $1',
            name,
        )
        seen = await refused(b, name, "newcomer")  # the older waiter comes first
        assert seen.owner == "older"
        granted = await grant(b, name, "older")
        assert (await refused(b, name, "newcomer")).owner == "older"
        assert await b.release(name, "older", granted.token)  # hands it to the newcomer
        holder = await b.read(name)
        assert holder is not None and holder.owner == "newcomer"
        assert await b.release(name, "newcomer", None)  # a release without token frees it
        assert await b.read(name) is None
        assert await waiter_rows(pg, schema, table, name) == []


async def blocked_on_a_lock(pg: str, app: str) -> None:
    """Wait until a statement of the connections named ``app`` waits for a row lock."""
    query = (
        "SELECT count(*) AS n FROM pg_stat_activity"
        " WHERE application_name = $1 AND wait_event_type = 'Lock'"
    )
    with anyio.fail_after(20):  # a hang guard
        while (await raw(pg, query, app))[0]["n"] == 0:  # noqa: ASYNC110
            await anyio.sleep(0.01)  # another session's state: no event to await


@asynccontextmanager
async def locked_waiter_row(
    pg: str, schema: str, table: str, name: str, owner: str
) -> AsyncIterator[tuple[Any, Any]]:
    """A raw connection, and its transaction (to commit), that holds ``owner``'s waiter
    row locked."""
    conn = await asyncpg.connect(pg)
    try:
        transaction = conn.transaction()
        await transaction.start()
        await conn.execute(
            f'SELECT 1 FROM "{schema}"."{table}_waiters" WHERE name = $1 AND owner = $2 FOR UPDATE',
            name,
            owner,
        )
        yield conn, transaction
    finally:
        await conn.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # holds a row lock on a raw connection
async def test_a_hand_off_to_a_waiter_that_left_meanwhile_is_given_back(
    pg: str, schema: str, anyio_backend: str
) -> None:
    table, app = unique("queue"), unique("aiolease_queue")
    url = with_query(pg, schema=schema, table=table, listen="false", application_name=app)
    async with backend(url) as b:
        name = unique("left")
        first = await grant(b, name, "holder", ttl=60)
        await refused(b, name, "leaver")
        async with locked_waiter_row(pg, schema, table, name, "leaver") as (conn, transaction):
            async with anyio.create_task_group() as tg:
                released: list[bool] = []

                async def release() -> None:
                    released.append(await b.release(name, "holder", first.token))

                tg.start_soon(release)
                # The release hands the row to "leaver" and waits to delete its waiter
                # row; "leaver" deletes it first (it stopped waiting).
                await blocked_on_a_lock(pg, app)
                await conn.execute(
                    f'DELETE FROM "{schema}"."{table}_waiters" WHERE name = $1 AND owner = $2',
                    name,
                    "leaver",
                )
                await transaction.commit()
        assert released == [True]
        assert await b.read(name) is None  # given back on the leaver's behalf
        assert (await grant(b, name, "next")).token == first.token + 2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # holds a row lock on a raw connection
async def test_a_waiter_that_leaves_during_a_hand_off_to_it_gives_it_back(
    pg: str, schema: str, anyio_backend: str
) -> None:
    table, app = unique("queue"), unique("aiolease_queue")
    url = with_query(pg, schema=schema, table=table, listen="false", application_name=app)
    async with backend(url) as b:
        name = unique("leaving")
        first = await grant(b, name, "holder", ttl=60)
        await refused(b, name, "leaver")
        async with locked_waiter_row(pg, schema, table, name, "leaver") as (conn, transaction):
            async with anyio.create_task_group() as tg:
                released: list[bool] = []

                async def leave() -> None:  # the core's release after a cancelled wait
                    released.append(await b.release(name, "leaver", None))

                tg.start_soon(leave)
                await blocked_on_a_lock(pg, app)
                # A hand-off to "leaver" commits after the leaver's statement began.
                await conn.execute(
                    f'UPDATE "{schema}"."{table}" SET token = token + 1, owner = $2'
                    " WHERE name = $1",
                    name,
                    "leaver",
                )
                await conn.execute(
                    f'DELETE FROM "{schema}"."{table}_waiters" WHERE name = $1 AND owner = $2',
                    name,
                    "leaver",
                )
                await transaction.commit()
        assert released == [True]  # its second statement found the grant, and freed it
        assert await b.read(name) is None
        assert (await grant(b, name, "next")).token == first.token + 2


async def test_an_uncontended_acquire_and_release_does_not_touch_the_waiters_table(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    url, table = table_url
    async with backend(url) as b:
        name, fresh = unique("mark"), unique("fresh")
        await grant(b, name, "holder")
        await refused(b, name, "waiter")  # queued: the row is marked
        assert await waiter_rows(pg, schema, table, name) == ["waiter"]
        marks = (
            f'SELECT queued_until IS NOT NULL AS marked FROM "{schema}"."{table}" WHERE name = $1'
        )
        assert (await raw(pg, marks, name))[0]["marked"]
        assert not await b.release(name, "waiter", None)  # it leaves the queue
        assert await b.release(name, "holder", None)  # nobody to hand to: the mark goes
        assert not (await raw(pg, marks, name))[0]["marked"]
        # Any statement that named the waiters table would now fail, and the backend
        # would make it again (as on first use).
        await raw(pg, f'DROP TABLE "{schema}"."{table}_waiters"')
        for _ in range(20):
            for each in (name, fresh):
                token = (await grant(b, each, "owner")).token
                assert await b.release(each, "owner", token)
        exists = "SELECT to_regclass($1) IS NOT NULL AS present"
        assert not (await raw(pg, exists, f'"{schema}"."{table}_waiters"'))[0]["present"]
        # A contended acquire needs it: made again.
        await grant(b, name, "holder")
        await refused(b, name, "waiter")
        assert await waiter_rows(pg, schema, table, name) == ["waiter"]


@pytest.mark.parametrize("made", ["before the queue", "before the watch mark"])
async def test_a_table_made_before_the_marks_gets_them(pg: str, schema: str, made: str) -> None:
    table = unique("old")
    # An older layout (no waiters table; no mark columns, or only the queue's), with a
    # free row.
    marks = ", queued_until timestamptz" if made == "before the watch mark" else ""
    await raw(
        pg,
        f'CREATE TABLE "{schema}"."{table}" (name text COLLATE "C" PRIMARY KEY,'
        " token bigint NOT NULL, owner text, identity text, metadata text,"
        f" ttl double precision, acquired_at timestamptz, expires_at timestamptz{marks})",
    )
    await raw(pg, f'INSERT INTO "{schema}"."{table}" (name, token) VALUES (\'old\', 7)')
    async with backend(with_query(pg, schema=schema, table=table)) as b:
        assert (await grant(b, "old", "holder")).token == 8
        await refused(b, "old", "waiter")
        assert await waiter_rows(pg, schema, table, "old") == ["waiter"]
    rows = await raw(
        pg,
        "SELECT column_name, data_type FROM information_schema.columns"
        " WHERE table_schema = $1 AND table_name = $2"
        " AND column_name IN ('queued_until', 'watched_until') ORDER BY column_name",
        schema,
        table,
    )
    assert [(row["column_name"], row["data_type"]) for row in rows] == [
        ("queued_until", "timestamp with time zone"),
        ("watched_until", "timestamp with time zone"),
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # holds a row lock on a raw connection
async def test_a_refusal_by_a_holder_that_released_meanwhile_is_asked_again(
    pg: str, schema: str, anyio_backend: str
) -> None:
    """A queued waiter asks again while the holder's release, one that found nobody
    queued (so handed nothing on and woke nobody), commits during the statement: its
    snapshot shows the holder, the locked row's newest version is free. Refused, the
    waiter would wait for a notification that never comes (before: for the whole ttl;
    4 processes starting at once stalled that way)."""
    table, app = unique("queue"), unique("aiolease_queue")
    url = with_query(pg, schema=schema, table=table)
    async with backend(url) as holding, backend(with_query(url, application_name=app)) as b:
        name = unique("stale")
        await grant(holding, name, "holder", ttl=60)
        await refused(b, name, "waiter")
        conn = await asyncpg.connect(pg)
        try:
            releasing = conn.transaction()
            await releasing.start()
            await conn.execute(
                f'UPDATE "{schema}"."{table}" SET owner = NULL, identity = NULL,'
                " metadata = NULL, expires_at = NULL WHERE name = $1",
                name,
            )
            results: list[Grant | HolderInfo] = []

            async def attempt() -> None:
                results.append(await b.try_acquire(name, "waiter", 30, "waiter", {}))

            async with anyio.create_task_group() as tg:
                tg.start_soon(attempt)
                await blocked_on_a_lock(pg, app)
                await releasing.commit()
        finally:
            await conn.close()
        assert isinstance(results[0], Grant), f"refused by a holder that is gone: {results[0]}"


async def test_a_waiter_sweeps_expired_rows_of_every_name(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    # Rows of waiters that died, of a name nobody queues for again, expire but are
    # deleted by no statement of that name: the first wait in a queue of a backend
    # sweeps them, and leaves live rows alone.
    url, table = table_url
    waiters = f'"{schema}"."{table}_waiters"'
    async with backend(url) as b:
        name, idle = unique("busy"), unique("idle")
        first = await AsyncLock(b, name, ttl=30).acquire()  # (makes the tables)
        for owner, seconds in (("dead-1", -60.0), ("dead-2", -2.0), ("alive", 3600.0)):
            await raw(
                pg,
                f"INSERT INTO {waiters} (name, owner, ttl, ask, expires_at)"
                " VALUES ($1, $2, 30, 0, clock_timestamp() + make_interval(secs => $3))",
                idle,
                owner,
                seconds,
            )
        got: list[Lease] = []
        with anyio.fail_after(20):  # a hang guard
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: take_into(got, b, name))
                await waiting(b)  # it swept before it waited
                assert await waiter_rows(pg, schema, table, idle) == ["alive"]
                assert await first.release()
        assert await got[0].release()
        assert await waiter_rows(pg, schema, table, name) == []


async def take_into(got: list[Lease], b: Backend, name: str) -> None:
    got.append(await AsyncLock(b, name, ttl=30).acquire())


async def test_a_name_that_changes_hands_under_every_statement_is_refused_not_an_error(
    table_url: tuple[str, str],
) -> None:
    """Under a storm of grants and releases every acquire statement may find the row
    changed since its snapshot (neither granted nor refused): after its retries the
    caller is refused with the holder the latest read showed, and waits as for any
    holder. Regression: it raised ``BackendTimeout`` out of a blocking ``async with``."""
    url, _ = table_url
    async with backend(url) as holder_side, backend(url) as contender:
        name = unique("churn")
        first = await grant(holder_side, name, "holder")
        pg = pg_of(contender)
        acquires = {pg._sql.acquire, pg._sql.acquire_fast}
        fetch = pg._fetch

        async def snapshot_never_shows_it(sql: str, *args: Any, renewal: bool = False) -> list[Any]:
            rows = await fetch(sql, *args, renewal=renewal)
            return [] if sql in acquires else rows

        pg._fetch = snapshot_never_shows_it  # type: ignore[method-assign]
        result = await contender.try_acquire(name, "contender", 30.0, "contender", {})
        assert isinstance(result, HolderInfo) and result.owner == "holder", result
        assert result.token == first.token
