"""The nodes of one backend on its one session, and the task that keeps them.

An :class:`Entry` is one contender node this backend created: a grant, or a queued
attempt. :class:`Keeper` runs the backend's one background task:

* **pings**: a cheap read every third of the negotiated session timeout (and
  sooner after a failure). Its replies, and those of every other request, move the
  session clock (:attr:`Wire.confirmed <._wire.Wire.confirmed>`). Holding N leases
  costs these pings and nothing per lease.
* **horizons**: a node that the core does not hold (a grant nobody renews, a
  queued attempt nobody waits with) is deleted once its horizon passes, so that a
  name is not held for as long as the session lives.
* **loss**: when the clock runs out (no reply to a request sent within the session
  timeout), every entry ends (``UNREACHABLE`` if requests were failing, else
  ``EXPIRED``), whatever the client library believes, and its node is deleted as
  soon as the session answers again; when replies come on a new session, the
  server expired the old one: every entry on it ends (``STOLEN``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..._exceptions import BackendError, LossReason
from .._asyncio import now, retrieve, wait_until
from ._wire import Wire

__all__ = ["Entry", "Keeper"]

logger = logging.getLogger("aiolease.backends.zookeeper")

#: First retry delay after a failed ping (doubles up to a sixth of the timeout).
RETRY_MIN = 0.05


@dataclass(eq=False)
class Entry:
    """One contender node of this backend's session.

    :param horizon: local time after which the node is deleted unless touched again
        (``inf`` while the core holds it)
    """

    name: str
    owner: str
    token: int
    sequence: int
    path: str
    session_id: int
    horizon: float
    queued: bool = True
    reason: LossReason | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    callbacks: list[Callable[[LossReason], object]] = field(default_factory=list)
    #: The path of the contender just before it, as last seen (queued entries).
    predecessor: str | None = None
    #: That contender was the first of the queue when listed: nothing can come before
    #: it (nodes only join at the end), so once it is gone this one is first.
    predecessor_first: bool = False
    #: Its predecessor was a node this backend held (so the first), and is gone: it is
    #: first now, and the next try grants it without listing the queue.
    first: bool = False
    #: The node's data (identity and metadata), as written.
    data: bytes = b""

    @classmethod
    def created(
        cls,
        name: str,
        owner: str,
        reply: Any,
        path: str,
        session_id: int,
        horizon: float,
        data: bytes,
    ) -> Entry:
        """The entry of the node that the create ``reply`` made at ``path`` (its token
        the create's zxid, its sequence the end of the node's name)."""
        node = reply.path.rsplit("/", 1)[1]
        sequence = int(node.rpartition("-")[2])  # ours: the callers' listings check every node
        token = int(reply.stat.created_zxid)
        return cls(name, owner, token, sequence, path, session_id, horizon, data=data)

    async def wait_ended(self) -> LossReason:
        """Wait until the entry ends; why."""
        await self.ended.wait()
        assert self.reason is not None
        return self.reason


class Keeper:
    """The entries of one backend and the background task that keeps them.

    :param wire: the session they ride on
    :param ping_path: a node to read as a ping
    """

    def __init__(self, wire: Wire, ping_path: str) -> None:
        self.wire = wire
        self.ping_path = ping_path
        self.entries: dict[tuple[str, str], Entry] = {}
        #: Paths of nodes of ended entries still to delete (the session may live on).
        self.zombies: dict[str, int] = {}
        self.wake = asyncio.Event()
        #: When the task, waiting, wakes up next (``-inf`` while it works).
        self.wake_at = -math.inf
        #: Set when the backend closes: every wait of it returns.
        self.wake_closed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.pings = 0
        self.ping_failures = 0
        self.lost_sessions = 0
        self.expired_entries = 0
        #: Called with each entry as it ends, after its own callbacks.
        self.on_end: Callable[[Entry], object] = lambda entry: None
        wire.on_new_session = self._new_session

    # -- the clock the core reads (SessionClock) ------------------------------------------

    @property
    def expires(self) -> float:
        """Local time before which the server cannot have expired the session."""
        return self.wire.expires

    @property
    def error(self) -> BaseException | None:
        """Why the last request failed, if it did."""
        return self.wire.error

    # -- entries ---------------------------------------------------------------------------

    def attach(self, entry: Entry) -> None:
        """Track ``entry`` (replacing an ended one of the same attempt)."""
        self.entries[(entry.name, entry.owner)] = entry
        self.poke(min(entry.horizon, self.wire.expires))

    def end(self, entry: Entry, reason: LossReason, quietly: bool = False) -> None:
        """``entry`` is over (its node deleted, or to be): tell whoever holds it.

        :param quietly: not the core's ``ended`` callbacks (:meth:`Backend.hold`): a
            release, which the core ends itself, after it looked at the lease's
            deadline (told ``RELEASED`` first, it would take a lease that ran out
            while the process stood still for released rather than lost)
        """
        if self.entries.get((entry.name, entry.owner)) is entry:
            del self.entries[(entry.name, entry.owner)]
        if entry.reason is not None:
            return
        entry.reason = reason
        entry.ended.set()
        for callback in () if quietly else entry.callbacks:
            try:
                callback(reason)
            except Exception:  # pragma: no cover - the core's callbacks only record
                logger.exception("a loss callback failed")
        self.on_end(entry)

    def lose_all(self, reason: LossReason, session_id: int) -> None:
        """Every entry of ``session_id`` is lost; their nodes are deleted if it lives on."""
        for entry in [e for e in self.entries.values() if e.session_id == session_id]:
            if reason is not LossReason.STOLEN:
                self.zombies[entry.path] = session_id
            self.end(entry, reason)

    def _new_session(self, old: int) -> None:
        logger.warning("ZooKeeper session %x was expired by the server: its leases are lost", old)
        self.lost_sessions += 1
        self.zombies = {p: s for p, s in self.zombies.items() if s != old}
        self.lose_all(LossReason.STOLEN, old)

    def closing(self) -> None:
        """The backend is closing: end every wait of it."""
        self.wake_closed.set()

    def poke(self, at: float = -math.inf) -> None:
        """Make the task look at its timers again (only if it sleeps past ``at``, the
        time something is due: a step of the event loop saved per acquire)."""
        if at < self.wake_at:
            self.wake.set()

    # -- the task ----------------------------------------------------------------------------

    def start(self) -> None:
        """Run the task (once) on the running loop."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())
            self.task.add_done_callback(retrieve)

    async def stop(self) -> None:
        """Stop the task."""
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def _run(self) -> None:
        try:
            await self._keep()
        except asyncio.CancelledError:
            raise
        except BaseException:  # pragma: no cover - a bug: every lease ends with it
            logger.exception("the ZooKeeper session keeper failed; its leases are lost")
            for entry in list(self.entries.values()):
                self.end(entry, LossReason.UNREACHABLE)
            raise

    async def _keep(self) -> None:
        delay = RETRY_MIN
        next_ping = now()
        while True:
            wake_at = min(next_ping, self._first_horizon(), self._lost_at())
            self.wake.clear()
            self.wake_at = wake_at
            try:
                await wait_until(self.wake, wake_at)
            finally:
                self.wake_at = -math.inf
            current = now()
            if current >= self._lost_at():
                self._clock_ran_out()
            await self._expire_horizons(current)
            if current < next_ping:
                continue
            try:
                await self._ping()
            except BackendError as exc:
                self.ping_failures += 1
                logger.info("ZooKeeper ping failed: %s", exc)
                next_ping = now() + delay
                delay = min(delay * 2, max(self.wire.negotiated / 6, RETRY_MIN))
                continue
            delay = RETRY_MIN
            next_ping = now() + max(self.wire.negotiated / 3, RETRY_MIN)

    def _first_horizon(self) -> float:
        return min((e.horizon for e in self.entries.values()), default=math.inf)

    def _lost_at(self) -> float:
        sid = self.wire.session_id
        if not any(e.session_id == sid for e in self.entries.values()):
            return math.inf
        return self.wire.expires

    def _clock_ran_out(self) -> None:
        reason = LossReason.UNREACHABLE if self.wire.error is not None else LossReason.EXPIRED
        logger.warning(
            "ZooKeeper session %x: no reply within its timeout; its leases are lost (%s)",
            self.wire.session_id,
            reason.value,
        )
        self.lose_all(reason, self.wire.session_id)

    async def _ping(self) -> None:
        self.pings += 1
        timeout = max(min(self.wire.timeout, self.wire.negotiated / 3), RETRY_MIN)
        await self.wire.send(self.wire.exists(self.wire.path(self.ping_path)), timeout=timeout)
        if self.zombies:
            await self._delete_zombies()

    async def _delete_zombies(self) -> None:
        sid = self.wire.session_id
        doomed = [p for p, s in self.zombies.items() if s == sid]
        self.zombies = {p: s for p, s in self.zombies.items() if s == sid}
        if doomed:
            await self.wire.send(*(self.wire.delete(self.wire.path(p)) for p in doomed))
        for path in doomed:
            self.zombies.pop(path, None)

    async def _expire_horizons(self, current: float) -> None:
        due = [e for e in self.entries.values() if e.horizon <= current]
        for entry in due:
            self.expired_entries += 1
            self.zombies[entry.path] = entry.session_id
            self.end(entry, LossReason.EXPIRED)
        if due:
            try:
                await self._delete_zombies()
            except BackendError as exc:
                logger.info("deleting expired ZooKeeper nodes failed (retried): %s", exc)
