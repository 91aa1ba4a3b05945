"""Permits (semaphores, read-write locks) in the SQL backends' tables, on the real
servers: what the conformance checks cannot see (two backend objects standing for two
processes, tables made by several processes at once, rows that aiolease did not write,
tokens kept across releases and backend objects).

Each runs on PostgreSQL and MariaDB, but for the ``NOTIFY`` wake-up (PostgreSQL's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, AsyncSemaphore, ForeignDataError
from aiolease._checked import HeldRenewals
from aiolease.abc import Grant, HolderInfo, NotOwnerError, PermitHolders, permit_owner
from aiolease.backends.mysql import MySQLBackend
from aiolease.backends.postgres import PostgresBackend
from aiolease.backends.postgres._listener import LISTEN_CHECK
from aiolease.backends.postgres._statements import permits_table
from tests.backends.mysql.support import in_database
from tests.backends.mysql.support import raw as my_raw
from tests.backends.postgres.support import raw as pg_raw
from tests.support import eventually, unique, with_query

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class Place:
    """A fresh lease table on one server, and raw access to its permits table."""

    url: str
    #: The permits table, quoted as the server wants it.
    permits: str
    #: Runs one statement on a connection of its own (``{}``: the n-th placeholder).
    raw: Callable[..., Awaitable[list[Any]]]
    #: The server's "an hour from now".
    hour: str
    placeholder: Callable[[int], str]


@pytest.fixture(params=["postgres", "mariadb"])
def place(request: pytest.FixtureRequest) -> Place:
    table = unique("permits")
    if request.param == "postgres":
        pg, schema = request.getfixturevalue("pg"), request.getfixturevalue("pg_schema")
        return Place(
            with_query(pg, schema=schema, table=table),
            f'"{schema}"."{permits_table(table)}"',
            lambda sql, *args: pg_raw(pg, sql, *args),
            "clock_timestamp() + interval '1 hour'",
            lambda n: f"${n}",
        )
    database = request.getfixturevalue("my_database")
    my = in_database(request.getfixturevalue("my"), database)
    return Place(
        with_query(my, table=table),
        f"`{database}`.`{table}_permits`",
        lambda sql, *args: my_raw(my, sql, *args),
        "UTC_TIMESTAMP(6) + INTERVAL 1 HOUR",
        lambda _: "%s",
    )


@pytest.fixture
def url(pg: str, pg_schema: str) -> str:
    """A fresh table in this module's schema (PostgreSQL)."""
    return with_query(pg, schema=pg_schema, table=unique("permits"))


async def test_a_release_by_another_backend_wakes_the_waiter(url: str) -> None:
    # Two backend objects: two processes as the server sees them (pools, listeners).
    async with aiolease.open_backend(url) as one, aiolease.open_backend(url) as two:
        name = unique("sem")
        held = await AsyncSemaphore(one, name, limit=1, ttl=600).acquire()
        waiter = permit_owner()
        refused = await two.try_acquire_permit(name, waiter, 600.0, "w", {}, 1, 1)
        assert isinstance(refused, HolderInfo) and refused.owner == held.owner
        done = anyio.Event()

        async def wait() -> None:
            await two.wait_permit_turn(name, waiter, 600.0, refused)
            done.set()

        # Without the NOTIFY, the wait would return only after LISTEN_CHECK.
        with anyio.fail_after(LISTEN_CHECK / 2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)  # (a release before it watches wakes it too: marks)
                assert await held.release()
                await done.wait()
        granted = await two.try_acquire_permit(name, waiter, 600.0, "w", {}, 1, 1)
        assert isinstance(granted, Grant) and granted.token == held.token + 1
        permits = await one.read_permits(name)
        assert permits is not None and [h.owner for h in permits.holders] == [waiter]
        assert await two.release(name, waiter, granted.token)
        assert await one.read_permits(name) is None


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # counts the waits in its loop
async def test_a_release_grants_the_requests_that_fit_and_wakes_only_them(
    place: Place,
) -> None:
    # A release grants the queue entries that then fit, in arrival order, and wakes
    # their waiters only: the others stay asleep (they were all woken, and asked
    # again, one statement each, before). The waiter takes its grant as it is. (No
    # poll ends a wait here: only a wake-up does.)
    async with aiolease.open_backend(with_query(place.url, poll_interval="60")) as b:
        assert isinstance(b, (PostgresBackend, MySQLBackend))
        name = unique("sem")
        holders = [permit_owner(), permit_owner()]
        grants = []
        for owner in holders:
            grant = await b.try_acquire_permit(name, owner, 600.0, "h", {}, 2, 1)
            assert isinstance(grant, Grant)
            grants.append(grant)
        waiters = [permit_owner() for _ in range(3)]
        refusals = []
        for owner in waiters:
            refused = await b.try_acquire_permit(name, owner, 600.0, "w", {"k": owner}, 2, 1)
            assert isinstance(refused, HolderInfo)
            refusals.append(refused)
        woken: list[str] = []

        async def wait(owner: str, seen: HolderInfo) -> None:
            await b.wait_permit_turn(name, owner, 600.0, seen)
            woken.append(owner)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for owner, seen in zip(waiters, refusals, strict=True):
                    tg.start_soon(wait, owner, seen)
                await eventually(lambda: b.statistics().waiting == 3, "three waits")
                assert await b.release(name, holders[0], grants[0].token)
                await eventually(lambda: woken == waiters[:1], "the first waiter woken")
                await anyio.wait_all_tasks_blocked()
                assert woken == waiters[:1] and b.statistics().waiting == 2
                first = await b.try_acquire_permit(name, waiters[0], 600.0, "w", {}, 2, 1)
                assert isinstance(first, Grant) and first.token == grants[1].token + 1
                permits = await b.read_permits(name)
                assert permits is not None and permits.waiting == 2
                assert [(h.owner, h.token) for h in permits.holders] == [
                    (holders[1], grants[1].token),
                    (waiters[0], first.token),
                ]
                assert permits.holders[1].metadata == {"k": waiters[0]}  # its request's
                assert await b.release(name, waiters[0], first.token)
                await eventually(lambda: woken == waiters[:2], "the second waiter woken")
                await anyio.wait_all_tasks_blocked()
                assert b.statistics().waiting == 1
                tg.cancel_scope.cancel()
        for owner in (holders[1], waiters[1], waiters[2]):
            await b.release(name, owner, None)
        assert await b.read_permits(name) is None


