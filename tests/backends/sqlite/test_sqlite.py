"""The SQLite backend: the contract on a real file, durability, bad input, and several processes."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import closing
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, BackendTimeout, BackendUnavailable, InvalidArgument
from aiolease._checked import HeldRenewals
from aiolease.abc import Capability, Grant, HolderInfo
from aiolease.backends.sqlite import SQLiteBackend

TTL = 5.0


class FakeClock:
    """A settable host clock, shared by the backends of one test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "leases.db"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def backend(db: Path, clock: FakeClock) -> AsyncIterator[SQLiteBackend]:
    async with SQLiteBackend(db) as b:
        b._clock = clock
        yield b


async def opened(
    db: Path,
    clock: Callable[[], float] | None = None,
    *,
    busy_timeout: float = 5.0,
    poll_interval: float = 0.05,
) -> SQLiteBackend:
    b = SQLiteBackend(db, busy_timeout=busy_timeout, poll_interval=poll_interval)
    await b.open()
    if clock is not None:
        b._clock = clock
    return b


async def grant(b: SQLiteBackend, owner: str, name: str = "job", ttl: float = TTL) -> Grant:
    result = await b.try_acquire(name, owner, ttl, f"id-{owner}", {"owner": owner})
    assert isinstance(result, Grant), result
    return result


async def held_by(b: SQLiteBackend, owner: str, name: str = "job") -> HolderInfo:
    result = await b.try_acquire(name, owner, TTL, f"id-{owner}", {})
    assert isinstance(result, HolderInfo), result
    return result


def raw_sql(db: Path, sql: str) -> None:
    """Change the file behind the backend's back, as another process would."""
    with closing(sqlite3.connect(db)) as raw, raw:
        raw.execute(sql)


# -- the contract on one file ---------------------------------------------------------


@pytest.mark.anyio
async def test_grant_then_held_reports_the_holder(backend: SQLiteBackend, clock: FakeClock) -> None:
    meta = {"host": "a", "note": "naïve ☃"}
    first = await backend.try_acquire("job", "o1", TTL, "host-a", meta)
    assert isinstance(first, Grant) and first.ttl == TTL
    clock.now += 2
    holder = await held_by(backend, "o2")
    assert (holder.owner, holder.identity, holder.token) == ("o1", "host-a", first.token)
    assert holder.metadata == meta
    assert holder.remaining == pytest.approx(TTL - 2)
    assert await backend.read("job") == holder


@pytest.mark.anyio
async def test_idempotent_retry_keeps_token_and_resets_expiry(
    backend: SQLiteBackend, clock: FakeClock
) -> None:
    first = await grant(backend, "o1")
    clock.now += 3
    again = await grant(backend, "o1")
    assert again.token == first.token
    holder = await backend.read("job")
    assert holder is not None and holder.remaining == pytest.approx(TTL)


@pytest.mark.anyio
async def test_renew_resets_never_adds(backend: SQLiteBackend, clock: FakeClock) -> None:
    g = await grant(backend, "o1")
    clock.now += 1
    renewed = await backend.renew("job", "o1", g.token, TTL)
    assert renewed.token == g.token
    holder = await backend.read("job")
    assert holder is not None and holder.remaining == pytest.approx(TTL)


@pytest.mark.anyio
async def test_renew_refused_to_others_and_after_expiry(
    backend: SQLiteBackend, clock: FakeClock
) -> None:
    g = await grant(backend, "o1")
    with pytest.raises(aiolease.NotOwnerError):
        await backend.renew("job", "o2", g.token, TTL)
    with pytest.raises(aiolease.NotOwnerError):
        await backend.renew("job", "o1", g.token + 1, TTL)
    clock.now += TTL
    with pytest.raises(aiolease.NotOwnerError) as info:
        await backend.renew("job", "o1", g.token, TTL)
    assert info.value.name == "job"
    assert await backend.read("job") is None  # an expired record is not revived


