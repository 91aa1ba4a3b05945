"""SQLite permits across backend objects on one file (as across processes), and
their tokens across a reopen. The permit rules themselves are the conformance
suite's checks."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import anyio
import pytest

from aiolease import AsyncReadWriteLock, AsyncSemaphore, ForeignDataError
from aiolease.abc import Grant, HolderInfo, permit_owner
from aiolease.backends.sqlite import SQLiteBackend

pytestmark = pytest.mark.anyio


async def test_permits_are_shared_through_the_file(tmp_path: Path) -> None:
    path = tmp_path / "leases.db"
    async with SQLiteBackend(path) as one, SQLiteBackend(path) as two:
        reader = AsyncReadWriteLock(one, "rw", ttl=10).read()
        writer = AsyncReadWriteLock(two, "rw", ttl=10).write()
        order: list[str] = []
        async with anyio.create_task_group() as tg:
            async with reader as reading:

                async def write() -> None:
                    async with writer as writing:
                        order.append("write")
                        assert writing.token > reading.token

                tg.start_soon(write)
                # The writer is queued in the file, seen from the other object.
                with anyio.fail_after(5):
                    while (permits := await one.read_permits("rw")) is None or not permits.waiting:
                        await anyio.wait_all_tasks_blocked()
                order.append("read done")
        assert order == ["read done", "write"]


async def test_a_release_grants_the_requests_that_fit_and_wakes_only_them(
    tmp_path: Path,
) -> None:
    # A release grants the queue entries that then fit, in arrival order, and wakes
    # their waiters only (every waiter of the name used to wake, and ask again); the
    # waiter takes its grant as it is. No poll ends a wait here: only a wake-up does.
    async with SQLiteBackend(tmp_path / "leases.db", poll_interval=60) as b:
        holders = [permit_owner(), permit_owner()]
        grants = []
        for owner in holders:
            grant = await b.try_acquire_permit("s", owner, 600.0, "h", {}, 2, 1)
            assert isinstance(grant, Grant)
            grants.append(grant)
        waiters = [permit_owner() for _ in range(3)]
        refusals = []
        for owner in waiters:
            refused = await b.try_acquire_permit("s", owner, 600.0, "w", {"k": owner}, 2, 1)
            assert isinstance(refused, HolderInfo)
            refusals.append(refused)
        woken: list[str] = []

        async def wait(owner: str, seen: HolderInfo) -> None:
            await b.wait_permit_turn("s", owner, 600.0, seen)
            woken.append(owner)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for owner, seen in zip(waiters, refusals, strict=True):
                    tg.start_soon(wait, owner, seen)
                await anyio.wait_all_tasks_blocked()
                assert await b.release("s", holders[0], grants[0].token)
                await anyio.wait_all_tasks_blocked()
                assert woken == waiters[:1]
                first = await b.try_acquire_permit("s", waiters[0], 600.0, "w", {}, 2, 1)
                assert isinstance(first, Grant) and first.token == grants[1].token + 1
                permits = await b.read_permits("s")
                assert permits is not None and permits.waiting == 2
                assert [(h.owner, h.token) for h in permits.holders] == [
                    (holders[1], grants[1].token),
                    (waiters[0], first.token),
                ]
                assert permits.holders[1].metadata == {"k": waiters[0]}  # its request's
                assert await b.release("s", waiters[0], first.token)
                await anyio.wait_all_tasks_blocked()
                assert woken == waiters[:2]
                tg.cancel_scope.cancel()
        for owner in (holders[1], waiters[1], waiters[2]):
            await b.release("s", owner, None)
        assert await b.read_permits("s") is None


async def test_permit_tokens_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "leases.db"
    async with SQLiteBackend(path) as backend:
        async with AsyncSemaphore(backend, "s", limit=2, ttl=10) as permit:
            first = permit.token
    async with SQLiteBackend(path) as backend:
        async with AsyncSemaphore(backend, "s", limit=3, ttl=10) as permit:
            assert permit.token > first


@pytest.mark.parametrize("booted_for", [50.0, 500.0, 834.0, 5000.0])
@pytest.mark.parametrize("with_token", [True, False])
async def test_a_live_permit_is_released_whatever_the_clock_reads(
    tmp_path: Path, booted_for: float, with_token: bool
) -> None:
    # The clock is the host's monotonic one: seconds since boot. A release asked SQLite
    # whether the permit was live inside DELETE ... RETURNING, which SQLite 3.40 got
    # wrong for some readings: on a host booted 500 s or 834 s ago a ttl-600 permit's
    # release said False (CI's fresh machine, and the model test, saw it).
    async with SQLiteBackend(tmp_path / "leases.db") as backend:
        backend._clock = lambda: booted_for
        owner = permit_owner()
        grant = await backend.try_acquire_permit("s", owner, 600.0, "p", {}, 2, 1)
        assert isinstance(grant, Grant)
        assert await backend.release("s", owner, grant.token if with_token else None)
        assert await backend.read_permits("s") is None
        assert not await backend.release("s", owner, None)  # released once only


@pytest.mark.parametrize(
    ("column", "value"),
    [("owner", "'intruder'"), ("weight", "0"), ("metadata", "'not json'"), ("token", "'x'")],
)
async def test_a_foreign_permit_row_is_refused_and_left_alone(
    tmp_path: Path, column: str, value: str
) -> None:
    """A row aiolease would not have written in the permits table: reading and asking
    raise ForeignDataError naming the name, and the row stays as it was."""
    path = tmp_path / "leases.db"
    async with SQLiteBackend(path) as backend:
        owner = permit_owner()
        granted = await backend.try_acquire_permit("s", owner, 60, "p", {}, 2, 1)
        assert isinstance(granted, Grant)
        with closing(sqlite3.connect(path)) as raw, raw:
            raw.execute(f"UPDATE aiolease_leases_permits SET {column} = {value}")
        before = _rows(path)
        for attempt in (
            lambda: backend.read_permits("s"),
            lambda: backend.try_acquire_permit("s", permit_owner(), 60, "p", {}, 2, 1),
        ):
            with pytest.raises(ForeignDataError, match="not written by aiolease") as caught:
                await attempt()
            assert caught.value.name == "s"
        assert _rows(path) == before


def _rows(path: Path) -> list[tuple[object, ...]]:
    with closing(sqlite3.connect(path)) as raw:
        return raw.execute("SELECT * FROM aiolease_leases_permits").fetchall()


class _Commits:
    """The transactions committed on a connection (a trace of its statements), each
    with the ``synchronous`` level it committed under and whether it issued a permit
    token (the statement that bumps a name's counter)."""

    def __init__(self, conn: sqlite3.Connection, table: str) -> None:
        self.committed: list[tuple[str, bool]] = []
        self.rolled_back = 0
        self._level = "FULL"
        self._token = f"INSERT INTO {table}_permit_names"
        self._issued = False
        conn.set_trace_callback(self._statement)

    def _statement(self, sql: str) -> None:
        words = sql.split()
        if words[:2] == ["PRAGMA", "synchronous"]:
            self._level = words[-1]
        elif sql.startswith(self._token) and "SET token" in sql:
            self._issued = True
        elif words[0] == "BEGIN":
            self._issued = False
        elif words[0] == "COMMIT":
            self.committed.append((self._level, self._issued))
        elif words[0] == "ROLLBACK" and "TO" not in words:
            self.rolled_back += 1


async def test_queue_entries_commit_without_a_sync_and_tokens_with_one(tmp_path: Path) -> None:
    # A permit request expected to be queued (behind a waiter of the same backend
    # object) commits with synchronous=NORMAL: a queue entry lost with a power cut was
    # dead anyway (a new boot). Every commit that issued a token is synced, also when
    # many tasks' calls share transactions. (The unsynced commit is checked on calls
    # made one at a time: under load, concurrent calls are grouped with releases, and
    # a group that is not all requests expected queued is synced, as it should be.)
    async with SQLiteBackend(tmp_path / "leases.db", poll_interval=60) as b:
        conn = b._conn
        assert conn is not None
        commits = _Commits(conn, b.table)
        holders = [permit_owner(), permit_owner()]
        for h in holders:
            assert isinstance(await b.try_acquire_permit("q", h, 60.0, "h", {}, 2, 1), Grant)
        first, second = permit_owner(), permit_owner()
        assert isinstance(await b.try_acquire_permit("q", first, 60.0, "w", {}, 2, 1), HolderInfo)
        assert commits.committed[-1] == ("FULL", False)  # nobody queued here yet
        assert isinstance(await b.try_acquire_permit("q", second, 60.0, "w", {}, 2, 1), HolderInfo)
        assert commits.committed[-1] == ("NORMAL", False)  # behind `first`: unsynced
        assert commits.committed[:2] == [("FULL", True), ("FULL", True)]

        sem = AsyncSemaphore(b, "s", limit=2, ttl=10)
        inside = [0, 0]

        async def task() -> None:
            for _ in range(15):
                async with sem:
                    inside[0] += 1
                    inside[1] = max(inside)
                    await anyio.sleep(0.001)
                    inside[0] -= 1

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(task)
        conn.set_trace_callback(None)
    assert inside[1] == 2
    assert [c for c in commits.committed if c == ("NORMAL", True)] == []
    assert ("FULL", True) in commits.committed[4:]  # the run's grants, traced too


async def test_a_request_expected_queued_but_granted_commits_with_a_sync(tmp_path: Path) -> None:
    # The backend object thinks its waiter is still queued (another object took the
    # entry out and freed the permit): the next request, expected to be queued, is
    # granted; its group is rolled back and run again with synchronous=FULL.
    path = tmp_path / "leases.db"
    async with SQLiteBackend(path, poll_interval=60) as b, SQLiteBackend(path) as other:
        holder, waiter, late = permit_owner(), permit_owner(), permit_owner()
        held = await other.try_acquire_permit("s", holder, 600.0, "h", {}, 1, 1)
        assert isinstance(held, Grant)
        assert isinstance(await b.try_acquire_permit("s", waiter, 600.0, "w", {}, 1, 1), HolderInfo)
        assert await other.release("s", waiter, None) is False  # its queue entry, gone
        assert await other.release("s", holder, held.token) is True
        conn = b._conn
        assert conn is not None
        commits = _Commits(conn, b.table)
        granted = await b.try_acquire_permit("s", late, 600.0, "l", {}, 1, 1)
        conn.set_trace_callback(None)
        assert isinstance(granted, Grant)
        assert granted.token > held.token
        assert commits.rolled_back == 1
        assert commits.committed == [("FULL", True)]
        permits = await other.read_permits("s")
        assert permits is not None
        assert [h.owner for h in permits.holders] == [late]