async def test_a_release_that_frees_nothing_leaves_the_grants_to_the_next(place: Place) -> None:
    # A release that deletes nothing (by a request that neither holds nor queues)
    # says nothing about the queue: the holder's release after it still grants the
    # queued request. (PostgreSQL's took it for "nobody queued", and the holder's
    # release became a plain DELETE that granted nothing: the waiter had to ask again.)
    async with aiolease.open_backend(place.url) as b:
        name, holder, waiter = unique("sem"), permit_owner(), permit_owner()
        held = await b.try_acquire_permit(name, holder, 600.0, "h", {}, 1, 1)
        assert isinstance(held, Grant)
        refused = await b.try_acquire_permit(name, waiter, 600.0, "w", {}, 1, 1)
        assert isinstance(refused, HolderInfo)
        assert not await b.release(name, permit_owner(), None)
        assert await b.release(name, holder, held.token)
        permits = await b.read_permits(name)
        assert permits is not None and permits.waiting == 0
        assert [(h.owner, h.token) for h in permits.holders] == [(waiter, held.token + 1)]
        assert await b.release(name, waiter, None)
        assert await b.read_permits(name) is None


async def test_two_backends_share_the_limit(place: Place) -> None:
    async with aiolease.open_backend(place.url) as one, aiolease.open_backend(place.url) as two:
        name = unique("sem")
        first = await AsyncSemaphore(one, name, limit=2, ttl=30).acquire()
        second = await AsyncSemaphore(two, name, limit=2, ttl=30).acquire()
        for backend in (one, two):
            with pytest.raises(aiolease.LeaseHeldError):
                await AsyncSemaphore(backend, name, limit=2, ttl=30).acquire_nowait()
        got: list[int] = []

        async def wait() -> None:
            permit = await AsyncSemaphore(two, name, limit=2, ttl=30).acquire(timeout=20)
            got.append(permit.token)
            assert await permit.release()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            assert await first.release()
        assert got == [second.token + 1]
        assert await second.release()
        assert await one.read_permits(name) is None


async def test_never_over_the_limit_across_backends(place: Place) -> None:
    # Tasks of two backend objects (two pools: concurrent transactions on the server)
    # take turns on a semaphore of limit 2: the server's lock on the name's row keeps
    # the permits granted at once within the limit.
    async with aiolease.open_backend(place.url) as one, aiolease.open_backend(place.url) as two:
        name = unique("sem")
        inside, most, tokens = 0, 0, []

        async def task(backend: Any) -> None:
            nonlocal inside, most
            for _ in range(3):
                async with AsyncSemaphore(backend, name, limit=2, ttl=30) as permit:
                    inside += 1
                    most = max(most, inside)
                    tokens.append(permit.token)
                    permits = await backend.read_permits(name)
                    assert permits is not None and permits.used <= 2
                    inside -= 1

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(task, (one, two)[i % 2])
        assert most <= 2
        assert sorted(tokens) == list(range(1, 19))  # one token per grant, none twice
        assert await one.read_permits(name) is None