async def _releases_waiting(
    backend: SQLiteBackend, releases: list[tuple[str, str, int]], cancelled: int | None = None
) -> tuple[list[bool | None], list[str]]:
    """Start ``releases`` while the connection is held, so that they all wait for it
    (the one at index ``cancelled`` is cancelled while it waits), then let them go: each
    one's answer (``None``: cancelled) and the statements the connection ran."""
    statements: list[str] = []
    answers: list[bool | None] = [None] * len(releases)
    scopes = [anyio.CancelScope() for _ in releases]

    async def release(i: int) -> None:
        with scopes[i]:
            answers[i] = await backend.release(*releases[i])

    assert backend._conn is not None
    backend._conn.set_trace_callback(statements.append)
    async with anyio.create_task_group() as tg:
        async with backend._lock.hold():
            for i in range(len(releases)):
                tg.start_soon(release, i)
            while backend._lock.waiting < len(releases):
                await anyio.lowlevel.checkpoint()
            if cancelled is not None:
                scopes[cancelled].cancel()
                while backend._lock.waiting > len(releases) - 1:
                    await anyio.lowlevel.checkpoint()
    backend._conn.set_trace_callback(None)
    return answers, statements


@pytest.mark.anyio
async def test_releases_waiting_for_the_connection_go_in_one_transaction(
    backend: SQLiteBackend,
) -> None:
    grants = [await grant(backend, f"o{i}", f"n{i}") for i in range(20)]
    releases = [(f"n{i}", f"o{i}", g.token) for i, g in enumerate(grants)]
    releases[3] = ("n3", "o3", grants[3].token + 1)  # not its token: answered False
    answers, statements = await _releases_waiting(backend, releases)
    assert answers == [i != 3 for i in range(20)]
    assert statements.count("BEGIN IMMEDIATE") == 1  # one commit, not 20
    assert sum(s.startswith("UPDATE") for s in statements) == 20
    for i in range(20):
        holder = await backend.read(f"n{i}")
        assert (holder is not None) == (i == 3), (i, holder)


@pytest.mark.anyio
async def test_a_release_cancelled_while_it_waits_for_the_connection_is_not_sent(
    backend: SQLiteBackend,
) -> None:
    grants = [await grant(backend, f"o{i}", f"n{i}") for i in range(5)]
    releases = [(f"n{i}", f"o{i}", g.token) for i, g in enumerate(grants)]
    answers, _ = await _releases_waiting(backend, releases, cancelled=2)
    assert answers == [True, True, None, True, True]
    holder = await backend.read("n2")
    assert holder is not None and holder.owner == "o2"  # still held, runs out at expiry
    assert await backend.release(*releases[2])


async def _run_together(
    backend: SQLiteBackend, names: list[str], call: Callable[[str], Coroutine[Any, Any, None]]
) -> list[str]:
    """Start ``call(name)`` for each name while the connection is held, one after the
    other, so that their first calls wait for it together, in the order of ``names``;
    the statements run meanwhile, once all ended."""
    statements: list[str] = []
    assert backend._conn is not None
    backend._conn.set_trace_callback(statements.append)
    async with anyio.create_task_group() as tg:
        async with backend._lock.hold():
            for i, name in enumerate(names):
                tg.start_soon(call, name)
                while backend._lock.waiting <= i:
                    await anyio.lowlevel.checkpoint()
    backend._conn.set_trace_callback(None)
    return statements


@pytest.mark.anyio
async def test_calls_waiting_for_the_connection_run_in_one_transaction(
    backend: SQLiteBackend, db: Path
) -> None:
    """Acquires (each a transaction of its own when alone) that wait for the connection
    run together, in one transaction: one commit for all. One that fails (a row
    aiolease did not write) undoes only its own work, and its caller alone gets the
    error (the group runs again, each call a savepoint); the foreign row is left as it
    was."""
    with closing(sqlite3.connect(db)) as other:
        other.execute(
            "INSERT INTO aiolease_leases (name, token, owner) VALUES ('foreign', 'x', 'them')"
        )
        other.commit()
    names = [f"n{i}" for i in range(8)] + ["foreign"]
    outcomes: dict[str, object] = {}

    async def ask(name: str) -> None:
        try:
            outcomes[name] = await backend.try_acquire(name, f"o-{name}", TTL, "me", {})
        except aiolease.ForeignDataError as exc:
            outcomes[name] = exc

    statements = await _run_together(backend, names, ask)
    assert statements.count("BEGIN IMMEDIATE") == 2  # the first run rolled back
    assert statements.count("COMMIT") == 1
    assert statements.count("SAVEPOINT aiolease_call") == len(names)
    assert all(isinstance(outcomes[name], Grant) for name in names[:-1]), outcomes
    assert isinstance(outcomes["foreign"], aiolease.ForeignDataError)
    for name in names[:-1]:
        holder = await backend.read(name)
        assert holder is not None and holder.owner == f"o-{name}"
    with closing(sqlite3.connect(db)) as other:
        row = other.execute("SELECT token, owner FROM aiolease_leases WHERE name = 'foreign'")
        assert row.fetchall() == [("x", "them")]


