"""Kafka: leader election over consumer-group membership, in one run.

There is no peer library to compare with (none elects a leader over Kafka's group
protocol in Python), and no raw floor below the group protocol itself: the figures
are set against the session timeout and the length of one rebalance, as the issue's
targets are. Prints:

* **one rebalance**: a lone member's JoinGroup + SyncGroup (Tansu makes every
  rebalance wait half the rebalance timeout, which aiolease sets to the session
  timeout; Apache Kafka waits only on a group's first join, and then only
  ``group.initial.rebalance.delay.ms``);
* **SIGKILL failover**: a leader process is killed; the time from the kill to the
  start of the next leader's term (in this process), against the session timeout.
  Target: within the session timeout + one rebalance. The coordinator drops the dead
  leader one session after its last heartbeat, and the follower learns of it at its
  own next heartbeat: the bound is the session + one heartbeat interval + one
  rebalance, printed too;
* **resign hand-off**: the time from ``resign()`` to the start of the next term.
  Target: within one rebalance. The follower learns of the rebalance only at its
  next heartbeat, so the hand-off is one rebalance plus up to one heartbeat interval
  (here the whole interval: the leader resigns right after the follower's sync, the
  start of its heartbeat cycle); that second bound is printed too;
* **CPU seconds per second** of a leader process and of an idle follower process
  (both heartbeating), from ``/proc``.

Usage: ``python benchmarks/bench_kafka.py [--url kafka://127.0.0.1:9092] [--quick]``
(``--session 6`` sets the session timeout, default 6 s; ``--heartbeat S`` the
heartbeat interval, default the backend's, a tenth of the session; ``--quick``: 1 s
sessions, one rebalance measured, not two, one failover, CPU over 2 s unless
``--cpu-seconds`` says otherwise). Needs ``pip install aiolease[kafka]``.
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
from contextlib import AsyncExitStack
from typing import Any

from _common import record, verdict

from aiolease import Elector, Lease, open_backend
from aiolease.abc import Backend
from aiolease.backends.kafka import KafkaBackend
from aiolease.backends.kafka._url import HEARTBEAT_SHARE

#: Clock ticks per second of /proc/<pid>/stat.
TICKS = os.sysconf("SC_CLK_TCK")


#: The heartbeat interval of every member, in seconds (``None``: the backend's default).
HEARTBEAT: float | None = None


def options(prefix: str, session: float) -> dict[str, Any]:
    chosen = {} if HEARTBEAT is None else {"heartbeat_interval": HEARTBEAT}
    return {"session_timeout": session, "group_prefix": prefix, "topic_prefix": prefix, **chosen}


async def candidate(url: str, prefix: str, name: str, session: float) -> None:
    """A candidate process: prints ``lead TOKEN`` when elected, ``follow`` once it sees
    another leader; waits to be killed."""
    async with open_backend(url, **options(prefix, session)) as backend:
        me = f"bench-{os.getpid()}"
        elector = Elector(backend, name, ttl=session, identity=me)

        async def work(lease: Lease) -> None:
            print(f"lead {lease.token}", flush=True)
            await asyncio.sleep(3600)

        async def follow() -> None:
            holder = None
            while holder is None or holder.identity in ("", me):
                await backend.wait_changed(name, holder)
                holder = await backend.read(name)
            print("follow", flush=True)

        await asyncio.gather(elector.run(work), follow())


async def spawn(url: str, prefix: str, name: str, session: float) -> asyncio.subprocess.Process:
    command = [sys.executable, __file__, "--url", url, "--worker", prefix, "--name", name]
    if HEARTBEAT is not None:
        command += ["--heartbeat", repr(HEARTBEAT)]
    return await asyncio.create_subprocess_exec(
        *command, "--session", repr(session), stdout=subprocess.PIPE
    )


async def expect(process: asyncio.subprocess.Process, word: str) -> str:
    assert process.stdout is not None
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
        if not line:
            raise RuntimeError(f"the candidate process ended before saying {word!r}")
        if line.startswith(word):
            return line


async def elected_in(
    backend: Backend, name: str, session: float, identity: str
) -> asyncio.Future[float]:
    """Campaign in this process; the future's result is when the term started."""
    started: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    elector = Elector(backend, name, ttl=session, identity=identity)

    async def work(lease: Lease) -> None:
        if not started.done():
            started.set_result(time.monotonic())
        await asyncio.sleep(3600)

    started.task = asyncio.ensure_future(elector.run(work))  # type: ignore[attr-defined]
    return started


async def stop(started: asyncio.Future[float]) -> None:
    """End the campaign of :func:`elected_in` (before its backend closes)."""
    task: asyncio.Task[None] = started.task  # type: ignore[attr-defined]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def synced(backend: Backend, name: str) -> None:
    """Wait until ``backend``'s member of the group of ``name`` is in a generation."""
    assert isinstance(backend, KafkaBackend)
    while backend.statistics().synced < 1:
        await backend.wait_changed(name, await backend.read(name))


async def one_rebalance(url: str, session: float) -> float:
    """A lone member's first join: JoinGroup + SyncGroup (+ the token's commit)."""
    prefix, name = f"bench-{uuid.uuid4().hex[:8]}.", "rebalance"
    async with open_backend(url, **options(prefix, session)) as backend:
        started = time.monotonic()
        async with Elector(backend, name, ttl=session, identity="alone").leadership():
            return time.monotonic() - started


