"""``bench_sql.py``'s crash failover: the holder process (killed with ``SIGKILL``), the
server-side expiry of its row, and the waiter of each contender (see ``bench_sql.py``'s
docstring for what the figure measures)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from contextlib import AsyncExitStack

from _sql_floors import FLOOR_TABLE, TABLE, Db, kind_of, make_db, opened_backend, tooz_coordinator

from aiolease import AsyncLock

__all__ = ["failover", "hold_forever"]


async def hold_forever(kind: str, db: Db, name: str, ttl: float) -> None:
    """The holder process of a failover: acquire, say so, and wait to be killed."""
    async with AsyncExitStack() as stack:
        if kind == "aiolease":
            lock = AsyncLock(await opened_backend(stack, db), name, ttl=ttl)
            await stack.enter_async_context(lock)
        elif kind == "floor":
            await db.open()
            await db.floor_acquire(name, uuid.uuid4().hex, ttl)
        elif kind == "advisory":
            advisory = await db.advisory()  # kept: its connection holds the lock
            assert await advisory.try_lock(name)
        else:
            coordinator = tooz_coordinator(db)
            lock = coordinator.get_lock(name.encode())
            assert lock.acquire(blocking=False)
        print("held", flush=True)
        await asyncio.sleep(3600)


async def expiry_at(db: Db, name: str, table: str) -> float | None:
    """When the killed holder's row expires by the server's clock, on this host's
    ``time.monotonic()`` (the best of a few reads: the one with the shortest round
    trip); ``None`` if it holds no row (session locks)."""
    best: tuple[float, float] | None = None
    for _ in range(5):
        sent = time.monotonic()
        remaining = await db.floor_remaining(name, table)
        answered = time.monotonic()
        if remaining is None:
            return None
        if best is None or answered - sent < best[0]:
            best = (answered - sent, (sent + answered) / 2 + remaining)
    assert best is not None
    return best[1]


async def failover(script: str, kind: str, db: Db, ttl: float) -> tuple[float | None, float]:
    """One crash failover: (seconds from the server-side expiry of the holder's row to
    the waiter's acquire, or ``None`` for session locks; seconds from the kill). The
    holder is ``script`` run with ``--worker hold-KIND`` (which calls
    :func:`hold_forever`)."""
    name = f"failover-{kind}-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, script, "--url", db.url, "--db", kind_of(db)]
    command += ["--worker", f"hold-{kind}", "--name", name, "--ttl", repr(ttl)]
    holder = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
    assert holder.stdout is not None
    assert (await holder.stdout.readline()).strip() == b"held"
    async with AsyncExitStack() as stack:
        acquired = asyncio.ensure_future(wait_and_acquire(kind, db, name, ttl, stack))
        await asyncio.sleep(0.3)  # the waiter is waiting
        killed = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
        expiry = None
        if kind in ("aiolease", "floor"):
            # The row as the killed holder left it (aiolease's and the floor's rows
            # have the same shape; read through the floor's pool).
            probe = make_db(kind_of(db), db.url)
            await probe.open()
            expiry = await expiry_at(probe, name, TABLE if kind == "aiolease" else FLOOR_TABLE)
            await probe.close()
        got = await acquired
    return (None if expiry is None else got - expiry), got - killed


async def wait_and_acquire(
    kind: str, db: Db, name: str, ttl: float, stack: AsyncExitStack
) -> float:
    """Wait for ``name`` as contender ``kind``; ``time.monotonic()`` once it is ours."""
    if kind == "aiolease":
        lease = await AsyncLock(await opened_backend(stack, db), name, ttl=ttl).acquire()
        got = time.monotonic()
        await lease.release()
        return got
    if kind == "floor":
        waiter = make_db(kind_of(db), db.url)
        await waiter.open(listen=True)
        stack.push_async_callback(waiter.close)
        owner = uuid.uuid4().hex
        token = await waiter.floor_lock(name, owner, ttl)
        got = time.monotonic()
        await waiter.floor_unlock(name, owner, token)
        return got
    if kind == "advisory":
        advisory = await db.advisory()
        stack.push_async_callback(advisory.close)
        await advisory.lock(name)
        got = time.monotonic()
        await advisory.unlock(name)
        return got

    def blocking() -> float:
        coordinator = tooz_coordinator(db)
        try:
            lock = coordinator.get_lock(name.encode())
            assert lock.acquire(blocking=True)
            got = time.monotonic()
            lock.release()
            return got
        finally:
            coordinator.stop()

    return await asyncio.to_thread(blocking)
