"""Kafka: leader election over consumer-group membership, in one run.

There is no peer library to compare with (none elects a leader over Kafka's group
protocol in Python). The hand-offs are set against the session timeout and the length
of one rebalance, as the issue's targets are, and against the raw floor of the group
protocol itself: two plain aiokafka consumers with aiolease's group settings
(:mod:`_kafka_floors`), one figure of each taken in turn with aiolease's, in a random
order. Prints:

* **one rebalance**: a lone member's JoinGroup + SyncGroup (Tansu makes every
  rebalance wait half the rebalance timeout, which aiolease sets to the session
  timeout; Apache Kafka waits only on a group's first join, and then only
  ``group.initial.rebalance.delay.ms``);
* **SIGKILL failover**: a leader process is killed; the time from the kill to the
  start of the next leader's term (in this process). Target: the session timeout + one
  heartbeat interval + one rebalance (the one measured above), what the classic group
  protocol allows: the coordinator drops the dead leader one session after the last
  heartbeat it had from it (at most a session after the kill), the survivor learns of
  the rebalance only when its next heartbeat is answered "rebalance in progress" (up
  to one interval later: the protocol has no push, and Kafka Connect's workers learn
  of it the same way), then one rebalance. The leader and the survivor sync together
  (Tansu answers a generation's SyncGroups at once), so their heartbeat cycles are in
  step and the survivor's heartbeat falls right at the dead leader's expiry: noise
  decides whether it sees it or waits one more interval. The leader is killed half
  an interval after the survivor's sync (the raw floor's at the same point), so the
  figure is the session + a rebalance, - or + half an interval, under the target
  either way, and one avoidable interval more misses it. The issue's "session + one rebalance" is
  printed beside it, and the **raw kill floor** (an aiokafka member killed, the time
  to the other's ``on_partitions_assigned`` with partition 0), with aiolease's figure
  as a multiple of it;
* **resign hand-off**: the time from ``resign()`` to the start of the next term.
  Target: one rebalance (measured above) + one heartbeat interval. A LeaveGroup starts
  the rebalance at once, but the follower learns of it only at its next heartbeat (up
  to a whole interval), which no client of the classic group protocol can avoid: a
  rebalance started by a leave lasts until every member has rejoined. The leader
  resigns half an interval after the follower's sync (where its heartbeat cycle
  starts), the middle of the cycle, so that the figure is about one rebalance + half
  an interval and one avoidable interval more would miss the target (right after the
  sync, the worst case, it lands on the target itself, within noise). The **raw
  leave floor** (an aiokafka member's ``stop()``, its LeaveGroup, at the same point
  of the cycle, to the other's assignment of partition 0) is printed beside it, with
  a second check:
  aiolease within the floor + half a heartbeat interval (what aiolease adds after the
  rebalance, the token's commit, the leader record, the grant's heartbeat, is a few
  milliseconds whatever the session; one more heartbeat interval would be the
  avoidable delay to catch);
* **CPU seconds per second** of a leader process and of an idle follower process
  (both heartbeating), from ``/proc``.

Usage: ``python benchmarks/bench_kafka.py [--url kafka://127.0.0.1:9092] [--quick]``
(``--session 6`` sets the session timeout, default 6 s; ``--heartbeat S`` the
heartbeat interval, default the backend's, a tenth of the session; ``--failovers``
the kills and resigns of aiolease, default 3; ``--raw-kills``, ``--raw-resigns`` the
raw floors', default as many; ``--quick``: 1 s sessions, one rebalance measured, not
two, one kill and one resign of aiolease, one raw leave floor (about 4 s) and no
raw kill floor (about 5 s each; ``--raw-kills N`` takes them), CPU over 2 s unless
``--cpu-seconds`` says otherwise). Needs ``pip install aiolease[kafka]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any

from _common import record, verdict
from _kafka_floors import raw_kill, raw_resign

from aiolease import Elector, Lease, open_backend
from aiolease.abc import Backend
from aiolease.backends.kafka import KafkaBackend
from aiolease.backends.kafka._url import HEARTBEAT_SHARE

#: Clock ticks per second of /proc/<pid>/stat.
TICKS = os.sysconf("SC_CLK_TCK")


#: The contenders of the raw floors (:mod:`_kafka_floors`).
RAW_KILL = "raw floor: aiokafka member killed"
RAW_LEAVE = "raw floor: aiokafka member leaves"
#: The resign hand-off may exceed the raw leave floor by this share of a heartbeat
#: interval (see the module's docstring).
SLACK = 0.5

#: The leader resigns this share of a heartbeat interval after the follower's sync, the
#: middle of the follower's heartbeat cycle (see the module's docstring).
PHASE = 0.5

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


async def failover(url: str, session: float, phase: float) -> float:
    """Seconds from a leader's SIGKILL, ``phase`` seconds after the survivor's sync, to
    the start of the next term."""
    prefix, name = f"bench-{uuid.uuid4().hex[:8]}.", "failover"
    leader = await spawn(url, prefix, name, session)
    await expect(leader, "lead")
    async with open_backend(url, **options(prefix, session)) as backend:
        started = await elected_in(backend, name, session, "survivor")
        # Its joining is a rebalance, which ends the leader's term: the leader (which
        # waited longest) leads again, in a new term.
        await expect(leader, "lead")
        await synced(backend, name)
        await asyncio.sleep(phase)
        killed = time.monotonic()
        leader.send_signal(signal.SIGKILL)
        await leader.wait()
        took = await started - killed
        await stop(started)
    return took


async def resign(url: str, session: float, phase: float) -> float:
    """Seconds from the leader's ``resign()``, ``phase`` seconds after the follower's
    sync (where its heartbeat cycle starts), to the start of the next term."""
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
        await asyncio.sleep(phase)
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


async def in_turns(
    runs: Mapping[str, tuple[int, Callable[[], Awaitable[float]]]],
) -> dict[str, list[float]]:
    """Each contender's figures: ``runs[label]`` is how many to take and how, one of
    each per round in a random order (as :func:`_common.take_turns` cycles), so that
    neither the floor nor aiolease always runs right after the other."""
    found: dict[str, list[float]] = {label: [] for label in runs}
    for round_ in range(max(count for count, _ in runs.values())):
        order = [(label, measure) for label, (count, measure) in runs.items() if count > round_]
        random.shuffle(order)
        for label, measure in order:
            found[label].append(await measure())
    return found


def median_of(samples: list[float]) -> str:
    return f"(median of {len(samples)})" if len(samples) > 1 else "(one)"


def each(samples: list[float]) -> str:
    """The samples, as measured (their order is the rounds')."""
    return "   runs: " + ", ".join(f"{sample:.3f}" for sample in samples)


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

    phase = heartbeat * PHASE
    kills = await in_turns(
        {
            "aiolease": (args.failovers, lambda: failover(url, session, phase)),
            RAW_KILL: (args.raw_kills, lambda: raw_kill(url, session, heartbeat, phase)),
        }
    )
    kill = statistics.median(kills["aiolease"])
    target = session + heartbeat + rebalance
    print(
        f"{'SIGKILL -> next leader ' + median_of(kills['aiolease']):<44} {kill:>8.2f} s"
        f"   target <= session + heartbeat + rebalance = {session:g} + {heartbeat:g}"
        f" + {rebalance:.2f} = {target:.2f} s {verdict(kill <= target)}"
        f"   (killed {phase:g} s into the survivor's heartbeat cycle; session + rebalance ="
        f" {session + rebalance:.2f} s)" + each(kills["aiolease"])
    )
    record(
        "kafka",
        "SIGKILL to next leader",
        "aiolease",
        kill,
        "s",
        target=f"<= {target:.2f} (session + heartbeat + rebalance)",
        ok=kill <= target,
    )
    if kills[RAW_KILL]:
        floor = statistics.median(kills[RAW_KILL])
        print(
            f"{'  ' + RAW_KILL:<44} {floor:>8.2f} s   aiolease: x{kill / floor:.2f} the raw floor"
            + each(kills[RAW_KILL])
        )
        record("kafka", "SIGKILL to next leader", RAW_KILL, floor, "s")
        record("kafka", "SIGKILL to next leader", "aiolease", kill / floor, "x raw floor")
    else:
        print("  raw floor (aiokafka member killed): not measured (--raw-kills 0)")

    hands = await in_turns(
        {
            "aiolease": (args.failovers, lambda: resign(url, session, phase)),
            RAW_LEAVE: (args.raw_resigns, lambda: raw_resign(url, session, heartbeat, phase)),
        }
    )
    hand = statistics.median(hands["aiolease"])
    bound = rebalance + heartbeat
    print(
        f"{'resign() -> next leader ' + median_of(hands['aiolease']):<44} {hand:>8.2f} s"
        f"   target <= rebalance + heartbeat = {rebalance:.2f} + {heartbeat:g} = {bound:.2f} s"
        f" {verdict(hand <= bound)}   (resigned {phase:g} s into the follower's heartbeat"
        f" cycle; rebalance + the rest of the cycle = {rebalance + heartbeat - phase:.2f} s)"
        + each(hands["aiolease"])
    )
    record(
        "kafka",
        "resign() to next leader",
        "aiolease",
        hand,
        "s",
        target=f"<= {bound:.2f} (rebalance + heartbeat)",
        ok=hand <= bound,
    )
    if hands[RAW_LEAVE]:
        floor = statistics.median(hands[RAW_LEAVE])
        allowed = floor + heartbeat * SLACK
        print(
            f"{'  ' + RAW_LEAVE:<44} {floor:>8.2f} s   aiolease: x{hand / floor:.2f} the raw"
            f" floor; <= floor + {SLACK:g} heartbeat = {allowed:.2f} s"
            f" {verdict(hand <= allowed)}" + each(hands[RAW_LEAVE])
        )
        record("kafka", "resign() to next leader", RAW_LEAVE, floor, "s")
        record("kafka", "resign() to next leader", "aiolease", hand / floor, "x raw floor")
    else:
        print("  raw floor (aiokafka member leaves): not measured (--raw-resigns 0)")

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
    parser.add_argument("--raw-resigns", type=int, help="raw leave floors (default --failovers)")
    parser.add_argument("--raw-kills", type=int, help="raw kill floors (default --failovers)")
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
            args.raw_kills = 0 if args.raw_kills is None else args.raw_kills
        args.raw_resigns = args.failovers if args.raw_resigns is None else args.raw_resigns
        args.raw_kills = args.failovers if args.raw_kills is None else args.raw_kills
        if args.cpu_seconds is None:
            args.cpu_seconds = 2.0 if args.quick else 10.0
        asyncio.run(main(args))
