"""Embedded backends: aiolease against the raw floor, in one run.

Prints, for the SQLite backend:

* uncontended acquire+release, as a ratio to the floor: the same two writes
  (a guarded upsert, then a conditional update) on a raw ``sqlite3`` connection
  through ``anyio.to_thread``, with no lease logic;
* in-process hand-offs per second: 8 tasks on one name, each holding 1 ms
  (the peers' pollers manage 1-13/s on Redis, python-redis-lock ~780/s);
* the same two figures for the memory backend, as the cost of the core alone;
* issue 23's semaphore and read-write lock figures on both (``_permits.py`` says
  what each measures): permit against lock uncontended, 16 tasks on a semaphore of
  limit 4, a read-heavy mix, ``--held`` permits held (renew ticks counted as the
  core's ``renew_many`` calls: no server to count round trips on).

Usage: ``python benchmarks/bench_embedded.py [--cycles N] [--seconds S] [--held N]
[--held-seconds S] [--only locks|permits] [--quick]`` (``--quick``: shorter permit
figures; the lock figures follow ``--cycles`` and ``--seconds``).
Quote ratios from one run; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.to_thread
from _common import record
from _permits import PermitSizes, permit_figures

from aiolease import AsyncLock, open_backend
from aiolease.abc import Backend

FLOOR_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS floor (name TEXT PRIMARY KEY, owner TEXT, token INTEGER,"
    " expires REAL)"
)
FLOOR_ACQUIRE = (
    "INSERT INTO floor VALUES (:n, :o, 1, :e) ON CONFLICT(name) DO UPDATE SET owner = :o,"
    " token = token + 1, expires = :e WHERE owner IS NULL OR expires <= :now"
)
FLOOR_RELEASE = "UPDATE floor SET owner = NULL WHERE name = :n AND owner = :o"


async def timed(cycle: Callable[[], Awaitable[object]], cycles: int) -> float:
    """Median seconds per call of ``cycle`` over ``cycles`` calls, after a warm-up."""
    for _ in range(min(cycles // 10, 50)):
        await cycle()
    samples = []
    for _ in range(cycles):
        start = time.perf_counter()
        await cycle()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


async def floor_cycle_factory(path: Path) -> Callable[[], Awaitable[object]]:
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(FLOOR_SCHEMA)
    lock = anyio.Lock()

    def write(sql: str, **params: object) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(sql, params)
        conn.execute("COMMIT")

    async def cycle() -> None:
        now = time.monotonic()
        async with lock:
            await anyio.to_thread.run_sync(
                lambda: write(FLOOR_ACQUIRE, n="bench", o="me", e=now + 10, now=now)
            )
        async with lock:
            await anyio.to_thread.run_sync(lambda: write(FLOOR_RELEASE, n="bench", o="me"))

    return cycle


def lease_cycle(backend: Backend) -> Callable[[], Awaitable[object]]:
    lock = AsyncLock(backend, "bench", ttl=10)

    async def cycle() -> None:
        lease = await lock.acquire_nowait()
        await lease.release()

    return cycle


async def handoffs_per_second(backend: Backend, seconds: float) -> tuple[float, float]:
    """Hand-offs per second among 8 tasks, and max/min acquisitions per task."""
    lock = AsyncLock(backend, "handoff", ttl=10)
    counts = [0] * 8

    async def worker(i: int) -> None:
        while True:
            async with lock:
                counts[i] += 1
                await anyio.sleep(0.001)
            await anyio.lowlevel.checkpoint()

    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(worker, i)
    return sum(counts) / seconds, max(counts) / max(min(counts), 1)


async def lock_figures(cycles: int, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        floor = await timed(await floor_cycle_factory(Path(tmp) / "floor.db"), cycles)
        async with open_backend(f"sqlite:///{tmp}/leases.db") as sqlite_backend:
            sqlite_time = await timed(lease_cycle(sqlite_backend), cycles)
            sqlite_rate, sqlite_fair = await handoffs_per_second(sqlite_backend, seconds)
        async with open_backend("memory://") as memory_backend:
            memory_time = await timed(lease_cycle(memory_backend), cycles)
            memory_rate, memory_fair = await handoffs_per_second(memory_backend, seconds)
    print(f"{'contender':<34} {'x floor':>8} {'hand-offs/s':>12} {'max/min':>8}")
    print(f"{'raw sqlite3 floor (2 writes)':<34} {1.0:>8.2f} {'-':>12} {'-':>8}")
    for label, cycle, rate, fair in (
        ("aiolease sqlite", sqlite_time, sqlite_rate, sqlite_fair),
        ("aiolease memory (core only)", memory_time, memory_rate, memory_fair),
    ):
        print(f"{label:<34} {cycle / floor:>8.2f} {rate:>12.0f} {fair:>8.2f}")
        record("sqlite", "uncontended acquire+release", label, cycle / floor, "x floor")
        record("sqlite", "hand-offs, one process", label, rate, "/s")


async def main(args: argparse.Namespace) -> None:
    if args.only in (None, "locks"):
        await lock_figures(args.cycles, args.seconds)
    if args.only in (None, "permits"):
        sizes = PermitSizes.of(args, 1.0)
        with tempfile.TemporaryDirectory() as tmp:
            async with open_backend(f"sqlite:///{tmp}/permits.db") as sqlite_backend:
                await permit_figures("sqlite", sqlite_backend, sizes, tick_target=None)
        async with open_backend("memory://") as memory_backend:
            await permit_figures("memory", memory_backend, sizes, machine_floors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--held", type=int, default=1000, help="permits held at once")
    parser.add_argument("--held-seconds", type=float, default=5.0)
    parser.add_argument("--only", choices=("locks", "permits"), help="these figures alone")
    parser.add_argument("--quick", action="store_true", help="short permit figures")
    args = parser.parse_args()
    anyio.run(main, args)
