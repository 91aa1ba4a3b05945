"""The MySQL / MariaDB backend's statements and connections: batched renewals, and the
lean pool of a backend made from a URL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import anyio
import asyncmy
import pytest

import aiolease
from aiolease import (
    AsyncLock,
    BackendUnavailable,
    NotOwnerError,
)
from aiolease.abc import Backend, Grant, HolderInfo, permit_owner
from aiolease.backends.mysql import MySQLBackend
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.proxy import FaultProxy
from aiolease.testing.servers import server
from tests.backends.mysql.support import (
    connect_args,
    in_database,
    raw,
)
from tests.support import eventually, grant, inner, raises, refused, unique, with_query

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def backend(url: str, **options: Any) -> AsyncIterator[Backend]:
    async with aiolease.open_backend(url, **options) as b:
        yield b


# -- batched renewals -----------------------------------------------------------------------


@asynccontextmanager
async def one_connection(url: str) -> AsyncIterator[tuple[MySQLBackend, Callable[[], Any]]]:
    """A backend on a pool of one connection, and a reader of that connection's count
    of UPDATE statements (``SHOW SESSION STATUS``: no other client adds to it)."""
    parts = urlsplit(url)
    pool = await asyncmy.create_pool(minsize=1, maxsize=1, db=parts.path[1:], **connect_args(url))
    b = MySQLBackend(pool, table=unique("batch"))

    async def updates() -> int:
        async with pool.acquire() as conn, conn.cursor() as cur:
            await cur.execute("SHOW SESSION STATUS LIKE 'Com_update%'")  # and _multi
            return sum(int(value) for _, value in await cur.fetchall())

    try:
        yield b, updates
    finally:
        await b.aclose()
        pool.close()
        await pool.wait_closed()


async def _remaining(url: str, table: str, name: str) -> float:
    """Seconds until ``name``'s row of ``table`` (qualified) expires, by the server."""
    sql = f"SELECT TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) FROM {table}"
    sql += " WHERE name = %s"
    return float((await raw(url, sql, name.encode()))[0][0]) / 1e6


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pool of this loop
async def test_concurrent_renewals_are_one_statement_with_an_answer_each(
    my_url: str, database: str, anyio_backend: str
) -> None:
    async with one_connection(my_url) as (b, updates):
        names = [unique("together") for _ in range(20)]
        tokens = [(await grant(b, name, "owner-1", ttl=2)).token for name in names]
        # One lease was taken over (by another process), one renewal names a wrong
        # token: both must come back "not owner", alone, while the others are renewed.
        qualified = f"`{database}`.`{b.table}`"
        takeover = f"UPDATE {qualified} SET owner = 'owner-2', token = token + 1 WHERE name = %s"
        await raw(my_url, takeover, names[3].encode())
        tokens[5] += 1
        before = await updates()
        results: dict[str, Grant | BaseException] = {}

        async def renew(name: str, token: int) -> None:
            try:
                results[name] = await b.renew(name, "owner-1", token, 30.0)
            except NotOwnerError as exc:
                results[name] = exc

        async with anyio.create_task_group() as tg:
            for name, token in zip(names, tokens, strict=True):
                tg.start_soon(renew, name, token)
        assert await updates() - before == 1  # 20 renewals, one UPDATE
        assert b.statistics().renew_statements == 1
        for i, name in enumerate(names):
            if i in (3, 5):
                assert isinstance(results[name], NotOwnerError), (i, results[name])
                continue
            renewed = results[name]
            assert isinstance(renewed, Grant) and renewed.token == tokens[i]
            assert await _remaining(my_url, qualified, name) > 10
        holder = await b.read(names[3])
        assert holder is not None and holder.owner == "owner-2"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pool of this loop
async def test_renewals_of_different_ttls_share_a_statement(
    my_url: str, database: str, anyio_backend: str
) -> None:
    async with one_connection(my_url) as (b, updates):
        names = [unique("mixed") for _ in range(6)]
        tokens = [(await grant(b, name, "owner-1", ttl=2)).token for name in names]
        before = await updates()
        async with anyio.create_task_group() as tg:
            for i, (name, token) in enumerate(zip(names, tokens, strict=True)):
                tg.start_soon(b.renew, name, "owner-1", token, 20.0 + 10 * (i % 2))
        assert await updates() - before == 1
        for i, name in enumerate(names):  # each row got its own ttl
            left = await _remaining(my_url, f"`{database}`.`{b.table}`", name)
            assert 15 < left <= 20 + 10 * (i % 2), (i, left)


async def test_many_held_leases_are_renewed_in_one_statement_per_tick(my_url: str) -> None:
    leases = 12
    async with backend(my_url) as b:
        spy = FaultyBackend(b)
        locks = [AsyncLock(spy, unique("held"), ttl=1.5) for _ in range(leases)]

        async def renewed(rounds: int) -> None:
            with anyio.fail_after(30):  # a hang guard: 3 renewals a ttl
                while min(lock.statistics().renewals for lock in locks) < rounds:
                    await spy.wait_called("renew")

        async with anyio.create_task_group() as tg:
            for lock in locks:
                await tg.start(_hold, lock)
            await renewed(2)
            before = inner(b, MySQLBackend).statistics().renew_statements
            await renewed(5)
            statements = inner(b, MySQLBackend).statistics().renew_statements - before
            tg.cancel_scope.cancel()
        # 3 more ticks of 12 leases: 36 statements unbatched, about 3 batched.
        assert statements <= 3 + 2, statements
        assert all(lock.statistics().losses == {} for lock in locks)


