"""Issue 23's figures for :class:`~aiolease.AsyncSemaphore` and
:class:`~aiolease.AsyncReadWriteLock`, one set of code for every backend: each
per-backend script (``bench_redis.py``, ``bench_sql.py``, ``bench_etcd.py``,
``bench_embedded.py``) calls :func:`permit_figures` with a backend it opened, the
peers it can drive (their locks, and grelmicro's read-write lock) and its own
round-trip counters. Every figure runs on that one backend object, so a permit is
always compared with the same backend's lock.

* **uncontended permit acquire+release**: ``async with`` on a semaphore of limit 4,
  on a reader and on a writer of a read-write lock, and on an :class:`AsyncLock`, one
  cycle each in a random order (:func:`_common.take_turns`), nobody else on the
  names; the median per cycle as a ratio to the lock's. Target: every permit
  <= 1.2x the lock. A peer's lock (none of the peers has a semaphore), and the read
  and the write of its read-write lock where it has one (grelmicro from 0.21), are
  shown as ratios to our lock, for reference.
* **16 tasks, semaphore of limit 4, hold 1 ms**: 16 tasks loop ``async with sem:
  sleep(1 ms)`` for 0.5 s of warm-up (:data:`WARMUP`, not counted), then for
  ``seconds`` (a checkpoint between turns, as in ``bench_embedded.py``);
  acquisitions per second (those whose block ended in the window), max/min
  acquisitions per task, the most holders seen inside at once (never above 4), this
  process's CPU seconds per second in the window (near 1: the client's CPU is the
  bottleneck, not the waits), and acquires that failed with a
  ``BackendError`` (counted, and the task goes on; the first is printed). The
  same 16 tasks on an :class:`AsyncLock` give the lock's hand-off rate, in the same
  run. Target: the semaphore's rate >= 3.5x the lock's, max/min <= 1.5, no failed
  acquire. The same loops on an in-process ``anyio.Lock`` and ``anyio.Semaphore(4)``
  (no backend at all) show the ratio this machine allows (four 1 ms sleeps at once
  are not four times as many on a loaded 2-core machine; their "x lock" is to
  ``anyio.Lock``'s rate). A peer's lock is shown with its hand-off rate (x our
  lock's).
* **read-heavy mix, 8 tasks**: 8 tasks loop for ``seconds``, each turn a write
  with probability 0.1 (else a read), every block held 1 ms: operations per
  second, the most readers seen inside at once, how often a writer was inside
  with anyone (must be 0), and the wait from calling ``async with`` to entering the
  block, p50/p99 for writers and p99 for readers, and acquires that failed with a
  ``BackendError`` (counted, and the task goes on). Target: reads proceed in
  parallel (peak readers > 1), no overlap, no failed acquire; the writer wait p99
  is printed without a target. The same mix (the same turns) then runs on each
  peer's read-write lock (grelmicro's from 0.21, which needs Python 3.12: run the
  script under Python 3.12 or newer for it; not with ``--quick``), without a target.
* **N permits held** (N = ``--held``, ttl 3 s, renewed every 1 s tick): N tasks each
  hold one permit of a semaphore of limit N, as an application would (granted one
  after the other, as ``bench_scale.py`` grants its locks: on SQLite, 1,000
  acquires started at once queue on its one connection ahead of the first leases'
  renewals, and most are lost, locks as permits); after
  ``settle`` seconds, for ``held_seconds``: per renew tick, the core's
  ``renew_many`` calls on the backend, and each counter the script gives (the same
  ones its locks' held figure reads), this process's CPU seconds per second, and
  permits lost. The window starts and ends just after a ``renew_many`` call
  returned, so that it spans whole ticks (a 1.5 s window would count one or
  two; on etcd, whose permits ride on the session's lease, the core renews none
  and the window is just timed). Target where the script names one counter (Redis: renewal round
  trips; SQL: server statements): <= 1.2 per tick (one, plus the counters' lag),
  0 lost, as for locks.

Figures are printed with PASS/MISS where they have a target and recorded for
``run_all.py`` (:func:`_common.record`). Taken on a loaded 2-core machine, they move
from run to run: quote ratios from one run.
"""

