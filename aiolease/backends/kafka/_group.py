"""What the members of a name's group tell each other: join metadata and assignments.

Every member offers one assignment protocol (:data:`~._wire.PROTOCOL`) in the
consumer protocol's format, subscribed to the name's one-partition topic; its user
data says who the member is (JSON)::

    {"i": identity, "m": metadata, "f": highest token seen,
     "s": the first generation it was in (null: none yet)}

The member the coordinator picks as the group's leader runs :func:`assign`. With
``top = max(committed offset, every member's highest token seen)``: the member that
has waited longest (in the group since the oldest generation) gets partition 0 and a
new term with token ``top + 1``. Every rebalance starts a new term: a member steps
down before it rejoins (the eager protocol revokes every assignment), so the leader
of the last generation, the longest-waiting member, usually leads the next one too,
with a new token. Every member gets the same user data::

    {"g": generation, "o": leader's member id, "i": identity, "m": metadata, "t": token,
     "q": the broker lost the committed token that members remember}

A broker that forgot the group (a restart of a broker without durable offsets, such
as Tansu's memory storage) also forgot its members' sessions: the old leader may
still be within its local deadline while the new group elects. The new leader then
waits one session timeout before its term starts (``"q"``), by which time the old
leader's deadline has passed.

so that each member knows who leads and with which token without another request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka.protocol.group import MemberAssignment, ProtocolMetadata

__all__ = ["Candidate", "View", "assign", "candidate_bytes", "record_bytes", "record_of", "view_of"]

logger = logging.getLogger("aiolease.backends.kafka")


@dataclass(frozen=True)
class Candidate:
    """One member as its join metadata describes it."""

    member: str
    identity: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    floor: int = 0
    since: int | None = None


@dataclass(frozen=True)
class View:
    """What a member knows of a generation once it has synced: who leads, with which token."""

    generation: int
    leader: str
    identity: str
    metadata: Mapping[str, str]
    token: int
    #: The broker lost the group's committed token while its members remember one (a
    #: broker restart without durable offsets): a new term waits one session first.
    lost: bool = False


def candidate_bytes(
    topic: str,
    identity: str,
    metadata: Mapping[str, str],
    floor: int,
    since: int | None,
) -> bytes:
    """The join metadata of a member."""
    user = json.dumps({"i": identity, "m": dict(metadata), "f": floor, "s": since})
    encoded: bytes = ProtocolMetadata(0, [topic], user.encode()).encode()
    return encoded


def _candidate(member: str, raw: bytes) -> Candidate:
    try:
        user = json.loads(ProtocolMetadata.decode(raw).user_data)
        since = user.get("s")
        return Candidate(
            member,
            str(user["i"]),
            dict(user["m"]),
            int(user["f"]),
            None if since is None else int(since),
        )
    except Exception:  # a member that is not ours: it may be a candidate, never a source
        logger.warning("member %r of a Kafka election group sent foreign metadata", member)
        return Candidate(member)


def assign(
    topic: str, generation: int, members: Sequence[Any], committed: int
) -> list[tuple[str, bytes]]:
    """The assignment of every member, as the group's leader sends it in SyncGroup.

    :param members: the JoinGroup response's members: ``(member id, ..., metadata)``
    :param committed: the offset the group committed for partition 0 (-1: none)
    """
    candidates = [_candidate(str(m[0]), bytes(m[-1])) for m in members]
    top = max([committed, *(c.floor for c in candidates)])
    # The member that has waited longest (in the group since the oldest generation)
    # starts a new term: every member stepped down before it rejoined.
    leader = min(candidates, key=lambda c: (c.since is None, c.since or 0))
    logger.debug("assign generation %d: %s -> %s", generation, candidates, leader.member)
    token = top + 1
    user = json.dumps(
        {
            "g": generation,
            "o": leader.member,
            "i": leader.identity,
            "m": dict(leader.metadata),
            "t": token,
            "q": committed < 0 < top,
        }
    ).encode()
    return [
        (
            c.member,
            MemberAssignment(0, [(topic, [0])] if c is leader else [], user).encode(),
        )
        for c in candidates
    ]


def view_of(raw: bytes) -> View | None:
    """The :class:`View` in an assignment (``None``: empty or not ours)."""
    if not raw:
        return None
    try:
        user = json.loads(MemberAssignment.decode(raw).user_data)
        return View(
            int(user["g"]),
            str(user["o"]),
            str(user["i"]),
            dict(user["m"]),
            int(user["t"]),
            bool(user.get("q", False)),
        )
    except Exception:
        logger.warning("a Kafka election group sent an assignment that is not aiolease's")
        return None


def record_bytes(member: str, view: View) -> bytes:
    """The leader record a new leader appends to the name's partition 0: what a
    backend that is not in the group reads to tell who leads."""
    record = {"o": member, "i": view.identity, "m": dict(view.metadata), "t": view.token}
    return json.dumps(record).encode()


def record_of(raw: bytes | None) -> View | None:
    """The leader record's :class:`View` (generation unknown: -1), if it is ours."""
    if raw is None:
        return None
    try:
        user = json.loads(raw)
        return View(-1, str(user["o"]), str(user["i"]), dict(user["m"]), int(user["t"]))
    except Exception:
        logger.warning("a Kafka election topic holds a record that is not aiolease's")
        return None
