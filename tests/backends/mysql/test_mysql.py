"""The MySQL/MariaDB backend on the real server: the contract, polling, faults, bad input.

Every run works in a database of its own (dropped at the end), so other users of
the server are never disturbed.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import anyio
import asyncmy
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
    NotOwnerError,
)
from aiolease.abc import Backend, Grant
from aiolease.backends.mysql import MySQLBackend
from aiolease.testing import CHECKS, Check
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.model import make_model_machine
from aiolease.testing.proxy import FaultProxy
from aiolease.testing.servers import server
from tests.backends.mysql.support import connect_args, raw, raw_asyncio, scratch_database
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


def in_database(url: str, database: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{database}"))


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A database of this run's own; dropped with everything in it at the end."""
    with scratch_database(server("mariadb").url, "aiolease_test") as name:
        yield name


@pytest.fixture
def my(aiolease_server: Callable[[str], str]) -> str:
    """The server's URL (no options of ours)."""
    return aiolease_server("mariadb")


@pytest.fixture
def my_url(my: str, database: str) -> str:
    """A URL whose leases live in this run's database."""
    return in_database(my, database)


@asynccontextmanager
async def backend(url: str, **options: Any) -> AsyncIterator[Backend]:
    async with aiolease.open_backend(url, **options) as b:
        yield b


# -- the contract -------------------------------------------------------------------------


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(check: Check, my_url: str) -> None:
    await check(lambda: aiolease.open_backend(my_url))


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_agrees_with_model(my_url: str, loop: str) -> None:
    machine = make_model_machine(lambda: aiolease.open_backend(my_url), anyio_backend=loop)
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)


async def test_capabilities_and_schemes(my_url: str) -> None:
    assert MySQLBackend.capabilities == {
        Capability.SERVER_TIME,
        Capability.DURABLE_TOKENS,
        Capability.MULTI_PROCESS,
        Capability.FAIR_QUEUE,
    }
    assert MySQLBackend.requires_asyncio
    mariadb = urlunsplit(urlsplit(my_url)._replace(scheme="mariadb"))
    async with backend(mariadb) as b:
        assert isinstance(inner(b, MySQLBackend), MySQLBackend)


async def test_released_row_is_kept_with_its_token(my_url: str, database: str) -> None:
    table = unique("leases")
    async with backend(with_query(my_url, table=table)) as b:
        first = await grant(b, "job", "owner-1")
        assert (await grant(b, "job", "owner-1")).token == first.token  # a retry
        assert await b.release("job", "owner-1", first.token)
        rows = await raw(my_url, f"SELECT token, owner, expires_at FROM `{database}`.`{table}`")
        assert rows == [(first.token, None, None)]
        assert (await grant(b, "job", "owner-2")).token == first.token + 1


async def test_names_are_bytes_exact(my_url: str) -> None:
    # The server's default collation folds case and ignores trailing spaces.
    async with backend(my_url) as b:
        prefix = unique("exact")
        names = [f"{prefix}/a", f"{prefix}/A", f"{prefix}/a ", f"{prefix}/á"]
        for i, name in enumerate(names):
            await grant(b, name, f"owner-{i}")
        for i, name in enumerate(names):
            holder = await b.read(name)
            assert holder is not None and holder.owner == f"owner-{i}"


async def test_setup_is_explicit_and_idempotent(my_url: str, database: str) -> None:
    table = unique("leases")
    async with backend(with_query(my_url, table=table)) as b:
        my_backend = inner(b, MySQLBackend)
        await on_asyncio(my_backend.setup)
        await on_asyncio(my_backend.setup)
    rows = await raw(
        my_url,
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = %s"
        " AND table_name = %s",
        database,
        table,
    )
    assert rows == [(1,)]


@pytest.mark.slow
def test_many_processes_create_the_table_on_first_use(my_url: str) -> None:
    url = with_query(my_url, table=unique("leases"), max_size=2)
    check_one_winner(first_use_by_processes(url, processes=6))


# -- waiting -----------------------------------------------------------------------------------


async def test_wait_changed_wakes_at_once_for_changes_through_this_backend(my_url: str) -> None:
    async with backend(my_url, poll_interval=60) as b:
        name = unique("inprocess")
        granted = await grant(b, name, "owner-1", ttl=60)
        seen = await b.read(name)
        done = anyio.Event()
        spy = FaultyBackend(b)

        async def wait() -> None:
            await spy.wait_changed(name, seen)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await spy.wait_called("wait_changed")
            assert await b.release(name, "owner-1", granted.token)
            with anyio.fail_after(5):  # no poll for 60 s, no expiry for 60 s
                await done.wait()