from __future__ import annotations

import functools
import importlib.metadata
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
from _common import fairness, hold_blocks, idle, percentile, record, take_turns, verdict

from aiolease import AsyncLock, AsyncReadWriteLock, AsyncSemaphore, BackendError
from aiolease.abc import Backend

__all__ = [
    "PeerLock",
    "PeerReadWrite",
    "PermitSizes",
    "grelmicro_peer",
    "permit_figures",
]

RUN = uuid.uuid4().hex[:8]
#: Hold time of each block in the contended figures.
HOLD = 0.001
TARGET_UNCONTENDED = 1.2
TARGET_THROUGHPUT = 3.5
TARGET_FAIRNESS = 1.5
TARGET_PER_TICK = 1.2
TASKS, LIMIT = 16, 4
#: Seconds the 16 tasks run before the contended figure's window opens (not counted):
#: the first grants, the backend's first statements and caches, the servers' warm-up.
WARMUP = 0.5
RW_TASKS, WRITES = 8, 0.1
HELD_TTL = 3.0

Cycle = Callable[[], Awaitable[object]]
#: A counter read before and after the held window (a sync or an async read).
Counter = Callable[[], Awaitable[float]]


#: ``mode(write)``: a fresh ``async with`` of one read-write lock's writer (``True``)
#: or reader (``False``).
Mode = Callable[[bool], AbstractAsyncContextManager[object]]


@dataclass(frozen=True)
class PeerReadWrite:
    """A peer library's read-write lock, driven as its users would."""

    #: ``modes(name)``: the :data:`Mode` of the peer's read-write lock of ``name`` (one
    #: object per name, reused).
    modes: Callable[[str], Mode]
    #: How it waits, printed with the figures.
    how: str


@dataclass(frozen=True)
class PeerLock:
    """A peer library's lock (none has a semaphore), driven as its users would, and
    its read-write lock where it has one."""

    #: Uncontended acquire and release, on a name of its own.
    cycle: Cycle
    #: ``once(name)``: a blocking acquire of ``name``, a 1 ms hold, a release.
    once: Callable[[str], Awaitable[object]]
    #: How it waits, printed with the figures.
    how: str
    rw: PeerReadWrite | None = None


@dataclass(frozen=True)
class PermitSizes:
    """How long each figure runs (the script's ``--cycles``, ``--seconds`` ...)."""

    cycles: int
    seconds: float
    held: int
    held_seconds: float
    #: Seconds between the last permit granted and the held window (``quick``: the
    #: window starts after the first renewal call that renews every permit, or after
    #: this and half a tick if none has by then: a session backend renews none).
    settle: float = 2.0
    #: ``--quick``: the 16-task figure leaves the peers out (their pollers' tails are
    #: long); the uncontended one still shows them.
    quick: bool = False

    @classmethod
    def of(cls, args: Any, settle: float) -> PermitSizes:
        """From a script's ``--cycles``, ``--seconds``, ``--held``, ``--held-seconds``;
        with ``--quick``, at most 50 cycles, 0.5 s per contended figure (after
        the 16-task figure's warm-up), 50 permits
        held for one tick, counted from the first renewal call that renews them all
        (granted within 0.1 s, they renew in one call from the first tick on; at
        most 1.5 s after the grants: a session backend renews none; the whole
        ``run_all.py --quick`` must stay short: a smoke test of the figures)."""
        if not getattr(args, "quick", False):
            return cls(args.cycles, args.seconds, args.held, args.held_seconds, settle)
        return cls(
            min(args.cycles, 50),
            min(args.seconds, 0.5),
            min(args.held, 50),
            min(args.held_seconds, 1.0),
            1.0,
            quick=True,
        )