@pytest.mark.anyio
async def test_a_hand_off_in_a_group_run_again_is_made_once(
    backend: SQLiteBackend, db: Path
) -> None:
    """A release that hands the name to a waiter here, in a group that runs again (a
    call beside it failed), hands it once: the waiter holds the name with the next
    token, the failed call's caller alone gets its error."""
    backend.poll_interval = 3600.0  # the waiter is woken by the hand-off, not a poll
    with closing(sqlite3.connect(db)) as other:
        other.execute(
            "INSERT INTO aiolease_leases (name, token, owner) VALUES ('foreign', 'x', 'them')"
        )
        other.commit()
    first = await AsyncLock(backend, "a", ttl=TTL).acquire()
    waiter = AsyncLock(backend, "a", ttl=TTL, identity="waiter")
    outcomes: dict[str, object] = {}

    async def wait() -> None:
        outcomes["waiter"] = await waiter.acquire()

    async def call(name: str) -> None:
        try:
            if name == "a":
                outcomes[name] = await backend.release("a", first.owner, first.token)
            else:
                outcomes[name] = await backend.try_acquire(name, "o", TTL, "me", {})
        except aiolease.ForeignDataError as exc:
            outcomes[name] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        while "a" not in backend._turns._queues:
            await anyio.lowlevel.checkpoint()
        statements = await _run_together(backend, ["a", "foreign"], call)
    assert statements.count("BEGIN IMMEDIATE") == 2  # the group ran again
    hand_offs = [sql for sql in statements if sql.startswith("UPDATE aiolease_leases SET token")]
    assert len(hand_offs) == 2  # the first rolled back
    assert outcomes["a"] is True
    assert isinstance(outcomes["foreign"], aiolease.ForeignDataError)
    lease = outcomes["waiter"]
    assert isinstance(lease, aiolease.Lease)
    assert lease.token == first.token + 1
    holder = await backend.read("a")
    assert holder is not None and holder.owner == lease.owner and holder.token == lease.token
    await lease.release()


@pytest.mark.anyio
async def test_a_group_without_a_failure_runs_without_savepoints(backend: SQLiteBackend) -> None:
    """Calls that wait for the connection and all succeed run in one transaction with no
    statement of their own for it (a savepoint per call cost 16 tasks on a semaphore of
    4 a third of their statements): each acquire is granted, each release frees."""
    names = [f"n{i}" for i in range(6)]
    grants = {name: await backend.try_acquire(name, "first", TTL, "me", {}) for name in names}
    outcomes: dict[str, object] = {}

    async def turn(name: str) -> None:
        first = grants[name]
        assert isinstance(first, Grant)
        outcomes[f"{name}-release"] = await backend.release(name, "first", first.token)
        outcomes[name] = await backend.try_acquire(name, "second", TTL, "me", {})

    statements = await _run_together(backend, names, turn)
    assert not any("SAVEPOINT" in statement for statement in statements), statements
    assert statements.count("BEGIN IMMEDIATE") == 2  # the releases, then the acquires
    assert statements.count("COMMIT") == 2
    for name in names:
        first, second = grants[name], outcomes[name]
        assert outcomes[f"{name}-release"] is True
        assert isinstance(first, Grant) and isinstance(second, Grant)
        assert second.token == first.token + 1
        holder = await backend.read(name)
        assert holder is not None and holder.owner == "second"


