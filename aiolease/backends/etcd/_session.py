"""Session leases: one etcd lease per backend and ttl, kept alive for every key on it.

A :class:`Session` is an etcd lease (id chosen here, so that a grant whose reply
was lost is still known and revoked) plus the *entries* (held grants and queued
attempts) whose keys ride on it. :class:`Sessions` keeps one session per requested
ttl and runs each in a background task of its own, owned by the backend:

* **keepalive** every ``granted / 3`` seconds (``granted`` is the TTL from the
  server's LeaseGrant reply: whole seconds, at least the server's minimum), with
  quick retries after a failure. Holding N leases costs one keepalive per tick.
* **horizons**: an entry not renewed within its ttl (a grant nobody renews any
  more) has its key deleted, so that the name is not held for as long as the
  session lives. An entry the core holds (:meth:`EtcdBackend.hold`) has no
  horizon: it stays as long as the session, until released or lost, and the core
  does not renew it at all.
* **loss**: when the server says the lease is gone, or no keepalive is confirmed
  before the server could have expired it, every entry on the session ends, with
  the reason the core reports (:meth:`Entry.wait_ended`, and the callbacks given to
  ``hold``), and later acquisitions get a new session.

Timing. The server keeps a session's keys at least until ``confirmed + granted``,
where ``confirmed`` is the local time at which the last confirmed keepalive (or the
grant) was *sent*. A grant of ttl ``t <= granted`` on it is therefore reported as
sent at ``confirmed + granted - t`` (:meth:`Session.effective_sent`): the core's
deadline, ``min(its own send time, that) + t - margin``, falls before the server
can drop the key. On a healthy session (``confirmed`` at most ``granted / 3`` old)
a renewal still leaves at least ``2/3 t - margin`` before the deadline, so the
default renew interval (``t / 3``) is early enough; a longer one may let a lease
lapse locally (safe, never late).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from ..._exceptions import BackendError, BackendUnavailable, LossReason
from .._asyncio import Tasks, now, wait_until
from ._aio import shielded, unshielded
from ._wire import LeaseIdTaken, Wire

__all__ = ["Entry", "Session", "SessionStats", "Sessions"]

logger = logging.getLogger("aiolease.backends.etcd")

#: How many names' (or requests') last reads a backend remembers (for ``wait_changed``
#: and the like); the oldest are dropped past it.
SEEN_LIMIT = 4096
#: A queued attempt (fair mode, or a queued permit request) is dropped after this many
#: ttls without a retry.
QUEUE_HORIZON = 2.0
#: First retry delay after a failed keepalive (doubles up to a third of the TTL).
RETRY_MIN = 0.05
#: How many ids to try when the server reports a lease id as taken.
GRANT_ATTEMPTS = 3


@dataclass(eq=False)
class Entry:
    """One key on a session: a held grant, or a queued attempt (fair mode).

    :param horizon: local time after which the key is deleted unless touched again
        (``inf`` while the core holds it)
    :param slot: the end of its key (see :mod:`._keys`; the owner id unless given)
    """

    name: str
    owner: str
    token: int
    session: Session
    horizon: float
    queued: bool = False
    reason: LossReason | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: Called with the reason when the entry ends (the core's ``hold``).
    callbacks: list[Callable[[LossReason], object]] = field(default_factory=list)
    slot: str = ""
    #: A permit's weight (0: a lock's key, or not known here).
    weight: int = 0

    def __post_init__(self) -> None:
        if not self.slot:
            self.slot = self.owner

    async def wait_ended(self) -> LossReason:
        """Wait until the entry ends; why."""
        await self.ended.wait()
        assert self.reason is not None
        return self.reason


class Session:
    """One etcd lease and the entries on it.

    :param ttl: the ttl asked for (seconds, any float)
    :param lease_id: the lease id, chosen by the client
    """

    def __init__(self, ttl: float, lease_id: int) -> None:
        self.ttl = ttl
        self.lease_id = lease_id
        self.granted = 0
        self.confirmed = -math.inf
        self.error: BackendError | None = None
        self.lost: LossReason | None = None
        self.retired = False
        self.users = 0
        self.entries: dict[tuple[str, str], Entry] = {}
        self.idle_since = now()
        self.next_keepalive = math.inf
        self.wake = asyncio.Event()
        self.wake_at = -math.inf  # when the task wakes by itself (-inf: it is awake)

    def __repr__(self) -> str:
        state = self.lost.value if self.lost else f"{len(self.entries)} entries"
        return f"<Session {self.lease_id:x} ttl={self.ttl:g}s granted={self.granted}s {state}>"

    @property
    def deadline(self) -> float:
        """Local time before which the server cannot have expired the lease."""
        return self.confirmed + self.granted

    @property
    def expires(self) -> float:
        """:attr:`deadline`, as the core's :class:`~aiolease.abc.SessionClock` reads it."""
        return self.confirmed + self.granted

    def grant_ttl(self, ttl: float) -> float:
        """The ttl a grant of ``ttl`` on this session is good for."""
        return min(ttl, float(self.granted))

    def effective_sent(self, ttl: float) -> float:
        """The send time to report for a grant of ``ttl`` (see the module docstring)."""
        return self.deadline - self.grant_ttl(ttl)

    def usable(self, now: float) -> bool:
        """Whether a new grant of this session's ttl would get at least half of it."""
        ttl = self.grant_ttl(self.ttl)
        return self.lost is None and not self.retired and now < self.deadline - ttl / 2

    def poke(self) -> None:
        """Make the session's task look at its entries and timers again."""
        self.wake.set()

    def poke_at(self, at: float) -> None:
        """Make sure the session's task looks again at local time ``at`` (no later)."""
        if at < self.wake_at:
            self.wake.set()


