"""What the PostgreSQL tests share: statements behind the backend's back, a schema
per run, server URLs without TLS, and waits for a backend's waits (to block, and to
be ended by a notification)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import asyncpg

from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.postgres import PostgresBackend
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.servers import server
from tests.support import eventually, inner, on_asyncio, unique, with_query


async def raw_on_asyncio(url: str, sql: str, *args: Any) -> list[Any]:
    """Run one statement on a connection of its own (asyncio only)."""
    conn = await asyncpg.connect(url)
    try:
        rows: list[Any] = await conn.fetch(sql, *args)
        return rows
    finally:
        await conn.close()


async def raw(url: str, sql: str, *args: Any) -> list[Any]:
    """Run one statement on a connection of its own, behind the backend's back."""
    return await on_asyncio(lambda: raw_on_asyncio(url, sql, *args))


def schema_of_run(prefix: str) -> Iterator[str]:
    """Make a schema of this run's own on the server itself; drop it, with everything
    in it, at the end (the body of a module-scoped fixture)."""
    name = unique(prefix)
    url = server("postgres").url
    asyncio.run(raw_on_asyncio(url, f'CREATE SCHEMA "{name}"'))
    yield name
    asyncio.run(raw_on_asyncio(url, f'DROP SCHEMA "{name}" CASCADE'))


def no_tls(url: str) -> str:
    """``url`` without TLS, which the test servers lack.

    asyncpg's default ``sslmode=prefer`` first asks the server for TLS; a connect
    cancelled during that exchange leaves a future with an unretrieved exception,
    which trio-asyncio's default exception handler turns into a crash of its loop.
    """
    return url if "sslmode=" in url else with_query(url, sslmode="disable")


class LeavesTheQueue(FaultyBackend):
    """A backend whose refused ``try_acquire`` leaves the waiters' queue at once, as the
    core makes a refused ``acquire_nowait`` do (a release with the same owner id): raw
    calls then agree with the memory model, which has no queue."""

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        result = await super().try_acquire(name, owner, ttl, identity, metadata)
        if isinstance(result, HolderInfo):
            assert not await self.inner.release(name, owner, None)  # it held nothing
        return result


@asynccontextmanager
async def leaving_the_queue(
    opening: AbstractAsyncContextManager[Backend],
) -> AsyncIterator[Backend]:
    """:class:`LeavesTheQueue` over the backend that ``opening`` opens."""
    async with opening as backend:
        yield LeavesTheQueue(backend)


async def waiting(b: Backend, count: int = 1) -> None:
    """Return once ``count`` waits (``wait_changed`` or ``wait_turn``) block in ``b``."""
    pg_backend = inner(b, PostgresBackend)
    await eventually(lambda: pg_backend.statistics().waiting >= count, "a blocked wait")


@asynccontextmanager
async def changed(b: Backend, name: str, seen: HolderInfo | None) -> AsyncIterator[None]:
    """Run ``b.wait_changed(name, seen)`` in a task; enter once it blocks; on leaving, it
    must have returned within 5 s (less than the 10 s that a listening wait lasts at
    most, so only a notification can have ended it)."""
    done = anyio.Event()

    async def wait() -> None:
        await b.wait_changed(name, seen)
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await waiting(b)
        yield
        with anyio.fail_after(5):
            await done.wait()