@dataclass
class Summary:
    """What :func:`permit_figures` found against its targets, for a script's summary:
    ``(figure, target, got, verdict)`` rows."""

    rows: list[tuple[str, str, str, str]] = field(default_factory=list)

    def add(self, figure: str, want: str, got: str, ok: bool) -> None:
        self.rows.append((figure, want, got, verdict(ok)))


async def permit_figures(
    where: str,
    backend: Backend,
    sizes: PermitSizes,
    *,
    peers: Mapping[str, PeerLock] | None = None,
    counters: Mapping[str, Counter] | None = None,
    tick_target: str | None = None,
    notes: Sequence[str] = (),
    machine_floors: bool = False,
) -> Summary:
    """Print and record the four figures for ``backend`` (``where`` names it in the
    table); ``tick_target`` names the counter of ``counters`` that must stay at
    <= 1.2 per renew tick. With ``--quick`` the in-process floors of the 16-task
    figure (no backend in them: the same on every backend) run only where
    ``machine_floors`` says so (``bench_embedded.py``'s memory figures)."""
    peers = peers or {}
    summary = Summary()
    print(f"\n-- semaphores and read-write locks ({where}; ratios from this run only)")
    for note in notes:
        print(f"  ({note})")
    for label, peer in peers.items():
        print(f"  {label}: {peer.how}")
        if peer.rw is not None:
            print(f"  {label} read-write lock: {peer.rw.how}")
    if sizes.quick and peers:
        print("  (--quick: the peers in the uncontended figure only)")
    await _uncontended(where, backend, sizes, peers, summary)
    floors = machine_floors or not sizes.quick
    if not floors:
        print(
            "  (--quick: the in-process anyio floors of the 16-task figure are measured once,"
            " in bench_embedded.py's memory figures)"
        )
    await _contended(where, backend, sizes, peers, summary, floors)
    await _read_heavy(where, backend, sizes, peers, summary)
    await _held(where, backend, sizes, counters or {}, tick_target, summary)
    return summary


# -- uncontended -------------------------------------------------------------------------


async def _uncontended(
    where: str,
    backend: Backend,
    sizes: PermitSizes,
    peers: Mapping[str, PeerLock],
    summary: Summary,
) -> None:
    lock = AsyncLock(backend, f"permit-lock-{RUN}", ttl=10)
    sem = AsyncSemaphore(backend, f"permit-sem-{RUN}", limit=LIMIT, ttl=10)
    rw = AsyncReadWriteLock(backend, f"permit-rw-{RUN}", ttl=10)

    def block(cm: AbstractAsyncContextManager[object]) -> Cycle:
        async def cycle() -> None:
            async with cm:
                pass

        return cycle

    ours = {
        "aiolease lock (async with)": block(lock),
        f"aiolease semaphore permit, limit {LIMIT}": block(sem),
        "aiolease read permit": block(rw.read()),
        "aiolease write permit": block(rw.write()),
    }
    theirs = {f"{label} lock (no semaphore)": peer.cycle for label, peer in peers.items()}
    for label, peer in peers.items():
        if peer.rw is not None:
            mode = peer.rw.modes(f"permit-rw-{label}-{RUN}")
            theirs[f"{label} read permit"] = block(mode(False))
            theirs[f"{label} write permit"] = block(mode(True))
    times = await take_turns({**ours, **theirs}, sizes.cycles)
    base = times["aiolease lock (async with)"]
    figure = "uncontended permit acquire+release"
    print(f"\n{figure:<44} {'median':>9} {'x lock':>7}  target <= {TARGET_UNCONTENDED} x lock")
    worst = 0.0
    for label, seconds in times.items():
        ratio = seconds / base
        permit = label.startswith("aiolease") and "permit" in label
        ok = ratio <= TARGET_UNCONTENDED if permit else None
        if permit:
            worst = max(worst, ratio)
        target = f"<= {TARGET_UNCONTENDED}" if ok is not None else ""
        record(where, figure, label, ratio, "x our lock", target=target, ok=ok)
        print(f"  {label:<42} {seconds * 1e6:>6.0f} us {ratio:>7.2f}  {verdict(ok)}")
    summary.add(
        figure,
        f"<= {TARGET_UNCONTENDED} x the lock",
        f"worst permit {worst:.2f}x",
        worst <= TARGET_UNCONTENDED,
    )