@dataclass(frozen=True)
class SessionStats:
    """Counters of one backend's sessions."""

    granted: int
    lost: int
    keepalives: int
    keepalive_failures: int
    expired_entries: int


class Sessions:
    """The sessions of one backend, by requested ttl, and their keepalive tasks.

    :param wire: where the leases live
    :param idle: seconds a session without entries is kept before it is revoked
    """

    def __init__(self, wire: Wire, idle: float) -> None:
        self._wire = wire
        self._idle = idle
        self._by_ttl: dict[float, Session] = {}
        self._granting: dict[float, asyncio.Lock] = {}
        self._all: set[Session] = set()
        self.entries: dict[tuple[str, str], Entry] = {}
        #: ``(name, owner, token)`` of expired grants whose keys are being deleted.
        self.doomed: set[tuple[str, str, int]] = set()
        self._tasks = Tasks(logger)
        self._closed = False
        self._delete: Callable[[str, str, int], Awaitable[object]] | None = None
        self._dropped: Callable[[Entry], object] = lambda entry: None
        self._counts = {"granted": 0, "lost": 0, "keepalives": 0, "failures": 0, "expired": 0}

    def stats(self) -> SessionStats:
        """A snapshot of the counters."""
        c = self._counts
        return SessionStats(c["granted"], c["lost"], c["keepalives"], c["failures"], c["expired"])

    def lease_ids(self) -> list[int]:
        """The ids of the sessions that may still exist on the server."""
        return sorted(s.lease_id for s in self._all)

    def set_deleter(self, delete: Callable[[str, str, int], Awaitable[object]]) -> None:
        """``await delete(name, slot, token)`` removes one key (the backend's release)."""
        self._delete = delete

    def set_dropped(self, dropped: Callable[[Entry], object]) -> None:
        """``dropped(entry)`` is called when an entry leaves the table (ended or replaced)."""
        self._dropped = dropped

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` in the background until done or the sessions close."""
        self._tasks.spawn(unshielded(coro), name)

    # -- getting a session -------------------------------------------------------------

    @asynccontextmanager
    async def using(self, ttl: float) -> AsyncIterator[Session]:
        """A usable session for ``ttl`` (granted if needed: one more round trip), kept
        from being revoked for being idle while the block runs.

        The grant is shielded from cancellation, so that its reply is always seen.

        :raises BackendError: the grant failed
        """
        session = await self.enter(ttl)
        try:
            yield session
        finally:
            self.leave(session)

    async def enter(self, ttl: float) -> Session:
        """:meth:`using` without a context manager: :meth:`leave` it when done."""
        session = self._by_ttl.get(ttl)
        if session is None or not session.usable(now()):
            session = await self._session(ttl)
        session.users += 1
        return session

    def leave(self, session: Session) -> None:
        """The end of :meth:`enter`."""
        session.users -= 1
        if not session.users and not session.entries:
            session.poke_at(-math.inf if session.retired else session.idle_since + self._idle)

    async def _session(self, ttl: float) -> Session:
        current = self._by_ttl.get(ttl)
        if current is not None and current.usable(now()):
            return current
        lock = self._granting.setdefault(ttl, asyncio.Lock())
        async with lock:
            current = self._by_ttl.get(ttl)
            if current is not None and current.usable(now()):
                return current
            if current is not None:
                self._retire(current)
            return await shielded(self._grant(ttl))

    async def _grant(self, ttl: float) -> Session:
        self._check_open()
        for _ in range(GRANT_ATTEMPTS):
            session = Session(ttl, random.getrandbits(62) + 1)
            self._all.add(session)
            sent = now()
            try:
                granted = await self._wire.lease_grant(
                    max(1, math.ceil(ttl)), session.lease_id, self._wire.timeout
                )
            except LeaseIdTaken:
                self._all.discard(session)
                continue
            except BaseException:
                # The lease may exist although its reply never came: revoke it.
                session.lost = LossReason.EXPIRED
                self._spawn(self._revoke(session), session)
                raise
            session.granted = granted
            session.confirmed = sent
            session.next_keepalive = sent + granted / 3
            self._counts["granted"] += 1
            self._by_ttl[ttl] = session
            self._spawn(self._run(session), session)
            return session
        raise BackendError("etcd lease grant: every lease id tried was taken")

    def _spawn(self, coro: Coroutine[Any, Any, None], session: Session) -> None:
        self._tasks.spawn(unshielded(coro), f"etcd session {session.lease_id:x}")

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the etcd backend is closed")

    # -- entries -----------------------------------------------------------------------

    def attach(self, entry: Entry) -> None:
        """Put ``entry`` in the table and on its session (replacing one of the same key)."""
        key = (entry.name, entry.owner)
        old = self.entries.get(key)
        if old is not None and old is not entry:
            self.end(old, LossReason.STOLEN)  # another grant of the same key replaced it
        self.entries[key] = entry
        entry.session.entries[key] = entry
        entry.session.poke_at(entry.horizon)

    def move(self, entry: Entry, session: Session) -> None:
        """Move ``entry`` onto ``session``."""
        key = (entry.name, entry.owner)
        entry.session.entries.pop(key, None)
        self._note_idle(entry.session)
        entry.session = session
        self.attach(entry)

    def end(self, entry: Entry, reason: LossReason) -> None:
        """Remove ``entry`` and tell whoever waits on it why it ended."""
        key = (entry.name, entry.owner)
        if self.entries.get(key) is entry:
            del self.entries[key]
        self._dropped(entry)
        if entry.session.entries.get(key) is entry:
            del entry.session.entries[key]
            self._note_idle(entry.session)
        if entry.reason is None:
            entry.reason = reason
            entry.ended.set()
            callbacks, entry.callbacks = entry.callbacks, []
            for callback in callbacks:
                try:
                    callback(reason)
                except Exception:  # the core's callback only records; never let it stop us
                    logger.exception("etcd: a loss callback of %r failed", entry.name)

    def _note_idle(self, session: Session) -> None:
        if not session.entries:
            session.idle_since = now()
            session.poke_at(session.idle_since + self._idle)

    # -- the task of one session --------------------------------------------------------

    async def _run(self, session: Session) -> None:
        retry = RETRY_MIN
        while session.lost is None:
            if self._should_revoke(session, now()):
                await self._revoke(session)
                return
            wake_at = min(session.next_keepalive, self._next_horizon(session), session.deadline)
            if not session.entries:
                wake_at = min(wake_at, session.idle_since + self._idle)
            session.wake_at = wake_at
            await wait_until(session.wake, wake_at)
            session.wake_at = -math.inf
            session.wake = asyncio.Event()
            self._expire_entries(session)
            if now() >= session.next_keepalive:
                retry = await self._keepalive(session, retry)
            if session.lost is None and now() >= session.deadline:
                self._lose(session, _reason(session.error))

    def _should_revoke(self, session: Session, at: float) -> bool:
        if session.entries or session.users:
            return False
        return session.retired or at >= session.idle_since + self._idle

    def _next_horizon(self, session: Session) -> float:
        return min((e.horizon for e in session.entries.values()), default=math.inf)

    def _expire_entries(self, session: Session) -> None:
        at = now()
        for entry in list(session.entries.values()):
            if entry.horizon <= at:
                self._counts["expired"] += 1
                self.end(entry, LossReason.EXPIRED)
                self.doomed.add((entry.name, entry.owner, entry.token))
                self._spawn(self._delete_key(entry), session)

    async def _delete_key(self, entry: Entry) -> None:
        """Delete the key of an expired entry (until done, or its session is gone)."""
        delay = RETRY_MIN
        doomed = (entry.name, entry.owner, entry.token)
        try:
            while entry.session.lost is None and not self._closed:
                try:
                    assert self._delete is not None
                    await self._delete(entry.name, entry.slot, entry.token)
                    return
                except BackendError as exc:
                    logger.info("deleting the expired key of %r failed: %r", entry.name, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        finally:
            # Deleted, or gone with its session.
            self.doomed.discard(doomed)

    async def _keepalive(self, session: Session, retry: float) -> float:
        sent = now()
        self._counts["keepalives"] += 1
        try:
            ttl = await self._wire.lease_keepalive(session.lease_id, session.granted / 3)
        except BackendError as exc:
            self._counts["failures"] += 1
            session.error = exc
            session.next_keepalive = now() + retry
            logger.info("keepalive of etcd lease %x failed: %r", session.lease_id, exc)
            return min(retry * 2, session.granted / 3)
        if ttl <= 0:
            self._lose(session, _reason(session.error, gone=sent < session.deadline))
            return RETRY_MIN
        session.granted = ttl
        session.confirmed = sent
        session.error = None
        session.next_keepalive = sent + ttl / 3
        return RETRY_MIN

    # -- loss and revocation ------------------------------------------------------------

    def lose(self, session: Session) -> None:
        """The server said ``session`` is gone (a request that used it failed)."""
        self._lose(session, _reason(session.error, gone=now() < session.deadline))

    def _lose(self, session: Session, reason: LossReason) -> None:
        if session.lost is not None:
            return
        session.lost = reason
        self._counts["lost"] += 1
        logger.warning("etcd session lease %x lost (%s)", session.lease_id, reason.value)
        self._retire(session)
        for entry in list(session.entries.values()):
            self.end(entry, reason)
        session.poke()
        # It may still exist (replies lost, not requests): revoke it when possible.
        self._spawn(self._revoke(session), session)

    def _retire(self, session: Session) -> None:
        session.retired = True
        if self._by_ttl.get(session.ttl) is session:
            del self._by_ttl[session.ttl]
        session.poke()

    async def _revoke(self, session: Session) -> None:
        """Revoke ``session``'s lease, retrying until the server has answered.

        Not only until its TTL would have run out: a server that restarts (or a new
        leader) extends every lease it has by a full TTL, so a lease given up while
        the server was down would hold its keys, names others wait for, that long
        again after the server is back.
        """
        self._retire(session)
        delay = RETRY_MIN
        while True:
            try:
                await self._wire.lease_revoke(session.lease_id)
                break
            except BackendError as exc:
                logger.info("revoking etcd lease %x failed: %r", session.lease_id, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        self._all.discard(session)

    async def aclose(self) -> None:
        """End every entry (``SHUTDOWN``), stop the tasks, revoke every lease. Idempotent."""
        if self._closed:
            return
        self._closed = True
        sessions = list(self._all)
        for session in sessions:
            session.lost = session.lost or LossReason.SHUTDOWN
            for entry in list(session.entries.values()):
                self.end(entry, LossReason.SHUTDOWN)
        await shielded(self._tasks.aclose())
        await shielded(self._revoke_all(sessions))

    async def _revoke_all(self, sessions: list[Session]) -> None:
        await asyncio.gather(*(self._revoke_once(session) for session in sessions))

    async def _revoke_once(self, session: Session) -> None:
        try:
            await self._wire.lease_revoke(session.lease_id)
        except BackendError as exc:
            logger.warning(
                "revoking etcd lease %x on close failed (it expires within %ss): %r",
                session.lease_id,
                session.granted,
                exc,
            )
        self._all.discard(session)


def _reason(error: BackendError | None, *, gone: bool = False) -> LossReason:
    """Why leases on a lost session ended: removed on the server while we kept it
    alive (``STOLEN``), keepalives sent and failing, refused or unanswered until too
    late (``UNREACHABLE``), or none sent in time (``EXPIRED``: a paused process)."""
    if gone:
        return LossReason.STOLEN
    return LossReason.EXPIRED if error is None else LossReason.UNREACHABLE
