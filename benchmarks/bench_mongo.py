"""MongoDB: aiolease against a raw floor and the Python MongoDB locks, in one run.

The floor is pymongo's ``AsyncMongoClient`` with the same write concern (majority):
one ``find_one_and_update`` upsert whose pipeline grants on ``$$NOW`` (free or
expired) to acquire, one owner-checked ``update_one`` to release; a refused floor
acquire polls again every 100 ms. Peers: mongoelector's ``MongoLocker`` (synchronous:
a thread per contender; it polls every 0.25 s, its default). mongolock 1.3.4 installs
but does not run on pymongo 4 (it calls ``Collection.insert``, removed in 4.0): it is
listed as such. Prints, as in the issue's table:

* **uncontended acquire+release**: median per cycle as a ratio to the floor, and the
  commands each cycle sends (counted by pymongo's command monitoring);
* **hand-offs, 8 tasks, then 4 processes, one name, hold 1 ms**: hand-offs per
  second, fairness (most / fewest acquisitions per contender), and the hand-off gap
  p50 (from the releaser's release call to the next holder's grant) beside the same
  figure of aiolease's PostgreSQL backend;
* **crash failover, ttl 2 s** (``--quick``: 1 s): a holder process is ``SIGKILL``ed;
  the time from the server-side expiry (the document's ``expires`` read against
  ``$$NOW``) to a waiter's grant;
* **N leases held** (default 1,000, ttl 15 s, 15 s; ``--quick``: 200, ttl 3 s, 2 s, so
  that the window holds renewals: with ttl 15 s the first come 5 s after the grants):
  commands per second for all the renewals, and leases lost;
* **50 processes waiting on one name**: server operations per second while they
  wait (``serverStatus`` opcounters: run on a quiet server), aiolease against the
  floor polling every 100 ms.

Usage: ``python benchmarks/bench_mongo.py [--url mongodb://...] [--quick]`` (``--help``
for the knobs). Quote ratios from one run; absolute times depend on the machine.
Needs ``pip install aiolease[mongo,postgres] mongoelector`` (``--skip mongoelector``,
``--skip postgres`` without them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import statistics
import subprocess
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
    quick_cut,
    record,
    run_processes,
    run_tasks,
    run_threads,
    serve_jobs,
    start_when_told,
)
from _permits import PermitSizes, permit_figures
from pymongo import AsyncMongoClient, MongoClient, ReturnDocument, monitoring

from aiolease import AsyncLock, open_backend
from aiolease.abc import Backend

DATABASE = "aiolease_bench"
RUN = uuid.uuid4().hex[:8]
#: Hold time of each hand-off.
HOLD = 0.001
#: How often the floor asks again while the name is taken.
POLL = 0.1


#: The commands that read or write leases (not the change streams' ``getMore``, nor the
#: drivers' own ``hello``).
LEASE_COMMANDS = frozenset({"findAndModify", "update", "insert", "delete", "find", "aggregate"})


class Commands(monitoring.CommandListener):
    """Counts the lease commands this process sends (every client made after it is
    registered)."""

    def __init__(self) -> None:
        self.count = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in LEASE_COMMANDS:
            self.count += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


COMMANDS = Commands()
monitoring.register(COMMANDS)


def bench_url(url: str, collection: str, **options: Any) -> str:
    sep = "&" if "?" in url else "?"
    extra = "".join(f"&{k}={v}" for k, v in options.items())
    return f"{url}{sep}collection={collection}{extra}".replace("/aiolease?", f"/{DATABASE}?")


def client_url(url: str) -> str:
    return url.replace("/aiolease?", f"/{DATABASE}?")


# -- the floor -------------------------------------------------------------------------


class Floor:
    """The raw floor: one upsert that grants on ``$$NOW``, one owner-checked release."""

    def __init__(self, url: str, collection: str = "floor") -> None:
        self.client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            client_url(url), w="majority"
        )
        self.coll = self.client[DATABASE][collection]

    async def acquire(self, name: str, owner: str, ttl: float) -> bool:
        free = {"$or": [{"$eq": [{"$type": "$owner"}, "missing"]}, {"$lte": ["$expires", "$$NOW"]}]}
        pipeline = [
            {"$set": {"_free": free}},
            {
                "$set": {
                    "owner": {"$cond": ["$_free", owner, "$owner"]},
                    "token": {
                        "$cond": ["$_free", {"$add": [{"$ifNull": ["$token", 0]}, 1]}, "$token"]
                    },
                    "expires": {
                        "$cond": ["$_free", {"$add": ["$$NOW", int(ttl * 1000)]}, "$expires"]
                    },
                }
            },
            {"$unset": "_free"},
        ]
        doc = await self.coll.find_one_and_update(
            {"_id": name}, pipeline, upsert=True, return_document=ReturnDocument.AFTER
        )
        return bool(doc and doc.get("owner") == owner)

    async def release(self, name: str, owner: str) -> None:
        await self.coll.update_one(
            {"_id": name, "owner": owner}, {"$unset": {"owner": "", "expires": ""}}
        )

    async def wait_acquire(self, name: str, owner: str, ttl: float) -> None:
        while not await self.acquire(name, owner, ttl):  # noqa: ASYNC110 - the floor polls
            await asyncio.sleep(POLL)

    async def close(self) -> None:
        await self.client.close()


def locker(url: str, name: str, ttl: float) -> Any:
    """mongoelector's lock on ``name`` (its own synchronous client)."""
    from mongoelector import MongoLocker

    client: MongoClient[dict[str, Any]] = MongoClient(client_url(url), w="majority")
    return MongoLocker(name, client[DATABASE], dbcollection="mongoelector", ttl=ttl)