# -- 16 tasks on a semaphore of limit 4 --------------------------------------------------


async def _loop_tasks(
    tasks: int, seconds: float, once: Callable[[int], Awaitable[object]], warmup: float = 0.0
) -> list[int]:
    """Acquisitions per task of ``tasks`` tasks that call ``once(i)`` in a loop; those
    whose ``once`` returned within the window of ``seconds`` count, the window starting
    ``warmup`` seconds after the loops (what returns before it is not counted). Each
    loop ends after its first call that returns past the window (a waiter is not
    cancelled: redis-py's client can swallow a cancel); any left after 15 s more are
    cancelled. An acquire that fails with :class:`~aiolease.BackendError` (in the
    warm-up too) is counted in :data:`LAST_ERRORS` and the loop goes on. The process's
    CPU seconds per second from the window's start to the loops' end are left in
    :data:`LAST_CPU`."""
    counts = [0] * tasks
    start = time.monotonic() + warmup
    end = start + seconds
    at_start = [time.process_time(), time.monotonic()]
    LAST_ERRORS.clear()

    async def loop(i: int) -> None:
        while time.monotonic() < end:
            try:
                await once(i)
            except BackendError as exc:
                LAST_ERRORS.append(exc)
                continue
            counts[i] += start <= time.monotonic() <= end
            await anyio.lowlevel.checkpoint()  # others may run before this one asks again

    async def window_starts() -> None:
        await anyio.sleep(warmup)
        at_start[:] = [time.process_time(), time.monotonic()]

    with anyio.move_on_after(warmup + seconds + 15):
        async with anyio.create_task_group() as tg:
            if warmup > 0:
                tg.start_soon(window_starts)
            for i in range(tasks):
                tg.start_soon(loop, i)
    cpu, wall = at_start
    LAST_CPU[0] = (time.process_time() - cpu) / (time.monotonic() - wall)
    return counts


#: The CPU seconds per second of this process during the last :func:`_loop_tasks`.
LAST_CPU = [0.0]
#: The acquires that failed during the last :func:`_loop_tasks`.
LAST_ERRORS: list[BackendError] = []


