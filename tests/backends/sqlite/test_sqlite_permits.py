"""SQLite permits across backend objects on one file (as across processes), and
their tokens across a reopen. The permit rules themselves are the conformance
suite's checks."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from aiolease import AsyncReadWriteLock, AsyncSemaphore
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


async def test_permit_tokens_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "leases.db"
    async with SQLiteBackend(path) as backend:
        async with AsyncSemaphore(backend, "s", limit=2, ttl=10) as permit:
            first = permit.token
    async with SQLiteBackend(path) as backend:
        async with AsyncSemaphore(backend, "s", limit=3, ttl=10) as permit:
            assert permit.token > first
