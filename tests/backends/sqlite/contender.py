"""One contender of the multi-process SQLite test (run by tests/backends/sqlite/test_sqlite.py).

Usage: ``python contender.py DB OUT WORKER ROUNDS TTL START_AT ASYNC_BACKEND``

Waits until ``time.monotonic() >= START_AT`` (one clock for every process on a
Linux host), then holds the lease ``ROUNDS`` times with :class:`AsyncLock`, and
writes one JSON line per hold to ``OUT``: the monotonic times at entering and
leaving the protected body, and the lease's token.

``python contender.py hold DB TTL`` takes the lease, prints its token and
keeps it until killed (the crash-failover test).
"""

from __future__ import annotations

import json
import random
import sys
import time

import anyio

from aiolease import AsyncLock, LeaseLostError
from aiolease.backends.sqlite import SQLiteBackend

Record = dict[str, float | int | str]


async def contend(db: str, worker: int, rounds: int, ttl: float, start_at: float) -> list[Record]:
    """Hold the lease ``rounds`` times; return one record per hold."""
    records: list[Record] = []
    async with SQLiteBackend(db) as backend:
        lock = AsyncLock(backend, "contended", ttl=ttl, identity=f"worker-{worker}")
        await anyio.sleep(max(start_at - time.monotonic(), 0.0))
        for _ in range(rounds):
            entered = left = 0.0
            outcome = "released"
            try:
                async with lock as lease:
                    entered = time.monotonic()
                    try:
                        # Work long enough that some holds span a renewal.
                        await anyio.sleep(random.uniform(0.3, 1.2) * lock.timing.renew_interval)
                    finally:
                        left = time.monotonic()
            except LeaseLostError as exc:
                outcome = exc.reason.value
            records.append(
                {
                    "worker": worker,
                    "start": entered,
                    "end": left,
                    "token": lease.token,
                    "outcome": outcome,
                }
            )
            # Let the others in now and then, without relying on it.
            await anyio.sleep(random.uniform(0.0, 0.03))
    return records


async def hold_forever(db: str, ttl: float) -> None:
    """Take the lease, print its token, and keep it until killed."""
    async with SQLiteBackend(db) as backend, AsyncLock(backend, "contended", ttl=ttl) as lease:
        print(lease.token, flush=True)
        await anyio.sleep_forever()


def main(argv: list[str]) -> None:
    """Parse the arguments, contend, write the records (or, with ``hold DB TTL``, hold)."""
    if argv[0] == "hold":
        anyio.run(hold_forever, argv[1], float(argv[2]))
        return
    db, out, worker, rounds, ttl, start_at, loop = argv
    records = anyio.run(
        contend, db, int(worker), int(rounds), float(ttl), float(start_at), backend=loop
    )
    with open(out, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
