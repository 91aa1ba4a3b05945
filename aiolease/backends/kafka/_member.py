"""One backend object's membership in the consumer group of one name.

A :class:`Member` runs in a background task of the backend: it joins the group,
syncs, and heartbeats every ``heartbeat_interval`` seconds. When the assignment gives
it partition 0 it commits the term's token as the group's offset for that partition,
fenced by its generation (the broker refuses a stale generation), and only then
offers the term (:class:`Term`) to the acquire attempts of the backend.

Timing (the local safe deadline). The coordinator keeps a member at least until
``sent + session`` where ``sent`` is the local send time of the last SyncGroup or
heartbeat it answered without error: :attr:`Member.expires`. The core's deadline for
a term is that minus its margin, so the leader stops before the coordinator can
drop it and give partition 0 to someone else.

Stepping down. Every rebalance ends the term in progress (Kafka's eager protocol
revokes every member's assignment): a heartbeat answered "rebalance in progress"
sends the member back to JoinGroup, and before it joins, its revocation callback
(:meth:`Member._revoked`) ends the term (``ended(STOLEN)``) and waits until the
core has released the lease (the holder's work was cancelled and has stopped), or
until its deadline has passed. The group cannot move partition 0 before this member
rejoins or the coordinator drops it, so the work is over before a successor starts.
A leader that is assigned partition 0 again starts a new term with a new token.
"Unknown member" and "illegal generation" end the term at once too (the member is
out of the group already).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from ..._exceptions import BackendError, BackendUnavailable, InvalidArgument, LossReason
from .._asyncio import now, wait_event
from ._group import View, assign, candidate_bytes, record_bytes, view_of
from ._wire import (
    COORDINATOR_MOVED,
    ILLEGAL_GENERATION,
    MEMBER_ID_REQUIRED,
    NO_ERROR,
    REBALANCE_IN_PROGRESS,
    UNKNOWN_MEMBER_ID,
    UNKNOWN_TOPIC,
    Wire,
    refused,
)

__all__ = ["Member", "Term"]

logger = logging.getLogger("aiolease.backends.kafka")

#: Seconds between two attempts to join after a failure.
RETRY = 0.25
#: SyncGroups refused in a row after which the member leaves and joins anew. Not
#: after one: a SyncGroup refused because another member joined meanwhile is common
#: (every rebalance now ends the term, and candidates rejoin more often), and leaving
#: then starts one more rebalance for everybody (seen in the SIGSTOP safety runs).
STUCK_SYNCS = 2
#: Codes after which the member rejoins: it is not (any more) in this generation.
_REJOIN = frozenset({REBALANCE_IN_PROGRESS, ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID})


@dataclass(eq=False)
class Term:
    """This member's leadership in one generation: granted to at most one acquire attempt."""

    token: int
    generation: int
    owner: str | None = None
    ended: Callable[[LossReason], object] | None = None
    over: bool = False
    released: asyncio.Event = field(default_factory=asyncio.Event)
    #: The term may not be granted before then (loop clock; see :mod:`._group`).
    not_before: float = -math.inf

    def end(self, reason: LossReason) -> None:
        """The term is over: tell the core (once)."""
        if not self.over:
            self.over = True
            if self.ended is not None:
                self.ended(reason)


