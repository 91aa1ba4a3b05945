"""The PostgreSQL backend on the real server: the contract, NOTIFY, batching, faults, bad input.

Every test uses tables of its own run (dropped at the end), so other users of the
server are never disturbed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, ClassVar

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
    LossReason,
    NotOwnerError,
)
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends._asyncio import run_to_end, timeout_after, wait_event
from aiolease.backends.postgres import PostgresBackend
from aiolease.backends.postgres._statements import grants_channel, parse_payload
from aiolease.backends.postgres._takers import Takers
from aiolease.backends.sql._pool import LeanPool
from aiolease.testing import CHECKS, Check
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.model import make_model_machine
from aiolease.testing.proxy import FaultProxy
from aiolease.testing.servers import server
from tests.backends.postgres.support import leaving_the_queue, no_tls, raw, schema_of_run, waiting
from tests.support import (
    HOSTILE_IDENTIFIERS,
    cancel_as_woken,
    check_oldest_waiter_gets_it,
    check_one_winner,
    eventually,
    first_use_by_processes,
    grant,
    inner,
    on_asyncio,
    raises,
    refused,
    suspended_in,
    unique,
    with_query,
)

pytestmark = pytest.mark.anyio

MODEL_SETTINGS = settings(
    max_examples=12,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema() -> Iterator[str]:
    """A schema of this run's own; dropped with everything in it at the end."""
    yield from schema_of_run("aiolease_test")


@pytest.fixture
def pg(aiolease_server: Callable[[str], str]) -> str:
    """The server's URL (no options of ours), without TLS (see ``no_tls``)."""
    return no_tls(aiolease_server("postgres"))


@pytest.fixture
def pg_url(pg: str, schema: str) -> str:
    """A URL whose leases live in this run's schema."""
    return with_query(pg, schema=schema)


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
        lambda: leaving_the_queue(aiolease.open_backend(pg_url)), anyio_backend=loop
    )
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)


async def test_capabilities_and_open_backend() -> None:
    assert PostgresBackend.capabilities == {
        Capability.PUSH_WAKEUP,
        Capability.FAIR_QUEUE,
        Capability.SERVER_TIME,
        Capability.DURABLE_TOKENS,
        Capability.MULTI_PROCESS,
    }
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

        async def renewed(rounds: int) -> None:
            with anyio.fail_after(30):  # a hang guard: 3 renewals a ttl
                while min(lock.statistics().renewals for lock in locks) < rounds:
                    await spy.wait_called("renew")

        async with anyio.create_task_group() as tg:
            for lock in locks:
                await tg.start(_hold, lock)
            await renewed(2)  # the first renewal of each lease has nothing to share yet
            before = Counting.renew_statements
            await renewed(5)
            statements = Counting.renew_statements - before
            tg.cancel_scope.cancel()
        # 3 more ticks of 12 leases: 36 statements unbatched, about 3 batched.
        assert statements <= 3 + 2, statements
        stats = inner(b, PostgresBackend).statistics()
        assert stats.renewals_shared > 0
        assert all(lock.statistics().losses == {} for lock in locks)


