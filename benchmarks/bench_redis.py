"""Redis: aiolease against redis-py's asyncio Lock, python-redis-lock, pottery's
AIORedlock, aioredlock and a raw floor, in one run.

The floor is ``SET NX PX`` to acquire and a Lua compare-and-delete (EVALSHA) to
release, through ``redis.asyncio``: 2 round trips. For hand-offs the floor adds
python-redis-lock's push: the release script also pushes onto a signal list that
one waiter ``BLPOP``s. Prints, as in issue 4's table, each figure for every
contender from the same run, with a target and PASS/MISS for aiolease:

* **uncontended acquire+release**: median per cycle as a ratio to the floor, and
  round trips per cycle, counted by the server (``total_reads_processed``);
* **hand-offs per second**: 8 tasks in one process, then 4 processes, on one key,
  each holding it 1 ms; fairness (most / fewest acquisitions per contender) and
  whether anybody starved (got nothing). On this 2-core machine one run of a figure
  moves by up to +-10 % with where the processes and the server land on the cores:
  the contenders take turns for ``--rounds`` rounds (3; the order rotates), and each
  figure is the median round's rate, the worst round's fairness, and the starved
  of all rounds;
* **crash failover, ttl 2 s**: a holder process is ``SIGKILL``ed; the time from the
  server-side expiry of its key (``PTTL`` read right after the kill) to a waiter's
  acquire;
* **transports**: the uncontended acquire+release cycle of aiolease through each of
  the backend's transports in one run, taking turns (``transport=lean`` and
  ``transport=redis-py``), with the ratio of the medians: the lean transport is kept
  only while it buys at least 10 %;
* **N leases held** (default 1,000, ttl 3 s, 15 s), each with the renewal its
  library offers: round trips per second (socket writes, counted in the client; for
  aiolease also those of its renewals alone), requests per second the server read
  (``total_reads_processed``: a request over 16 KiB takes several reads), this
  process's CPU seconds per second, and leases lost;
* **semaphores and read-write locks** (issue 23; ``_permits.py`` says what each
  figure measures): a permit against the lock uncontended, 16 tasks on a semaphore
  of limit 4 against the lock's hand-off rate, a read-heavy mix, N permits held
  (renewal round trips per tick: the backend's own count of its renewal pipelines,
  as in the held figure). The peers have no semaphore (pottery 3.0.1: locks,
  counters, collections; grelmicro): their locks are shown beside ours, and
  grelmicro's read-write lock in the uncontended and read-heavy figures where it
  installs (0.21 and newer, which need Python 3.12: ``pip install -e '.[bench]'``
  takes 0.41.1 there, and 0.20.0, locks only, on Python 3.11).

Usage: ``python benchmarks/bench_redis.py [--url redis://127.0.0.1:6379] [--quick]
[--skip peer,...] [--only handoffs] [--kinds aiolease-fair,python-redis-lock]
[--spawn-server]``: ``--only`` runs one figure (``uncontended``, ``transports``,
``handoffs``, ``failover``, ``held``, ``permits``), ``--kinds`` only the contenders
named (the uncontended figure always runs the floor and aiolease). Server-side
counts are only right on a quiet server: ``--spawn-server`` runs a private
``redis-server`` on a free port for the run. Quote ratios from one run; absolute
times depend on the machine. Needs ``pip install aiolease[bench]`` (or ``--skip``
the peers that are missing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection
from _common import (
    QUICK_NOTE,
    add_figure_arguments,
    close_processes,
    fairness,
    hold_in_tasks,
    idle,
    quick_cut,
    record,
    run_processes,
    run_threads,
    serve_jobs,
    start_when_told,
    started,
    verdict,
)
from _permits import PeerLock, PermitSizes, grelmicro_peer, permit_figures
from _redis_contenders import (
    HOLD,
    HOW,
    PEERS,
    RENEW_ALL,
    RUN,
    TRANSPORTS,
    Contender,
    Sends,
    server_reads,
    spawned_server,
)

from aiolease import AsyncLock
from aiolease.backends.redis import RedisBackend

# -- uncontended ---------------------------------------------------------------------------


async def uncontended(
    url: str, kinds: Sequence[str], cycles: int
) -> dict[str, tuple[float, float]]:
    """Median seconds per acquire+release, and requests per cycle the server read, by contender.
    The contenders take turns, one cycle each, so a busy moment hits them all alike."""
    found: dict[str, list[float]] = {}
    async with AsyncExitStack() as stack:
        cycle: dict[str, Callable[[], Awaitable[object]]] = {}
        for kind in kinds:
            contender = Contender(kind, url, stack)
            await contender.start()
            cycle[kind] = make_cycle(contender)
        if "aiolease" in cycle:
            contender = Contender("aiolease", url, stack)
            await contender.start()
            cycle["aiolease async with"] = make_block(contender)
        pings = redis.asyncio.Redis.from_url(url)
        stack.push_async_callback(pings.aclose)

        async def two_pings() -> None:
            await pings.ping()
            await pings.ping()

        cycle["two PINGs"] = two_pings
        for _ in range(min(cycles // 10, 50)):
            for one in cycle.values():
                await one()
        for _ in range(cycles):
            for label, one in cycle.items():
                start = time.perf_counter()
                await one()
                found.setdefault(label, []).append(time.perf_counter() - start)
        trips: dict[str, float] = {}
        for label, one in cycle.items():  # alone, so the server's count is this one's
            before = server_reads(url)
            for _ in range(20):
                await one()
            trips[label] = (server_reads(url) - before - 1) / 20  # less the INFO
    return {label: (statistics.median(s), trips[label]) for label, s in found.items()}


def make_cycle(contender: Contender) -> Callable[[], Awaitable[None]]:
    name = f"uncontended-{contender.kind}-{RUN}"

    async def cycle() -> None:
        handle = await contender.acquire(name, 10, blocking=False)
        await contender.release(name, handle)

    return cycle


def make_block(contender: Contender) -> Callable[[], Awaitable[None]]:
    lock = AsyncLock(contender.backend, f"uncontended-with-{RUN}", ttl=10)

    async def block() -> None:
        async with lock:
            pass

    return block


async def transports(url: str, cycles: int) -> dict[str, float]:
    """Median seconds per uncontended acquire+release of aiolease, by transport. The
    transports take turns, one cycle each, as in :func:`uncontended`."""
    found: dict[str, list[float]] = {}
    async with AsyncExitStack() as stack:
        cycle: dict[str, Callable[[], Awaitable[None]]] = {}
        for transport in TRANSPORTS:
            contender = Contender("aiolease", url, stack, transport=transport)
            await contender.start()
            cycle[transport] = make_cycle(contender)
        for _ in range(min(cycles // 10, 50)):
            for one in cycle.values():
                await one()
        for _ in range(cycles):
            for label, one in cycle.items():
                start = time.perf_counter()
                await one()
                found.setdefault(label, []).append(time.perf_counter() - start)
    return {label: statistics.median(s) for label, s in found.items()}


# -- hand-offs -----------------------------------------------------------------------------


async def handoffs(
    kind: str,
    url: str,
    name: str,
    tasks: int,
    seconds: float,
) -> list[int]:
    """Acquisitions per task of ``tasks`` tasks (threads for python-redis-lock) that
    end within ``seconds`` from the start (:func:`_common.started`, once connected)."""
    counts = [0] * tasks
    async with AsyncExitStack() as stack:
        contender = Contender(kind, url, stack)
        await contender.start()
        await started()
        end_at = time.monotonic() + seconds
        if kind == "python-redis-lock":
            return await threaded_handoffs(contender.sync, name, tasks, end_at)
        stopped = False

        async def loop(i: int) -> None:
            while not stopped:
                await contender.once(name)
                counts[i] += time.monotonic() <= end_at

        # redis-py's asyncio client can swallow a cancel() that arrives while it awaits a
        # reply: the loops are told to stop, and cancelled only if they do not.
        runners = [asyncio.ensure_future(loop(i)) for i in range(tasks)]
        await asyncio.sleep(max(end_at - time.monotonic(), 0))
        stopped = True
        _, late = await asyncio.wait(runners, timeout=15)
        for runner in late:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
    return counts


async def threaded_handoffs(
    client: redis.Redis, name: str, threads: int, end_at: float
) -> list[int]:
    """python-redis-lock is synchronous: one thread per contender, one client shared."""
    import redis_lock

    counts = [0] * threads

    def run(i: int) -> None:
        while time.monotonic() < end_at:
            lock = redis_lock.Lock(client, name, expire=10)
            if lock.acquire(timeout=0.5):
                time.sleep(HOLD)
                lock.release()
                counts[i] += time.monotonic() <= end_at

    await run_threads(run, threads, None, 0.0)
    return counts


async def handoffs_across_processes(
    kind: str, url: str, processes: int, seconds: float, delay: float
) -> list[int]:
    """Acquisitions per process, ``processes`` processes of one task each."""
    name = f"procs-{kind}-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, __file__, "--url", url, "--worker", "serve"]
    command += ["--seconds", repr(seconds)]
    return [int(line) for line in await run_processes(command, processes, kind, name, delay)]


async def worker(kind: str, url: str, name: str, seconds: float) -> str:
    """One process's job in :func:`handoffs_across_processes`: connected, it says it
    is ready, waits for the start every process shares; its acquisitions."""
    start_when_told()
    (count,) = await handoffs(kind, url, name, 1, seconds)
    return str(count)


# -- crash failover ------------------------------------------------------------------------


async def hold_forever(kind: str, url: str, name: str, ttl: float) -> None:
    """The holder process of a failover: acquire (with auto-renewal where the library
    has it), say so, and wait to be killed."""
    async with AsyncExitStack() as stack:
        contender = Contender(kind, url, stack)
        await contender.start()
        if kind.startswith("aiolease"):
            await stack.enter_async_context(AsyncLock(contender.backend, name, ttl=ttl))
        elif kind == "python-redis-lock":
            import redis_lock

            lock = redis_lock.Lock(contender.sync, name, expire=int(ttl), auto_renewal=True)
            assert lock.acquire()
        elif kind == "aioredlock":
            from aioredlock import Aioredlock

            host = contender.client.connection_pool.connection_kwargs["host"]
            port = contender.client.connection_pool.connection_kwargs["port"]
            manager = Aioredlock([{"host": host, "port": port}], internal_lock_timeout=ttl)
            await manager.lock(contender.key(name))  # no lock_timeout: its watchdog renews
        else:
            await contender.acquire(name, ttl)
        print("held", flush=True)
        await asyncio.sleep(3600)


async def failover(kind: str, url: str, ttl: float) -> float:
    """One crash failover: seconds from the server-side expiry of the killed holder's
    key to the waiter's acquire."""
    name = f"failover-{kind}-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, __file__, "--url", url, "--worker", f"hold-{kind}"]
    holder = await asyncio.create_subprocess_exec(
        *command, "--name", name, "--ttl", repr(ttl), stdout=subprocess.PIPE
    )
    assert holder.stdout is not None
    assert (await holder.stdout.readline()).strip() == b"held"
    async with AsyncExitStack() as stack:
        contender = Contender(kind, url, stack)
        await contender.start()
        observer = redis.asyncio.Redis.from_url(url)
        stack.push_async_callback(observer.aclose)
        await observer.ping()

        async def wait_and_acquire() -> float:
            handle = await contender.acquire(name, ttl)
            got = time.monotonic()
            await contender.release(name, handle)
            return got

        acquired = asyncio.ensure_future(wait_and_acquire())
        await asyncio.sleep(0.3)  # the waiter is waiting
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
        sent = time.monotonic()
        pttl = await observer.pttl(contender.key(name))
        answered = time.monotonic()
        assert pttl > 0, f"{kind}: the holder's key {contender.key(name)!r} has PTTL {pttl}"
        expiry = (sent + answered) / 2 + pttl / 1000
        return await acquired - expiry


