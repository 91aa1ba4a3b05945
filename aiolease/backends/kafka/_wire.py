"""Requests to the brokers over aiokafka's client, with every driver error mapped.

The group protocol is spoken here directly (JoinGroup, SyncGroup, Heartbeat,
LeaveGroup, OffsetCommit, OffsetFetch, DescribeGroups, CreateTopics), not through
``AIOKafkaConsumer``: the backend must know the send time of every heartbeat the
coordinator answered, and must step down *before* it rejoins a rebalance, and the
consumer hides both. aiokafka's client still does the connections, the security
settings, the metadata and the choice of request versions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka.errors import KafkaError
from aiokafka.protocol.admin import CreateTopicsRequest, DescribeGroupsRequest
from aiokafka.protocol.commit import OffsetCommitRequest, OffsetFetchRequest
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.group import (
    HeartbeatRequest,
    JoinGroupRequest,
    LeaveGroupRequest,
    SyncGroupRequest,
)
from aiokafka.protocol.offset import OffsetRequest
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import TopicPartition

from ..._exceptions import BackendTimeout, BackendUnavailable, InvalidArgument
from .._asyncio import timeout_after

__all__ = [
    "COORDINATOR_MOVED",
    "ILLEGAL_GENERATION",
    "MEMBER_ID_REQUIRED",
    "NO_ERROR",
    "REBALANCE_IN_PROGRESS",
    "UNKNOWN_MEMBER_ID",
    "UNKNOWN_TOPIC",
    "Wire",
]

NO_ERROR = 0
UNKNOWN_TOPIC = 3
ILLEGAL_GENERATION = 22
UNKNOWN_MEMBER_ID = 25
REBALANCE_IN_PROGRESS = 27
MEMBER_ID_REQUIRED = 79
#: GROUP_LOAD_IN_PROGRESS, COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR: ask again where.
COORDINATOR_MOVED = frozenset({14, 15, 16})
_TOPIC_EXISTS = 36
#: Codes that say the argument is wrong, not the broker: INVALID_TOPIC_EXCEPTION,
#: INVALID_GROUP_ID, INVALID_SESSION_TIMEOUT, INVALID_REPLICATION_FACTOR.
_INVALID = {17: "topic name", 24: "group id", 26: "session timeout", 38: "replication factor"}
_CONSUMER = "consumer"
#: The name of the assignment protocol every member offers (the assignor of :mod:`._group`).
PROTOCOL = "aiolease-leader"


def refused(code: int, what: str) -> Exception:
    """The typed error for a broker's error ``code`` in the answer to ``what``."""
    if code in _INVALID:
        return InvalidArgument(f"the Kafka broker refused the {_INVALID[code]} of {what}")
    return BackendUnavailable(f"the Kafka broker answered {what} with error code {code}")


