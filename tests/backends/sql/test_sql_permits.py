"""Permits (semaphores, read-write locks) in the SQL backends' tables, on the real
servers: what the conformance checks cannot see (two backend objects standing for two
processes, tables made by several processes at once, rows that aiolease did not write,
tokens kept across releases and backend objects).

PostgreSQL only so far: MySQL / MariaDB does not serve permits yet.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, AsyncSemaphore, ForeignDataError
from aiolease.abc import Grant, HolderInfo, NotOwnerError, PermitHolders, permit_owner
from aiolease.backends.postgres._listener import LISTEN_CHECK
from aiolease.backends.postgres._statements import permits_table
from tests.backends.postgres.support import raw as pg_raw
from tests.support import unique, with_query

pytestmark = pytest.mark.anyio


@pytest.fixture
def url(pg: str, pg_schema: str) -> str:
    """A fresh table in this module's schema."""
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


async def test_tokens_survive_release_and_backends(url: str) -> None:
    name = unique("sem")
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


async def test_renew_many_mixes_locks_and_permits(url: str) -> None:
    async with aiolease.open_backend(url) as backend:
        name, lock_owner, owner = unique("mix"), "lock-owner", permit_owner()
        lock = await backend.try_acquire(name, lock_owner, 30.0, "l", {})
        permit = await backend.try_acquire_permit(name, owner, 30.0, "p", {}, 2, 1)
        assert isinstance(lock, Grant) and isinstance(permit, Grant)
        results = await backend.renew_many(
            [
                (name, lock_owner, lock.token, 60.0),
                (name, owner, permit.token, 60.0),
                (name, permit_owner(), permit.token, 60.0),  # nobody's
            ]
        )
        assert [type(r) for r in results] == [Grant, Grant, NotOwnerError]
        permits = await backend.read_permits(name)
        assert permits is not None and permits.holders[0].remaining is not None
        assert permits.holders[0].remaining > 30.0


async def test_a_foreign_row_is_refused(url: str, pg: str, pg_schema: str) -> None:
    async with aiolease.open_backend(url) as backend:
        name = unique("sem")
        await backend.read_permits(name)  # the tables exist from here
        lease_table = dict(parse_qsl(urlsplit(url).query))["table"]
        table = f'"{pg_schema}"."{permits_table(lease_table)}"'
        await pg_raw(
            pg,
            f"INSERT INTO {table} (name, owner, weight, lim, granted, seq, token, ttl,"
            " expires_at) VALUES ($1, 'intruder', 1, 2, true, 0, 5, 60,"
            " clock_timestamp() + interval '1 hour')",
            name,
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
        rows = await pg_raw(pg, f"SELECT owner, token FROM {table} WHERE name = $1", name)
        assert [(r["owner"], r["token"]) for r in rows] == [("intruder", 5)]


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
def test_processes_make_the_tables_at_once(url: str) -> None:
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