# -- many leases held ----------------------------------------------------------------------


async def held(
    kind: str, url: str, count: int, seconds: float, settle: float
) -> tuple[float, float, float, float, int]:
    """Hold ``count`` leases (ttl 3 s) for ``seconds``: (round trips per second counted
    in the client, of them renewals, requests per second read by the server, CPU
    seconds per second, leases lost)."""
    ttl = 3
    async with AsyncExitStack() as stack:
        contender = Contender(kind, url, stack)
        await contender.start()
        names = [f"held-{kind}-{RUN}-{i}" for i in range(count)]
        lost = await start_holding(contender, names, ttl, stack)
        async with idle():
            await asyncio.sleep(settle)  # every renewal loop is running
            backend = getattr(contender, "backend", None)
            stats = backend.statistics if isinstance(backend, RedisBackend) else None
            batches = stats().batches if stats else 0
            sends, reads = Sends.count, server_reads(url)
            cpu, wall = time.process_time(), time.monotonic()
            await asyncio.sleep(seconds)
            sends, reads = Sends.count - sends, server_reads(url) - reads - 1
            batches = stats().batches - batches if stats else sends
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        return sends / wall, batches / wall, reads / wall, cpu / wall, await lost()


async def start_holding(
    contender: Contender, names: Sequence[str], ttl: int, stack: AsyncExitStack
) -> Callable[[], Awaitable[int]]:
    """Acquire every name with the library's own renewal running; how to count the lost."""
    kind, client = contender.kind, contender.client
    tasks: list[asyncio.Future[Any]] = []
    stack.callback(lambda: [t.cancel() for t in tasks])
    if kind == "aiolease":  # each held in a task of its own, as an application would
        leases = await hold_in_tasks(contender.backend, names, ttl, stack, return_exceptions=True)

        async def aiolease_lost() -> int:
            return sum(lease.lost is not None for lease in leases)

        return aiolease_lost
    if kind == "floor":  # one script renews them all
        renew_all = client.register_script(RENEW_ALL)
        keys = [contender.key(name) for name in names]
        for key in keys:
            assert await client.set(key, RUN, nx=True, px=ttl * 1000)

        async def renew() -> None:
            while True:
                await asyncio.sleep(ttl / 3)
                await renew_all(keys=keys, args=[RUN, ttl * 1000])

        tasks.append(asyncio.ensure_future(renew()))

        async def floor_lost() -> int:
            return len(keys) - int(await renew_all(keys=keys, args=[RUN, ttl * 1000]))

        return floor_lost
    if kind == "python-redis-lock":
        import redis_lock

        plocks = [redis_lock.Lock(contender.sync, n, expire=ttl, auto_renewal=True) for n in names]
        for plock in plocks:
            assert plock.acquire(blocking=False)

        def stop_renewers() -> None:
            for plock in plocks:
                plock._stop_lock_renewer()

        stack.callback(stop_renewers)

        async def threads_lost() -> int:
            owners = await client.mget([contender.key(n) for n in names])
            return sum(o != p.id.encode() for o, p in zip(owners, plocks, strict=True))

        return threads_lost
    if kind == "aioredlock":
        from aioredlock import Aioredlock

        kwargs = client.connection_pool.connection_kwargs
        manager = Aioredlock(
            [{"host": kwargs["host"], "port": kwargs["port"]}], internal_lock_timeout=ttl
        )
        stack.push_async_callback(manager.destroy)
        alocks = [await manager.lock(contender.key(n)) for n in names]  # watchdog renews

        async def watchdog_lost() -> int:
            owners = await client.mget([contender.key(n) for n in names])
            return sum(o != a.id.encode() for o, a in zip(owners, alocks, strict=True))

        return watchdog_lost
    # redis-py and pottery have no auto-renewal: a task per lock renews it every ttl/3,
    # from its own acquisition on.
    failed: set[int] = set()

    async def renew_one(i: int, handle: Any) -> None:
        if kind == "pottery":
            handle.num_extensions = 10**9
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await (handle.reacquire() if kind == "redis-py" else handle.extend())
            except Exception:
                failed.add(i)

    for i, name in enumerate(names):
        handle = await contender.acquire(name, ttl, blocking=False)
        tasks.append(asyncio.ensure_future(renew_one(i, handle)))

    async def renewer_lost() -> int:
        return len(failed)

    return renewer_lost


