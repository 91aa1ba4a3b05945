"""The PostgreSQL backend's statements and connections: batched renewals, the lean pool
of a backend made from a URL, and a cancelled acquire whose statement still runs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import anyio
import asyncpg
import pytest

import aiolease
from aiolease import (
    AsyncLock,
    BackendUnavailable,
    NotOwnerError,
)
from aiolease.abc import Backend, Grant, HolderInfo, permit_owner
from aiolease.backends.postgres import PostgresBackend
from aiolease.backends.sql._pool import LeanPool
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.servers import server
from tests.backends.postgres.support import raw
from tests.support import eventually, grant, inner, on_asyncio, raises, unique, with_query

pytestmark = pytest.mark.anyio


def fresh_table_url(pg: str, schema: str, **options: object) -> tuple[str, str]:
    table = unique("leases")
    return with_query(pg, schema=schema, table=table, **options), table


@asynccontextmanager
async def backend(url: str, **options: Any) -> AsyncIterator[Backend]:
    async with aiolease.open_backend(url, **options) as b:
        yield b


# -- batched renewals --------------------------------------------------------------------------


class Counting(asyncpg.Connection):  # type: ignore[misc]  # asyncpg has no type hints
    """Counts the renew statements sent on every connection of a pool."""

    renew_statements: ClassVar[int] = 0

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
        if "unnest(" in query:
            Counting.renew_statements += 1
        return await super().fetch(query, *args, **kwargs)


async def test_renewals_of_many_leases_share_one_statement_per_tick(pg_url: str) -> None:
    leases = 12
    options = {"connect_options": {"connection_class": Counting}}
    async with backend(pg_url, **options) as b:
        spy = FaultyBackend(b)
        locks = [AsyncLock(spy, unique("batch"), ttl=1.5) for _ in range(leases)]

        async def renewed(rounds: int) -> int:
            """Wait until every lease was renewed ``rounds`` times; the renew statements
            sent until then (not counting the next tick's, whose call ends the wait)."""
            with anyio.fail_after(30):  # a hang guard: 3 renewals a ttl
                sent = Counting.renew_statements
                while min(lock.statistics().renewals for lock in locks) < rounds:
                    sent = Counting.renew_statements
                    await spy.wait_called("renew")
                return sent

        async with anyio.create_task_group() as tg:
            before = Counting.renew_statements
            # Granted all at once, not one after the other: on a loaded machine a line
            # of 12 acquires (through the trio bridge) can spread the grants over more
            # than half a renew interval, and their first renewals then go in two
            # statements (CI saw 6 where 5 were allowed).
            held = [anyio.Event() for _ in locks]
            for lock, event in zip(locks, held, strict=True):
                tg.start_soon(_hold, lock, event)
            for event in held:
                await event.wait()
            statements = await renewed(4) - before  # the first renewals join one batch
            tg.cancel_scope.cancel()
        # 4 ticks of 12 leases: 48 statements one lease at a time, 4 batched (one more
        # if the grants straddled a tick).
        assert statements <= 4 + 1, statements
        stats = inner(b, PostgresBackend).statistics()
        assert stats.renew_statements >= statements
        assert all(lock.statistics().losses == {} for lock in locks)


async def _hold(lock: AsyncLock, held: anyio.Event) -> None:
    async with lock:
        held.set()
        await anyio.sleep_forever()


async def test_each_renewal_of_one_lease_is_a_newer_statement(pg_url: str) -> None:
    async with backend(pg_url) as b:
        name = unique("sequential")
        token = (await grant(b, name, "owner-1")).token
        pg_backend = inner(b, PostgresBackend)
        sent: list[float] = []
        for _ in range(4):
            called = anyio.current_time()
            renewed = await b.renew(name, "owner-1", token, 30)
            assert renewed.sent_at is not None and renewed.sent_at >= called
            sent.append(renewed.sent_at)
        assert sent == sorted(set(sent))  # never answered from the previous statement
        assert pg_backend.statistics().renew_statements == 4
        with pytest.raises(NotOwnerError):
            await b.renew(name, "owner-2", token, 30)


async def test_concurrent_renewals_share_a_statement(pg_url: str) -> None:
    async with backend(pg_url) as b:
        names = [unique("together") for _ in range(10)]
        tokens = [(await grant(b, name, "owner-1")).token for name in names]
        async with anyio.create_task_group() as tg:
            for name, token in zip(names, tokens, strict=True):
                tg.start_soon(b.renew, name, "owner-1", token, 30.0)
        assert inner(b, PostgresBackend).statistics().renew_statements <= 2


# -- round trips of a permit -------------------------------------------------------------------


class RoundTrips(asyncpg.Connection):  # type: ignore[misc]  # asyncpg has no type hints
    """Counts what every connection of a pool sends (each call: one round trip; a
    transaction's BEGIN and COMMIT go through ``execute``)."""

    sent: ClassVar[int] = 0

    async def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        RoundTrips.sent += 1
        return await super().execute(query, *args, **kwargs)

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
        RoundTrips.sent += 1
        return await super().fetch(query, *args, **kwargs)

    async def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
        RoundTrips.sent += 1
        return await super().fetchval(query, *args, **kwargs)

    async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        RoundTrips.sent += 1
        return await super().fetchrow(query, *args, **kwargs)


async def test_an_uncontended_permit_is_one_round_trip_to_acquire_and_one_to_release(
    pg_url: str,
) -> None:
    options = {"connect_options": {"connection_class": RoundTrips}, "listen": False}
    async with backend(pg_url, **options) as b:
        await b.read_permits(unique("warm"))  # the tables and the function exist from here

        async def sent(call: Callable[[], Any]) -> tuple[Any, int]:
            before = RoundTrips.sent
            result = await call()
            return result, RoundTrips.sent - before

        name, owner, other = unique("sem"), permit_owner(), permit_owner()
        got, acquire = await sent(lambda: b.try_acquire_permit(name, owner, 30.0, "a", {}, 1, 1))
        assert isinstance(got, Grant) and acquire == 1
        retried, again = await sent(lambda: b.try_acquire_permit(name, owner, 30.0, "a", {}, 1, 1))
        assert isinstance(retried, Grant) and retried.token == got.token and again == 1
        refused_by, refusal = await sent(
            lambda: b.try_acquire_permit(name, other, 30.0, "b", {}, 1, 1)
        )
        assert isinstance(refused_by, HolderInfo) and refused_by.owner == owner
        assert refusal == 1
        freed, release = await sent(lambda: b.release(name, owner, got.token))
        assert freed and release == 1
        # The waiter's turn: the release granted its queue entry the next token, which
        # it takes from the release's answer, without a statement.
        turn, taken = await sent(lambda: b.try_acquire_permit(name, other, 30.0, "b", {}, 1, 1))
        assert isinstance(turn, Grant) and turn.token == got.token + 1 and taken == 0


# -- the connections of a backend made from a URL ----------------------------------------------


async def _server_pids(app: str) -> set[int]:
    rows = await raw(
        server("postgres").url, "SELECT pid FROM pg_stat_activity WHERE application_name = $1", app
    )
    return {row["pid"] for row in rows}


async def _until_pids(app: str, predicate: Callable[[set[int]], bool], what: str) -> set[int]:
    with anyio.move_on_after(20):  # a hang guard: the server notices closed sockets soon
        while True:
            pids = await _server_pids(app)
            if predicate(pids):
                return pids
            await anyio.sleep(0.02)
    raise AssertionError(f"{what} did not happen")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # holds a row lock on a raw connection
async def test_a_burst_is_bounded_and_never_delays_the_renewal(
    pg: str, schema: str, anyio_backend: str
) -> None:
    app = unique("aiolease_burst")
    url, table = fresh_table_url(pg, schema, max_size=3, listen="false", application_name=app)
    async with backend(url) as b:
        stats = inner(b, PostgresBackend).statistics
        await grant(b, "locked", "owner-1")
        kept = await grant(b, "kept", "owner-2")
        conn = await asyncpg.connect(pg)
        try:
            lock = conn.transaction()
            await lock.start()
            await conn.execute(
                f'SELECT 1 FROM "{schema}"."{table}" WHERE name = $1 FOR UPDATE', "locked"
            )
            async with anyio.create_task_group() as tg:
                for _ in range(6):  # the holder's retries update the row: they wait for the lock
                    tg.start_soon(b.try_acquire, "locked", "owner-1", 30, "me", {})

                def full() -> bool:
                    pool = stats().pool
                    return pool is not None and pool.others == 2 and pool.waiting == 4

                await eventually(full, "the burst filling all but one connection")
                # The reserved connection renews while the burst waits.
                renewed = await b.renew("kept", "owner-2", kept.token, 30)
                assert renewed.token == kept.token
                pool = stats().pool
                assert pool is not None and pool.size == 3 and pool.opened == 3
                assert len(await _server_pids(app)) == 3
                await lock.rollback()
            pool = stats().pool
            assert pool is not None and pool.size <= 3 and pool.opened == 3 and pool.waiting == 0
        finally:
            await conn.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # holds a row lock on a raw connection
async def test_an_interrupted_statements_connection_is_never_reused(
    pg: str, schema: str, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An acquire's statement is waited for after a cancel (``finished``): not this one.
    monkeypatch.setattr("aiolease.backends.sql._running.FINISH_GRACE", 0.0)
    app = unique("aiolease_interrupt")
    url, table = fresh_table_url(pg, schema, max_size=2, listen="false", application_name=app)
    async with backend(url) as b:
        stats = inner(b, PostgresBackend).statistics
        await grant(b, "locked", "owner-1")
        (first,) = await _server_pids(app)  # min_size 1: the one connection
        conn = await asyncpg.connect(pg)
        try:
            async with conn.transaction():
                await conn.execute(
                    f'SELECT 1 FROM "{schema}"."{table}" WHERE name = $1 FOR UPDATE', "locked"
                )
                async with anyio.create_task_group() as tg:
                    tg.start_soon(b.try_acquire, "locked", "owner-1", 30, "me", {})
                    await eventually(lambda: stats().pool.others == 1, "the retry waiting")  # type: ignore[union-attr]
                    tg.cancel_scope.cancel()
                pool = stats().pool
                assert pool is not None and pool.discarded == 1 and pool.size == 0
        finally:
            await conn.close()
        holder = await b.read("locked")  # on a new connection
        assert holder is not None and holder.owner == "owner-1"
        pids = await _until_pids(app, lambda pids: first not in pids, "the old connection closing")
        assert len(pids) == 1


async def test_close_closes_idle_connections_and_refuses_new_use(pg: str, schema: str) -> None:
    app = unique("aiolease_close")
    url, _ = fresh_table_url(pg, schema, min_size=2, listen="false", application_name=app)
    async with backend(url) as b:
        assert len(await _server_pids(app)) == 2  # min_size, opened ahead of use
        await b.aclose()
        await _until_pids(app, lambda pids: not pids, "the idle connections closing")
        pool = inner(b, PostgresBackend).statistics().pool
        assert pool is not None and pool.size == 0
        with raises(BackendUnavailable, match="closed"):
            await b.try_acquire("x", "owner", 1, "", {})


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_pool_hands_over_to_waiters_and_closes_what_comes_back(
    pg: str, anyio_backend: str
) -> None:
    pool: LeanPool[Any] = LeanPool(
        lambda: asyncpg.connect(pg),
        close=lambda conn: conn.close(),
        terminate=lambda conn: conn.terminate(),
        usable=lambda conn: not conn.is_closed(),
        max_size=2,
    )
    first = await pool.acquire()  # other statements may hold 1 of 2
    waiter = asyncio.ensure_future(pool.acquire())
    await eventually(lambda: pool.statistics().waiting == 1, "the second caller queued")
    # Handed over to the waiter, which is cancelled before it runs: it gives it back.
    pool.release(first)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (pool.statistics().idle, pool.statistics().others) == (1, 0)
    again = await pool.acquire()
    assert again is first  # reused: it ended normally
    queued = asyncio.ensure_future(pool.acquire())
    await eventually(lambda: pool.statistics().waiting == 1, "a caller queued")
    renewal = await pool.acquire(renewal=True)  # the reserve, past the queue
    assert pool.statistics().size == 2
    await pool.aclose()
    with pytest.raises(BackendUnavailable):
        await queued
    pool.release(again)
    pool.release(renewal, renewal=True)
    assert again.is_closed() and renewal.is_closed()
    await asyncio.sleep(0)  # their transports finish closing
    assert pool.statistics().size == 0
    with pytest.raises(BackendUnavailable):
        await pool.acquire()


# -- a cancelled acquire whose statement is still running on the server ---------------------


async def test_a_cancelled_acquire_waits_for_its_statement_before_giving_back(
    pg: str, schema: str
) -> None:
    """Closing the connection of an interrupted acquire does not stop the server from
    committing it: the compensating release must come after that commit, or the grant
    stays held until its ttl runs out. A trigger holds the acquire on the server."""
    url, table = fresh_table_url(pg, schema)
    name = unique("slow")
    async with backend(url) as b:
        first = uuid.uuid4().hex
        await grant(b, name, first)  # creates the table, and a row to update
        assert await b.release(name, first, None)
        await raw(
            pg,
            f'CREATE FUNCTION "{schema}"."slow_{table}"() RETURNS trigger LANGUAGE plpgsql'
            " AS $$ BEGIN IF NEW.identity = 'slow' THEN PERFORM pg_sleep(0.5); END IF;"
            " RETURN NEW; END $$",
        )
        await raw(
            pg,
            f'CREATE TRIGGER slow BEFORE INSERT OR UPDATE ON "{schema}"."{table}"'
            f' FOR EACH ROW EXECUTE FUNCTION "{schema}"."slow_{table}"()',
        )
        lease = None
        with anyio.move_on_after(0.1) as scope:
            lease = await AsyncLock(b, name, ttl=30, identity="slow").acquire()
        assert lease is None and scope.cancelled_caught
        # Wait for every statement on the table to end (the lock waits for them), then look.
        await on_asyncio(lambda: _lock_table(pg, f'"{schema}"."{table}"'))
        assert await b.read(name) is None


async def _lock_table(url: str, table: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            await conn.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
    finally:
        await conn.close()


async def test_listener_log_lines_never_show_the_listen_url_password(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``listen_url`` that asyncpg cannot parse: its error quotes a piece of the
    password (cut at the ``/``), which the listener's log line must mask."""
    listen_url = "postgresql://u:pw1/pw2@[::1/test"
    caplog.set_level("INFO", logger="aiolease.backends.postgres")
    async with aiolease.open_backend(pg_url, listen_url=listen_url) as b:
        with anyio.move_on_after(0.5):
            await b.wait_changed("listener-log", None)
    shown = [r.getMessage() for r in caplog.records if "listener" in r.getMessage()]
    assert any("cannot connect" in line for line in shown), shown
    assert not any("pw1" in line or "pw2" in line for line in shown), shown