def mongolock_works(url: str) -> str:
    try:
        import mongolock
    except ImportError:
        return "not installed"
    try:
        mongolock.MongoLock(client_url(url), db=DATABASE).lock(f"probe-{RUN}", "me", expire=5)
    except Exception as exc:
        return f"does not run: {type(exc).__name__}: {str(exc)[:70]}"
    return "runs"


# -- uncontended -------------------------------------------------------------------------


async def uncontended(url: str, cycles: int, skip: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Median seconds per acquire+release and commands per cycle, by contender; they
    take turns, one cycle each."""
    found: dict[str, list[float]] = {}
    sent: dict[str, int] = {}
    cycle: dict[str, Callable[[], Awaitable[object]]] = {}
    async with AsyncExitStack() as stack:
        floor = Floor(url)
        stack.push_async_callback(floor.close)

        async def floor_cycle() -> None:
            assert await floor.acquire(f"uncontended-{RUN}", "me", 10)
            await floor.release(f"uncontended-{RUN}", "me")

        cycle["raw floor (upsert + update)"] = floor_cycle
        # A collection per contender: a change stream sees only its own backend's writes.
        backend = await stack.enter_async_context(open_backend(bench_url(url, "nowait")))
        lock = AsyncLock(backend, f"uncontended-{RUN}", ttl=10)
        with_block = await stack.enter_async_context(open_backend(bench_url(url, "with")))
        other = AsyncLock(with_block, f"uncontended-with-{RUN}", ttl=10)

        async def nowait() -> None:
            lease = await lock.acquire_nowait()
            await lease.release()

        async def block() -> None:
            async with other:
                pass

        cycle["aiolease acquire_nowait+release"] = nowait
        cycle["aiolease async with"] = block
        quiet = await stack.enter_async_context(open_backend(bench_url(url, "quiet", watch=0)))
        qlock = AsyncLock(quiet, f"uncontended-q-{RUN}", ttl=10)

        async def qnowait() -> None:
            lease = await qlock.acquire_nowait()
            await lease.release()

        cycle["aiolease, no change stream"] = qnowait
        if "mongoelector" not in skip:
            peer = locker(url, f"uncontended-{RUN}", 10)

            async def peer_cycle() -> None:  # blocking calls: the loop waits, as intended
                peer.acquire(blocking=False)
                peer.release()

            cycle["mongoelector MongoLocker"] = peer_cycle
        for _ in range(min(cycles // 10, 50)):
            for one in cycle.values():
                await one()
        for _ in range(cycles):
            for label, one in cycle.items():
                before = COMMANDS.count
                start = time.perf_counter()
                await one()
                found.setdefault(label, []).append(time.perf_counter() - start)
                sent[label] = sent.get(label, 0) + COMMANDS.count - before
    return {k: (statistics.median(v), sent[k] / cycles) for k, v in found.items()}


# -- hand-offs -----------------------------------------------------------------------------


class Gaps:
    """Hand-off gaps in one process: release call -> the next holder's grant."""

    def __init__(self) -> None:
        self.released_at: float | None = None
        self.gaps: list[float] = []

    def granted(self) -> None:
        if self.released_at is not None:
            self.gaps.append(time.monotonic() - self.released_at)
            self.released_at = None

    def releasing(self) -> None:
        self.released_at = time.monotonic()


async def handoffs(
    kind: str, url: str, name: str, tasks: int, seconds: float, gaps: Gaps
) -> list[int]:
    """Acquisitions per task of ``tasks`` tasks of contender ``kind`` on ``name``."""
    async with AsyncExitStack() as stack:
        if kind.startswith("aiolease") or kind == "postgres":
            if kind == "postgres":
                target = os.environ.get(
                    "AIOLEASE_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
                )
            else:
                target = bench_url(url, "handoffs", fair=int(kind == "aiolease-fair"))
            backend: Backend = await stack.enter_async_context(open_backend(target))
            lock = AsyncLock(backend, name, ttl=10)

            def aiolease_once(i: int) -> Callable[[], Awaitable[None]]:
                async def once() -> None:
                    async with lock:
                        gaps.granted()
                        await asyncio.sleep(HOLD)
                        gaps.releasing()

                return once

            return await run_tasks(aiolease_once, tasks, seconds)
        if kind == "floor":
            floor = Floor(url)
            stack.push_async_callback(floor.close)

            def floor_once(i: int) -> Callable[[], Awaitable[None]]:
                owner = uuid.uuid4().hex

                async def once() -> None:
                    await floor.wait_acquire(name, owner, 10)
                    gaps.granted()
                    await asyncio.sleep(HOLD)
                    gaps.releasing()
                    await floor.release(name, owner)

                return once

            return await run_tasks(floor_once, tasks, seconds)
        if kind == "mongoelector":
            return await peer_handoffs(url, name, tasks, seconds, gaps)
    raise ValueError(f"unknown contender {kind!r}")


async def peer_handoffs(url: str, name: str, threads: int, seconds: float, gaps: Gaps) -> list[int]:
    """mongoelector is synchronous: one thread per contender, one lock object each."""
    counts = [0] * threads
    stop = threading.Event()

    def run(i: int) -> None:
        lock = locker(url, name, 10)
        while not stop.is_set():
            try:
                lock.acquire(blocking=True, timeout=0.5)
            except Exception:  # AcquireTimeout
                continue
            gaps.granted()
            time.sleep(HOLD)
            gaps.releasing()
            lock.release()
            counts[i] += 1

    await run_threads(run, threads, stop, seconds)
    return counts


async def handoffs_across_processes(
    kind: str, url: str, processes: int, seconds: float
) -> tuple[list[int], list[float]]:
    """Acquisitions per process (one task each), and every process's gaps."""
    name = f"procs-{kind}-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, __file__, "--url", url, "--worker", "serve"]
    command += ["--seconds", repr(seconds)]
    counts, gaps = [], []
    for last in await run_processes(command, processes, kind, name):
        line = last.split()
        counts.append(int(line[0]))
        gaps.extend(float(g) for g in line[1:])
    return counts, gaps


async def worker(kind: str, url: str, name: str, seconds: float) -> str:
    """One process's job in :func:`handoffs_across_processes`: its acquisitions, and
    the gaps from release calls to its grants (on ``time.monotonic()``, one clock for
    every process of the host: the release times travel through a file per name).
    Connected first, then all processes count the same window."""
    start_when_told()
    shared = Shared(name)
    (count,) = await handoffs(kind, url, name, 1, seconds, shared)
    return " ".join([str(count), *(f"{g:.6f}" for g in shared.gaps)])


class Shared(Gaps):
    """Gaps across processes: the last release time is kept in a small file."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.path = f"/tmp/aiolease-bench-{name}"

    def granted(self) -> None:
        try:
            with open(self.path) as f:
                released = float(f.read() or "nan")
        except (OSError, ValueError):
            return
        if released == released:  # not nan
            self.gaps.append(time.monotonic() - released)

    def releasing(self) -> None:
        with open(self.path, "w") as f:
            f.write(repr(time.monotonic()))


# -- crash failover ------------------------------------------------------------------------


async def hold_forever(kind: str, url: str, name: str, ttl: float) -> None:
    if kind == "floor":
        floor = Floor(url, "failover")
        assert await floor.acquire(name, "dead", ttl)
    else:
        backend = await open_backend(bench_url(url, "failover")).__aenter__()
        await AsyncLock(backend, name, ttl=ttl).acquire()
    print("held", flush=True)
    await asyncio.sleep(3600)


async def server_expiry(url: str, collection: str, name: str) -> float:
    """``time.monotonic()`` at which the document of ``name`` expires on the server."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(client_url(url))
    try:
        sent = time.monotonic()
        cursor = await client[DATABASE][collection].aggregate(
            [
                {"$match": {"_id": name}},
                {"$project": {"left": {"$subtract": ["$expires", "$$NOW"]}}},
            ]
        )
        docs = await cursor.to_list(None)
        return sent + docs[0]["left"] / 1000
    finally:
        await client.close()


async def failover(kind: str, url: str, ttl: float) -> float:
    """One crash failover: seconds from the server-side expiry to the waiter's grant."""
    name = f"failover-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, __file__, "--url", url, "--worker", f"hold-{kind}"]
    holder = await asyncio.create_subprocess_exec(
        *command, "--name", name, "--ttl", repr(ttl), stdout=subprocess.PIPE
    )
    assert holder.stdout is not None
    assert (await holder.stdout.readline()).strip() == b"held"
    async with AsyncExitStack() as stack:
        if kind == "floor":
            floor = Floor(url, "failover")
            stack.push_async_callback(floor.close)

            async def acquire() -> float:
                await floor.wait_acquire(name, "waiter", ttl)
                return time.monotonic()
        else:
            backend = await stack.enter_async_context(open_backend(bench_url(url, "failover")))

            async def acquire() -> float:
                lease = await AsyncLock(backend, name, ttl=ttl).acquire()
                got = time.monotonic()
                await lease.release()
                return got

        acquired = asyncio.ensure_future(acquire())
        await asyncio.sleep(0.3)  # the waiter is waiting
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
        expires = await server_expiry(url, "failover", name)
        return await acquired - expires


# -- many leases held ----------------------------------------------------------------------


async def held(
    url: str, count: int, seconds: float, settle: float, ttl: float = 15.0
) -> tuple[float, int]:
    """Hold ``count`` leases (``ttl``) through one backend for ``seconds``: (commands
    per second this process sent, leases lost)."""
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(open_backend(bench_url(url, "held")))
        names = [f"held-{RUN}-{i}" for i in range(count)]
        leases = await hold_in_tasks(backend, names, ttl, stack)
        async with idle():
            await asyncio.sleep(settle)
            before, wall = COMMANDS.count, time.monotonic()
            await asyncio.sleep(seconds)
            rate = (COMMANDS.count - before) / (time.monotonic() - wall)
        return rate, sum(lease.lost is not None for lease in leases)


# -- waiting processes ---------------------------------------------------------------------


def server_ops(url: str) -> int:
    with MongoClient(client_url(url)) as client:
        counters = client.admin.command("serverStatus")["opcounters"]
    return int(sum(counters.values()))


async def waiting(
    kind: str, url: str, processes: int, seconds: float, settle: float = 2.0
) -> float:
    """Server operations per second while ``processes`` processes wait for a name held
    all along (a quiet server: every client's operations count), counted from
    ``settle`` seconds after the last one said it waits."""
    name = f"waiting-{kind}-{uuid.uuid4().hex[:6]}"
    async with AsyncExitStack() as stack:
        if kind == "floor":
            floor = Floor(url, "waiting")
            stack.push_async_callback(floor.close)
            assert await floor.acquire(name, "holder", 600)
        else:
            backend = await stack.enter_async_context(open_backend(bench_url(url, "waiting")))
            await stack.enter_async_context(AsyncLock(backend, name, ttl=600))
        command = [sys.executable, __file__, "--url", url, "--worker", f"wait-{kind}"]
        children = [
            await asyncio.create_subprocess_exec(*command, "--name", name, stdout=subprocess.PIPE)
            for _ in range(processes)
        ]
        try:
            for child in children:
                assert child.stdout is not None
                assert (await child.stdout.readline()).strip() == b"waiting"
            async with idle():
                await asyncio.sleep(settle)  # every waiter settled into its wait
                before, wall = server_ops(url), time.monotonic()
                await asyncio.sleep(seconds)
                ops = (server_ops(url) - before - 1) / (time.monotonic() - wall)
            return ops
        finally:
            for child in children:
                child.kill()
                await child.wait()


async def wait_forever(kind: str, url: str, name: str) -> None:
    if kind == "floor":
        floor = Floor(url, "waiting")
        print("waiting", flush=True)
        await floor.wait_acquire(name, uuid.uuid4().hex, 600)
    else:
        async with open_backend(bench_url(url, "waiting")) as backend:
            print("waiting", flush=True)
            await AsyncLock(backend, name, ttl=600).acquire()
    await asyncio.sleep(3600)


# -- the run -------------------------------------------------------------------------------


def p50_ms(gaps: Sequence[float]) -> str:
    return f"{statistics.median(gaps) * 1000:.1f}" if gaps else "-"


async def permits(url: str, args: argparse.Namespace) -> None:
    """Issue 23's figures (``_permits.py``): permits against this backend's lock, on one
    backend object; renewals counted as the backend's renew commands per tick."""
    async with open_backend(bench_url(url, "permits")) as backend:
        stats: Any = backend

        async def renew_commands() -> float:
            return float(stats.statistics().renew_commands)

        sizes = PermitSizes.of(args, settle=3.0)
        if args.permits_held is not None:
            sizes = dataclasses.replace(sizes, held=args.permits_held)
        await permit_figures(
            "MongoDB",
            backend,
            sizes,
            counters={"renew commands": renew_commands},
            tick_target="renew commands",
            notes=["mongolock and mongoelector have no semaphore and no read-write lock"],
        )


async def main(args: argparse.Namespace) -> None:
    url, skip = args.url, args.skip
    print(f"MongoDB benchmarks against {url} (ratios from this run only)")
    if args.only == "permits":
        await permits(url, args)
        return
    print(f"mongolock 1.3.4: {mongolock_works(url)}\n")
    times = await uncontended(url, args.cycles, skip)
    floor, floor_sent = times["raw floor (upsert + update)"]
    print(f"{'uncontended acquire+release':<36} {'x floor':>8} {'commands':>9}")
    for label, (seconds, sent) in times.items():
        print(f"  {label:<34} {seconds / floor:>8.2f} {sent:>9.1f}")
        ok = seconds / floor <= 1.10 if label.startswith("aiolease") else None
        record(
            "mongo",
            "uncontended acquire+release",
            label,
            seconds / floor,
            "x floor",
            target="<= 1.10" if ok is not None else "",
            ok=ok,
        )
    print(f"  (floor: {floor * 1000:.2f} ms per cycle, {floor_sent:.0f} commands)")
    if args.only == "uncontended":
        return

    kinds = ["floor", "aiolease-fair", "aiolease"] + [
        k for k in ("mongoelector", "postgres") if k not in skip
    ]
    print(
        f"\n{'hand-offs, 8 tasks, one name, 1 ms':<36} {'per s':>8} {'max/min':>8} {'gap p50':>10}"
    )
    if args.quick:
        print(QUICK_NOTE)
    for kind in quick_cut(kinds, args.quick):
        gaps = Gaps()
        counts = await handoffs(kind, url, f"handoff-{kind}-{RUN}", 8, args.seconds, gaps)
        label = "postgres (aiolease, for the gap)" if kind == "postgres" else kind
        print(
            f"  {label:<34} {sum(counts) / args.seconds:>8.0f} {fairness(counts):>8.2f}"
            f" {p50_ms(gaps.gaps):>7} ms"
        )
        figure = "hand-offs, 8 tasks, one name, 1 ms"
        record("mongo", figure, label, sum(counts) / args.seconds, "/s")
        record("mongo", figure + ": fairness", label, fairness(counts), "max/min")
    print(f"{'hand-offs, 4 processes, one name':<36} {'per s':>8} {'max/min':>8} {'gap p50':>10}")
    if args.quick:
        print(QUICK_NOTE)
    across = ["floor", "aiolease-fair", "aiolease"] + (
        ["postgres"] if "postgres" not in skip else []
    )
    for kind in quick_cut(across, args.quick):
        counts, gaps_ = await handoffs_across_processes(kind, url, 4, args.seconds)
        label = "postgres (aiolease, for the gap)" if kind == "postgres" else kind
        print(
            f"  {label:<34} {sum(counts) / args.seconds:>8.0f} {fairness(counts):>8.2f}"
            f" {p50_ms(gaps_):>7} ms"
        )
        figure = "hand-offs, 4 processes, one name, 1 ms"
        record("mongo", figure, label, sum(counts) / args.seconds, "/s")
        record("mongo", figure + ": fairness", label, fairness(counts), "max/min")
    await close_processes()

    title = f"crash failover, ttl {args.failover_ttl:g} s"
    print(f"\n{title:<36} {'expiry->grant':>14}")
    for kind in ("floor", "aiolease"):
        runs = [await failover(kind, url, args.failover_ttl) for _ in range(args.failovers)]
        print(f"  {kind:<34} {statistics.median(runs) * 1000:>11.1f} ms")
        record(
            "mongo",
            title + ": expiry to grant",
            kind,
            statistics.median(runs) * 1000,
            "ms",
        )

    ttl, settle = (3.0, 1.0) if args.quick else (15.0, 6.0)
    print(f"\n{f'{args.held} leases held, ttl {ttl:g} s':<36} {'cmd/s':>8} {'lost':>6}")
    rate, lost = await held(url, args.held, args.held_seconds, settle, ttl)
    print(f"  {'aiolease (one backend)':<34} {rate:>8.2f} {lost:>6}")
    figure = f"{args.held} leases held"
    record("mongo", figure + ": commands", "aiolease", rate, "/s", target="<= 2")
    record("mongo", figure + ": lost", "aiolease", lost, "", target="0")

    print(f"\n{f'{args.waiters} processes waiting on one name':<36} {'server ops/s':>13}")
    for kind in ("floor", "aiolease"):
        ops = await waiting(kind, url, args.waiters, args.seconds * 2, 1.0 if args.quick else 2.0)
        label = "floor (polls every 100 ms)" if kind == "floor" else kind
        print(f"  {label:<34} {ops:>13.1f}")
        record("mongo", f"{args.waiters} processes waiting on one name", label, ops, "ops/s")
    await permits(url, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "AIOLEASE_MONGO_URL", "mongodb://127.0.0.1:27017/aiolease?replicaSet=rs0"
        ),
    )
    add_figure_arguments(parser)
    parser.add_argument("--waiters", type=int, default=50, help="waiting processes")
    parser.add_argument(
        "--permits-held",
        type=int,
        help="permits held at once (default: --held; granting 1,000 on one name takes"
        " minutes on a loaded machine)",
    )
    parser.add_argument("--skip", action="append", default=[], choices=["mongoelector", "postgres"])
    parser.add_argument("--quick", action="store_true", help="fewer cycles, shorter figures")
    parser.add_argument(
        "--only", choices=["uncontended", "permits"], help="print these figures only"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--ttl", type=float, default=2.0, help=argparse.SUPPRESS)
    parser.add_argument("--failover-ttl", type=float, default=2.0, help="crash failover's ttl")
    args = parser.parse_args()
    if args.worker is not None and args.worker.startswith("hold-"):
        asyncio.run(hold_forever(args.worker.removeprefix("hold-"), args.url, args.name, args.ttl))
    elif args.worker is not None and args.worker.startswith("wait-"):
        asyncio.run(wait_forever(args.worker.removeprefix("wait-"), args.url, args.name))
    elif args.worker == "serve":
        serve_jobs(lambda kind, name: worker(kind, args.url, name, args.seconds))
    else:
        if args.quick:
            args.cycles, args.seconds, args.failovers, args.failover_ttl = 100, 1.0, 1, 1.0
            args.held, args.held_seconds, args.waiters = 200, 2.0, 4
        asyncio.run(main(args))
