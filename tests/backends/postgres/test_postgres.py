"""The PostgreSQL backend on the real server: the contract, identifiers
and URLs, a pool of the user's, faults, cancellation.

Every test uses tables of its own run (dropped at the end), so other users of the
server are never disturbed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import asyncpg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import aiolease
from aiolease import (
    AsyncLock,
    BackendTimeout,
    BackendUnavailable,
    Capability,
    InvalidArgument,
    LeaseLostError,
)
from aiolease.abc import Backend, Grant, HolderInfo, permit_owner
from aiolease.backends.postgres import PostgresBackend
from aiolease.testing import CHECKS, Check
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.model import make_model_machine
from aiolease.testing.proxy import FaultProxy
from aiolease.testing.servers import server
from tests.backends.postgres.support import leaving_the_queue, raw
from tests.backends.sql.support import (
    HOSTILE_IDENTIFIERS,
    cancel_as_woken,
    check_one_winner,
    first_use_by_processes,
)
from tests.support import grant, inner, on_asyncio, raises, refused, unique, with_query

pytestmark = pytest.mark.anyio


MODEL_SETTINGS = settings(
    max_examples=12,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def fresh_table_url(pg: str, schema: str, **options: object) -> tuple[str, str]:
    table = unique("leases")
    return with_query(pg, schema=schema, table=table, **options), table


@asynccontextmanager
async def backend(url: str, **options: Any) -> AsyncIterator[Backend]:
    async with aiolease.open_backend(url, **options) as b:
        yield b


# -- the contract -------------------------------------------------------------------------


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(check: Check, pg_url: str) -> None:
    await check(lambda: aiolease.open_backend(pg_url))


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_agrees_with_model(pg_url: str, loop: str) -> None:
    # The model has no queue: a refused caller leaves it at once (as acquire_nowait does).
    machine = make_model_machine(
        lambda: leaving_the_queue(aiolease.open_backend(pg_url)),
        anyio_backend=loop,
        grants_on_release=True,
    )
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)


async def test_capabilities_and_open_backend() -> None:
    import asyncpg

    pool = asyncpg.create_pool("postgresql://localhost/never", min_size=0)  # never opened
    polling = {
        Capability.FAIR_QUEUE,
        Capability.SERVER_TIME,
        Capability.DURABLE_TOKENS,
        Capability.MULTI_PROCESS,
        Capability.PROCLAIM,
        Capability.SEMAPHORE,
        Capability.FAIR_PERMITS,
        Capability.PERMIT_RETRY_KEEPS_ENTRY,
    }
    assert PostgresBackend(pool).capabilities == polling | {Capability.PUSH_WAKEUP}
    assert PostgresBackend(pool, listen=False).capabilities == polling
    assert PostgresBackend.requires_asyncio


async def test_released_row_is_kept_with_its_token(pg: str, schema: str) -> None:
    url, table = fresh_table_url(pg, schema)
    async with backend(url) as b:
        first = await grant(b, "job", "owner-1")
        assert (await grant(b, "job", "owner-1")).token == first.token  # a retry
        assert await b.release("job", "owner-1", first.token)
        rows = await raw(pg, f'SELECT token, owner, expires_at FROM "{schema}"."{table}"')
        assert [tuple(r) for r in rows] == [(first.token, None, None)]
        assert (await grant(b, "job", "owner-2")).token == first.token + 1


async def _in_a_transaction(url: str, sql: str, *args: Any) -> tuple[list[Any], str, str]:
    """Run ``sql`` in a transaction of its own: its rows, ``synchronous_commit`` as the
    statement left it for that transaction, and as it is after the commit."""
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            rows = await conn.fetch(sql, *args)
            inside = await conn.fetchval("SHOW synchronous_commit")
        return rows, inside, await conn.fetchval("SHOW synchronous_commit")
    finally:
        await conn.close()


async def test_only_releases_that_grant_nothing_skip_the_wal_flush(pg: str, schema: str) -> None:
    # A release that frees a lock or a permit and grants nothing commits without waiting
    # for the WAL flush (its transaction's own setting; the session's is untouched); the
    # release that may hand the name on, and the grants, wait for it.
    url, _ = fresh_table_url(pg, schema)
    async with backend(url) as b:
        pgb = inner(b, PostgresBackend)
        lock = await grant(b, "job", "owner-1")
        released, inside, after = await on_asyncio(
            lambda: _in_a_transaction(
                pg, pgb._sql.release_fast, "job", "owner-1", lock.token, "unused", False
            )
        )
        assert [r["token"] for r in released] == [lock.token]
        assert (inside, after) == ("off", "on")
        lock = await grant(b, "job", "owner-2")
        released, inside, _ = await on_asyncio(
            lambda: _in_a_transaction(pg, pgb._sql.release, "job", "owner-2", lock.token, "unused")
        )
        assert released[0]["token"] == lock.token and inside == "on"

        owner = permit_owner()
        permit = await b.try_acquire_permit("pool", owner, 30, "w", {}, 4, 1)
        assert isinstance(permit, Grant)
        released, inside, after = await on_asyncio(
            lambda: _in_a_transaction(
                pg, pgb._permit_sql.release_plain, "pool", owner, permit.token, "unused"
            )
        )
        assert released[0]["freed"] and (inside, after) == ("off", "on")


async def test_tokens_survive_a_new_backend_and_a_lost_row_owner(pg: str, schema: str) -> None:
    url, table = fresh_table_url(pg, schema)
    async with backend(url) as b:
        token = (await grant(b, "job", "owner-1", ttl=0.2)).token
    async with backend(url) as b:
        with anyio.fail_after(10):  # a hang guard: expiry is the server's, 0.2 s
            while (holder := await b.read("job")) is not None:
                await b.wait_changed("job", holder)
        again = await grant(b, "job", "owner-1")  # the same owner after expiry: a new grant
        assert again.token == token + 1


async def test_setup_is_explicit_and_idempotent(pg: str, schema: str) -> None:
    url, table = fresh_table_url(pg, schema)
    async with backend(url) as b:
        pg_backend = inner(b, PostgresBackend)
        await on_asyncio(pg_backend.setup)
        await on_asyncio(pg_backend.setup)
        rows = await raw(pg, "SELECT to_regclass($1) IS NOT NULL AS found", f"{schema}.{table}")
        assert rows[0]["found"]


@pytest.mark.slow
def test_many_processes_create_the_table_on_first_use(pg: str, schema: str) -> None:
    url, _ = fresh_table_url(pg, schema, max_size=2)
    check_one_winner(first_use_by_processes(url, processes=6))


# -- identifiers and URLs -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "bad"),
    [
        (option, bad)
        for option in ("table", "schema", "channel")
        for bad in HOSTILE_IDENTIFIERS
        if not (option == "channel" and bad is None)  # None: the default channel
    ],
    ids=repr,
)
def test_hostile_identifiers_are_rejected_by_the_constructor(option: str, bad: object) -> None:
    options: dict[str, Any] = {option: bad}
    with pytest.raises(InvalidArgument, match=option):
        PostgresBackend(None, **options)


@pytest.mark.parametrize(
    "bad", [b for b in HOSTILE_IDENTIFIERS if isinstance(b, str) and b], ids=repr
)
async def test_hostile_table_names_in_urls_never_reach_the_server(
    pg: str, schema: str, bad: str
) -> None:
    canary = unique("canary")
    await raw(pg, f'CREATE TABLE "{schema}"."{canary}" (x int)')
    for url in (with_query(pg, table=bad, schema=schema), with_query(pg, schema=bad)):
        with raises(InvalidArgument, match="table" if "table=" in url else "schema"):
            async with backend(url):
                pass
    rows = await raw(pg, "SELECT to_regclass($1) IS NOT NULL AS found", f"{schema}.{canary}")
    assert rows[0]["found"]


async def test_identifiers_are_quoted_so_keywords_and_case_work(pg: str, schema: str) -> None:
    name = unique("job")
    for table in ("select", "User", "order_"):
        async with backend(with_query(pg, schema=schema, table=table)) as b:
            token = (await grant(b, name, unique("owner"))).token
            assert (await b.read(name)) is not None
        rows = await raw(pg, f'SELECT token FROM "{schema}"."{table}" WHERE name = $1', name)
        assert rows[0]["token"] == token


@pytest.mark.parametrize(
    "query",
    [
        "table=a&table=b",
        "poll_interval=-1",
        "poll_interval=soon",
        "listen=maybe",
        "max_size=0",
        "min_size=-1",
        "min_size=5&max_size=2",
        "renew_window=nan",
        "statement_cache_size=-1",
        "channel=no-dashes",
        "target_session_attrs=bogus",  # asyncpg's own: checked by asyncpg
    ],
)
async def test_bad_url_options_are_invalid(pg: str, query: str) -> None:
    with raises(InvalidArgument):
        async with backend(f"{pg}&{query}" if "?" in pg else f"{pg}?{query}"):
            pass


@pytest.mark.parametrize(
    "url",
    ["postgresql://127.0.0.1:port/test", "mysql://127.0.0.1/test", "postgresql://h/db#frag"],
)
async def test_malformed_urls_are_invalid(url: str) -> None:
    with pytest.raises(InvalidArgument):
        await PostgresBackend.from_url(url)


async def test_options_given_twice_or_unknown_are_invalid(pg: str) -> None:
    with raises(InvalidArgument, match="table"):
        async with backend(with_query(pg, table="a"), table="b"):
            pass
    with raises(InvalidArgument, match="nosuch"):
        async with backend(pg, nosuch=1):
            pass


async def test_an_unreachable_server_is_unavailable() -> None:
    with raises(BackendUnavailable):
        async with backend("postgresql://postgres@127.0.0.1:1/test", connect_timeout=5):
            pass


# -- a pool or connection of the user's --------------------------------------------------------


async def test_a_users_pool_and_connection_are_used_and_never_closed(pg: str, schema: str) -> None:
    table = unique("leases")

    async def run() -> None:
        pool = await asyncpg.create_pool(pg, min_size=1, max_size=2)
        conn = await asyncpg.connect(pg)
        try:
            for db in (pool, conn):
                async with PostgresBackend(db, schema=schema, table=table) as b:
                    owner = unique("owner")
                    granted = await b.try_acquire("job", owner, 30, "me", {})
                    assert isinstance(granted, Grant)
                    # Not listening yet: the core's watch task (wait_taken) watches.
                    assert b.on_taken("job", owner, granted.token, print) is None
                    seen = await b.read("job")
                    await b.wait_changed("job", None)  # opens the listener, returns at once
                    assert b.statistics().listening
                    assert b.statistics().pool is None  # the user's
                    unsubscribe = b.on_taken("job", owner, granted.token, print)
                    assert unsubscribe is not None
                    unsubscribe()
                    assert await b.release("job", owner, granted.token)
                    await b.wait_changed("job", seen)
            assert await conn.fetchval("SELECT 1") == 1
            assert await pool.fetchval("SELECT 1") == 1
        finally:
            await conn.close()
            await pool.close()

    await on_asyncio(run)


def test_db_must_be_a_pool_or_connection() -> None:
    with pytest.raises(InvalidArgument, match="Pool or Connection"):
        PostgresBackend("postgresql://localhost/test")


# -- faults -----------------------------------------------------------------------------------


async def test_killed_connections_mid_hold_keep_the_lease(pg: str, schema: str) -> None:
    app = unique("aiolease_kill")
    url = with_query(pg, schema=schema, application_name=app)
    async with backend(url) as b, backend(with_query(pg, schema=schema)) as other:
        spy = FaultyBackend(b)
        lock = AsyncLock(spy, unique("kill"), ttl=1.5)
        async with lock as lease:
            await spy.wait_called("renew")
            killed = await raw(
                pg,
                "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity"
                " WHERE application_name = $1",
                app,
            )
            assert killed[0]["n"] >= 1
            renewals = lock.statistics().renewals
            with anyio.fail_after(20):
                while lock.statistics().renewals < renewals + 2:
                    await spy.wait_called("renew")
            assert lease.lost is None
            stranger = unique("owner")
            holder = await refused(other, lease.name, stranger)
            assert (holder.owner, holder.token) == (lease.owner, lease.token)
            assert not await other.release(lease.name, stranger, None)  # leaves the queue
        assert await other.read(lease.name) is None


async def test_a_cut_off_holder_stops_before_anyone_else_gets_the_lease(
    pg: str, schema: str
) -> None:
    host, port = server("postgres").addresses[0]
    name = unique("cutoff")
    async with FaultProxy(host, port) as proxy:
        url = with_query(proxy.url_for(pg), schema=schema)
        async with (
            backend(url, connect_timeout=2) as cut,
            backend(with_query(pg, schema=schema)) as b,
        ):
            lock = AsyncLock(cut, name, ttl=1.0)
            stopped_at = None
            with pytest.raises(LeaseLostError), anyio.fail_after(20):
                async with lock as lease:
                    await proxy.blackhole()
                    try:
                        await anyio.sleep_forever()
                    finally:
                        stopped_at = anyio.current_time()
            taken = await AsyncLock(b, name, ttl=5.0).acquire(timeout=20)
            granted_at = anyio.current_time()
            assert stopped_at is not None and stopped_at < granted_at
            assert taken.token > lease.token
            await proxy.pass_through()
            assert await taken.release()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_statement_that_waits_too_long_is_a_timeout(
    pg: str, schema: str, anyio_backend: str
) -> None:
    url, table = fresh_table_url(pg, schema)
    async with backend(url, command_timeout=0.3) as b:
        await grant(b, "locked", "owner-1")
        conn = await asyncpg.connect(pg)
        try:
            async with conn.transaction():
                await conn.execute(
                    f'SELECT 1 FROM "{schema}"."{table}" WHERE name = $1 FOR UPDATE', "locked"
                )
                # A read does not lock the row: it does not wait.
                seen = await b.read("locked")
                assert isinstance(seen, HolderInfo) and seen.owner == "owner-1"
                # A refusal marks the row as having waiters, and the holder's own retry
                # updates it: both wait for the lock.
                for owner in ("owner-2", "owner-1"):
                    with pytest.raises(BackendTimeout):
                        await b.try_acquire("locked", owner, 30, "me", {})
        finally:
            await conn.close()
        holder = await b.read("locked")
        assert holder is not None and holder.owner == "owner-1"


async def test_a_closed_backend_is_unavailable(pg_url: str) -> None:
    async with backend(pg_url) as b:
        await b.aclose()
        for call in (
            b.read("x"),
            b.renew("x", "owner", 1, 1.0),
            b.try_acquire("x", "o", 1, "", {}),
        ):
            with pytest.raises(BackendUnavailable, match="closed"):
                await call
        await b.aclose()  # idempotent; open_backend closes it once more


# -- cancellation ------------------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio's cancel scopes cancel again
async def test_a_cancel_that_comes_with_the_wake_up_is_not_swallowed(
    pg_url: str, anyio_backend: str
) -> None:
    # Without a listener: its NOTIFY of the hand-off could wake the waiter while the
    # release still awaits its reply, and the waiter would take the lease before the
    # cancel. The waiter is then woken only by the release's own reply.
    async with backend(pg_url, poll_interval=60, listen=False) as b:
        name = unique("cancel")
        granted = await grant(b, name, "owner-1", ttl=60)
        await cancel_as_woken(b, name, "owner-1", granted.token)