async def test_wait_changed_polls_for_changes_by_others(my_url: str) -> None:
    async with backend(my_url, poll_interval=0.2) as waiter, backend(my_url) as other:
        name = unique("polled")
        granted = await grant(other, name, "owner-1", ttl=60)
        done = anyio.Event()
        spy = FaultyBackend(waiter)

        async def wait() -> None:
            while (holder := await waiter.read(name)) is not None:
                await spy.wait_changed(name, holder)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await spy.wait_called("wait_changed")
            assert await other.release(name, "owner-1", granted.token)
            with anyio.fail_after(10):  # a hang guard: the holder had 60 s left
                await done.wait()


async def test_wait_changed_returns_when_the_holder_expires(my_url: str) -> None:
    async with backend(my_url, poll_interval=60) as waiter, backend(my_url) as other:
        name = unique("expiring")
        await grant(other, name, "owner-1", ttl=0.5)
        with anyio.fail_after(10):  # a hang guard: no poll for 60 s
            while (holder := await waiter.read(name)) is not None:
                await waiter.wait_changed(name, holder)


# -- identifiers and URLs -------------------------------------------------------------------


@pytest.mark.parametrize("bad", HOSTILE_IDENTIFIERS, ids=repr)
def test_hostile_table_names_are_rejected_by_the_constructor(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="table"):
        MySQLBackend(None, table=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", [b for b in HOSTILE_IDENTIFIERS if isinstance(b, str) and b], ids=repr
)
async def test_hostile_table_names_in_urls_never_reach_the_server(
    my_url: str, database: str, bad: str
) -> None:
    canary = unique("canary")
    await raw(my_url, f"CREATE TABLE `{database}`.`{canary}` (x int)")
    with raises(InvalidArgument, match="table"):
        async with backend(f"{my_url}?table={quote(bad)}"):
            pass
    rows = await raw(
        my_url,
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = %s"
        " AND table_name = %s",
        database,
        canary,
    )
    assert rows == [(1,)]


async def test_identifiers_are_quoted_so_keywords_and_case_work(my_url: str) -> None:
    name = unique("job")
    for table in ("select", "Order", "key_"):
        async with backend(with_query(my_url, table=table)) as b:
            token = (await grant(b, name, unique("owner"))).token
            holder = await b.read(name)
            assert holder is not None and holder.token == token


@pytest.mark.parametrize(
    "query",
    [
        "table=a&table=b",
        "poll_interval=-1",
        "poll_interval=soon",
        "max_size=0",
        "min_size=-1",
        "min_size=5&max_size=2",
        "nosuch=1",
        "sslmode=require",
    ],
)
async def test_bad_url_options_are_invalid(my_url: str, query: str) -> None:
    with raises(InvalidArgument):
        async with backend(f"{my_url}?{query}"):
            pass


@pytest.mark.parametrize(
    "url",
    [
        "mysql://127.0.0.1:port/test",
        "mysql://127.0.0.1",
        "mysql://127.0.0.1/",
        "mysql://127.0.0.1/a/b",
        "postgresql://127.0.0.1/test",
        "mysql://127.0.0.1/test#frag",
    ],
)
async def test_malformed_urls_are_invalid(url: str) -> None:
    with pytest.raises(InvalidArgument):
        await MySQLBackend.from_url(url)


async def test_options_given_twice_or_unknown_are_invalid(my_url: str) -> None:
    with raises(InvalidArgument, match="table"):
        async with backend(f"{my_url}?table=a", table="b"):
            pass
    with raises(InvalidArgument, match="nosuch"):
        async with backend(my_url, nosuch=1):
            pass


async def test_an_unreachable_server_is_unavailable() -> None:
    with raises(BackendUnavailable):
        async with backend("mysql://root@127.0.0.1:1/test", connect_timeout=5):
            pass


async def test_a_missing_database_is_unavailable(my: str) -> None:
    with raises(BackendUnavailable):
        async with backend(in_database(my, unique("nosuchdb"))):
            pass


# -- a pool of the user's ----------------------------------------------------------------------