# -- the run -------------------------------------------------------------------------------


class Report:
    """The sections as they are measured, then issue 4's table with the verdicts."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def target(self, figure: str, want: str, got: str, ok: bool) -> None:
        self.rows.append((figure, want, got, verdict(ok)))

    def print_summary(self) -> None:
        print(f"\n{'figure':<44} {'target':<36} {'aiolease':<30} verdict")
        for figure, want, got, ok in self.rows:
            print(f"{figure:<44} {want:<36} {got:<30} {ok}")


async def main(args: argparse.Namespace) -> None:
    url, skip = args.url, set(args.skip)
    peers = wanted(args, [p for p in PEERS if p not in skip])
    report = Report()
    print(f"Redis benchmarks against {url} (ratios from this run only)")
    for kind in wanted(args, ["floor", "aiolease", "aiolease-fair", *peers]):
        print(f"  {kind:<18} {HOW[kind]}")

    if args.only in (None, "uncontended"):
        await uncontended_figure(args, peers, report)
    if args.only in (None, "transports"):
        await transport_figure(args, report)
    if args.only in (None, "handoffs"):
        await handoff_figures(args, peers, report)
    if args.only in (None, "failover"):
        await failover_figure(args, peers, report)
    if args.only in (None, "held"):
        await held_figure(args, peers, report)
    if args.only in (None, "permits"):
        await permit_figure(args, report)
    report.print_summary()


def wanted(args: argparse.Namespace, kinds: Sequence[str]) -> list[str]:
    """``kinds`` less those ``--kinds`` leaves out."""
    return [k for k in kinds if args.kinds is None or k in args.kinds]


async def uncontended_figure(
    args: argparse.Namespace, peers: Sequence[str], report: Report
) -> None:
    url = args.url
    times = await uncontended(url, ["floor", "aiolease", *peers], args.cycles)
    floor = times["floor"][0]
    print(f"\n{'uncontended acquire+release':<36} {'x floor':>8} {'RT/cycle':>9}")
    for label, (seconds, trips) in times.items():
        print(f"  {label:<34} {seconds / floor:>8.2f} {trips:>9.1f}")
        ok = seconds / floor <= 1.10 if label.startswith("aiolease") else None
        target = "<= 1.10" if ok is not None else ""
        record(
            "redis",
            "uncontended acquire+release",
            label,
            seconds / floor,
            "x floor",
            target=target,
            ok=ok,
        )
    ratio, trips = times["aiolease"][0] / floor, times["aiolease"][1]
    best = min((times[p][0] / floor, p) for p in peers) if peers else (float("nan"), "-")
    report.target(
        "uncontended acquire+release (token incl.)",
        "<= 1.10 x floor, 2 round trips",
        f"{ratio:.2f}x, {trips:.1f} RT (best peer {best[0]:.2f}x)",
        ratio <= 1.10 and trips <= 2.0,
    )


async def transport_figure(args: argparse.Namespace, report: Report) -> None:
    times = await transports(args.url, args.cycles)
    print(f"\n{'aiolease acquire+release, by transport':<36} {'median':>8}")
    for label, seconds in times.items():
        print(f"  {label:<34} {seconds * 1e6:>6.0f} us")
    ratio = times["redis-py"] / times["lean"]
    print(f"  {'redis-py / lean':<34} {ratio:>8.2f}")
    report.target(
        "lean transport (uncontended acquire+release)",
        ">= 1.10 x faster than redis-py's",
        f"{ratio:.2f}x",
        ratio >= 1.10,
    )


async def handoff_figures(args: argparse.Namespace, peers: Sequence[str], report: Report) -> None:
    url = args.url
    kinds = wanted(args, ["floor", "aiolease-fair", "aiolease", *peers])
    figures: dict[str, dict[str, tuple[float, float, int]]] = {"tasks": {}, "procs": {}}
    for where, label in (("tasks", "8 tasks"), ("procs", "4 processes")):
        title = f"hand-offs, {label}, one key, 1 ms"
        print(f"\n{title:<36} {'per s':>8} {'max/min':>8} {'starved':>8}  rounds")
        kinds = quick_cut(kinds, args.quick, ("python-redis-lock",))
        if args.quick:
            print(QUICK_NOTE)
        rounds: dict[str, list[list[int]]] = {kind: [] for kind in kinds}
        for turn in range(args.rounds):
            for kind in kinds[turn % len(kinds) :] + kinds[: turn % len(kinds)]:
                if where == "tasks":
                    name = f"handoff-{kind}-{RUN}-{turn}"
                    counts = await handoffs(kind, url, name, 8, args.seconds)
                else:
                    counts = await handoffs_across_processes(
                        kind, url, 4, args.seconds, args.start_delay
                    )
                rounds[kind].append(counts)
        await close_processes()
        for kind in kinds:
            rates = [sum(counts) / args.seconds for counts in rounds[kind]]
            rate = statistics.median(rates)
            fair = max(fairness(counts) for counts in rounds[kind])
            starved = sum(counts.count(0) for counts in rounds[kind])
            figures[where][kind] = (rate, fair, starved)
            each = " ".join(f"{r:.0f}" for r in rates)
            print(f"  {kind:<34} {rate:>8.0f} {fair:>8.2f} {starved:>8}  {each}")
            record("redis", title, kind, rate, "/s")
            record("redis", title + ": fairness", kind, fair, "max/min")
        if "aiolease-fair" not in figures[where]:
            continue
        rate, fair, starved = figures[where]["aiolease-fair"]
        prl = figures[where].get("python-redis-lock", (0.0, 0.0, 0))[0]
        report.target(
            f"hand-offs, {label}, fair=True",
            ">= python-redis-lock, max/min <= 1.5",
            f"{rate:.0f}/s vs {prl:.0f}/s, {fair:.2f}, {starved} starved",
            rate >= prl and fair <= 1.5 and starved == 0,
        )


async def failover_figure(args: argparse.Namespace, peers: Sequence[str], report: Report) -> None:
    url = args.url
    label = f"crash failover, ttl {args.failover_ttl:g} s"
    print(f"\n{label:<36} {'expiry->acquire':>16}")
    gaps: dict[str, float] = {}
    if args.quick:
        print(QUICK_NOTE)
    for kind in quick_cut(("floor", "aiolease", "aiolease-fair", *peers), args.quick):
        runs = [await failover(kind, url, args.failover_ttl) for _ in range(args.failovers)]
        gaps[kind] = statistics.median(runs)
        print(f"  {kind:<34} {gaps[kind] * 1000:>13.1f} ms")
        ok = gaps[kind] <= 0.020 if kind.startswith("aiolease") else None
        record(
            "redis",
            label + ": expiry to acquire",
            kind,
            gaps[kind] * 1000,
            "ms",
            target="<= 20" if ok is not None else "",
            ok=ok,
        )
    worst = max(gaps["aiolease"], gaps["aiolease-fair"])
    report.target(
        label,
        "<= 20 ms after server-side expiry",
        f"{gaps['aiolease'] * 1000:.1f} ms, fair {gaps['aiolease-fair'] * 1000:.1f} ms",
        worst <= 0.020,
    )


async def held_figure(args: argparse.Namespace, peers: Sequence[str], report: Report) -> None:
    url = args.url
    title = f"{args.held} leases held, ttl 3 s, {args.held_seconds:g} s"
    head = f"{'RT/s':>8} {'renew RT/s':>10} {'reads/s':>8} {'CPU s/s':>8} {'lost':>6}"
    print(f"\n{title:<36} {head}")
    found: dict[str, tuple[float, float, float, float, int]] = {}
    if args.quick:
        print(QUICK_NOTE)
    for kind in quick_cut(("floor", "aiolease", *peers), args.quick, ("redis-py",)):
        found[kind] = await held(kind, url, args.held, args.held_seconds, args.settle)
        rate, renew, reads, cpu, lost = found[kind]
        print(f"  {kind:<34} {rate:>8.1f} {renew:>10.1f} {reads:>8.1f} {cpu:>8.3f} {lost:>6}")
        record("redis", title + ": renewal round trips", kind, renew, "/s")
        record("redis", title + ": CPU", kind, cpu, "CPU s/s")
        record("redis", title + ": lost", kind, lost, "")
    rate, renew, reads, cpu, lost = found["aiolease"]
    base = found.get("redis-py", (0.0, 0.0, 0.0, float("nan"), 0))[3]
    report.target(
        f"{args.held} leases held, ttl 3 s",
        "<= 2 RT/s; CPU <= 1/3 redis-py's; 0 lost",
        f"{renew:.1f} renew RT/s ({rate:.0f} all), CPU {cpu / base:.2f}x, {lost} lost",
        renew <= 2 and cpu <= base / 3 and lost == 0,
    )


async def permit_figure(args: argparse.Namespace, report: Report) -> None:
    """Issue 23's figures (``_permits.py``) on one aiolease backend, with pottery's and
    grelmicro's locks beside ours where they install."""
    url = args.url
    sizes = PermitSizes.of(args, args.settle)
    async with AsyncExitStack() as stack:
        ours = Contender("aiolease", url, stack)
        await ours.start()
        backend = ours.backend
        assert isinstance(backend, RedisBackend)
        peers: dict[str, PeerLock] = {}
        notes = ["pottery has no semaphore and no read-write lock: its AIORedlock is shown"]
        if "pottery" not in args.skip:
            pottery = Contender("pottery", url, stack)
            await pottery.start()
            peers["pottery"] = PeerLock(make_cycle(pottery), pottery.once, HOW["pottery"])
        if "grelmicro" not in args.skip:
            try:
                peers["grelmicro"] = await grelmicro_peer("redis", url, stack)
            except ImportError:
                notes.append("grelmicro: not installed (pip install 'grelmicro[redis]')")

        async def batches() -> float:
            return backend.statistics().batches

        # The INFO that reads the server's count is a write of this process and a read
        # of the server's: neither is counted.
        own = [0]
        server_reads(url)  # connected before the window

        async def writes() -> float:
            return Sends.count - own[0]

        async def reads() -> float:
            count = server_reads(url)
            own[0] += 1
            return count - own[0]

        summary = await permit_figures(
            "redis",
            backend,
            sizes,
            peers=peers,
            counters={
                "renewal round trips": batches,
                "socket writes": writes,
                "server reads": reads,
            },
            tick_target="renewal round trips",
            notes=notes,
        )
    for row in summary.rows:
        report.rows.append(row)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default=os.environ.get("AIOLEASE_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    add_figure_arguments(parser)
    parser.add_argument("--failover-ttl", type=float, default=2.0)
    parser.add_argument("--start-delay", type=float, default=0.3, help=argparse.SUPPRESS)
    parser.add_argument("--settle", type=float, default=3.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--skip",
        type=lambda s: s.split(","),
        default=[],
        help=f"peers: {','.join(PEERS)},grelmicro",
    )
    parser.add_argument(
        "--only",
        choices=("uncontended", "transports", "handoffs", "failover", "held", "permits"),
        help="run this figure alone",
    )
    parser.add_argument(
        "--kinds",
        type=lambda s: s.split(","),
        help="contenders to run (default all): floor,aiolease,aiolease-fair and peers",
    )
    parser.add_argument("--spawn-server", action="store_true", help="use a private server")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the hand-off figures")
    parser.add_argument("--quick", action="store_true", help="fewer cycles, shorter figures")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--ttl", type=float, default=2.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None and args.worker.startswith("hold-"):
        asyncio.run(hold_forever(args.worker.removeprefix("hold-"), args.url, args.name, args.ttl))
    elif args.worker == "serve":
        serve_jobs(lambda kind, name: worker(kind, args.url, name, args.seconds))
    else:
        unknown = set(args.skip) - {*PEERS, "grelmicro"}
        if unknown:
            parser.error(f"--skip: unknown peers {sorted(unknown)}; known: {', '.join(PEERS)}")
        unknown = set(args.kinds or ()) - set(HOW)
        if unknown:
            parser.error(f"--kinds: unknown {sorted(unknown)}; known: {', '.join(HOW)}")
        if args.quick:
            args.cycles, args.seconds, args.failovers, args.rounds = 100, 0.5, 1, 1
            args.held, args.held_seconds, args.settle = 100, 1.5, 0.5
            args.failover_ttl = 1.0
        Sends.install()
        if args.spawn_server:
            with spawned_server() as args.url:
                asyncio.run(main(args))
        else:
            asyncio.run(main(args))