async def test_a_cancelled_waiter_leaves_the_queue(place: Place) -> None:
    async with aiolease.open_backend(place.url) as one, aiolease.open_backend(place.url) as two:
        name = unique("sem")
        held = await AsyncSemaphore(one, name, limit=1, ttl=30).acquire()

        async def waiting() -> bool:
            permits = await one.read_permits(name)
            return permits is not None and permits.waiting == 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(AsyncSemaphore(two, name, limit=1, ttl=30).acquire)
            await eventually(waiting, "the waiter queued")
            tg.cancel_scope.cancel()
        permits = await one.read_permits(name)
        assert permits is not None and permits.waiting == 0
        assert [h.owner for h in permits.holders] == [held.owner]
        assert await held.release()
        assert await one.read_permits(name) is None


async def test_tokens_survive_release_and_backends(place: Place) -> None:
    name, url = unique("sem"), place.url
    async with aiolease.open_backend(url) as backend:
        lock = await AsyncLock(backend, name, ttl=30).acquire()  # the lock's keyspace is apart
        tokens = []
        for _ in range(2):
            permit = await AsyncSemaphore(backend, name, limit=3, ttl=30).acquire()
            tokens.append(permit.token)
            assert await permit.release()
        assert await backend.read_permits(name) is None
        assert await lock.release()
    async with aiolease.open_backend(url) as backend:  # a new process: from the table
        permit = await AsyncSemaphore(backend, name, limit=1, ttl=30).acquire()
        tokens.append(permit.token)
        assert await permit.release()
    assert tokens == [1, 2, 3]


async def test_renew_many_mixes_locks_and_permits(place: Place) -> None:
    async with aiolease.open_backend(place.url) as backend:
        name, lock_owner, owner = unique("mix"), "lock-owner", permit_owner()
        lock = await backend.try_acquire(name, lock_owner, 30.0, "l", {})
        permit = await backend.try_acquire_permit(name, owner, 30.0, "p", {}, 2, 1)
        assert isinstance(lock, Grant) and isinstance(permit, Grant)
        # As the core hands a cohort: the same list tick after tick (what a backend
        # derives from it is kept), and as any other list.
        cohort = HeldRenewals()
        cohort.extend(
            [
                (name, lock_owner, lock.token, 60.0),
                (name, owner, permit.token, 60.0),
                (name, permit_owner(), permit.token, 60.0),  # nobody's
            ]
        )
        for renewals in (cohort, cohort, list(cohort)):
            results = await backend.renew_many(renewals)
            assert [type(r) for r in results] == [Grant, Grant, NotOwnerError]
        permits = await backend.read_permits(name)
        assert permits is not None and permits.holders[0].remaining is not None
        assert permits.holders[0].remaining > 30.0


async def test_a_foreign_row_is_refused(place: Place) -> None:
    async with aiolease.open_backend(place.url) as backend:
        name = unique("sem")
        await backend.read_permits(name)  # the tables exist from here
        at = place.placeholder
        await place.raw(
            f"INSERT INTO {place.permits} (name, owner, weight, lim, granted, seq, token,"
            f" ttl, expires_at) VALUES ({at(1)}, 'intruder', 1, 2, 1 = 1, 0, 5, 60,"
            f" {place.hour})",
            name if at(1) == "$1" else name.encode(),
        )
        for attempt in (
            lambda: backend.read_permits(name),
            lambda: backend.try_acquire_permit(name, permit_owner(), 30.0, "p", {}, 2, 1),
        ):
            # (Seen through the exception group a trio-asyncio loop may wrap it in.)
            with pytest.RaisesGroup(
                pytest.RaisesExc(
                    ForeignDataError, match="intruder", check=lambda e: e.name == name
                ),
                allow_unwrapped=True,
                flatten_subgroups=True,
            ):
                await attempt()
        rows = await place.raw(
            f"SELECT owner, token FROM {place.permits} WHERE name = {at(1)}",
            name if at(1) == "$1" else name.encode(),
        )
        assert [tuple(r) for r in rows] in ([("intruder", 5)], [(b"intruder", 5)])