@pytest.mark.parametrize("autocommit", [True, False])
async def test_a_users_pool_is_used_and_never_closed(
    my_url: str, database: str, autocommit: bool
) -> None:
    table = unique("leases")

    async def run() -> None:
        pool = await asyncmy.create_pool(
            minsize=1,
            maxsize=2,
            db=database,
            charset="utf8mb4",
            autocommit=autocommit,
            **{k: v for k, v in connect_args(my_url).items() if k != "autocommit"},
        )
        try:
            async with MySQLBackend(pool, table=table) as b:
                owner = unique("owner")
                granted = await b.try_acquire("job", owner, 30, "me", {"k": "v"})
                assert isinstance(granted, Grant)
                # Committed: another connection sees it.
                rows = await raw_asyncio(my_url, f"SELECT owner FROM `{database}`.`{table}`")
                assert rows == [(owner.encode(),)]
                assert (await b.renew("job", owner, granted.token, 30)).token == granted.token
                assert await b.release("job", owner, granted.token)
            async with pool.acquire() as conn, conn.cursor() as cur:
                await cur.execute("SELECT 1")
                assert [tuple(row) for row in await cur.fetchall()] == [(1,)]
        finally:
            pool.close()
            await pool.wait_closed()

    await on_asyncio(run)


def test_pool_must_be_an_asyncmy_pool() -> None:
    with pytest.raises(InvalidArgument, match="asyncmy Pool"):
        MySQLBackend("mysql://localhost/test")


# -- faults -----------------------------------------------------------------------------------