class Member:
    """The membership of one backend object in the group of one lease name.

    It is also the :class:`~aiolease.abc.SessionClock` of the term it holds.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Wire]],
        name: str,
        group: str,
        topic: str,
        identity: str,
        metadata: Mapping[str, str],
        session: float,
        heartbeat: float,
        floor: Callable[[int | None], int],
        replication: int,
    ) -> None:
        self._connect = connect
        self._replication = replication
        self.wire: Wire | None = None
        self.name = name
        self.group = group
        self.topic = topic
        self.identity = identity
        self.metadata = dict(metadata)
        self.session = session
        self.heartbeat = heartbeat
        self._floor = floor
        self.member_id = ""
        self.generation = -1
        #: The first generation this member was in (its place in the queue).
        self.since: int | None = None
        self.view: View | None = None
        self.term: Term | None = None
        #: The term the last rebalance ended (its work may still be stopping).
        self.stepped: Term | None = None
        self._failed_syncs = 0
        #: Set when the task has ended (the group left).
        self.done = asyncio.Event()
        self.confirmed = -math.inf
        self.error: BaseException | None = None
        self.failure: BaseException | None = None
        self.waiters: set[str] = set()
        self.interest = now()
        self.closed = False
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()
        #: Set to make the heartbeat loop send its next heartbeat at once.
        self._wake = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Member {self.member_id!r} of {self.group!r} generation {self.generation}>"

    # -- the SessionClock of the term ---------------------------------------------------

    @property
    def expires(self) -> float:
        """The coordinator keeps this member at least until then (loop clock)."""
        return self.confirmed + self.session

    # -- what the backend asks ----------------------------------------------------------

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float | None = None) -> None:
        """Wait until the view, the term or the state changes (or ``timeout`` passes)."""
        await wait_event(self._changed, timeout)

    async def settled(self, timeout: float) -> View | None:
        """The view of the current generation once synced, if that is within ``timeout``
        seconds (``None``: not yet, or the member closed).

        :raises BackendError: the member cannot join (the broker is unreachable, say)
        :raises InvalidArgument: the broker refused the group, topic or session timeout
        """
        deadline = now() + timeout
        while True:
            if self.failure is not None:
                raise self.failure
            if self.closed:
                return None
            if self.view is not None:
                return self.view
            if self.error is not None:
                raise BackendUnavailable(
                    f"cannot join the Kafka group {self.group!r}: {self.error}"
                ) from self.error
            if now() >= deadline:
                return None
            await self.changed(deadline - now())

    async def confirm(self) -> bool:
        """Heartbeat now (when a term is granted: its deadline counts from this send
        time); whether the coordinator answered that this member is in the generation.

        :raises BackendError: the heartbeat failed
        """
        wire = self.wire
        if wire is None or self.view is None:
            return False
        sent = now()
        code = await wire.heartbeat(self.group, self.generation, self.member_id)
        if code != NO_ERROR:
            self._wake.set()  # the heartbeat loop sees the same answer at once
            return False
        self.confirmed = max(self.confirmed, sent)
        return True

    def idle(self, at: float) -> bool:
        """Nobody holds a term or waits for one here, and nobody asked for a session."""
        term = self.term
        held = term is not None and term.owner is not None and not term.over
        return not held and not self.waiters and at - self.interest > self.session

    def close(self) -> None:
        """Stop the member's task (which then leaves the group)."""
        self.closed = True
        self._stop.set()
        self._wake.set()
        self._signal()

    # -- the task -------------------------------------------------------------------------

    async def run(self) -> None:
        """Join, sync, heartbeat; rejoin after every rebalance; leave when closed.

        The member has a connection of its own: a broker answers the requests of one
        connection in order, and a JoinGroup or SyncGroup waits for the other members,
        so two members on one connection would wait for each other.
        """
        try:
            while not self.closed:
                try:
                    if self.wire is None:
                        logger.debug("Kafka group %r: connecting", self.group)
                        self.wire = await self._connect()
                    joined = await self._join(self.wire)
                except InvalidArgument as exc:
                    self.failure = exc
                    self.closed = True
                    self._signal()
                    return
                except BackendError as exc:
                    self._fail(exc)
                    await wait_event(self._stop, RETRY)
                    continue
                if joined:
                    await self._beat(self.wire)
        finally:
            self._step_down(LossReason.SHUTDOWN)
            self.closed = True
            self._signal()
            if self.wire is not None:
                await self._leave(self.wire)
                await self.wire.client.close()

    def _fail(self, exc: BaseException) -> None:
        logger.info("Kafka group %r: %r", self.group, exc)
        self.error = exc
        self._signal()

    async def _join(self, wire: Wire) -> bool:
        """One round of JoinGroup and SyncGroup; whether this member is now in a
        generation (else it rejoins)."""
        await self._revoked()
        floor = self._floor(None)
        metadata = candidate_bytes(self.topic, self.identity, self.metadata, floor, self.since)
        logger.debug("Kafka group %r: %s (%s) joins", self.group, self.member_id, self.identity)
        response = await wire.join(self.group, self.member_id, self.session, metadata)
        code = int(response.error_code)
        logger.debug("Kafka group %r: JoinGroup answered %d", self.group, code)
        if code == MEMBER_ID_REQUIRED:
            self.member_id = response.member_id
            return False
        if code == UNKNOWN_MEMBER_ID:
            self.member_id = ""
            return False
        if code in COORDINATOR_MOVED:
            wire.moved(self.group)
            raise BackendUnavailable(f"the Kafka coordinator of {self.group!r} moved")
        if code == REBALANCE_IN_PROGRESS:
            return False
        if code != NO_ERROR:
            raise refused(code, f"JoinGroup({self.group!r})")
        self.member_id, self.generation = response.member_id, int(response.generation_id)
        assignments: list[tuple[str, bytes]] = []
        if response.leader_id == self.member_id:
            committed = await wire.committed(self.group, self.topic)
            assignments = assign(self.topic, self.generation, response.members, committed)
        sent = now()
        synced = await wire.sync(
            self.group, self.generation, self.member_id, self.session, assignments
        )
        logger.debug("Kafka group %r: SyncGroup answered %d", self.group, synced.error_code)
        if not self._accepted(wire, int(synced.error_code), "SyncGroup"):
            self._failed_syncs += 1
            if self._failed_syncs >= STUCK_SYNCS and self.term is None:
                # Tansu, when a member leaves while another joins, may name the one that
                # left as the group's leader, and no SyncGroup ever completes: start
                # over as a new member (never while holding a term: leaving would let
                # the group move it before the deadline).
                logger.info("Kafka group %r: SyncGroup keeps failing; rejoining anew", self.group)
                self._failed_syncs = 0
                await self._leave(wire)
            return False
        self._failed_syncs = 0
        self.confirmed, self.error = sent, None
        if self.since is None:
            self.since = self.generation
        view = view_of(synced.member_assignment)
        if view is None:
            return False
        self._floor(view.token)
        if view.leader == self.member_id:
            code = await wire.commit(
                self.group, self.generation, self.member_id, self.topic, view.token
            )
            if code == UNKNOWN_TOPIC:  # a broker that lost its topics: make it again
                await wire.create_topic(self.topic, self._replication)
                return False
            if not self._accepted(wire, code, "OffsetCommit"):
                return False
            self.term = Term(view.token, self.generation)
            if view.lost:  # the old leader may run until its deadline: outwait it
                self.term.not_before = now() + self.session
                asyncio.get_running_loop().call_later(self.session, self._signal)
                logger.warning(
                    "Kafka group %r: the broker lost the group's token %d; the next"
                    " term starts after one session timeout",
                    self.group,
                    view.token - 1,
                )
            await self._publish(wire, view)
        self.view = view
        self._signal()
        logger.debug(
            "Kafka group %r: %s (%s) in generation %d, %r leads",
            self.group,
            self.member_id[-6:],
            self.identity,
            self.generation,
            view,
        )
        return True

    async def _publish(self, wire: Wire, view: View) -> None:
        """Append the leader record (for readers outside the group); a failure only
        leaves them an older record, so it is logged, not raised."""
        try:
            await wire.publish(self.topic, record_bytes(self.member_id, view))
        except BackendError as exc:
            logger.warning("Kafka group %r: the leader record was not written: %r", self.group, exc)

    def _accepted(self, wire: Wire, code: int, what: str) -> bool:
        """Whether ``code`` says yes; a code that means "rejoin" says no.

        :raises BackendError: any other code
        """
        if code == NO_ERROR:
            return True
        if code == UNKNOWN_MEMBER_ID:
            self.member_id = ""
        if code in _REJOIN:
            return False
        if code in COORDINATOR_MOVED:
            wire.moved(self.group)
        raise refused(code, f"{what}({self.group!r})")

    async def _beat(self, wire: Wire) -> None:
        """Heartbeat until the generation ends for this member."""
        delay = self.heartbeat
        while True:
            await wait_event(self._wake, delay)
            self._wake.clear()
            if self.closed:
                return
            if self.idle(now()):
                logger.debug("Kafka group %r: nobody campaigns here any more", self.group)
                self.closed = True
                return
            sent = now()
            try:
                code = await wire.heartbeat(self.group, self.generation, self.member_id)
            except BackendError as exc:
                self._fail(exc)
                if now() >= self.expires:  # the coordinator may have dropped us: rejoin
                    self._step_down(LossReason.UNREACHABLE)
                    return
                delay = min(self.heartbeat, RETRY)
                continue
            delay = self.heartbeat
            if code == NO_ERROR:
                self.confirmed, self.error = max(self.confirmed, sent), None
                continue
            if code == REBALANCE_IN_PROGRESS:
                return  # rejoin, once the term is revoked (see _join)
            if code in _REJOIN:  # this member is out of the group: so is its term
                if code == UNKNOWN_MEMBER_ID:
                    self.member_id = ""
                self._step_down(LossReason.STOLEN)
                return
            if code in COORDINATOR_MOVED:
                wire.moved(self.group)
            self._fail(refused(code, f"Heartbeat({self.group!r})"))

    async def _revoked(self) -> None:
        """The revocation callback, run before every (re)join: Kafka's eager protocol
        revokes every assignment in a rebalance, so the term ends (``STOLEN``) first.

        It waits until the core has released the term (the holder's work was cancelled
        and has stopped), at most until :attr:`expires`: the coordinator cannot move
        partition 0 before this member rejoins or that time passes, so the work is over
        before the next generation's leader starts. A term nobody took ends at once.
        """
        term = self._step_down(LossReason.STOLEN)
        if term is None or term.owner is None:
            return
        logger.debug("Kafka group %r: rebalance; waiting for the term's work to stop", self.group)
        if not await wait_event(term.released, self.expires - now()):
            logger.warning(
                "Kafka group %r: the term's work did not stop before its deadline", self.group
            )

    def _step_down(self, reason: LossReason) -> Term | None:
        """End the term (if any) and forget the view; the ended term."""
        term, self.term = self.term, None
        self.view = None
        if term is not None:
            self.stepped = term
            term.end(reason)
        self._signal()
        return term

    async def _leave(self, wire: Wire) -> None:
        """Leave the group at once (bounded, shielded from nothing: a failure is logged),
        so that the next leader is chosen without waiting for a session timeout."""
        if not self.member_id:
            return
        member, self.member_id = self.member_id, ""
        logger.debug("Kafka group %r: %s (%s) leaves", self.group, member[-6:], self.identity)
        try:
            code = await wire.leave(self.group, member)
        except BackendError as exc:
            logger.info("Kafka group %r: leaving failed: %r", self.group, exc)
            return
        if code not in (NO_ERROR, UNKNOWN_MEMBER_ID):
            logger.info("Kafka group %r: LeaveGroup answered %d", self.group, code)
