"""Python function calls per contended acquisition, on ``memory://`` (the core's cost)
or on any backend's URL.

Runs issue 23's contended loop (16 tasks, each ``async with x: await anyio.sleep(0.001)``
on one ``AsyncSemaphore(limit=4, ttl=10)``, or on one ``AsyncLock(ttl=10)``) under
cProfile for a few seconds and prints the acquisitions, the CPU per acquisition and
the function calls per acquisition (which, unlike times, the machine's load does not
change), then the functions called most per acquisition.

``--url`` runs it on that backend instead (``sqlite:////tmp/p.db``, ``redis://...``):
its figures are then the core's and the client's cost together (the server's CPU is
not counted), under the same name each run (``profile-sem``, ``profile-lock``).

``--hold 0`` makes the loop bound by the CPU alone (no timer between a grant and its
release), and ``--no-profile`` leaves cProfile out: then the acquisitions per second
and the CPU per acquisition are the core's cost on this machine, to compare in
alternated runs.

Usage: ``python benchmarks/profile_contended.py [--kind semaphore|lock]
[--loop asyncio|trio] [--url URL] [--seconds S] [--hold S] [--no-profile] [--top N]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import Counter

import anyio

import aiolease
from aiolease import AsyncLock, AsyncSemaphore

TASKS = 16
LIMIT = 4


async def contend(
    url: str, kind: str, seconds: float, hold: float, profile: cProfile.Profile | None
) -> int:
    """Run the loop for ``seconds`` (with ``profile`` on, if any); the acquisitions made."""
    async with aiolease.open_backend(url) as backend:
        return await _contend(backend, kind, seconds, hold, profile)


async def _contend(
    backend: aiolease.abc.Backend,
    kind: str,
    seconds: float,
    hold: float,
    profile: cProfile.Profile | None,
) -> int:
    blocks = (
        AsyncSemaphore(backend, "profile-sem", limit=LIMIT, ttl=10)
        if kind == "semaphore"
        else AsyncLock(backend, "profile-lock", ttl=10)
    )
    done = [0]

    async def loop() -> None:
        while True:
            async with blocks:
                await anyio.sleep(hold)
            done[0] += 1

    if profile is not None:
        profile.enable()
    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as tg:
            for _ in range(TASKS):
                tg.start_soon(loop)
    if profile is not None:
        profile.disable()
    return done[0]


def report(profile: cProfile.Profile, acquisitions: int, top: int) -> None:
    """Print the calls per acquisition, in all and of the ``top`` functions."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    calls: Counter[str] = Counter()
    for (path, line, function), (_, ncalls, *_rest) in stats.items():
        where = path.split("site-packages/")[-1].split("/aiolease/")[-1]
        calls[f"{where}:{line}({function})"] += ncalls
    print(f"calls per acquisition: {sum(calls.values()) / acquisitions:.1f}")
    for where, count in calls.most_common(top):
        print(f"  {count / acquisitions:7.2f}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("semaphore", "lock"), default="semaphore")
    parser.add_argument("--loop", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--url", default="memory://", help="the backend (default memory://)")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--hold", type=float, default=0.001, help="seconds each block holds")
    parser.add_argument("--no-profile", action="store_true", help="times only, no cProfile")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    profile = None if args.no_profile else cProfile.Profile()
    started, cpu = time.monotonic(), time.process_time()
    acquisitions = anyio.run(
        contend, args.url, args.kind, args.seconds, args.hold, profile, backend=args.loop
    )
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    print(
        f"{args.kind} on {args.url} under {args.loop}: {acquisitions} acquisitions, "
        f"{acquisitions / elapsed:.0f}/s, {cpu / elapsed:.2f} CPU s/s, "
        f"{cpu / max(acquisitions, 1) * 1e6:.0f} us CPU per acquisition"
        + ("" if profile is None else " (profiled)")
    )
    if profile is not None:
        report(profile, max(acquisitions, 1), args.top)


if __name__ == "__main__":
    main()