class Wire:
    """One aiokafka client and the group coordinators found through it.

    :param client: an ``aiokafka.AIOKafkaClient`` (bootstrapped)
    :param timeout: seconds one request may take
    :param described: the brokers, for messages
    """

    def __init__(self, client: Any, timeout: float, described: str) -> None:
        self.client = client
        self.timeout = timeout
        self.described = described
        self._coordinators: dict[str, int] = {}

    async def _send(self, node: int, request: Any, what: str) -> Any:
        try:
            async with timeout_after(self.timeout):
                return await self.client.send(node, request)
        except asyncio.TimeoutError:
            raise BackendTimeout(f"Kafka {what} at {self.described}: no answer in time") from None
        except (KafkaError, OSError) as exc:
            raise BackendUnavailable(f"Kafka {what} at {self.described} failed: {exc!r}") from exc

    async def _coordinator(self, group: str) -> int:
        node = self._coordinators.get(group)
        if node is None:
            try:
                async with timeout_after(self.timeout):
                    node = int(await self.client.coordinator_lookup(0, group))
            except asyncio.TimeoutError:
                raise BackendTimeout(
                    f"Kafka coordinator lookup at {self.described}: no answer in time"
                ) from None
            except (KafkaError, OSError) as exc:
                raise BackendUnavailable(
                    f"Kafka coordinator lookup at {self.described} failed: {exc!r}"
                ) from exc
            self._coordinators[group] = node
        return node

    async def group_call(self, group: str, request: Any, what: str) -> Any:
        """Send ``request`` to the coordinator of ``group``; a connection failure makes
        the next call look the coordinator up again."""
        node = await self._coordinator(group)
        try:
            return await self._send(node, request, what)
        except (BackendUnavailable, BackendTimeout):
            self.moved(group)
            raise

    def moved(self, group: str) -> None:
        """The coordinator of ``group`` said it is not (any more): look it up again."""
        self._coordinators.pop(group, None)

    # -- the group protocol -----------------------------------------------------------

    async def _waiting(self, group: str, request: Any, session: float, what: str) -> Any:
        """Send a request that waits for the other members (JoinGroup, SyncGroup): it
        may take up to the rebalance timeout (the session timeout), not one request's."""
        node = await self._coordinator(group)
        try:
            async with timeout_after(session + self.timeout):
                return await self.client.send(node, request)
        except asyncio.TimeoutError:
            self.moved(group)
            raise BackendTimeout(f"Kafka {what} at {self.described}: no answer") from None
        except (KafkaError, OSError) as exc:
            self.moved(group)
            raise BackendUnavailable(f"Kafka {what} at {self.described}: {exc!r}") from exc

    async def join(self, group: str, member: str, session: float, metadata: bytes) -> Any:
        request = JoinGroupRequest(
            group,
            int(session * 1000),
            int(session * 1000),  # rebalance timeout: a member rejoins within its session
            member,
            None,  # no static membership: an instance id of "" is a real (shared) one
            _CONSUMER,
            [(PROTOCOL, metadata)],
        )
        return await self._waiting(group, request, session, "JoinGroup")

    async def sync(
        self,
        group: str,
        generation: int,
        member: str,
        session: float,
        assignments: list[tuple[str, bytes]],
    ) -> Any:
        request = SyncGroupRequest(group, generation, member, None, assignments)
        return await self._waiting(group, request, session, "SyncGroup")

    async def heartbeat(self, group: str, generation: int, member: str) -> int:
        response = await self.group_call(
            group, HeartbeatRequest(group, generation, member), "Heartbeat"
        )
        return int(response.error_code)

    async def leave(self, group: str, member: str) -> int:
        response = await self.group_call(group, LeaveGroupRequest(group, member), "LeaveGroup")
        return int(response.error_code)

    async def commit(
        self, group: str, generation: int, member: str, topic: str, offset: int
    ) -> int:
        """Commit ``offset`` for partition 0 of ``topic``, fenced by ``generation``."""
        request = OffsetCommitRequest(group, generation, member, -1, [(topic, [(0, offset, "")])])
        response = await self.group_call(group, request, "OffsetCommit")
        return int(response.topics[0][1][0][1])

    async def committed(self, group: str, topic: str) -> int:
        """The offset committed for partition 0 of ``topic`` by ``group`` (-1: none)."""
        response = await self.group_call(
            group, OffsetFetchRequest(group, [(topic, [0])]), "OffsetFetch"
        )
        code = int(getattr(response, "error_code", 0))
        if code in COORDINATOR_MOVED:
            self.moved(group)
            raise BackendUnavailable(f"the Kafka coordinator of {group!r} moved")
        for _topic, partitions in response.topics:
            for partition in partitions:
                if partition[0] == 0 and partition[-1] == NO_ERROR:
                    return int(partition[1])
        return -1

    async def describe(self, group: str) -> Any:
        """The group's state and members, as DescribeGroups gives them."""
        response = await self.group_call(group, DescribeGroupsRequest([group]), "DescribeGroups")
        described = response.groups[0]
        code = int(described[0])
        if code in COORDINATOR_MOVED:
            self.moved(group)
            raise BackendUnavailable(f"the Kafka coordinator of {group!r} moved")
        return described

    async def create_topic(self, topic: str, replication: int) -> None:
        """Create ``topic`` with one partition, unless it exists."""
        node = self.client.cluster.controller
        node = self.client.get_random_node() if node is None else node.nodeId
        request = CreateTopicsRequest(
            [(topic, 1, replication, [], [])], int(self.timeout * 1000), False
        )
        response = await self._send(node, request, "CreateTopics")
        code = int(response.topic_errors[0][1])
        if code not in (NO_ERROR, _TOPIC_EXISTS):
            raise refused(code, f"CreateTopics({topic!r})")

    # -- the leader record: the last record of partition 0 -----------------------------

    async def _partition_leader(self, topic: str) -> int:
        partition = TopicPartition(topic, 0)
        node = self.client.cluster.leader_for_partition(partition)
        if node is None or node < 0:
            self.client.add_topic(topic)
            try:
                async with timeout_after(self.timeout):
                    await self.client.force_metadata_update()
            except (asyncio.TimeoutError, KafkaError, OSError) as exc:
                raise BackendUnavailable(f"Kafka metadata at {self.described}: {exc!r}") from exc
            node = self.client.cluster.leader_for_partition(partition)
        if node is None or node < 0:
            raise BackendUnavailable(f"partition 0 of Kafka topic {topic!r} has no leader")
        return int(node)

    async def publish(self, topic: str, value: bytes) -> None:
        """Append ``value`` to partition 0 of ``topic`` (acknowledged by all replicas)."""
        builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1 << 20)
        builder.append(0, int(time.time() * 1000), None, value, [])
        request = ProduceRequest(
            None, -1, int(self.timeout * 1000), [(topic, [(0, bytes(builder.build()))])]
        )
        response = await self._send(await self._partition_leader(topic), request, "Produce")
        code = int(response.topics[0][1][0][1])
        if code != NO_ERROR:
            raise refused(code, f"Produce({topic!r})")

    async def latest(self, topic: str) -> bytes | None:
        """The value of the last record of partition 0 of ``topic`` (``None``: empty)."""
        node = await self._partition_leader(topic)
        listed = await self._send(node, OffsetRequest(-1, 0, [(topic, [(0, -1)])]), "ListOffsets")
        end = int(listed.topics[0][1][0][-1])
        if end <= 0:
            return None
        request = FetchRequest(
            int(self.timeout * 500), 1, 1 << 20, 0, [(topic, [(0, end - 1, 1 << 20)])]
        )
        fetched = await self._send(node, request, "Fetch")
        value: bytes | None = None
        for _topic, partitions in fetched.topics:
            for partition in partitions:
                records = MemoryRecords(bytes(partition[-1] or b""))
                while records.has_next():
                    batch = records.next_batch()
                    if batch is None:
                        break
                    for record in batch:
                        if record.value is not None:
                            value = bytes(record.value)
        return value