async def test_a_held_row_without_a_token_is_refused(place: Place) -> None:
    # A row that a permit's owner id, weight and limit make look like aiolease's, but
    # held without a token: the acquire (whose grant the limit would allow) refuses
    # to grant over it, and writes nothing.
    async with aiolease.open_backend(place.url) as backend:
        name = unique("sem")
        await backend.read_permits(name)  # the tables exist from here
        at, intruder = place.placeholder, permit_owner()
        key = name if at(1) == "$1" else name.encode()
        await place.raw(
            f"INSERT INTO {place.permits} (name, owner, weight, lim, granted, seq, token,"
            f" ttl, expires_at) VALUES ({at(1)}, {at(2)}, 1, 2, 1 = 1, 0, NULL, 60,"
            f" {place.hour})",
            key,
            intruder if at(1) == "$1" else intruder.encode(),
        )
        with pytest.RaisesGroup(
            pytest.RaisesExc(ForeignDataError, check=lambda e: e.name == name),
            allow_unwrapped=True,
            flatten_subgroups=True,
        ):
            await backend.try_acquire_permit(name, permit_owner(), 30.0, "p", {}, 2, 1)
        rows = await place.raw(f"SELECT token FROM {place.permits} WHERE name = {at(1)}", key)
        assert [tuple(r) for r in rows] == [(None,)]


FIRST_USE = """
import json, sys, time
import anyio
import aiolease
from aiolease.abc import Grant

async def main(url, owner, start_at):
    async with aiolease.open_backend(url) as backend:
        await anyio.sleep(max(start_at - time.monotonic(), 0.0))
        got = await backend.try_acquire_permit("first-use", owner, 30.0, owner, {}, 2, 1)
        print(json.dumps({"granted": isinstance(got, Grant), "token": got.token}))

url, owner, start_at = sys.argv[1:]
anyio.run(main, url, owner, float(start_at))
"""


@pytest.mark.slow
def test_processes_make_the_tables_at_once(place: Place) -> None:
    url = place.url
    start_at = time.monotonic() + 2.0  # all pools are open by then
    owners = [permit_owner() for _ in range(3)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FIRST_USE, with_query(url, max_size=2), o, str(start_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for o in owners
    ]
    reports: list[dict[str, Any]] = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # Limit 2: two permits (tokens 1 and 2), the third refused by one of them.
    granted = sorted(r["token"] for r in reports if r["granted"])
    assert granted == [1, 2], reports

    async def read() -> PermitHolders | None:
        async with aiolease.open_backend(url) as backend:
            return await backend.read_permits("first-use")

    permits = anyio.run(read)
    assert permits is not None and permits.limit == 2 and permits.waiting == 1
    assert sorted(h.token for h in permits.holders) == [1, 2]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # asks in one step of its loop
async def test_asks_of_a_contended_name_asked_in_one_step_go_as_one_statement(
    place: Place,
) -> None:
    """Once a request of the name was refused here (it waits), the asks that tasks make
    in one step of the event loop go together in one statement (as the waiters that one
    release granted ask again), not the first alone and the others after it."""
    async with aiolease.open_backend(place.url) as opened:
        backend: Any = opened  # (statistics() is the SQL backends')
        name = unique("sem")
        held = await backend.try_acquire_permit(name, permit_owner(), 600.0, "h", {}, 1, 1)
        assert isinstance(held, Grant)
        queued = await backend.try_acquire_permit(name, permit_owner(), 600.0, "w", {}, 1, 1)
        assert isinstance(queued, HolderInfo)
        before = backend.statistics().permit_statements_combined
        # Two: without gathering, the first goes alone and the second alone after it.
        owners = [permit_owner() for _ in range(2)]
        answers: list[object] = [None] * len(owners)

        async def ask(i: int) -> None:
            answers[i] = await backend.try_acquire_permit(name, owners[i], 600.0, "w", {}, 1, 1)

        async with anyio.create_task_group() as tg:
            for i in range(len(owners)):
                tg.start_soon(ask, i)
        assert all(isinstance(a, HolderInfo) for a in answers)
        assert backend.statistics().permit_statements_combined == before + 1
        queue = await place.raw(
            f"SELECT owner FROM {place.permits} WHERE name = {place.placeholder(1)}"
            " AND granted = false ORDER BY seq",
            name,
        )
        owned = [row[0].decode() if isinstance(row[0], bytes) else row[0] for row in queue]
        assert owned[1:] == owners  # in the order asked