async def _contended(
    where: str,
    backend: Backend,
    sizes: PermitSizes,
    peers: Mapping[str, PeerLock],
    summary: Summary,
    floors: bool = True,
) -> None:
    seconds = sizes.seconds
    lock = AsyncLock(backend, f"permit-handoff-lock-{RUN}", ttl=10)
    sem = AsyncSemaphore(backend, f"permit-handoff-sem-{RUN}", limit=LIMIT, ttl=10)
    inside = [0, 0]  # now, most

    async def lock_once(i: int) -> None:
        async with lock:
            await anyio.sleep(HOLD)

    async def sem_once(i: int) -> None:
        async with sem:
            inside[0] += 1
            inside[1] = max(inside[1], inside[0])
            try:
                await anyio.sleep(HOLD)
            finally:
                inside[0] -= 1

    found: dict[str, list[int]] = {}
    cpus: dict[str, float] = {}
    errors: dict[str, list[BackendError]] = {}
    bare_lock, bare_sem = anyio.Lock(), anyio.Semaphore(LIMIT)

    async def bare_lock_once(i: int) -> None:
        async with bare_lock:
            await anyio.sleep(HOLD)

    async def bare_sem_once(i: int) -> None:
        async with bare_sem:
            await anyio.sleep(HOLD)

    runs: dict[str, Callable[[int], Awaitable[object]]] = {
        "aiolease lock (hand-off rate)": lock_once,
        f"aiolease semaphore, limit {LIMIT}": sem_once,
    }
    if floors:
        runs["floor: anyio.Lock, in-process"] = bare_lock_once
        runs[f"floor: anyio.Semaphore({LIMIT}), in-process"] = bare_sem_once
    for label, peer in {} if sizes.quick else peers.items():
        name = f"permit-handoff-{label}-{RUN}"

        async def peer_once(i: int, peer: PeerLock = peer, name: str = name) -> None:
            await peer.once(name)

        runs[f"{label} lock (no semaphore)"] = peer_once
    for label, run in runs.items():
        found[label] = await _loop_tasks(TASKS, seconds, run, WARMUP)
        cpus[label] = LAST_CPU[0]
        errors[label] = list(LAST_ERRORS)
    figure = f"{TASKS} tasks, semaphore of limit {LIMIT}, hold 1 ms"
    print(
        f"\n{figure:<44} {'per s':>7} {'x lock':>7} {'max/min':>8} {'peak':>5} {'CPU s/s':>8}"
        f" {'errors':>6}  target >= {TARGET_THROUGHPUT} x lock, max/min <= {TARGET_FAIRNESS},"
        " no error"
    )
    ours = sum(found["aiolease lock (hand-off rate)"]) / seconds
    floor = floor_ratio = float("nan")
    if floors:
        floor = sum(found["floor: anyio.Lock, in-process"]) / seconds
        floor_ratio = sum(found[f"floor: anyio.Semaphore({LIMIT}), in-process"]) / seconds / floor
    for label, counts in found.items():
        rate, fair = sum(counts) / seconds, fairness(counts)
        base = floor if label.startswith("floor") else ours  # x its own kind's lock
        is_sem = label.startswith("aiolease semaphore")
        ok = (
            rate >= TARGET_THROUGHPUT * base
            and fair <= TARGET_FAIRNESS
            and inside[1] <= LIMIT
            and not errors[label]
            if is_sem and base > 0  # no hand-off of the lock in the window: no verdict
            else None
        )
        peak = f"{inside[1]:>5}" if is_sem else f"{'':>5}"
        ratio = rate / base if base else float("nan")
        record(where, figure, label, rate, "/s")
        record(
            where,
            figure + ": fairness",
            label,
            fair,
            "max/min",
            target=f"<= {TARGET_FAIRNESS}" if is_sem else "",
            ok=None if ok is None else fair <= TARGET_FAIRNESS,
        )
        record(
            where,
            figure + ": x its kind's lock (ours; floors: anyio.Lock)",
            label,
            ratio,
            "x",
            target=f">= {TARGET_THROUGHPUT}" if is_sem else "",
            ok=ok,
        )
        if is_sem and ok is not None:
            summary.add(
                figure,
                f">= {TARGET_THROUGHPUT} x lock, max/min <= {TARGET_FAIRNESS}",
                f"{rate:.0f}/s = {ratio:.2f}x lock"
                + (f" (floor {floor_ratio:.2f}x)" if floors else "")
                + f", {fair:.2f}",
                bool(ok),
            )
        print(
            f"  {label:<42} {rate:>7.0f} {ratio:>7.2f} {fair:>8.2f} {peak} {cpus[label]:>8.2f}"
            f" {len(errors[label]):>6}  {verdict(ok)}"
        )
        if errors[label]:
            print(f"    first error: {errors[label][0]!r}")
            record(where, figure + ": failed acquires", label, len(errors[label]), "", target="0")


# -- read-heavy mix ----------------------------------------------------------------------


@dataclass
class Mix:
    """What one read-write lock did in the read-heavy mix."""

    rate: float = 0.0
    peak: int = 0
    overlaps: int = 0
    waits: dict[str, list[float]] = field(default_factory=lambda: {"read": [], "write": []})
    failed: list[BackendError] = field(default_factory=list)