async def _hold(lock: AsyncLock, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    async with lock:
        task_status.started()
        await anyio.sleep_forever()


# Seconds of slow round trips: once (the loops take turns between Redis and MySQL).
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_renewals_slower_than_a_third_of_the_ttl_still_confirm(my_url: str) -> None:
    host, port = server("mariadb").addresses[0]
    async with FaultProxy(host, port) as proxy:
        async with backend(proxy.url_for(my_url)) as b:
            # Round trips of about 2.4 s: longer than ttl / 3 (2 s), shorter than the
            # renew interval.
            faulty = FaultyBackend(b)
            lock = AsyncLock(faulty, unique("slow"), ttl=6.0, renew_interval=2.9, margin=0.05)
            async with lock as lease:
                await proxy.delay(1.2)
                with anyio.fail_after(30):
                    for _ in range(3):  # the third renewal starts when the second has ended
                        await faulty.wait_called("renew")
                assert lock.statistics().renewals >= 2
                assert lease.lost is None
                await proxy.pass_through()


# -- round trips of a permit -------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pool of this loop
async def test_an_uncontended_permit_is_one_round_trip_to_acquire_and_one_to_release(
    my_url: str, anyio_backend: str
) -> None:
    parts = urlsplit(my_url)
    pool = await asyncmy.create_pool(
        minsize=1, maxsize=1, db=parts.path[1:], **connect_args(my_url)
    )
    b = MySQLBackend(pool, table=unique("trips"))

    async def questions() -> int:
        """The pool's one connection's count of statements sent by the client (a
        procedure's own statements not counted; the read itself counts one)."""
        async with pool.acquire() as conn, conn.cursor() as cur:
            await cur.execute("SHOW SESSION STATUS LIKE 'Questions'")
            return int((await cur.fetchall())[0][1])

    async def sent(call: Callable[[], Any]) -> tuple[Any, int]:
        before = await questions()
        result = await call()
        return result, await questions() - before - 1  # less the second read

    try:
        await b.read_permits(unique("warm"))  # the tables and the procedure exist from here
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
        # A request queued behind it (this backend saw the refusal): the release is the
        # procedure at once, which grants the waiter's queue entry the next token; the
        # waiter takes it from the release's answer, without a statement.
        freed, release = await sent(lambda: b.release(name, owner, got.token))
        assert freed and release == 1
        turn, taken = await sent(lambda: b.try_acquire_permit(name, other, 30.0, "b", {}, 1, 1))
        assert isinstance(turn, Grant) and turn.token == got.token + 1 and taken == 0
    finally:
        await b.aclose()
        pool.close()
        await pool.wait_closed()


# -- the connections of a backend made from a URL ----------------------------------------------


async def _thread_ids(my: str, database: str) -> set[int]:
    rows = await raw(my, "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = %s", database)
    return {int(row[0]) for row in rows}


async def _until_ids(
    my: str, database: str, predicate: Callable[[set[int]], bool], what: str
) -> set[int]:
    with anyio.move_on_after(20):  # a hang guard: the server notices closed sockets soon
        while True:
            ids = await _thread_ids(my, database)
            if predicate(ids):
                return ids
            await anyio.sleep(0.02)
    raise AssertionError(f"{what} did not happen")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # holds a row lock on a raw connection
async def test_an_interrupted_statements_connection_is_never_reused(
    my: str, own_database: str, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An acquire's statement is waited for after a cancel (``finished``): not this one.
    monkeypatch.setattr("aiolease.backends.sql._running.FINISH_GRACE", 0.0)
    table = unique("leases")
    url = with_query(in_database(my, own_database), table=table, max_size=2)
    async with backend(url) as b, backend(url) as other:
        stats = inner(b, MySQLBackend).statistics
        await grant(other, "locked", "owner-1")  # elsewhere: b must ask the server
        before = await _thread_ids(my, own_database)
        conn = await asyncmy.connect(**connect_args(my), db=own_database)
        try:
            await conn.begin()
            async with conn.cursor() as cur:
                await cur.execute(f"SELECT 1 FROM `{table}` WHERE name = 'locked' FOR UPDATE")
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.try_acquire, "locked", "owner-2", 30, "me", {})
                await eventually(lambda: stats().pool.others == 1, "the acquire waiting")  # type: ignore[union-attr]
                tg.cancel_scope.cancel()
            pool = stats().pool
            assert pool is not None and pool.discarded == 1 and pool.size == 0
            await conn.rollback()
        finally:
            conn.close()
        holder = await refused(b, "locked", "owner-2")  # on a new connection
        assert holder.owner == "owner-1"
        pool = stats().pool
        assert pool is not None and pool.opened == 2 and pool.size == 1
        # The interrupted one is gone from the server too (b's first is one of "before").
        await _until_ids(
            my,
            own_database,
            lambda ids: len(ids - before) == 1 and len(before - ids) == 1,
            "the old connection closing",
        )


async def test_close_closes_idle_connections_and_refuses_new_use(
    my: str, own_database: str
) -> None:
    url = with_query(in_database(my, own_database), min_size=2)
    async with backend(url) as b:
        assert len(await _thread_ids(my, own_database)) == 2  # min_size, opened ahead of use
        await b.aclose()
        await _until_ids(my, own_database, lambda ids: not ids, "the idle connections closing")
        pool = inner(b, MySQLBackend).statistics().pool
        assert pool is not None and pool.size == 0
        with raises(BackendUnavailable, match="closed"):
            await b.read("x")