@pytest.mark.anyio
async def test_a_release_hands_the_lock_to_the_first_waiter_of_this_process(
    backend: SQLiteBackend, clock: FakeClock
) -> None:
    """Waiters of one backend object get the lock in the order they came, each from the
    release before (no ask of its own, one transaction per hand-off); the releasing
    task, asking again at once, queues behind them. Every release and grant used to
    wake every waiter, and the releasing task won most turns. Polls are turned off
    (an hour apart, as is the ttl): under load a 50 ms poll made a waiter ask."""
    backend.poll_interval = 3600.0
    lock = AsyncLock(backend, "turns", ttl=3600.0)
    order: list[str] = []
    first = await lock.acquire()

    async def take(who: str) -> None:
        async with lock:
            order.append(who)

    queued = backend._turns._queues
    async with anyio.create_task_group() as tg:
        for i, who in enumerate(["w1", "w2", "w3"]):
            tg.start_soon(take, who)
            while len(queued.get("turns", {})) < i + 1:
                await anyio.lowlevel.checkpoint()
        asks = []
        inner = backend._try_acquire_sync

        def counted(*args: object) -> Grant | HolderInfo:
            asks.append(args[1])
            return inner(*args)  # type: ignore[arg-type]

        backend._try_acquire_sync = counted  # type: ignore[method-assign,assignment]
        assert await first.release()
        tg.start_soon(take, "again")
    assert order == ["w1", "w2", "w3", "again"]
    assert asks.count("turns") == 1  # "again"'s refused ask; the waiters asked nothing


@pytest.mark.anyio
async def test_renew_many_of_one_ttl_checks_each_owner_and_token(
    backend: SQLiteBackend, clock: FakeClock
) -> None:
    """The usual batch (distinct names, one ttl) is sent as one JSON object keyed by
    name: each renewal still renews only its owner's grant of its token; a name twice
    in one batch (an old grant and the new one) is answered per renewal too."""
    a, b, c = 'a "q": {x}', "b:1", "c"
    ga, gb, gc = (
        await grant(backend, "o:1", a),
        await grant(backend, "o2", b),
        await grant(backend, "o3", c),
    )
    clock.now += 2
    renewals = HeldRenewals()
    renewals.extend(
        [
            (a, "o:1", ga.token, TTL),  # the owner's: renewed
            (b, "o2", gb.token + 1, TTL),  # another token
            (c, "o3:" + str(gc.token), gc.token, TTL),  # another owner, look-alike text
            ("free", "o4", 1, TTL),
        ]
    )
    for _ in range(2):  # the second call reuses what the first derived from the list
        results = list(await backend.renew_many(renewals))
        assert isinstance(results[0], Grant) and results[0].token == ga.token
        assert [type(r) for r in results[1:]] == [aiolease.NotOwnerError] * 3
        assert [r.name for r in results[1:]] == [b, c, "free"]  # type: ignore[union-attr]
    assert renewals.cache["sqlite"][0].keyed  # type: ignore[index]  # the keyed form
    remaining = {}
    for name in (a, b, c):
        holder = await backend.read(name)
        assert holder is not None
        remaining[name] = holder.remaining
    assert remaining == pytest.approx({a: TTL, b: TTL - 2, c: TTL - 2})
    twice = [(a, "o:1", ga.token, TTL), (a, "o0", ga.token - 1, TTL)]
    results = list(await backend.renew_many(twice))
    assert isinstance(results[0], Grant) and isinstance(results[1], aiolease.NotOwnerError)


@pytest.mark.anyio
async def test_release_is_owner_checked_and_idempotent(backend: SQLiteBackend) -> None:
    g = await grant(backend, "o1")
    assert await backend.release("job", "o2", None) is False
    assert await backend.release("job", "o1", g.token + 1) is False
    assert (await held_by(backend, "o2")).owner == "o1"
    assert await backend.release("job", "o1", g.token) is True
    assert await backend.release("job", "o1", g.token) is False
    assert await backend.read("job") is None


@pytest.mark.anyio
async def test_release_without_token_frees_the_owners_grant(backend: SQLiteBackend) -> None:
    await grant(backend, "o1")
    assert await backend.release("job", "o1", None) is True
    assert await backend.read("job") is None