async def _mix(mode: Mode, seconds: float) -> Mix:
    """:data:`RW_TASKS` tasks, each turn a write with probability :data:`WRITES` (the
    same turns for every lock), each block held 1 ms."""
    found = Mix()
    readers, writers = [0], [0]

    def once_for(i: int) -> Callable[[int], Awaitable[None]]:
        rng = random.Random(i)  # the same mix in every run

        async def once(_: int) -> None:
            write = rng.random() < WRITES
            called = time.monotonic()
            async with mode(write):
                found.waits["write" if write else "read"].append(time.monotonic() - called)
                if writers[0] or (write and readers[0]):
                    found.overlaps += 1
                (writers if write else readers)[0] += 1
                found.peak = max(found.peak, readers[0])
                try:
                    await anyio.sleep(HOLD)
                finally:
                    (writers if write else readers)[0] -= 1

        return once

    onces = [once_for(i) for i in range(RW_TASKS)]
    counts = await _loop_tasks(RW_TASKS, seconds, lambda i: onces[i](i))
    found.failed = list(LAST_ERRORS)
    found.rate = sum(counts) / seconds
    return found


async def _read_heavy(
    where: str,
    backend: Backend,
    sizes: PermitSizes,
    peers: Mapping[str, PeerLock],
    summary: Summary,
) -> None:
    rw = AsyncReadWriteLock(backend, f"permit-mix-{RUN}", ttl=10)
    contender = "aiolease read-write lock"
    modes: dict[str, Mode] = {contender: lambda write: rw.write() if write else rw.read()}
    for label, peer in {} if sizes.quick else peers.items():
        if peer.rw is not None:
            modes[f"{label} read-write lock"] = peer.rw.modes(f"permit-mix-{label}-{RUN}")
    figure = f"read-heavy mix ({1 - WRITES:.0%} reads), {RW_TASKS} tasks, hold 1 ms"
    print(
        f"\n{figure:<44} {'ops/s':>7} {'peak rd':>8} {'overlap':>8} {'w p50':>8} {'w p99':>8}"
        f" {'r p99':>8} {'errors':>6}  target peak readers > 1, 0 overlaps, no error"
    )
    for label, mode in modes.items():
        mix = await _mix(mode, sizes.seconds)
        w50, w99 = percentile(mix.waits["write"], 0.5), percentile(mix.waits["write"], 0.99)
        r99 = percentile(mix.waits["read"], 0.99)
        ours = label == contender
        ok = mix.peak > 1 and mix.overlaps == 0 and not mix.failed if ours else None
        print(
            f"  {label:<42} {mix.rate:>7.0f} {mix.peak:>8} {mix.overlaps:>8}"
            f" {w50 * 1e3:>5.1f} ms {w99 * 1e3:>5.1f} ms {r99 * 1e3:>5.1f} ms"
            f" {len(mix.failed):>6}  {verdict(ok)}  ({len(mix.waits['write'])} writes,"
            f" {len(mix.waits['read'])} reads)"
        )
        if mix.failed:
            print(f"    first error: {mix.failed[0]!r}")
            record(where, figure + ": failed acquires", label, len(mix.failed), "", target="0")
        record(where, figure, label, mix.rate, "ops/s")
        record(
            where,
            figure + ": peak readers",
            label,
            mix.peak,
            "",
            target="> 1" if ours else "",
            ok=ok,
        )
        record(
            where,
            figure + ": writer with anyone",
            label,
            mix.overlaps,
            "",
            target="0" if ours else "",
            ok=mix.overlaps == 0 if ours else None,
        )
        record(where, figure + ": writer wait p99", label, w99 * 1e3, "ms")
        record(where, figure + ": reader wait p99", label, r99 * 1e3, "ms")
        if ours:
            summary.add(
                figure,
                "peak readers > 1, 0 overlaps; writer p99",
                f"peak {mix.peak}, {mix.overlaps} overlaps, writer p99 {w99 * 1e3:.1f} ms",
                bool(ok),
            )


# -- N permits held ----------------------------------------------------------------------


async def _read(counter: Counter) -> float:
    return float(await counter())