@asynccontextmanager
async def user_of(my_url: str, database: str) -> AsyncIterator[tuple[str, str]]:
    """A MySQL user of this test's own (so its connections can be killed); yields its URL."""
    user, password = unique("u")[:30], unique("p")
    await raw(my_url, f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'")
    try:
        await raw(my_url, f"GRANT ALL ON `{database}`.* TO '{user}'@'%'")
        parts = urlsplit(my_url)
        netloc = f"{user}:{password}@{parts.hostname}:{parts.port or 3306}"
        yield user, urlunsplit(parts._replace(netloc=netloc))
    finally:
        await raw(my_url, f"DROP USER '{user}'@'%'")


async def test_killed_connections_mid_hold_keep_the_lease(my_url: str, database: str) -> None:
    async with user_of(my_url, database) as (user, url):
        async with backend(url) as b, backend(my_url) as other:
            spy = FaultyBackend(b)
            lock = AsyncLock(spy, unique("kill"), ttl=1.5)
            async with lock as lease:
                await spy.wait_called("renew")
                count = "SELECT COUNT(*) FROM information_schema.processlist WHERE user = %s"
                assert (await raw(my_url, count, user))[0][0] >= 1
                await raw(my_url, f"KILL USER '{user}'")
                renewals = lock.statistics().renewals
                with anyio.fail_after(20):
                    while lock.statistics().renewals < renewals + 2:
                        await spy.wait_called("renew")
                assert lease.lost is None
                holder = await refused(other, lease.name, unique("owner"))
                assert (holder.owner, holder.token) == (lease.owner, lease.token)
            assert await other.read(lease.name) is None


async def test_a_cut_off_holder_stops_before_anyone_else_gets_the_lease(my_url: str) -> None:
    host, port = server("mariadb").addresses[0]
    name = unique("cutoff")
    async with FaultProxy(host, port) as proxy:
        async with (
            backend(proxy.url_for(my_url), connect_timeout=2) as cut,
            backend(my_url) as b,
        ):
            stopped_at = None
            with pytest.raises(LeaseLostError), anyio.fail_after(20):
                async with AsyncLock(cut, name, ttl=1.0) as lease:
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


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # holds a row lock on this loop
async def test_a_lock_wait_timeout_is_a_timeout(
    my_url: str, database: str, anyio_backend: str
) -> None:
    table = unique("leases")
    url = with_query(my_url, table=table)
    options = {"connect_options": {"init_command": "SET SESSION innodb_lock_wait_timeout = 1"}}
    async with backend(url, **options) as b, backend(url) as other:
        await grant(other, "locked", "owner-1")  # elsewhere: b must ask the server
        conn = await asyncmy.connect(**connect_args(my_url), db=database)
        try:
            await conn.begin()
            async with conn.cursor() as cur:
                await cur.execute(f"SELECT 1 FROM `{table}` WHERE name = 'locked' FOR UPDATE")
            with pytest.raises(BackendTimeout):
                await b.try_acquire("locked", "owner-2", 30, "me", {})
            await conn.rollback()
        finally:
            conn.close()
        holder = await b.read("locked")
        assert holder is not None and holder.owner == "owner-1"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # holds row locks on this loop
async def test_a_statement_chosen_as_a_deadlock_victim_is_sent_again(
    my_url: str, database: str, anyio_backend: str
) -> None:
    # A transaction of our own writes queue entries of the name while the backend's
    # release statement locks the row and waits to read them; then it asks for the
    # row: a deadlock, whose victim is the backend's statement (it has written less).
    table = unique("leases")
    url = with_query(my_url, table=table)
    async with backend(url) as b:
        token = (await grant(b, "dead", "owner-1")).token
        await raw(  # marked as having waiters: the release asks the queue
            my_url,
            f"UPDATE `{database}`.`{table}` SET queued = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR",
        )
        conn = await asyncmy.connect(**connect_args(my_url), db=database)
        try:
            await conn.begin()
            async with conn.cursor() as cur:
                await cur.execute(
                    f"INSERT INTO `{table}_waiters` (name, owner, identity, metadata, ttl, us,"
                    " expires_at) WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL"
                    " SELECT i + 1 FROM n WHERE i < 100) SELECT 'dead', CONCAT('w-', i), '',"
                    " '', 30, 30000000, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR FROM n"
                )
                released: list[bool] = []

                async def release() -> None:
                    released.append(await b.release("dead", "owner-1", token))

                async def blocked() -> bool:  # that statement runs, and holds the row
                    running = await raw(
                        my_url,
                        "SELECT COUNT(*) FROM information_schema.PROCESSLIST"
                        f" WHERE INFO LIKE 'UPDATE `{table}` AS l LEFT JOIN%'",
                    )
                    if not running[0][0]:
                        return False
                    try:
                        await raw(
                            my_url,
                            f"SELECT 1 FROM `{database}`.`{table}` WHERE name = 'dead'"
                            " FOR UPDATE NOWAIT",
                        )
                    except asyncmy.errors.OperationalError:
                        return True
                    return False

                async with anyio.create_task_group() as tg:
                    tg.start_soon(release)
                    await eventually(blocked, "the release statement holding the row")
                    await cur.execute(f"UPDATE `{table}` SET token = token WHERE name = 'dead'")
                    await eventually(
                        lambda: inner(b, MySQLBackend).statistics().deadlocks > 0, "a deadlock"
                    )
                    await conn.rollback()  # the entries go: the retry frees the row
        finally:
            conn.close()
        assert released == [True]
        assert await b.read("dead") is None
        assert (await grant(b, "dead", "owner-2")).token == token + 1


async def test_renew_by_another_owner_or_token_is_refused(my_url: str) -> None:
    async with backend(my_url) as b:
        name = unique("renew")
        token = (await grant(b, name, "owner-1")).token
        for owner, wrong in (("owner-2", token), ("owner-1", token + 1)):
            with pytest.raises(NotOwnerError):
                await b.renew(name, owner, wrong, 30)
        assert (await b.renew(name, "owner-1", token, 30)).token == token


async def test_a_closed_backend_is_unavailable(my_url: str) -> None:
    async with backend(my_url) as b:
        await b.aclose()
        with pytest.raises(BackendUnavailable, match="closed"):
            await b.read("x")
        await b.aclose()  # idempotent; open_backend closes it once more


# -- cancellation ------------------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio's cancel scopes cancel again
async def test_a_cancel_that_comes_with_the_wake_up_is_not_swallowed(
    my_url: str, anyio_backend: str
) -> None:
    async with backend(my_url, poll_interval=60) as b:
        name = unique("cancel")
        granted = await grant(b, name, "owner-1", ttl=60)
        await cancel_as_woken(b, name, "owner-1", granted.token)


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
    my_url: str, seed: int
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
                patience = rng.uniform(0, 0.005 if rng.random() < 0.5 else 0.05)
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
        assert await b.read(name) is None


# -- the connections of a backend made from a URL ----------------------------------------------


@pytest.fixture
def own_database(my: str) -> Iterator[str]:
    """A database of this test's own, so that its connections can be counted."""
    with scratch_database(my, "aiolease_pool") as name:
        yield name


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