@pytest.mark.anyio
async def test_expired_grant_is_free_for_others(backend: SQLiteBackend, clock: FakeClock) -> None:
    first = await grant(backend, "o1")
    clock.now += TTL - 0.01
    assert (await held_by(backend, "o2")).owner == "o1"
    clock.now += 0.01
    assert await backend.read("job") is None
    assert await backend.release("job", "o1", first.token) is False
    assert (await grant(backend, "o2")).token > first.token


@pytest.mark.anyio
async def test_tokens_increase_across_release_expiry_and_reopening(
    db: Path, clock: FakeClock
) -> None:
    tokens = []
    async with await opened(db, clock) as b:
        tokens.append((await grant(b, "o1")).token)
        assert await b.release("job", "o1", tokens[-1])
        tokens.append((await grant(b, "o2")).token)
        clock.now += TTL  # o2's grant expires
        tokens.append((await grant(b, "o3")).token)
    async with await opened(db, clock) as b:
        assert (await held_by(b, "o4")).token == tokens[-1]
        assert await b.release("job", "o3", None)
        tokens.append((await grant(b, "o4")).token)
    assert tokens == sorted(set(tokens)), tokens


@pytest.mark.anyio
async def test_names_are_independent(backend: SQLiteBackend) -> None:
    a = await grant(backend, "o1", name="a")
    b = await grant(backend, "o2", name="b")
    assert (await held_by(backend, "o3", name="a")).owner == "o1"
    assert await backend.release("b", "o2", b.token)
    assert (await held_by(backend, "o3", name="a")).token == a.token


@pytest.mark.anyio
async def test_a_row_from_another_boot_counts_as_expired(
    backend: SQLiteBackend, clock: FakeClock
) -> None:
    first = await grant(backend, "o1")
    backend._boot_id = "a-later-boot"
    assert await backend.read("job") is None
    assert (await grant(backend, "o2")).token > first.token


@pytest.mark.anyio
async def test_a_row_from_another_clock_epoch_counts_as_expired(
    backend: SQLiteBackend, clock: FakeClock
) -> None:
    # Without a boot id (not Linux) a reboot shows as a monotonic clock far behind
    # the stored expiry; the row must not keep the name for that long.
    backend._boot_id = ""
    first = await grant(backend, "o1")
    clock.now -= 500
    assert await backend.read("job") is None
    assert (await grant(backend, "o2")).token > first.token


@pytest.mark.anyio
async def test_two_backend_objects_on_one_file_are_one_store(db: Path, clock: FakeClock) -> None:
    async with await opened(db, clock) as a, await opened(db, clock) as b:
        g = await grant(a, "o1")
        holder = await held_by(b, "o2")
        assert (holder.owner, holder.token) == ("o1", g.token)
        with pytest.raises(aiolease.NotOwnerError):
            await b.renew("job", "o2", g.token, TTL)
        await b.renew("job", "o1", g.token, TTL)  # the owner id alone proves ownership
        assert await b.release("job", "o1", g.token)
        assert await a.read("job") is None
        assert (await grant(a, "o2")).token > g.token


@pytest.mark.anyio
async def test_custom_table_is_separate(db: Path) -> None:
    async with await opened(db) as a, SQLiteBackend(db, table="other_leases") as b:
        await grant(a, "o1")
        assert b.table == "other_leases"
        assert await b.read("job") is None
        await grant(b, "o2")


# -- wait_changed -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_wait_changed_wakes_at_once_on_release_in_this_process(db: Path) -> None:
    # A poll interval and a ttl far beyond the test's bound: only the wake-up can end the wait.
    async with await opened(db, poll_interval=60) as a, await opened(db, poll_interval=60) as b:
        g = await a.try_acquire("job", "o1", 60, "a", {})
        assert isinstance(g, Grant)
        seen = await b.read("job")
        assert seen is not None
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.wait_changed, "job", seen)
                await anyio.wait_all_tasks_blocked()
                assert await a.release("job", "o1", g.token)


@pytest.mark.anyio
async def test_wait_changed_polls_for_changes_by_other_processes(db: Path) -> None:
    async with await opened(db, poll_interval=0.02) as b:
        assert isinstance(await b.try_acquire("job", "o1", 60, "a", {}), Grant)
        seen = await b.read("job")
        assert seen is not None
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.wait_changed, "job", seen)
                await anyio.wait_all_tasks_blocked()
                # Another process frees it: no in-process wake-up reaches this waiter.
                raw_sql(db, "UPDATE aiolease_leases SET owner = NULL")


