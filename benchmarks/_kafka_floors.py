"""The raw floor of Kafka's group protocol under ``bench_kafka.py``'s two hand-offs.

Two plain aiokafka consumers (no aiolease code) in one group, subscribed to a
one-partition topic, with aiolease's group settings: the session timeout, a rebalance
timeout equal to it, the same heartbeat interval. The member assigned partition 0
"leads". Their assignor gives it to the oldest member, as aiolease's does (the one
that waited longest), so that the second member's join leaves the first one leading.
Once the second member is a stable follower (it has its empty assignment, the first
has partition 0 again):

* **leave** (:func:`raw_resign`): the leader's ``consumer.stop()`` (a LeaveGroup);
  the time from the call to the follower's ``on_partitions_assigned`` with partition
  0. That is what a rebalance started by a leave costs when the other member learns
  of it at its next heartbeat, as Kafka's classic group protocol has it learn;
* **kill** (:func:`raw_kill`): the leader runs in a child process, killed with
  SIGKILL; the time from the kill to the same callback.

Both start right after the follower's SyncGroup, as ``bench_kafka.py``'s aiolease
figures do, so the follower's next heartbeat is a whole interval away in both.

Run as a script, it is the child process of :func:`raw_kill`:
``python _kafka_floors.py URL TOPIC SESSION HEARTBEAT`` prints ``lead`` each time
it is assigned partition 0, and waits to be killed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import urlsplit

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)

__all__ = ["raw_kill", "raw_resign"]

# Every rebalance makes aiokafka warn ("Heartbeat failed ... because it is
# rebalancing"): here rebalances are the point.
logging.getLogger("aiokafka").setLevel(logging.ERROR)

#: Seconds any one step may take before the figure fails (never a hang).
PATIENCE = 120.0


def servers(url: str) -> str:
    """The bootstrap servers of a ``kafka://`` URL (without user or options)."""
    return urlsplit(url).netloc.rsplit("@", 1)[-1]


def oldest_first(since: float) -> type[AbstractPartitionAssignor]:
    """An assignor that gives partition 0 to the member that started first (each
    member says when, in its user data: ``time.monotonic()``, one clock per host)."""

    class OldestFirst(AbstractPartitionAssignor):  # type: ignore[misc]
        name = "bench-oldest-first"
        version = 0

        @classmethod
        def metadata(cls, topics: Iterable[str]) -> Any:
            return ConsumerProtocolMemberMetadata(cls.version, sorted(topics), repr(since).encode())

        @classmethod
        def assign(cls, cluster: Any, members: Mapping[str, Any]) -> dict[str, Any]:
            oldest = min(members, key=lambda member: float(members[member].user_data))
            return {
                member: ConsumerProtocolMemberAssignment(
                    cls.version,
                    [(topic, [0]) for topic in meta.subscription] if member == oldest else [],
                    b"",
                )
                for member, meta in members.items()
            }

        @classmethod
        def on_assignment(cls, assignment: Any) -> None:
            pass

    return OldestFirst


class Seat(ConsumerRebalanceListener):  # type: ignore[misc]
    """A member's assignments as they come: (when, whether it holds partition 0)."""

    def __init__(self, topic: str) -> None:
        self.partition = TopicPartition(topic, 0)
        self.assignments: asyncio.Queue[tuple[float, bool]] = asyncio.Queue()

    def on_partitions_revoked(self, revoked: Any) -> None:
        pass

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.assignments.put_nowait((time.monotonic(), self.partition in assigned))

    async def next(self, leads: bool) -> float:
        """When the next assignment that gives (or, ``leads=False``, does not give)
        partition 0 came."""
        while True:
            at, got = await asyncio.wait_for(self.assignments.get(), PATIENCE)
            if got == leads:
                return at


async def member(
    url: str, topic: str, session: float, heartbeat: float, stack: AsyncExitStack
) -> tuple[AIOKafkaConsumer, Seat]:
    """A started member of the group ``topic`` (closed with ``stack``), and its seat."""
    seat = Seat(topic)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=servers(url),
        group_id=topic,
        session_timeout_ms=int(session * 1000),
        rebalance_timeout_ms=int(session * 1000),  # as aiolease's members
        heartbeat_interval_ms=int(heartbeat * 1000),
        enable_auto_commit=False,
        partition_assignment_strategy=(oldest_first(time.monotonic()),),
    )
    consumer.subscribe([topic], listener=seat)
    await consumer.start()
    stack.push_async_callback(consumer.stop)  # a second stop() does nothing
    return consumer, seat


async def new_topic(url: str) -> str:
    """A new one-partition topic (also the group's name)."""
    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=servers(url))
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    return topic


async def raw_resign(url: str, session: float, heartbeat: float, phase: float = 0.0) -> float:
    """Seconds from the leading member's ``stop()`` (its LeaveGroup), ``phase`` seconds
    after the follower's sync (where its heartbeat cycle starts), to the follower's
    assignment of partition 0."""
    topic = await new_topic(url)
    async with AsyncExitStack() as stack:
        first, first_seat = await member(url, topic, session, heartbeat, stack)
        await first_seat.next(leads=True)
        _, second_seat = await member(url, topic, session, heartbeat, stack)
        synced = await second_seat.next(leads=False)
        await first_seat.next(leads=True)  # the first leads again, in the new generation
        await asyncio.sleep(max(0.0, synced + phase - time.monotonic()))
        left = time.monotonic()
        await first.stop()
        return await second_seat.next(leads=True) - left


async def raw_kill(url: str, session: float, heartbeat: float, phase: float = 0.0) -> float:
    """Seconds from the SIGKILL of the leading member's process, ``phase`` seconds
    after the follower's sync, to the follower's assignment of partition 0."""
    topic = await new_topic(url)
    command = [sys.executable, __file__, url, topic, repr(session), repr(heartbeat)]
    leader = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
    try:
        await lead(leader)
        async with AsyncExitStack() as stack:
            _, seat = await member(url, topic, session, heartbeat, stack)
            synced = await seat.next(leads=False)
            await lead(leader)  # it leads again, in the new generation
            await asyncio.sleep(max(0.0, synced + phase - time.monotonic()))
            killed = time.monotonic()
            leader.send_signal(signal.SIGKILL)
            await leader.wait()
            return await seat.next(leads=True) - killed
    finally:
        if leader.returncode is None:
            leader.kill()
            await leader.wait()


async def lead(process: asyncio.subprocess.Process) -> None:
    """Wait until the child process says it leads."""
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), PATIENCE)
    if line.strip() != b"lead":
        raise RuntimeError(f"the raw Kafka member process said {line!r}, not b'lead'")


async def child(url: str, topic: str, session: float, heartbeat: float) -> None:
    async with AsyncExitStack() as stack:
        _, seat = await member(url, topic, session, heartbeat, stack)
        while True:
            await seat.next(leads=True)
            print("lead", flush=True)


if __name__ == "__main__":
    url, topic, session, heartbeat = sys.argv[1:5]
    asyncio.run(child(url, topic, float(session), float(heartbeat)))