async def _hold(lock: AsyncLock, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    async with lock:
        task_status.started()
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


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_wait_event_never_swallows_a_cancel(anyio_backend: str) -> None:
    event = asyncio.Event()
    task = asyncio.create_task(wait_event(event, 60))
    await eventually(lambda: suspended_in(task, "wait_event"), "the wait blocking")
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_event(event, 60)
    assert not await wait_event(asyncio.Event(), 0.01)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_run_to_end_ends_its_work_before_the_cancel_is_raised(anyio_backend: str) -> None:
    release = asyncio.Event()
    ended: list[str] = []

    async def work(label: str) -> str:
        try:
            await release.wait()
        finally:
            ended.append(label)
        return label

    # Cancelled meanwhile: the work runs on, and only then is the cancel raised.
    caller = asyncio.create_task(run_to_end(work("within grace"), 60))
    await eventually(lambda: suspended_in(caller, "run_to_end"), "the caller waiting")
    caller.cancel()
    for _ in range(3):  # loop turns in which a cancel passed on would end the work
        await asyncio.sleep(0)
    assert not caller.done() and ended == []
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert ended == ["within grace"]
    # Past the grace, the work itself is cancelled.
    release.clear()
    caller = asyncio.create_task(run_to_end(work("past grace"), 0.01))
    await eventually(lambda: suspended_in(caller, "run_to_end"), "the caller waiting")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert ended == ["within grace", "past grace"] and not release.is_set()
    # Not cancelled: the work's result.
    release.set()
    assert await run_to_end(work("plain"), 60) == "plain"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_timeout_after_never_swallows_a_cancel(anyio_backend: str) -> None:
    async def guarded(future: asyncio.Future[int], seconds: float = 60) -> int:
        async with timeout_after(seconds):
            return await future

    future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(guarded(future))
    await eventually(lambda: suspended_in(task, "guarded"), "the guarded await blocking")
    future.set_result(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(asyncio.TimeoutError):
        await guarded(asyncio.get_running_loop().create_future(), 0.01)
    async with timeout_after(None):  # no limit
        await asyncio.sleep(0)


# -- hand-offs and reads without statements -------------------------------------------------------


async def test_a_release_hands_the_name_to_the_oldest_waiter(pg_url: str) -> None:
    async with backend(pg_url, poll_interval=60) as b:
        await check_oldest_waiter_gets_it(b, lambda n: waiting(b, n))


async def test_a_cached_read_of_a_held_lease_sees_a_takeover(
    pg: str, pg_url: str, schema: str
) -> None:
    # A read of a lease held through the backend needs no statement while the listener
    # shows no change; a takeover's NOTIFY must end that at once.
    async with backend(pg_url, poll_interval=60) as mine, backend(pg_url) as other:
        with anyio.move_on_after(0.2):  # connects the listener
            await mine.wait_changed(unique("listen"), None)
        assert inner(mine, PostgresBackend).statistics().listening
        name = unique("cached")
        await grant(mine, name, "owner-1", ttl=60)
        seen = await mine.read(name)
        assert seen is not None and seen.owner == "owner-1"
        await raw(
            pg,
            f'UPDATE "{schema}".aiolease_leases SET expires_at = clock_timestamp() WHERE name = $1',
            name,
        )
        await grant(other, name, "owner-2")  # takes over the expired row: NOTIFY
        with anyio.fail_after(5):  # a read still answered from memory would wait 10 s
            await mine.wait_changed(name, seen)
        now = await mine.read(name)
        assert now is not None and now.owner == "owner-2" and now.token == seen.token + 1


# -- takeovers by notification (on_taken) -------------------------------------------------------


@pytest.mark.parametrize("how", ["steal", "release"])
async def test_a_takeover_ends_the_holder_at_once_by_notification(
    pg: str, pg_url: str, schema: str, how: str
) -> None:
    async with backend(pg_url) as b, backend(pg_url) as other:
        spy = FaultyBackend(b)
        name = unique("taken")
        # A long ttl: the first renewal is far away, so only the notification can end it.
        with pytest.raises(LeaseLostError) as caught, anyio.fail_after(20):
            async with AsyncLock(spy, name, ttl=60) as lease:
                assert inner(b, PostgresBackend).statistics().listening  # from the start
                if how == "steal":  # the row expires, and another backend takes it
                    await raw(
                        pg,
                        f'UPDATE "{schema}".aiolease_leases'
                        " SET expires_at = clock_timestamp() WHERE name = $1",
                        name,
                    )
                    await grant(other, name, "thief")
                else:  # another backend releases it in the holder's name
                    assert await other.release(name, lease.owner, lease.token)
                await anyio.sleep_forever()
        assert caught.value.reason is LossReason.STOLEN
        # By callback: no watch task, no read, and no renewal was involved.
        assert spy.calls["on_taken"] == 1
        assert spy.calls["wait_taken"] == spy.calls["read"] == spy.calls["renew"] == 0


async def test_a_holder_released_normally_is_not_taken(pg_url: str) -> None:
    async with backend(pg_url) as b:
        spy = FaultyBackend(b)
        name = unique("kept")
        for _ in range(3):  # each grant and release notifies the holder's own listener
            async with AsyncLock(spy, name, ttl=60) as lease:
                holder = await b.read(name)
                assert holder is not None and holder.owner == lease.owner
            assert lease.lost is LossReason.RELEASED
        assert spy.calls["on_taken"] == 3
        assert len(inner(b, PostgresBackend)._takers) == 0  # every one unsubscribed


def test_takers_trust_only_notifications_newer_than_the_grant() -> None:
    takers = Takers()
    ended: list[LossReason] = []
    cancel = takers.add("n", "me", 7, ended.append)
    takers.notified("n", None, 6)  # a release from before our grant, delivered late
    takers.notified("n", "earlier", 6)  # a grant from before ours
    takers.notified("n", "me", 7)  # our own grant
    takers.notified("n", None, None)  # a notification of an unknown token
    takers.notified("other", "thief", 8)  # another name
    assert ended == []
    takers.notified("n", "thief", 8)
    assert ended == [LossReason.STOLEN]
    takers.notified("n", None, 8)  # reported once
    assert ended == [LossReason.STOLEN]
    cancel()  # after it fired: harmless
    assert len(takers) == 0


def test_takers_end_on_a_release_of_their_token_by_somebody_else() -> None:
    takers = Takers()
    ended: list[str] = []
    takers.add("a", "me", 3, lambda _: ended.append("a"))
    cancel_b = takers.add("b", "me", 3, lambda _: ended.append("b"))
    takers.notified("a", None, 3)  # released in our name (our own release unsubscribes first)
    takers.notified("b", None, 2)  # an older token's release
    assert ended == ["a"]
    cancel_b()
    takers.notified("b", "thief", 4)  # unsubscribed
    assert ended == ["a"]
    assert len(takers) == 0


@pytest.mark.parametrize(
    ("payload", "parsed"),
    [
        ("r12:name", ("r", "name", None, 12)),
        ("r12:a:b", ("r", "a:b", None, 12)),
        ("g3:5:ownerna:me", ("g", "na:me", "owner", 3)),
        ("g3:0:x", ("g", "x", "", 3)),
        ("g3:9:short", ("r", "g3:9:short", None, None)),  # a length past the end
        ("gx:1:ab", ("r", "gx:1:ab", None, None)),
        ("rname", ("r", "rname", None, None)),  # the old format: a release, token unknown
        ("", ("r", "", None, None)),
    ],
)
def test_payloads_parse_or_count_as_releases_of_unknown_tokens(
    payload: str, parsed: tuple[str, str, str | None, int | None]
) -> None:
    assert parse_payload(payload) == parsed


def test_grants_of_free_names_have_a_channel_of_their_own() -> None:
    assert grants_channel("aiolease_0123") == "aiolease_0123_g"
    long = "c" * 63
    assert grants_channel(long) != long and len(grants_channel(long)) <= 63


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