@pytest.mark.anyio
async def test_wait_changed_ignores_renewals(backend: SQLiteBackend) -> None:
    backend.poll_interval = 0.01
    g = await grant(backend, "o1", ttl=60)
    seen = await backend.read("job")
    returned = anyio.Event()

    async def waiter() -> None:
        await backend.wait_changed("job", seen)
        returned.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        for _ in range(5):
            await backend.renew("job", "o1", g.token, 60)
            await anyio.sleep(0.02)  # give several polls a chance to see the renewals
        assert not returned.is_set()
        assert await backend.release("job", "o1", g.token)
        with anyio.fail_after(5):
            await returned.wait()


@pytest.mark.anyio
async def test_wait_changed_returns_when_the_seen_holder_expires(db: Path) -> None:
    async with await opened(db, poll_interval=60) as b:
        assert isinstance(await b.try_acquire("job", "o1", 0.2, "a", {}), Grant)
        seen = await b.read("job")
        assert seen is not None
        with anyio.fail_after(5):
            await b.wait_changed("job", seen)
        assert await b.read("job") is None


@pytest.mark.anyio
async def test_wait_changed_returns_at_once_when_already_changed(backend: SQLiteBackend) -> None:
    await grant(backend, "o1")
    with anyio.fail_after(5):
        await backend.wait_changed("job", None)


# -- errors -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_busy_database_is_a_timeout(db: Path) -> None:
    async with await opened(db, busy_timeout=0.05) as b:
        raw = sqlite3.connect(db, isolation_level=None)
        try:
            raw.execute("BEGIN IMMEDIATE")
            with pytest.raises(BackendTimeout) as info:
                await b.try_acquire("job", "o1", TTL, "a", {})
            assert isinstance(info.value.__cause__, sqlite3.OperationalError)
            raw.execute("ROLLBACK")
        finally:
            raw.close()
        await grant(b, "o1")  # usable again once the other writer is gone


@pytest.mark.anyio
async def test_other_sqlite_errors_are_unavailable(db: Path) -> None:
    async with await opened(db) as b:
        raw_sql(db, "DROP TABLE aiolease_leases")
        with pytest.raises(BackendUnavailable) as info:
            await b.read("job")
        assert isinstance(info.value.__cause__, sqlite3.Error)


@pytest.mark.anyio
async def test_aclose_is_idempotent_and_final(db: Path) -> None:
    b = await opened(db)
    await b.aclose()
    await b.aclose()
    with pytest.raises(BackendUnavailable):
        await b.read("job")


# -- opening: URLs and bad input ------------------------------------------------------------


@pytest.mark.anyio
async def test_url_forms_follow_sqlalchemy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    async with aiolease.open_backend("sqlite:///rel.db?table=t1&poll_interval=0.2") as b:
        assert isinstance(b, SQLiteBackend)
        assert (b.path, b.table, b.poll_interval) == (str(tmp_path / "rel.db"), "t1", 0.2)
        assert b.capabilities == {
            Capability.SERVER_TIME,
            Capability.DURABLE_TOKENS,
            Capability.MULTI_PROCESS,
            Capability.PROCLAIM,
            Capability.SEMAPHORE,
            Capability.FAIR_PERMITS,
            Capability.PERMIT_RETRY_KEEPS_ENTRY,
        }
    absolute = tmp_path / "sub" / "abs.db"
    absolute.parent.mkdir()
    async with aiolease.open_backend(f"sqlite:///{absolute}", busy_timeout=1) as b:
        assert isinstance(b, SQLiteBackend) and b.path == str(absolute)
    assert sorted(_snapshot(tmp_path)) == ["rel.db", "sub", "sub/abs.db"]