async def _held(
    where: str,
    backend: Backend,
    sizes: PermitSizes,
    counters: Mapping[str, Counter],
    tick_target: str | None,
    summary: Summary,
) -> None:
    tick = HELD_TTL / 3
    calls, renewed, all_in_one = [0], anyio.Event(), anyio.Event()
    renew_many = backend.renew_many

    async def counted(renewals: Any) -> Any:
        nonlocal renewed
        try:
            return await renew_many(renewals)
        finally:
            calls[0] += 1
            if len(renewals) >= sizes.held:
                all_in_one.set()
            renewed.set()
            renewed = anyio.Event()

    async def after_a_call() -> float:
        """Wait for a ``renew_many`` call to return: the window starts and ends just
        after one, so it spans whole ticks and every counter counts each tick once.
        A session backend (etcd) renews none of them (its session lease is kept
        alive): at most two ticks."""
        if calls[0]:  # none yet after the settle: none will come
            with anyio.move_on_after(2 * tick):
                await renewed.wait()
        return time.monotonic()

    async def core_calls() -> float:
        return calls[0]

    every: dict[str, Counter] = {"renew_many calls": core_calls, **counters}
    sem = AsyncSemaphore(backend, f"permit-held-{RUN}", limit=sizes.held, ttl=HELD_TTL)
    backend.renew_many = counted  # type: ignore[method-assign]
    try:
        async with AsyncExitStack() as stack:
            started = time.monotonic()
            leases = await hold_blocks(
                [sem] * sizes.held, stack, return_exceptions=True, one_at_a_time=True
            )
            took = time.monotonic() - started
            async with idle():  # only renewals run: the window is this process's CPU
                if sizes.quick:  # from the first call that renews them all, if it comes in time
                    with anyio.move_on_after(sizes.settle + tick / 2):
                        await all_in_one.wait()
                    wall = time.monotonic() if all_in_one.is_set() else await after_a_call()
                else:
                    await anyio.sleep(sizes.settle)
                    wall = await after_a_call()
                before = {label: await _read(c) for label, c in every.items()}
                cpu = time.process_time()
                await anyio.sleep(max(sizes.held_seconds - tick / 2, 0))
                wall = await after_a_call() - wall
                after = {label: await _read(c) for label, c in every.items()}
                cpu = time.process_time() - cpu
            lost = sum(lease.lost is not None for lease in leases)
    finally:
        del backend.renew_many
    ticks = wall / tick
    per_tick = {label: (after[label] - before[label]) / ticks for label in every}
    figure = f"{sizes.held} permits held, ttl 3 s, tick 1 s"
    heads = " ".join(f"{label:>{max(len(label), 8)}}" for label in every)
    want = f"  target {tick_target} <= {TARGET_PER_TICK}/tick, 0 lost" if tick_target else ""
    print(f"\n{figure:<44} {heads} {'CPU s/s':>8} {'lost':>5}{want}")
    ok = None
    if tick_target is not None:
        ok = per_tick[tick_target] <= TARGET_PER_TICK and lost == 0
    cells = " ".join(f"{per_tick[label]:>{max(len(label), 8)}.2f}" for label in every)
    print(
        f"  {'aiolease semaphore permits':<42} {cells} {cpu / wall:>8.3f} {lost:>5}  {verdict(ok)}"
        f"  (granted in {took:.1f} s)"
    )
    contender = "aiolease semaphore permits"
    for label in every:
        is_target = label == tick_target
        record(
            where,
            f"{figure}: {label} per tick",
            contender,
            per_tick[label],
            "/tick",
            target=f"<= {TARGET_PER_TICK}" if is_target else "",
            ok=ok if is_target else None,
        )
    record(where, figure + ": CPU", contender, cpu / wall, "CPU s/s")
    record(where, figure + ": lost", contender, lost, "")
    if tick_target is not None:
        summary.add(
            figure,
            f"<= {TARGET_PER_TICK} {tick_target}/tick, 0 lost",
            f"{per_tick[tick_target]:.2f}/tick, {lost} lost",
            bool(ok),
        )


# -- peers -------------------------------------------------------------------------------


#: Where the peers keep their keys and rows, apart from ours.
GRELMICRO_PREFIX = "aiolease-bench-grelmicro:"
GRELMICRO_TABLE = "grelmicro_bench_locks"


