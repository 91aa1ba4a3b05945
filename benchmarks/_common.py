"""What the benchmarks share: leases held the way an application holds them, threads
for the synchronous peers, and the PASS/MISS column."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, NoReturn

from _turn import TURN_ENV, idle

from aiolease import AsyncLock, Lease
from aiolease.abc import Backend

__all__ = [
    "QUICK_NOTE",
    "RESULTS_ENV",
    "TURN_ENV",
    "add_figure_arguments",
    "close_processes",
    "hold_blocks",
    "hold_in_tasks",
    "idle",
    "quick_cut",
    "record",
    "run_processes",
    "run_tasks",
    "run_threads",
    "serve_jobs",
    "start_when_told",
    "started",
    "take_turns",
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
    locks = [AsyncLock(backend, name, ttl=ttl) for name in names]
    return await hold_blocks(locks, stack, return_exceptions=return_exceptions)


async def hold_blocks(
    blocks: Sequence[AbstractAsyncContextManager[Lease]],
    stack: AsyncExitStack,
    *,
    return_exceptions: bool = False,
    one_at_a_time: bool = False,
) -> list[Lease]:
    """Enter each of ``blocks`` (an :class:`~aiolease.AsyncLock`, an
    :class:`~aiolease.AsyncSemaphore` ..., the same object several times for several
    permits) in a task of its own (its keepalive running) until ``stack`` closes;
    return once all are held. ``return_exceptions`` as for :func:`hold_in_tasks`.

    :param one_at_a_time: start each task once the one before holds its block (as
        ``bench_scale.py`` does), instead of all at once: on a backend with one
        connection (SQLite) 1,000 acquires started at once queue ahead of the first
        leases' renewals
    """
    stop, leases = asyncio.Event(), list[Lease]()
    loop = asyncio.get_running_loop()

    async def hold(
        block: AbstractAsyncContextManager[Lease], entered: asyncio.Future[None]
    ) -> None:
        try:
            async with block as lease:
                leases.append(lease)
                entered.set_result(None)
                await stop.wait()
        except BaseException as exc:
            if not entered.done():
                if isinstance(exc, asyncio.CancelledError):
                    entered.cancel()
                else:
                    entered.set_exception(exc)
            raise

    holders, entries = [], []
    for block in blocks:
        entries.append(loop.create_future())
        holders.append(asyncio.ensure_future(hold(block, entries[-1])))
        if one_at_a_time:
            await entries[-1]

    async def release_all() -> None:
        stop.set()
        await asyncio.gather(*holders, return_exceptions=return_exceptions)

    stack.push_async_callback(release_all)
    await asyncio.gather(*entries)
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


#: In a worker process of a cross-process figure, what :func:`started` waits for (see
#: :func:`start_when_told`); ``None`` elsewhere.
_start_gate: Callable[[], Awaitable[None]] | None = None


def start_when_told() -> None:
    """Make this process a worker of :func:`run_processes`: its first :func:`started`
    prints ``ready``, reads the start time from stdin (``time.monotonic()``: one clock
    for every process of the host) and sleeps until then."""
    global _start_gate

    async def gate() -> None:
        print("ready", flush=True)
        start_at = float(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(max(start_at - time.monotonic(), 0))

    _start_gate = gate


async def started() -> None:
    """Called by a figure once its contenders are connected, right before it counts: in
    a worker process, wait for the start that every process shares (at once elsewhere).
    Connecting is never counted, and every process counts the same window."""
    global _start_gate
    gate, _start_gate = _start_gate, None
    if gate is not None:
        await gate()


def serve_jobs(job: Callable[[str, str], Coroutine[Any, Any, str]]) -> NoReturn:
    """The loop of a worker process of :func:`run_processes`: for each ``KIND NAME``
    line read from stdin, ``job(kind, name)`` in an event loop of its own (it calls
    :func:`start_when_told`: it says ``ready`` once connected and counts from the
    start it is told), then its result printed as ``done RESULT``. At the end of
    stdin it exits at once: its connections are closed, and the interpreter's
    teardown (0.1-0.7 s on a loaded 2-core machine) would only delay the caller."""
    while line := sys.stdin.readline():
        kind, name = line.split()
        result = asyncio.run(job(kind, name))
        print(f"done {result}", flush=True)
    sys.stderr.flush()
    os._exit(0)


#: The worker processes of :func:`run_processes`, by command and count.
_workers: dict[tuple[tuple[str, ...], int], list[asyncio.subprocess.Process]] = {}


async def _line(child: asyncio.subprocess.Process, prefix: bytes) -> bytes:
    """The next line ``child`` prints that starts with ``prefix`` (without it)."""
    assert child.stdout is not None
    while line := await child.stdout.readline():
        if line.startswith(prefix):
            return line.removeprefix(prefix).strip()
    raise AssertionError(f"a worker ended without printing {prefix!r}")


async def run_processes(
    command: Sequence[str], processes: int, kind: str, name: str, lead: float = 0.05
) -> list[str]:
    """Run the job ``kind`` on ``name`` in ``processes`` worker processes of
    ``command`` (:func:`serve_jobs`): wait until each one is connected (says
    ``ready``), then tell them all to start ``lead`` seconds from now; each one's
    result. The processes are started at the first call and kept, idle, for the
    next calls with the same command (each job connects anew: only the start-up of
    the interpreter and of its imports is saved); :func:`close_processes` ends them."""
    key = (tuple(command), processes)
    if key not in _workers:
        _workers[key] = [
            await asyncio.create_subprocess_exec(
                *command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=1 << 26
            )
            for _ in range(processes)
        ]
    children = _workers[key]
    for child in children:
        assert child.stdin is not None
        child.stdin.write(f"{kind} {name}\n".encode())
        await child.stdin.drain()
    for child in children:
        assert await _line(child, b"ready") == b""
    start_at = repr(time.monotonic() + lead).encode() + b"\n"
    for child in children:
        assert child.stdin is not None
        child.stdin.write(start_at)
        await child.stdin.drain()
    return [(await _line(child, b"done ")).decode() for child in children]


async def close_processes() -> None:
    """End the worker processes of :func:`run_processes` (their stdin ends)."""
    while _workers:
        _, children = _workers.popitem()
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
        for child in children:
            await child.wait()


async def run_tasks(
    make: Callable[[int], Callable[[], Awaitable[None]]], tasks: int, seconds: float
) -> list[int]:
    """Run ``tasks`` loops of ``make(i)()`` (one acquire, hold, release) for ``seconds``
    from :func:`started`: how many times each task's loop went round."""
    await started()
    counts = [0] * tasks

    async def loop(i: int) -> None:
        once = make(i)
        while True:
            await once()
            counts[i] += 1

    runners = [asyncio.ensure_future(loop(i)) for i in range(tasks)]
    await asyncio.sleep(seconds)
    for runner in runners:
        runner.cancel()
    await asyncio.gather(*runners, return_exceptions=True)
    return counts