def _bad_paths(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("plain text")
    (tmp_path / "not_a_db.db").write_bytes(b"this is not a SQLite database, just bytes")
    return {
        "directory": tmp_path / "a_dir",
        "missing parent": tmp_path / "missing" / "x.db",
        "parent is a file": tmp_path / "a_file" / "x.db",
        "not a database": tmp_path / "not_a_db.db",
    }


BAD_PATH_KINDS = ["directory", "missing parent", "parent is a file", "not a database"]


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("kind", BAD_PATH_KINDS)
def test_bad_path_is_rejected_by_the_constructor(tmp_path: Path, kind: str) -> None:
    path = _bad_paths(tmp_path)[kind]
    before = _snapshot(tmp_path)
    with pytest.raises(InvalidArgument, match="SQLite"):
        SQLiteBackend(path)
    assert _snapshot(tmp_path) == before


@pytest.mark.anyio
@pytest.mark.parametrize("kind", BAD_PATH_KINDS)
async def test_bad_path_is_rejected_by_open_backend(tmp_path: Path, kind: str) -> None:
    path = _bad_paths(tmp_path)[kind]
    before = _snapshot(tmp_path)
    with pytest.raises(InvalidArgument):
        async with aiolease.open_backend(f"sqlite:///{path}"):
            pass
    assert _snapshot(tmp_path) == before


@pytest.fixture
def corrupt_db(db: Path) -> Path:
    db.write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)
    return db


@pytest.mark.anyio
async def test_corrupt_database_behind_a_valid_header_is_rejected_at_open(
    corrupt_db: Path,
) -> None:
    db = corrupt_db
    before = _snapshot(db.parent)
    backend = SQLiteBackend(db)  # the header alone looks right
    with pytest.raises(InvalidArgument, match="cannot be used"):
        await backend.open()
    assert _snapshot(db.parent) == before


@pytest.mark.parametrize(
    "table", ["", "1leases", "lea-ses", "leases; DROP TABLE x", "a" * 64, "lé", "leases\n", None]
)
def test_bad_table_name(db: Path, table: object) -> None:
    with pytest.raises(InvalidArgument, match="table"):
        SQLiteBackend(db, table=table)  # type: ignore[arg-type]
    assert not db.exists()


def test_longest_table_name_is_accepted(db: Path) -> None:
    assert SQLiteBackend(db, table="_" + "a" * 62).table == "_" + "a" * 62


@pytest.mark.parametrize(
    ("option", "value"), [("busy_timeout", -1.0), ("poll_interval", 0.0), ("busy_timeout", "1")]
)
def test_bad_timeouts(db: Path, option: str, value: object) -> None:
    with pytest.raises(InvalidArgument, match=option):
        SQLiteBackend(db, **{option: value})  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "url",
    [
        "sqlite://host/x.db",
        "sqlite://",
        "sqlite:///",
        "sqlite:///:memory:",
        "sqlite:///x.db?unknown=1",
        "sqlite:///x.db?table=a&table=b",
        "sqlite:///x.db?busy_timeout=soon",
        "sqlite:///x.db?poll_interval=-1",
        "sqlite:///x.db?table=no-dashes",
        "sqlite:///x.db#frag",
    ],
)
async def test_bad_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument):
        async with aiolease.open_backend(url):
            pass
    assert _snapshot(tmp_path) == {}


@pytest.mark.anyio
async def test_option_in_url_and_keyword_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument, match="table"):
        async with aiolease.open_backend("sqlite:///x.db?table=a", table="b"):
            pass
    with pytest.raises(InvalidArgument, match="bogus"):
        async with aiolease.open_backend("sqlite:///x.db", bogus=1):
            pass
    assert _snapshot(tmp_path) == {}


# -- AsyncLock on SQLite ------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_lock_hands_over_in_process(db: Path) -> None:
    async with await opened(db) as b:
        lock = AsyncLock(b, "job", ttl=2)
        got: list[aiolease.Lease] = []

        async def wait_for_it() -> None:
            got.append(await lock.acquire(timeout=5))

        async with anyio.create_task_group() as tg:
            async with lock as first:
                with pytest.raises(aiolease.LeaseHeldError) as info:
                    await lock.acquire_nowait()
                assert info.value.holder is not None
                assert info.value.holder.token == first.token
                tg.start_soon(wait_for_it)
                await anyio.wait_all_tasks_blocked()
                assert got == []
            # Leaving the block released the lease and woke the waiter.
        [second] = got
        assert second.token > first.token
        assert await second.release()


# -- several OS processes ------------------------------------------------------------------

WORKERS = 4


