"""The SQLite backend's lock waiters in one process, first come, first served.

SQLite has no push: a waiter used to wait for any change of the name in this process
(or its poll), and every release and grant woke every waiter of the name, each of
which read the row and asked again, one transaction after the other on the backend's
one connection. Sixteen tasks taking turns on one lock made about 100 hand-offs a
second, and the releasing task, already running, asked again first and won most of
them (one task got 66 times as many turns as another).

Now a refused ask that the core goes on to wait for (:meth:`LockTurns.join`, from
``wait_turn``) joins this backend object's queue of the name, and a release through
this backend hands the name to the first waiter of the queue in its own transaction
(the waiter's token, ttl, identity and metadata: as if its ask had just been
granted). The waiter takes that grant without a statement
(:class:`~aiolease.backends.sql._handed.Handed`), and only it wakes. Only the first
waiter wakes for any change of the name in this process (a release by another
backend object, say); the others wait for their own turn. Every waiter also asks
again after :attr:`~aiolease.backends.sqlite.SQLiteBackend.poll_interval`, for
changes made by other processes, as before.

A waiter that gives up is undone by the core's release with no token: it leaves the
queue, and a grant handed to it meanwhile is released, and handed on, by that same
release.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio

from .._clock import event

__all__ = ["Ask", "LockTurns", "notify", "watching"]

#: The most refused asks remembered (those that do not wait are then forgotten; past
#: as many waiting, they are too, and only poll).
_MAX_ASKS = 4096


@dataclass(frozen=True, slots=True)
class Ask:
    """A refused ask, as a release hands the name to it."""

    owner: str
    ttl: float
    identity: str
    metadata: str  # JSON, as the backend writes it


class LockTurns:
    """One backend object's lock waiters, per name, in the order they first waited."""

    def __init__(self) -> None:
        #: Refused asks, until granted or released.
        self._asks: dict[tuple[str, str], Ask] = {}
        #: Per name, the owners waiting (in ``wait_turn`` or between two of its calls).
        self._queues: dict[str, dict[str, None]] = {}
        #: The asks that :meth:`take_next` gave to a release in flight.
        self._taken: dict[tuple[str, str], Ask] = {}

    def refused(self, name: str, owner: str, ttl: float, identity: str, metadata: str) -> None:
        """``owner``'s ask was refused: what a hand-off to it would grant."""
        if len(self._asks) >= _MAX_ASKS:  # refusals of asks that did not wait (nowait)
            queued = {(n, o) for n, queue in self._queues.items() for o in queue}
            self._asks = {key: ask for key, ask in self._asks.items() if key in queued}
            if len(self._asks) >= _MAX_ASKS:  # a safety net: those waiting then only poll
                self._asks.clear()
                self._queues.clear()
                self._taken.clear()
        self._asks[name, owner] = Ask(owner, float(ttl), identity, metadata)

    def join(self, name: str, owner: str) -> bool:
        """``owner`` waits for its turn (it keeps its place if it was queued); whether it
        is first in the queue."""
        if (name, owner) not in self._asks:
            return True  # not refused here (as far as is remembered): it only polls
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = {}
        queue.setdefault(owner, None)
        return next(iter(queue)) == owner

    def leave(self, name: str, owner: str) -> None:
        """``owner`` was granted by its own ask, or released: it waits no more (nor
        goes back to the queue if a release in flight does not hand it the name)."""
        self._taken.pop((name, owner), None)
        if self._asks.pop((name, owner), None) is None:
            return
        queue = self._queues.get(name)
        if queue is not None:
            queue.pop(owner, None)
            if not queue:
                del self._queues[name]

    def take_next(self, name: str, skip: Collection[str]) -> Ask | None:
        """The first waiter of ``name`` not in ``skip``, out of the queue (a release is
        about to hand it the name; :meth:`put_back` if it did not)."""
        queue = self._queues.get(name)
        if not queue:
            return None
        for owner in queue:
            if owner not in skip:
                del queue[owner]
                if not queue:
                    del self._queues[name]
                ask = self._taken[name, owner] = self._asks.pop((name, owner))
                return ask
        return None

    def handed(self, name: str, ask: Ask) -> None:
        """The release handed the name to ``ask``'s waiter."""
        self._taken.pop((name, ask.owner), None)

    def put_back(self, name: str, ask: Ask) -> None:
        """A waiter that :meth:`take_next` gave, whose release handed nothing: first
        again, unless it left meanwhile (a cancelled wait's undo)."""
        if self._taken.pop((name, ask.owner), None) is None:
            return
        self._asks[name, ask.owner] = ask
        queue = self._queues.get(name, {})
        self._queues[name] = {ask.owner: None, **queue}


@dataclass
class _Waiters:
    event: anyio.Event
    count: int = 0


#: In-process wake-ups, keyed by (thread of the event loop, file, name). The thread
#: keeps an event from being set by another thread's event loop.
_wakeups: dict[tuple[int, str, str], _Waiters] = {}


@contextmanager
def watching(path: str, name: str) -> Iterator[anyio.Event]:
    key = (threading.get_ident(), path, name)
    entry = _wakeups.get(key)
    if entry is None:
        entry = _wakeups[key] = _Waiters(event())
    entry.count += 1
    try:
        yield entry.event
    finally:
        entry.count -= 1
        if entry.count == 0 and _wakeups.get(key) is entry:
            del _wakeups[key]


def notify(path: str, name: str) -> None:
    entry = _wakeups.pop((threading.get_ident(), path, name), None)
    if entry is not None:
        entry.event.set()
