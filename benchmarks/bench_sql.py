"""PostgreSQL and MySQL/MariaDB: aiolease against raw floors and tooz, in one run.

Floors, on the same table shape as aiolease's (a table of their own):

* **raw lease-row floor**: one ``INSERT .. ON CONFLICT .. DO UPDATE .. WHERE expired
  .. RETURNING`` (MySQL: ``INSERT .. ON DUPLICATE KEY UPDATE`` read through
  ``LAST_INSERT_ID``) to acquire, one conditional ``UPDATE`` to release, on an asyncpg
  (asyncmy) pool. Its waiters wake on ``NOTIFY`` (PostgreSQL) or an in-process event
  plus a 10 ms poll (MySQL), and at the holder's expiry.
* **raw advisory floor**: ``pg_try_advisory_lock`` / ``GET_LOCK`` on a connection of its
  own; it has no ttl and is shown for reference.

tooz's ``pgsql`` / ``mysql`` drivers (synchronous, a new connection per acquire) run
in threads. Prints, as in issue 5's table, with ratios and a PASS/MISS column:

* **uncontended acquire+release**: median per cycle (contenders take turns, one
  cycle each), as a ratio to the lease-row floor and to the advisory floor
  (``--quick``: 100 cycles, which spread more but are not biased: on PostgreSQL,
  ``async with`` over the floor was 1.03-1.11x in six runs of 100 cycles and
  1.07-1.12x in six of 500, taken alternately, median 1.08x both; the first fifth of
  the cycles no slower than the rest). On PostgreSQL aiolease's release of a name
  nobody waits for commits with ``synchronous_commit`` off for its transaction (it
  grants nothing); the floor's release is a plain synchronous ``UPDATE``;
* **hand-offs**: 8 tasks in one process, then 4 processes, on one key, holding it
  1 ms: hand-offs per second; the *gap* p50/p95, from the releaser's release
  returning to the next holder's acquire returning (how long the name looks idle
  to the releaser: aiolease hands the name over inside the release statement, so
  this can be near zero or negative); the *body* p50, from the releaser's body
  ending (its release called) to the next holder's acquire returning (the release's
  own round trip included: what a user waits between two holders' work); fairness
  max/min. The
  contenders take turns for ``--rounds`` rounds (3): one round moves with where the
  processes land on the cores. Shown is the round with the median gap p50 (each
  round's p50 follows), with the worst round's fairness;
* **crash failover, ttl 2 s** (``--quick``: 1 s): the holder process is ``SIGKILL``ed;
  the time from the server-side expiry of its row (``expires_at``, mapped onto this
  host's monotonic clock) to a waiter's acquire, and from the kill;
* **N leases held** (default 1,000, ttl 3 s, renewed every second): statements per
  renew tick counted server-side (PostgreSQL: ``pg_stat_database`` transactions of
  the benchmark's own database, which lag by up to a second; MySQL: global ``Com_*``
  counters, server-wide: run on a quiet server), CPU seconds per second (this process's
  ``time.process_time``) and its ratio to the floor's (target: <= 2x). The floor is
  issue 18's: one ``UPDATE ... WHERE name = ANY($1)`` (MySQL: ``name IN (...)``, its
  text rendered once per count of names) per tick from one task, renewing from its
  first grant on, checking neither owner nor token (aiolease sends each lease's name,
  owner and token). A second floor, all leases of one owner renewed by ``UPDATE ...
  WHERE owner = ...`` (a statement of a few bytes), is printed for reference,
  leases lost. With ``--quick`` PostgreSQL's count cannot be read fresh (an idle
  connection reports its transactions up to 10 s late, and the acquisitions' would fall
  in the window): the verdict then takes the backend's own count of its renew
  statements, and the server's count is printed beside it.
* **semaphores and read-write locks** (issue 23; ``_permits.py`` says what each
  figure measures): a permit against the lock uncontended, 16 tasks on a semaphore
  of limit 4 against the lock's hand-off rate, a read-heavy mix, N permits held
  (server statements per renew tick counted as in the held figure, and the
  backend's own renewal statements: the target is on the first on PostgreSQL
  without ``--quick``, else on the second: MySQL's counters are the whole server's,
  and PostgreSQL's lag more than ``--quick`` waits). tooz has no
  semaphore and no read-write lock; grelmicro (PostgreSQL only) has no semaphore:
  its Lock is shown beside ours, and its read-write lock in the uncontended and
  read-heavy figures where it installs (0.21 and newer, which need Python 3.12:
  ``pip install -e '.[bench]'`` takes 0.41.1 there, and 0.20.0, locks only, on
  Python 3.11).

Usage: ``python benchmarks/bench_sql.py [--db postgres|mysql|both] [--url URL]
[--quick] [--skip tooz|grelmicro|FIGURE] [--only FIGURE] [--rounds N]``; the
floors live in ``_sql_floors.py``. PostgreSQL runs in a database of its own
(``aiolease_bench``, created if missing) so that its counters are the benchmark's.
Quote ratios from one run; absolute times depend on the machine. Needs
``pip install aiolease[bench]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

from _common import (
    QUICK_NOTE,
    add_figure_arguments,
    close_processes,
    fairness,
    hold_in_tasks,
    idle,
    percentile,
    quick_cut,
    record,
    run_processes,
    run_threads,
    serve_jobs,
    start_when_told,
    started,
    take_turns,
    verdict,
)
from _permits import PeerLock, PermitSizes, grelmicro_peer, permit_figures
from _sql_failover import failover, hold_forever
from _sql_floors import (
    TTL,
    Db,
    Postgres,
    bench_database,
    kind_of,
    make_db,
    opened_backend,
    tooz_coordinator,
)

from aiolease import AsyncLock
from aiolease.abc import Backend

RUN = uuid.uuid4().hex[:8]
#: Hold time of each hand-off.
HOLD = 0.001
#: Seconds the held leases settle before counting (shorter with --quick). PostgreSQL
#: reports an idle connection's counts up to 10 s late (PGSTAT_IDLE_INTERVAL): the
#: acquisitions must be in before the first reading.
SETTLE = [11.0]
TARGET_RATIO = 1.10
TARGET_GAP = 0.0005
TARGET_FAIRNESS = 1.5
TARGET_FAILOVER = 0.020
#: Server-side statements per renew tick allowed (1, plus the counters' lag).
TARGET_PER_TICK = 1.2
#: CPU seconds per second of the held leases allowed, as a multiple of the floor's.
TARGET_HELD_CPU = 2.0
#: The held figure's floors: issue 18's (the CPU target is its ratio to this one), and
#: the cheapest (one owner for all, a statement of a few bytes), for reference.
NAMES_FLOOR = "floor: UPDATE ... WHERE name = ANY(names)"
OWNER_FLOOR = "floor, one owner: UPDATE ... WHERE owner = ..."
#: Each floor's part of its rows' names (both use the floor's table).
FLOORS = {NAMES_FLOOR: "n", OWNER_FLOOR: "o"}
FIGURES = ("uncontended", "handoffs", "failover", "held", "permits")
DEFAULT_URLS = {
    "postgres": os.environ.get(
        "AIOLEASE_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
    ),
    "mysql": os.environ.get("AIOLEASE_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
}

#: (acquire returned, body ended: release called, release returned), time.monotonic()
Record = tuple[float, float, float]


def statistics_of(backend: Backend) -> Any:
    stats = getattr(backend, "statistics", None)
    return None if stats is None else stats()


# -- uncontended -----------------------------------------------------------------------------


async def uncontended(db: Db, cycles: int, skip: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Median seconds per acquire+release by contender, and the lease-row floor's median
    measured alongside it. The contenders take turns, one cycle each in a random order,
    so that a busy moment of the machine (or of the server's disk: every grant and
    release is a commit) hits them all alike.

    tooz takes its turns with the floor in a second round of its own: each of its
    cycles opens a connection, so the server forks a process and tears it down, and
    that load spills into whatever cycle comes next (measured: +400 us on the next
    cycle of any contender). Its ratio is to the floor of its own round."""
    cycle: dict[str, Callable[[], Awaitable[object]]] = {}
    async with AsyncExitStack() as stack:
        await db.open()
        stack.push_async_callback(db.close)

        def floor(key: str, notify: bool) -> Callable[[], Awaitable[object]]:
            async def floor_cycle() -> None:
                owner = uuid.uuid4().hex
                token = await db.floor_acquire(key, owner, TTL)
                assert token is not None
                assert await db.floor_release(key, owner, token, notify)

            return floor_cycle

        cycle["raw lease-row floor"] = floor(f"uncontended-floor-{RUN}", False)
        if isinstance(db, Postgres):
            notify = floor(f"uncontended-notify-{RUN}", True)
            cycle["raw lease-row floor, NOTIFY on release"] = notify
        advisory = await db.advisory()
        stack.push_async_callback(advisory.close)

        async def advisory_cycle() -> None:
            assert await advisory.try_lock(f"uncontended-{RUN}")
            await advisory.unlock(f"uncontended-{RUN}")

        cycle["raw advisory floor (no ttl)"] = advisory_cycle
        backend = await opened_backend(stack, db)
        lock = AsyncLock(backend, f"uncontended-{RUN}", ttl=TTL)
        other = AsyncLock(backend, f"uncontended-with-{RUN}", ttl=TTL)

        async def nowait() -> None:
            lease = await lock.acquire_nowait()
            await lease.release()

        async def block() -> None:
            async with other:
                pass

        cycle["aiolease acquire_nowait+release"] = nowait
        cycle["aiolease async with"] = block
        found = await take_turns(cycle, cycles)
        floor_median = found["raw lease-row floor"]
        times = {label: (median, floor_median) for label, median in found.items()}
        if "tooz" not in skip:
            coordinator = tooz_coordinator(db)
            stack.callback(coordinator.stop)
            tooz_lock = coordinator.get_lock(f"uncontended-{RUN}".encode())

            async def tooz_cycle() -> None:  # blocking calls: the loop waits, as intended
                assert tooz_lock.acquire(blocking=False)
                tooz_lock.release()

            label = "tooz (new connection per acquire)"
            own = await take_turns(
                {"raw lease-row floor": cycle["raw lease-row floor"], label: tooz_cycle},
                max(cycles // 5, 20),
            )
            times[label] = (own[label], own["raw lease-row floor"])
    return times


# -- hand-offs -------------------------------------------------------------------------------


async def run_tasks(
    make: Callable[[int], Callable[[], Awaitable[tuple[float, float]]]],
    tasks: int,
    seconds: float,
) -> list[list[Record]]:
    """Run ``tasks`` loops of ``make(i)()`` (acquire, hold, release; returns when the
    acquire returned and when the body ended) for ``seconds`` from the start
    (:func:`_common.started`: connecting is not measured): each
    task's records."""
    records: list[list[Record]] = [[] for _ in range(tasks)]
    await started()
    end = time.monotonic() + seconds

    async def loop(i: int) -> None:
        once = make(i)
        while time.monotonic() < end:
            acquired, ended = await once()
            records[i].append((acquired, ended, time.monotonic()))

    runners = [asyncio.ensure_future(loop(i)) for i in range(tasks)]
    await asyncio.sleep(seconds)
    # A waiter is cancelled; the loop's check also ends one whose cancellation
    # asyncio.wait_for swallowed (it can, on Python 3.11, when its event fires).
    for runner in runners:
        runner.cancel()
    await asyncio.gather(*runners, return_exceptions=True)
    return records


async def handoffs(kind: str, db: Db, name: str, tasks: int, seconds: float) -> list[list[Record]]:
    """Records per task of ``tasks`` tasks of contender ``kind`` on ``name``."""
    async with AsyncExitStack() as stack:
        if kind == "aiolease":
            lock = AsyncLock(await opened_backend(stack, db), name, ttl=TTL)

            def aiolease_once(i: int) -> Callable[[], Awaitable[tuple[float, float]]]:
                async def once() -> tuple[float, float]:
                    async with lock:
                        acquired = time.monotonic()
                        await asyncio.sleep(HOLD)
                        ended = time.monotonic()
                    return acquired, ended

                return once

            return await run_tasks(aiolease_once, tasks, seconds)
        if kind == "floor":
            await db.open(listen=True)
            stack.push_async_callback(db.close)

            def floor_once(i: int) -> Callable[[], Awaitable[tuple[float, float]]]:
                async def once() -> tuple[float, float]:
                    owner = uuid.uuid4().hex
                    token = await db.floor_lock(name, owner, TTL)
                    acquired = time.monotonic()
                    await asyncio.sleep(HOLD)
                    ended = time.monotonic()
                    await db.floor_unlock(name, owner, token)
                    return acquired, ended

                return once

            return await run_tasks(floor_once, tasks, seconds)
        if kind == "advisory":
            advisories = [await db.advisory() for _ in range(tasks)]
            for one in advisories:
                stack.push_async_callback(one.close)

            def advisory_once(i: int) -> Callable[[], Awaitable[tuple[float, float]]]:
                async def once() -> tuple[float, float]:
                    await advisories[i].lock(name)
                    acquired = time.monotonic()
                    await asyncio.sleep(HOLD)
                    ended = time.monotonic()
                    await advisories[i].unlock(name)
                    return acquired, ended

                return once

            return await run_tasks(advisory_once, tasks, seconds)
        if kind == "tooz":
            return await tooz_handoffs(db, name, tasks, seconds)
    raise ValueError(f"unknown contender {kind!r}")


async def tooz_handoffs(db: Db, name: str, threads: int, seconds: float) -> list[list[Record]]:
    """tooz is synchronous: one thread per contender, one coordinator each."""
    records: list[list[Record]] = [[] for _ in range(threads)]
    stop = threading.Event()

    def run(i: int) -> None:
        coordinator = tooz_coordinator(db)
        try:
            while not stop.is_set():
                lock = coordinator.get_lock(name.encode())
                assert lock.acquire(blocking=True)
                acquired = time.monotonic()
                time.sleep(HOLD)
                ended = time.monotonic()
                lock.release()
                records[i].append((acquired, ended, time.monotonic()))
        finally:
            coordinator.stop()

    await run_threads(run, threads, stop, seconds)
    return records


async def handoffs_across_processes(
    kind: str, db: Db, processes: int, seconds: float
) -> list[list[Record]]:
    """Records per process, ``processes`` processes of one task each."""
    name = f"procs-{kind}-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, __file__, "--url", db.url, "--db", kind_of(db)]
    command += ["--worker", "serve", "--seconds", repr(seconds)]
    return [
        [(a, e, r) for a, e, r in json.loads(line)]
        for line in await run_processes(command, processes, kind, name)
    ]


async def worker(kind: str, db: Db, name: str, seconds: float) -> str:
    """One process's job in :func:`handoffs_across_processes`: its records (connected
    first, then all processes count the same window)."""
    start_when_told()
    (records,) = await handoffs(kind, db, name, 1, seconds)
    return json.dumps(records)


def gaps(records: Sequence[Sequence[Record]]) -> list[float]:
    """Hand-off gaps: each acquire's return minus the previous holder's release return
    (how long the name looks idle to the releaser: the hand-off may happen inside the
    release's own statement, before it returns)."""
    ordered = sorted(record for task in records for record in task)
    return [b[0] - a[2] for a, b in zip(ordered, ordered[1:], strict=False)]


def body_gaps(records: Sequence[Sequence[Record]]) -> list[float]:
    """Body to body: each acquire's return minus the end of the previous holder's body
    (its call of release: the release's own round trip included)."""
    ordered = sorted(record for task in records for record in task)
    return [b[0] - a[1] for a, b in zip(ordered, ordered[1:], strict=False)]


# -- crash failover --------------------------------------------------------------------------


# -- many leases held ------------------------------------------------------------------------


def _report_failure(task: asyncio.Task[None]) -> None:
    """A floor's renewal task that failed says so (else its figures would be a quiet
    task's)."""
    if not task.cancelled() and task.exception() is not None:
        print(f"  floor renewals failed: {task.exception()!r}", file=sys.stderr)


async def held(
    kind: str, db: Db, count: int, seconds: float
) -> tuple[float, float | None, float, int]:
    """Hold ``count`` leases (ttl 3 s, renewed every second) for ``seconds``: (server
    statements per renew tick, renew statements per tick as the backend counted
    them, CPU seconds per second, leases lost)."""
    ttl = 3.0
    tick = ttl / 3
    counter = make_db(kind_of(db), db.url)
    await counter.open()
    renewals: Callable[[], int | None] = lambda: None  # noqa: E731
    try:
        async with AsyncExitStack() as stack:
            check: Callable[[], int]
            if kind in FLOORS:
                await db.open()
                stack.push_async_callback(db.close)
                owner = uuid.uuid4().hex
                lost, acquired = [0], [0]
                held_names: list[str] = []  # grows as they are granted

                async def keepalive() -> None:
                    while True:
                        await asyncio.sleep(tick)
                        if kind == NAMES_FLOOR:
                            renewed = await db.floor_renew_names(held_names, ttl)
                        else:
                            renewed = await db.floor_renew_all(owner, ttl)
                        if acquired[0] == count:  # (counted once all are held)
                            lost[0] = max(lost[0], count - renewed)

                # Renewing from the first grant on: on a loaded machine the grants
                # one after the other may take longer than the ttl.
                task = asyncio.ensure_future(keepalive())
                task.add_done_callback(_report_failure)
                stack.callback(task.cancel)
                for i in range(count):
                    name = f"held-{RUN}-{FLOORS[kind]}-{i}"
                    assert await db.floor_acquire(name, owner, ttl) is not None
                    held_names.append(name)
                    acquired[0] += 1
                check = lambda: lost[0]  # noqa: E731
            else:  # each held in a task of its own, as an application would
                backend = await opened_backend(stack, db)
                names = [f"held-{RUN}-{i}" for i in range(count)]
                leases = await hold_in_tasks(backend, names, ttl, stack)
                check = lambda: sum(lease.lost is not None for lease in leases)  # noqa: E731
                if statistics_of(backend) is not None:
                    renewals = lambda: statistics_of(backend).renew_statements  # noqa: E731
            async with idle():
                await asyncio.sleep(SETTLE[0])  # settle: every renewal loop is running
                before = await counter.statements()
                renewed, cpu, wall = renewals(), time.process_time(), time.monotonic()
                await asyncio.sleep(seconds)
                after, after_renewed = await counter.statements(), renewals()
                cpu, wall = time.process_time() - cpu, time.monotonic() - wall
                lost_now = check()
    finally:
        await counter.close()
    ticks = wall / tick
    if isinstance(db, Postgres):
        after -= 1  # the first reading's own transaction
    per_tick = (
        None if renewed is None or after_renewed is None else (after_renewed - renewed) / ticks
    )
    return (after - before) / ticks, per_tick, cpu / wall, lost_now


# -- the run -----------------------------------------------------------------------------------


async def print_uncontended(db: Db, args: argparse.Namespace) -> None:
    times = await uncontended(db, args.cycles, args.skip)
    advisory = times["raw advisory floor (no ttl)"][0]
    head = f"{'uncontended acquire+release':<40} {'median':>9} {'x floor':>8} {'x advis.':>8}"
    print(f"{head}  target <= {TARGET_RATIO:.2f} x floor")
    for label, (seconds, floor) in times.items():
        ratio = seconds / floor
        ok = ratio <= TARGET_RATIO if label.startswith("aiolease") else None
        target = f"<= {TARGET_RATIO:.2f}" if ok is not None else ""
        record(
            db.name, "uncontended acquire+release", label, ratio, "x floor", target=target, ok=ok
        )
        print(
            f"  {label:<38} {seconds * 1e6:>6.0f} us {ratio:>8.2f} {seconds / advisory:>8.2f}"
            f"  {verdict(ok)}"
        )
    if isinstance(db, Postgres):
        print(
            "  (aiolease's release of a name nobody waits for commits without waiting for the"
            " WAL flush; the floor's release waits: docs/backends/postgres.md)"
        )


async def print_handoffs(db: Db, args: argparse.Namespace, kinds: Sequence[str]) -> None:
    table = f"{'per s':>7} {'gap p50':>9} {'gap p95':>9} {'body p50':>9} {'max/min':>8}"
    for title, across in (("8 tasks", False), ("4 processes", True)):
        print(f"\n{'hand-offs, ' + title + ', one key, 1 ms':<40} {table}  target p50 <= 0.5 ms,")
        print(f"{'':<40} {'':>37}  max/min <= {TARGET_FAIRNESS}; p50 of each round")
        contenders = [c for c in quick_cut(kinds, args.quick) if not (across and c == "tooz")]
        if args.quick:
            print(QUICK_NOTE)
        rounds: dict[str, list[list[list[Record]]]] = {c: [] for c in contenders}
        for turn in range(args.rounds):  # the contenders take turns; the order rotates
            shift = turn % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                if across:
                    records = await handoffs_across_processes(contender, db, 4, args.seconds)
                else:
                    name = f"handoff-{contender}-{RUN}-{turn}"
                    records = await handoffs(contender, db, name, 8, args.seconds)
                rounds[contender].append(records)
        await close_processes()
        for contender in contenders:
            runs = rounds[contender]
            p50s = [percentile(gaps(records), 0.5) for records in runs]
            median = sorted(range(len(runs)), key=p50s.__getitem__)[len(runs) // 2]
            found = gaps(runs[median])
            fair = max(fairness([len(task) for task in records]) for records in runs)
            p50 = p50s[median]
            ok = p50 <= TARGET_GAP and fair <= TARGET_FAIRNESS if contender == "aiolease" else None
            each = " ".join(f"{g * 1e3:.2f}" for g in p50s)
            figure = f"hand-offs, {title}, one key, 1 ms"
            rate = (len(found) + 1) / args.seconds
            record(db.name, figure, contender, rate, "/s")
            body = percentile(body_gaps(runs[median]), 0.5)
            record(
                db.name,
                figure + ": gap p50 (release returned to the next acquire returned)",
                contender,
                p50 * 1e3,
                "ms",
                target="<= 0.5" if ok is not None else "",
                ok=ok,
            )
            record(
                db.name,
                figure + ": body p50 (release called to the next acquire returned)",
                contender,
                body * 1e3,
                "ms",
            )
            record(db.name, figure + ": fairness", contender, fair, "max/min")
            print(
                f"  {contender:<38} {(len(found) + 1) / args.seconds:>7.0f}"
                f" {p50 * 1e3:>6.2f} ms {percentile(found, 0.95) * 1e3:>6.2f} ms"
                f" {body * 1e3:>6.2f} ms {fair:>8.2f}  {verdict(ok)}  {each}"
            )


async def print_failover(db: Db, args: argparse.Namespace, kinds: Sequence[str]) -> None:
    title = f"crash failover, ttl {args.failover_ttl:g} s"
    print(
        f"\n{title:<40} {'expiry->acquire':>16} {'kill->acquire':>14}"
        f"  target <= {TARGET_FAILOVER * 1e3:.0f} ms"
    )
    if args.quick:
        print(QUICK_NOTE)
    for contender in quick_cut(kinds, args.quick):
        runs = [
            await failover(__file__, contender, db, args.failover_ttl)
            for _ in range(args.failovers)
        ]
        total = statistics.median(r[1] for r in runs)
        after = [r[0] for r in runs if r[0] is not None]
        gap = f"{statistics.median(after) * 1e3:>13.1f} ms" if after else f"{'n/a (no ttl)':>16}"
        ok = statistics.median(after) <= TARGET_FAILOVER if contender == "aiolease" else None
        if after:
            record(
                db.name,
                title + ": expiry to acquire",
                contender,
                statistics.median(after) * 1e3,
                "ms",
                ok=ok,
            )
        print(f"  {contender:<38} {gap} {total:>12.3f} s  {verdict(ok)}")


async def print_held(db: Db, args: argparse.Namespace) -> None:
    head = f"{args.held} leases held, ttl 3 s, tick 1 s"
    print(
        f"\n{head:<40} {'stmt/tick':>9} {'renew/tick':>10} {'CPU s/s':>9} {'x floor':>7}"
        f" {'lost':>5}  target 1 stmt/tick, CPU <= {TARGET_HELD_CPU:g}x the floor's, 0 lost"
    )
    # PostgreSQL's server-side count lags by up to 10 s: with a shorter settle, the
    # verdict takes the backend's own count (see the module docstring).
    lagging = isinstance(db, Postgres) and SETTLE[0] < 11
    floor_cpu = math.nan
    for contender in (NAMES_FLOOR, OWNER_FLOOR, "aiolease"):
        per_tick, renews, cpu, lost = await held(contender, db, args.held, args.held_seconds)
        figure = f"{args.held} leases held, ttl 3 s"
        ok = ratio_ok = None
        if contender == NAMES_FLOOR:
            floor_cpu = cpu
        elif contender in FLOORS:
            pass
        else:
            counted = renews if lagging and renews is not None else per_tick
            ok = counted <= TARGET_PER_TICK and lost == 0
            ratio_ok = cpu / floor_cpu <= TARGET_HELD_CPU
        server_ok = None if lagging else ok
        record(db.name, figure + ": statements per tick", contender, per_tick, "", ok=server_ok)
        if renews is not None:
            renew_ok = ok if lagging else None
            record(
                db.name,
                figure + ": renew statements per tick (backend's count)",
                contender,
                renews,
                "",
                ok=renew_ok,
            )
        record(db.name, figure + ": CPU", contender, cpu, "CPU s/s")
        target = f"<= {TARGET_HELD_CPU:g}" if contender not in FLOORS else ""
        record(
            db.name,
            figure + ": CPU",
            contender,
            cpu / floor_cpu,
            "x floor",
            target=target,
            ok=ratio_ok,
        )
        record(db.name, figure + ": lost", contender, lost, "")
        renew_text = "" if renews is None else f"{renews:.2f}"
        figures = f"{per_tick:>9.2f} {renew_text:>10} {cpu:>9.5f} {cpu / floor_cpu:>7.2f} {lost:>5}"
        verdicts = "" if ok is None else f"{verdict(ok)} {verdict(ratio_ok)}"
        print(f"  {contender:<38} {figures}  {verdicts}")
    print("  (tooz: n/a, a session lock holds a connection each; no ttl to renew)")
    if lagging:
        print(
            "  (--quick: PostgreSQL's counts of the acquisitions may still arrive in the"
            " window: the verdict takes renew/tick, the backend's own count)"
        )


async def print_permits(db: Db, args: argparse.Namespace) -> None:
    """Issue 23's figures (``_permits.py``) on one aiolease backend, with grelmicro's
    lock beside ours on PostgreSQL where it installs."""
    sizes = PermitSizes.of(args, SETTLE[0])
    counter = make_db(kind_of(db), db.url)
    await counter.open()
    try:
        async with AsyncExitStack() as stack:
            backend = await opened_backend(stack, db)
            peers: dict[str, PeerLock] = {}
            notes = ["tooz has no semaphore and no read-write lock"]
            if isinstance(db, Postgres) and "grelmicro" not in args.skip:
                try:
                    peers["grelmicro"] = await grelmicro_peer("postgres", db.url, stack)
                except ImportError:
                    notes.append("grelmicro: not installed (pip install 'grelmicro[postgres]')")
            own = [0]  # PostgreSQL: each reading is a transaction of its own

            async def statements() -> float:
                count = await counter.statements()
                if isinstance(db, Postgres):
                    own[0] += 1
                return count - own[0]

            async def renew_statements() -> float:
                return float(statistics_of(backend).renew_statements)

            await permit_figures(
                db.name,
                backend,
                sizes,
                peers=peers,
                counters={
                    "server statements": statements,
                    "renew statements": renew_statements,
                },
                # MySQL's counters are the whole server's (other clients' included),
                # and PostgreSQL's lag by up to 10 s (--quick settles 1 s): there the
                # target is the backend's own count of renewal statements.
                tick_target=(
                    "server statements"
                    if isinstance(db, Postgres) and not args.quick
                    else "renew statements"
                ),
                notes=notes,
            )
    finally:
        await counter.close()


async def main_for(kind: str, url: str, args: argparse.Namespace) -> None:
    if kind == "postgres":
        url = await bench_database(url)
    db = make_db(kind, url)
    skip = args.skip
    print(f"\n== {db.name}: {url} (ratios from this run only)\n")
    kinds = ["floor", "advisory", "aiolease"] + ([] if "tooz" in skip else ["tooz"])
    if "uncontended" not in skip:
        await print_uncontended(db, args)
    if "handoffs" not in skip:
        await print_handoffs(db, args, kinds)
    if "failover" not in skip:
        await print_failover(db, args, kinds)
    if "held" not in skip:
        await print_held(db, args)
    if "permits" not in skip:
        await print_permits(db, args)


async def main(args: argparse.Namespace) -> None:
    kinds = ["postgres", "mysql"] if args.db == "both" else [args.db]
    if args.url is not None and len(kinds) > 1:
        raise SystemExit("--url names one database: give --db postgres or --db mysql too")
    for kind in kinds:
        await main_for(kind, args.url or DEFAULT_URLS[kind], args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=["postgres", "mysql", "both"], default="both")
    parser.add_argument("--url", help="the database (default: the test servers')")
    add_figure_arguments(parser)
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["tooz", "grelmicro", *FIGURES],
        help="repeatable",
    )
    parser.add_argument("--only", choices=FIGURES, help="this figure alone")
    parser.add_argument("--quick", action="store_true", help="fewer cycles, shorter figures")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the hand-off figures")
    parser.add_argument("--ttl", type=float, default=2.0, help=argparse.SUPPRESS)
    parser.add_argument("--failover-ttl", type=float, default=2.0, help="crash failover's ttl")
    args = parser.parse_args()
    if args.worker is not None:
        worker_db = make_db(args.db, args.url)
        if args.worker.startswith("hold-"):
            kind = args.worker.removeprefix("hold-")
            asyncio.run(hold_forever(kind, worker_db, args.name, args.ttl))
        else:  # a fresh Db for each job: its pools belong to the job's event loop
            serve_jobs(
                lambda kind, name: worker(kind, make_db(args.db, args.url), name, args.seconds)
            )
    else:
        if args.only is not None:
            args.skip += [figure for figure in FIGURES if figure != args.only]
        if args.quick:
            args.cycles, args.seconds, args.failovers, args.rounds = 100, 0.5, 1, 1
            args.held, args.held_seconds, args.failover_ttl = 200, 2.0, 1.0
            SETTLE[0] = 1.0
        asyncio.run(main(args))