class Hold(NamedTuple):
    """One process's stay in the protected body, on the host's monotonic clock."""

    start: float
    end: float
    token: int
    worker: int


ROUNDS = 4
CONTENDER = Path(__file__).with_name("contender.py")


def _run_contenders(db: Path, out_dir: Path, ttl: float) -> list[Hold]:
    start_at = time.monotonic() + 1.5  # every process starts contending at once
    procs = []
    for worker in range(WORKERS):
        loop = "trio" if worker % 2 else "asyncio"
        args = [str(db), str(out_dir / f"{worker}.jsonl"), str(worker), str(ROUNDS), str(ttl)]
        procs.append(
            subprocess.Popen(
                [sys.executable, str(CONTENDER), *args, repr(start_at), loop],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    for proc in procs:
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output.decode(errors="replace")
    holds = []
    for worker in range(WORKERS):
        for line in (out_dir / f"{worker}.jsonl").read_text().splitlines():
            r = json.loads(line)
            hold = Hold(float(r["start"]), float(r["end"]), int(r["token"]), int(r["worker"]))
            holds.append(hold)
    return holds


def test_processes_never_hold_the_lock_at_once(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    holds = sorted(_run_contenders(db, tmp_path, ttl=0.5))
    assert len(holds) == WORKERS * ROUNDS
    assert {h.worker for h in holds} == set(range(WORKERS))
    for before, after in zip(holds, holds[1:], strict=False):
        assert before.start < before.end <= after.start, (before, after)
        assert before.token < after.token, (before, after)
    with closing(sqlite3.connect(db)) as raw:
        [(stored,)] = raw.execute("SELECT token FROM aiolease_leases WHERE name = 'contended'")
    assert stored == holds[-1].token


@pytest.mark.anyio
async def test_lease_of_a_killed_process_passes_on_after_its_ttl(db: Path) -> None:
    ttl = 1.0
    async with await anyio.open_process(
        [sys.executable, str(CONTENDER), "hold", str(db), str(ttl)]
    ) as proc:
        assert proc.stdout is not None
        with anyio.fail_after(30):
            line = await proc.stdout.receive()
        crashed_token = int(line.decode())
        async with await opened(db) as b:
            lock = AsyncLock(b, "contended", ttl=ttl)
            with pytest.raises(aiolease.LeaseHeldError):
                await lock.acquire_nowait()  # renewed while the process lives
            proc.kill()
            killed_at = time.monotonic()
            await proc.wait()
            lease = await lock.acquire(timeout=10)
            elapsed = time.monotonic() - killed_at
            # Its last renewal was sent at most one renew interval (ttl / 3) before the kill,
            # so the row lived on for at least the rest of that ttl, and at most a ttl.
            assert ttl * 2 / 3 - 0.1 <= elapsed <= ttl + 1
            assert lease.token > crashed_token
            assert await lease.release()


# -- renewals before everything else -------------------------------------------------------


@pytest.mark.anyio
async def test_a_renewal_goes_before_the_calls_waiting_for_the_connection(
    backend: SQLiteBackend,
) -> None:
    """One connection serves every call, one at a time. A renewal that arrives behind
    a burst of acquires goes first: in FIFO order it waited for all of them, and 882
    of 1,000 leases (ttl 1 s) acquired at once ran out before their renewals."""
    held = await grant(backend, "holder", "held")
    busy, done = threading.Event(), []
    blocker = anyio.Event()

    async def block() -> None:  # keeps the connection until told
        blocker.set()
        await backend._run(lambda conn: busy.wait(10))

    async def acquire(i: int) -> None:
        await grant(backend, f"o{i}", f"n{i}")
        done.append(f"acquire {i}")

    async def renew() -> None:
        renewals = HeldRenewals()
        renewals.append(("held", "holder", held.token, TTL))
        await backend.renew_many(renewals)
        done.append("renew")

    async with anyio.create_task_group() as tg:
        tg.start_soon(block)
        await blocker.wait()
        for i in range(20):
            tg.start_soon(acquire, i)
        await anyio.wait_all_tasks_blocked()  # the acquires wait for the connection
        tg.start_soon(renew)
        await anyio.wait_all_tasks_blocked()
        busy.set()
    assert done[0] == "renew" and len(done) == 21
