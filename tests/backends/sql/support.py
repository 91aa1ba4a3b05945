"""Helpers shared by the PostgreSQL and MySQL / MariaDB tests: hostile identifiers, the
queue's order, many processes on a fresh table, a cancel that comes with a wake-up."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from aiolease import AsyncLock
from aiolease.abc import Backend
from aiolease.testing.servers import server
from tests.support import eventually, suspended_in, unique, with_query

#: Hostile or malformed table / schema names: none may reach the server.
HOSTILE_IDENTIFIERS: list[object] = [
    "",
    "leases; DROP TABLE canary",
    'leases" ; DROP TABLE "canary',
    "leases` ; DROP TABLE `canary",
    "leases'--",
    "le ases",
    "1leases",
    "leases.other",
    "public.leases",
    "lease-s",
    "läses",
    "leases\x00",
    "leases\n",
    "x" * 64,
    None,
    42,
    b"leases",
]


async def check_oldest_waiter_gets_it(
    b: Backend, waiting: Callable[[int], Awaitable[None]]
) -> None:
    """Waiters of one backend queue oldest first; each release grants the next in line
    in the release statement itself (a herd would wake all, in no set order), with
    tokens one apart. ``waiting(n)`` returns once ``n`` waits are blocked."""
    name = unique("handoff")
    first = await AsyncLock(b, name, ttl=30).acquire()
    order: list[int] = []
    tokens: list[int] = []

    async def wait(i: int) -> None:
        lease = await AsyncLock(b, name, ttl=30).acquire()
        order.append(i)
        tokens.append(lease.token)
        assert await lease.release()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(wait, i)
                await waiting(i + 1)  # queued before the next one starts
            assert await first.release()
    assert order == [0, 1, 2, 3]
    assert tokens == [first.token + 1, first.token + 2, first.token + 3, first.token + 4]
    assert await b.read(name) is None


# -- many processes using a fresh table at once ----------------------------------------------

FIRST_USE = """
import json, sys, time
import anyio
import aiolease
from aiolease.abc import Grant

async def main(url, owner, start_at):
    async with aiolease.open_backend(url) as backend:
        await anyio.sleep(max(start_at - time.monotonic(), 0.0))
        result = await backend.try_acquire("first-use", owner, 30.0, owner, {})
        mine = await backend.try_acquire(f"own/{owner}", owner, 30.0, owner, {})
        assert isinstance(mine, Grant) and mine.token == 1, mine
        if isinstance(result, Grant):
            print(json.dumps({"owner": owner, "granted": result.token}))
        else:
            print(json.dumps({"owner": owner, "holder": result.owner, "token": result.token}))

url, owner, start_at, loop = sys.argv[1:]
anyio.run(main, url, owner, float(start_at), backend=loop)
"""


def first_use_by_processes(url: str, processes: int) -> list[dict[str, Any]]:
    """Start ``processes`` processes that use ``url``'s fresh table at the same moment.

    Each takes its own name and contends for one shared name; returns what each reported.
    """
    start_at = time.monotonic() + 2.0  # all pools are open by then
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                FIRST_USE,
                url,
                f"owner-{i}",
                repr(start_at),
                "trio" if i % 2 else "asyncio",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    reports = []
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
    return reports


def check_one_winner(reports: list[dict[str, Any]]) -> None:
    """Exactly one process got the shared name (token 1); the rest saw it as the holder."""
    winners = [r for r in reports if "granted" in r]
    assert len(winners) == 1, reports
    assert winners[0]["granted"] == 1
    for report in reports:
        if report is not winners[0]:
            assert (report["holder"], report["token"]) == (winners[0]["owner"], 1), reports


# -- a cancel that comes together with a wake-up ----------------------------------------------


async def cancel_as_woken(backend: Backend, name: str, owner: str, token: int) -> None:
    """Check that an asyncio task cancelled in the very step that wakes it is cancelled.

    A task acquires ``name`` (held by ``owner``) with an :class:`~aiolease.AsyncLock`;
    once it waits, ``owner`` releases through the same backend object, which wakes the
    waiter, and the task is cancelled before it runs again. ``asyncio.wait_for`` (before
    Python 3.12) would return the wake-up and drop the cancel: the acquire would go on
    and hold the lease although its caller was cancelled.
    """
    task = asyncio.create_task(AsyncLock(backend, name, ttl=30).acquire())
    await eventually(lambda: suspended_in(task, "wait_event"), "the acquire waiting")
    # No await between the wake-up (inside release) and the cancel.
    assert await backend.release(name, owner, token)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        lease = await task
        await lease.release()  # the acquire went on: do not leave it held
    assert await backend.read(name) is None  # and nothing is held in its name


# -- the servers of the safety runs -------------------------------------------------------------


@dataclass(frozen=True)
class Database:
    """One SQL server kind: its shared service, and the one the tests may kill."""

    shared: str
    restartable: str
    #: The pidfile ``scripts/services.sh`` keeps for the restartable server.
    pidfile: str

    def url(self, service: str) -> str:
        """The service's URL; without TLS for PostgreSQL (see the ``pg`` fixture of
        tests/backends/conftest.py: trio-asyncio crashes on a connect
        cancelled mid-TLS-request)."""
        url = server(service).url
        if url.startswith("postgres") and "sslmode=" not in url:
            url = with_query(url, sslmode="disable")
        return url


DATABASES = {
    "postgres": Database("postgres", "postgres-restart", "postgres.pid"),
    "mariadb": Database("mariadb", "mariadb-restart", "mariadb.pid"),
}