async def run_threads(
    run: Callable[[int], object], threads: int, stop: threading.Event | None, seconds: float
) -> None:
    """Run ``run(i)`` in ``threads`` threads (a synchronous peer's contenders) from
    :func:`started`; set ``stop`` after ``seconds`` (``None``: they stop by
    themselves), then join them."""
    await started()
    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    if stop is not None:
        await asyncio.sleep(seconds)
        stop.set()
    for thread in workers:
        await asyncio.to_thread(thread.join)


async def take_turns(
    cycle: Mapping[str, Callable[[], Awaitable[object]]], cycles: int
) -> dict[str, float]:
    """Median seconds of each contender of ``cycle``, taking turns in a random order."""
    found: dict[str, list[float]] = {label: [] for label in cycle}
    for _ in range(min(cycles // 10, 50)):
        for one in cycle.values():
            await one()
    order = list(cycle.items())
    for _ in range(cycles):
        random.shuffle(order)  # no contender always follows the same one
        for label, one in order:
            start = time.perf_counter()
            await one()
            found[label].append(time.perf_counter() - start)
    return {label: statistics.median(samples) for label, samples in found.items()}


#: The contenders a ``--quick`` pass keeps in its contended figures (hand-offs, in
#: tasks or processes), its failovers and its held figures: the raw floors and
#: aiolease (their names start so).
OURS_AND_FLOORS = ("floor", "raw", "advisory", "aiolease")


def quick_cut(kinds: Sequence[str], quick: bool, also: Sequence[str] = ()) -> list[str]:
    """The contenders of a slow figure (hand-offs, processes started, expiries waited
    for): all of ``kinds``, or with ``--quick`` only the floors and aiolease, and the
    peers of ``also`` (those a target is measured against). A quick pass spends its
    minutes on what the targets judge; the uncontended figures keep every peer, and
    the full run every peer everywhere."""
    if not quick:
        return list(kinds)
    return [k for k in kinds if k.startswith(OURS_AND_FLOORS) or k in also]


#: Printed under a figure whose peers a ``--quick`` pass left out.
QUICK_NOTE = "  (--quick: peers other than those a target names are left out of this figure)"


def add_figure_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that size the figures every benchmark prints."""
    parser.add_argument("--cycles", type=int, default=500, help="uncontended cycles")
    parser.add_argument("--seconds", type=float, default=3.0, help="per hand-off figure")
    parser.add_argument("--failovers", type=int, default=3, help="crash failovers each")
    parser.add_argument("--held", type=int, default=1000, help="leases held at once")
    parser.add_argument("--held-seconds", type=float, default=15.0)


def fairness(counts: Sequence[int]) -> float:
    """Max/min of the acquisitions per contender (a contender with none counts as one)."""
    return max(counts) / max(min(counts), 1)


def percentile(values: Sequence[float], share: float) -> float:
    """The value ``share`` of the way up ``values`` (NaN for none)."""
    ordered = sorted(values)
    return ordered[min(int(share * len(ordered)), len(ordered) - 1)] if ordered else float("nan")