async def grelmicro_peer(server: str, url: str, stack: AsyncExitStack) -> PeerLock:
    """grelmicro on ``server`` (``"redis"`` or ``"postgres"``, at ``url``), opened here
    and closed by ``stack``, with its defaults: it polls every 0.1 s while it waits
    and renews nothing by itself (one object per name, reused, as documented). Its
    ``Lock``; from 0.21 (Python 3.12 and newer) its ``ReadWriteLock`` too
    (writer-preferring: a refused writer records an intent that holds new readers
    back).

    :raises ImportError: grelmicro, or its extra for ``server``, is not installed
    """
    try:
        from grelmicro.coordination import Lock, ReadWriteLock
    except ImportError:  # 0.20 and older: grelmicro.sync, locks only
        return await _grelmicro_sync_peer(server, url, stack)
    version = importlib.metadata.version("grelmicro")
    if server == "redis":
        from grelmicro.coordination.redis import RedisLockAdapter, RedisReadWriteLockAdapter
        from grelmicro.providers.redis import RedisProvider

        redis = RedisProvider(url=url)
        opened = [
            redis,
            RedisLockAdapter(provider=redis, prefix=GRELMICRO_PREFIX),
            RedisReadWriteLockAdapter(provider=redis, prefix=GRELMICRO_PREFIX),
        ]
    else:
        from grelmicro.coordination.postgres import (
            PostgresLockAdapter,
            PostgresReadWriteLockAdapter,
        )
        from grelmicro.providers.postgres import PostgresProvider

        postgres = PostgresProvider(url=url)
        opened = [
            postgres,
            PostgresLockAdapter(provider=postgres, table_name=GRELMICRO_TABLE),
            PostgresReadWriteLockAdapter(provider=postgres, table_name=f"{GRELMICRO_TABLE}_rw"),
        ]
    for each in opened:
        await stack.enter_async_context(each)
    _, lock_backend, rw_backend = opened
    locks = functools.cache(lambda name: Lock(name, backend=lock_backend, lease_duration=10.0))
    rws = functools.cache(lambda name: ReadWriteLock(name, backend=rw_backend, lease_duration=10.0))

    def modes(name: str) -> Mode:
        rw = rws(name)
        return lambda write: rw.write if write else rw.read

    rw_how = (
        "writer-preferring (a refused writer's intent holds new readers back); polls every 0.1 s"
    )
    how = f"{version}: Lock (no semaphore); polls every 0.1 s"
    return _peer_lock(locks, how, PeerReadWrite(modes, rw_how))


async def _grelmicro_sync_peer(server: str, url: str, stack: AsyncExitStack) -> PeerLock:
    from grelmicro.sync import Lock

    version = importlib.metadata.version("grelmicro")

    if server == "redis":
        from grelmicro.sync.redis import RedisSyncBackend

        backend: Any = RedisSyncBackend(url, prefix=GRELMICRO_PREFIX)
    else:
        from grelmicro.sync.postgres import PostgresSyncBackend

        backend = PostgresSyncBackend(url, table_name=GRELMICRO_TABLE)
    await stack.enter_async_context(backend)
    locks = functools.cache(lambda name: Lock(name, backend=backend, lease_duration=10.0))
    how = (
        f"{version}: Lock (no read-write lock before 0.21, which needs Python 3.12;"
        " no semaphore); polls every 0.1 s"
    )
    return _peer_lock(locks, how)


def _peer_lock(locks: Callable[[str], Any], how: str, rw: PeerReadWrite | None = None) -> PeerLock:
    """A grelmicro ``Lock`` as a :class:`PeerLock` (both versions drive it alike)."""
    uncontended = locks(f"grelmicro-uncontended-{RUN}")

    async def cycle() -> None:
        await uncontended.acquire_nowait()
        await uncontended.release()

    async def once(name: str) -> None:
        async with locks(name):
            await anyio.sleep(HOLD)

    return PeerLock(cycle, once, how, rw)