async def failover(url: str, session: float) -> float:
    """Seconds from a leader's SIGKILL to the start of the next term."""
    prefix, name = f"bench-{uuid.uuid4().hex[:8]}.", "failover"
    leader = await spawn(url, prefix, name, session)
    await expect(leader, "lead")
    async with open_backend(url, **options(prefix, session)) as backend:
        started = await elected_in(backend, name, session, "survivor")
        # Its joining is a rebalance, which ends the leader's term: the leader (which
        # waited longest) leads again, in a new term.
        await expect(leader, "lead")
        await synced(backend, name)
        killed = time.monotonic()
        leader.send_signal(signal.SIGKILL)
        await leader.wait()
        took = await started - killed
        await stop(started)
    return took


async def resign(url: str, session: float) -> float:
    """Seconds from the leader's ``resign()`` to the start of the next term."""
    prefix, name = f"bench-{uuid.uuid4().hex[:8]}.", "resign"
    async with AsyncExitStack() as stack:
        one = await stack.enter_async_context(open_backend(url, **options(prefix, session)))
        two = await stack.enter_async_context(open_backend(url, **options(prefix, session)))
        first = Elector(one, name, ttl=session, identity="first")
        terms: asyncio.Queue[None] = asyncio.Queue()

        async def work(lease: Lease) -> None:
            terms.put_nowait(None)
            await asyncio.sleep(3600)

        campaign = asyncio.ensure_future(first.run(work))
        await terms.get()
        second = await elected_in(two, name, session, "second")
        # Its joining is a rebalance, which ends the first's term: the first (which
        # waited longest) leads again, in a new term, and resigns that one.
        await terms.get()
        await synced(two, name)
        resigned = time.monotonic()
        await first.resign()
        campaign.cancel()
        await asyncio.gather(campaign, return_exceptions=True)
        took = await second - resigned
        await stop(second)
    return took


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


async def cpu_per_second(url: str, session: float, seconds: float) -> tuple[float, float]:
    """CPU seconds per second of a leader process and of an idle follower process."""
    prefix, name = f"bench-{uuid.uuid4().hex[:8]}.", "cpu"
    leader = await spawn(url, prefix, name, session)
    await expect(leader, "lead")
    follower = await spawn(url, prefix, name, session)
    await expect(follower, "follow")
    try:
        before = [cpu_seconds(p.pid) for p in (leader, follower)]
        await asyncio.sleep(seconds)
        after = [cpu_seconds(p.pid) for p in (leader, follower)]
    finally:
        for process in (leader, follower):
            process.send_signal(signal.SIGKILL)
            await process.wait()
    return (after[0] - before[0]) / seconds, (after[1] - before[1]) / seconds


async def main(args: argparse.Namespace) -> None:
    url, session = args.url, args.session
    heartbeat = HEARTBEAT_SHARE * session if HEARTBEAT is None else HEARTBEAT
    print(
        f"Kafka benchmarks against {url}, session timeout {session:g} s,"
        f" heartbeat interval {heartbeat:g} s\n"
    )
    joins = 1 if args.quick else 2
    rebalance = statistics.median([await one_rebalance(url, session) for _ in range(joins)])
    print(f"{'one rebalance (lone member)':<44} {rebalance:>8.2f} s")
    record("kafka", "one rebalance (lone member)", "aiolease", rebalance, "s")

    kills = [await failover(url, session) for _ in range(args.failovers)]
    kill = statistics.median(kills)
    target = session + rebalance
    print(
        f"{'SIGKILL -> next leader (median of ' + str(len(kills)) + ')':<44} {kill:>8.2f} s"
        f"   target <= session + rebalance = {target:.2f} s {verdict(kill <= target)}"
        f"   (bound: + heartbeat = {target + heartbeat:.2f} s"
        f" {verdict(kill <= target + heartbeat)})"
    )
    record(
        "kafka",
        "SIGKILL to next leader",
        "aiolease",
        kill,
        "s",
        target=f"<= {target:.2f}",
        ok=kill <= target,
    )
    hands = [await resign(url, session) for _ in range(args.failovers)]
    hand = statistics.median(hands)
    print(
        f"{'resign() -> next leader (median of ' + str(len(hands)) + ')':<44} {hand:>8.2f} s"
        f"   target <= rebalance = {rebalance:.2f} s {verdict(hand <= rebalance)}"
        f"   (bound: rebalance + heartbeat = {rebalance + heartbeat:.2f} s"
        f" {verdict(hand <= rebalance + heartbeat)})"
    )
    record(
        "kafka",
        "resign() to next leader",
        "aiolease",
        hand,
        "s",
        target=f"<= {rebalance:.2f}",
        ok=hand <= rebalance,
    )
    lead, follow = await cpu_per_second(url, session, args.cpu_seconds)
    print(f"{'CPU s/s, leader process':<44} {lead:>8.4f}")
    print(f"{'CPU s/s, idle follower process':<44} {follow:>8.4f}")
    record("kafka", "CPU, leader process", "aiolease", lead, "CPU s/s")
    record("kafka", "CPU, idle follower process", "aiolease", follow, "CPU s/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default=os.environ.get("AIOLEASE_KAFKA_URL", "kafka://127.0.0.1:9092")
    )
    parser.add_argument("--session", type=float, default=6.0, help="session timeout, s")
    parser.add_argument("--failovers", type=int, default=3, help="kills and resigns each")
    parser.add_argument("--heartbeat", type=float, help="heartbeat interval, s")
    parser.add_argument("--cpu-seconds", type=float, help="CPU measured over (default 10 s)")
    parser.add_argument("--quick", action="store_true", help="1 s sessions, one of each")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    HEARTBEAT = args.heartbeat
    if args.worker is not None:
        asyncio.run(candidate(args.url, args.worker, args.name, args.session))
    else:
        if args.quick:
            args.session, args.failovers = 1.0, 1
        if args.cpu_seconds is None:
            args.cpu_seconds = 2.0 if args.quick else 10.0
        asyncio.run(main(args))
