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
from aiolease.abc import Grant, permit_owner
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
