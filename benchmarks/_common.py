"""What the benchmarks share: leases held the way an application holds them, threads
for the synchronous peers, and the PASS/MISS column."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack

from aiolease import AsyncLock, Lease
from aiolease.abc import Backend

__all__ = [
    "RESULTS_ENV",
    "add_figure_arguments",
    "hold_in_tasks",
    "record",
    "run_threads",
    "verdict",
]


async def hold_in_tasks(
    backend: Backend,
    names: Sequence[str],
    ttl: float,
    stack: AsyncExitStack,
    *,
    return_exceptions: bool = False,
) -> list[Lease]:
    """Hold every name through :class:`~aiolease.AsyncLock`, each in a task of its own
    (its keepalive running), until ``stack`` closes; return once all are held.

    :param return_exceptions: at the close, ignore a holder's failure (a lost lease)
        instead of raising it, as :func:`asyncio.gather` does
    """
    stop, leases = asyncio.Event(), list[Lease]()

    async def hold(name: str) -> None:
        async with AsyncLock(backend, name, ttl=ttl) as lease:
            leases.append(lease)
            await stop.wait()

    holders = [asyncio.ensure_future(hold(name)) for name in names]

    async def release_all() -> None:
        stop.set()
        await asyncio.gather(*holders, return_exceptions=return_exceptions)

    stack.push_async_callback(release_all)
    while len(leases) < len(names):  # noqa: ASYNC110 - a benchmark's set-up
        await asyncio.sleep(0.05)
    return leases


#: The file (JSON lines) that :func:`record` appends each figure to, when set
#: (``run_all.py`` sets it for each benchmark it runs).
RESULTS_ENV = "AIOLEASE_BENCH_RESULTS"


def record(
    backend: str,
    figure: str,
    contender: str,
    value: float,
    unit: str,
    *,
    target: str = "",
    ok: bool | None = None,
) -> None:
    """Note one printed figure for ``run_all.py``'s table (nothing without
    :data:`RESULTS_ENV`)."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    row = {
        "backend": backend,
        "figure": figure,
        "contender": contender,
        "value": value,
        "unit": unit,
        "target": target,
        "ok": ok,
    }
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


def verdict(ok: bool | None) -> str:
    """``PASS`` or ``MISS`` for a figure with a target, ``""`` for one without."""
    return "" if ok is None else ("PASS" if ok else "MISS")


async def run_threads(
    run: Callable[[int], object], threads: int, stop: threading.Event | None, seconds: float
) -> None:
    """Run ``run(i)`` in ``threads`` threads (a synchronous peer's contenders); set
    ``stop`` after ``seconds`` (``None``: they stop by themselves), then join them."""
    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    if stop is not None:
        await asyncio.sleep(seconds)
        stop.set()
    for thread in workers:
        await asyncio.to_thread(thread.join)


def add_figure_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that size the figures every benchmark prints."""
    parser.add_argument("--cycles", type=int, default=500, help="uncontended cycles")
    parser.add_argument("--seconds", type=float, default=3.0, help="per hand-off figure")
    parser.add_argument("--failovers", type=int, default=3, help="crash failovers each")
    parser.add_argument("--held", type=int, default=1000, help="leases held at once")
    parser.add_argument("--held-seconds", type=float, default=15.0)
