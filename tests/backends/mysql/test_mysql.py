"""The MySQL/MariaDB backend on the real server: the contract, waiting,
identifiers and URLs, a pool of the user's, faults, cancellation.

Every run works in a database of its own (dropped at the end), so other users of
the server are never disturbed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
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
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    Capability,
    InvalidArgument,
    LeaseLostError,
    LimitMismatchError,
    NotOwnerError,
)
from aiolease.abc import Backend, Grant, HolderInfo, permit_owner
from aiolease.backends.mysql import MySQLBackend
from aiolease.testing import CHECKS, Check
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.model import make_model_machine
from aiolease.testing.proxy import FaultProxy
from aiolease.testing.servers import server
from tests.backends.mysql.support import (
    connect_args,
    in_database,
    raw,
    raw_asyncio,
)
from tests.backends.sql.support import (
    HOSTILE_IDENTIFIERS,
    cancel_as_woken,
    check_one_winner,
    first_use_by_processes,
)
from tests.support import eventually, grant, inner, on_asyncio, raises, refused, unique, with_query

pytestmark = pytest.mark.anyio


MODEL_SETTINGS = settings(
    max_examples=12,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- fixtures and helpers ------------------------------------------------------------------


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
    machine = make_model_machine(
        lambda: aiolease.open_backend(my_url), anyio_backend=loop, grants_on_release=True
    )
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)


async def test_capabilities_and_schemes(my_url: str) -> None:
    assert MySQLBackend.capabilities == {
        Capability.SERVER_TIME,
        Capability.DURABLE_TOKENS,
        Capability.MULTI_PROCESS,
        Capability.FAIR_QUEUE,
        Capability.PROCLAIM,
        Capability.SEMAPHORE,
        Capability.FAIR_PERMITS,
        Capability.PERMIT_RETRY_KEEPS_ENTRY,
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


async def test_a_user_without_create_routine_still_gets_locks(
    my: str, my_url: str, database: str
) -> None:
    # Setup goes on without the permits' procedure (logged): locks work, and a permit
    # acquire fails as a BackendError (MariaDB: "execute command denied" for a
    # procedure the user may not see), never a raw driver error.
    user = unique("noroutine")
    await raw(my, f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")
    try:
        await raw(
            my,
            "GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, ALTER, INDEX"
            f" ON `{database}`.* TO '{user}'@'%'",
        )
        parts = urlsplit(with_query(my_url, table=unique("leases")))
        url = urlunsplit(parts._replace(netloc=f"{user}:pw@{parts.hostname}:{parts.port}"))
        async with backend(url) as b:
            assert isinstance(await b.try_acquire("name", "owner-1", 30.0, "", {}), Grant)
            with raises(BackendError, match="denied|does not exist"):
                await b.try_acquire_permit("name", permit_owner(), 30.0, "", {}, 2, 1)
    finally:
        await raw(my, f"DROP USER '{user}'@'%'")


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


async def _permit_answers(b: Backend) -> None:
    """A grant, a renewal, a refusal (with the blocker's identity and metadata) and a
    limit mismatch, each answered as the acquire procedure means it."""
    name, first, second = unique("sem"), permit_owner(), permit_owner()
    granted = await b.try_acquire_permit(name, first, 30.0, "me", {"k": "v"}, 1, 1)
    assert isinstance(granted, Grant)
    again = await b.try_acquire_permit(name, first, 30.0, "me", {"k": "v"}, 1, 1)
    assert isinstance(again, Grant) and again.token == granted.token
    blocked = await b.try_acquire_permit(name, second, 30.0, "you", {}, 1, 1)
    assert isinstance(blocked, HolderInfo)
    assert (blocked.owner, blocked.identity, blocked.token) == (first, "me", granted.token)
    assert blocked.metadata == {"k": "v"}
    assert blocked.remaining is not None and 0 < blocked.remaining <= 30
    with pytest.raises(LimitMismatchError):
        await b.try_acquire_permit(name, permit_owner(), 30.0, "", {}, 2, 1)
    assert await b.release(name, second, None) is False  # its queue entry, dropped
    assert await b.release(name, first, granted.token)
    later = await b.try_acquire_permit(name, second, 30.0, "you", {}, 1, 1)
    assert isinstance(later, Grant) and later.token > granted.token


async def test_permit_answers_from_the_prepared_acquire(my_url: str) -> None:
    # A backend made from a URL runs the acquire CALL as a prepared statement (its
    # connections ask for PS_MULTI_RESULTS): its answers, grant or rows, are decoded
    # from the binary protocol.
    async def run() -> None:
        async with backend(my_url, table=unique("leases")) as b:
            assert isinstance(b, MySQLBackend) and b._permits.prepared
            await _permit_answers(b)

    await on_asyncio(run)


async def test_permits_on_a_users_pool_with_a_statement_cache(my_url: str, database: str) -> None:
    # A user's pool that prepares statements but never asked for PS_MULTI_RESULTS: a
    # prepared CALL that answers a result set would fail there (error 1312), so the
    # acquire goes as text.
    async def run() -> None:
        pool = await asyncmy.create_pool(
            minsize=1,
            maxsize=2,
            db=database,
            charset="utf8mb4",
            stmt_cache_size=16,
            **connect_args(my_url),
        )
        try:
            async with MySQLBackend(pool, table=unique("leases")) as b:
                assert not b._permits.prepared
                await _permit_answers(b)
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
