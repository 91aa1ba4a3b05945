"""Waiters of one SQL backend object, oldest first, for direct hand-offs and wake-one.

A lease row has no queue, so every waiter used to wake on every change and retry:
a herd, where the releasing task (already running) usually won again. Within one
backend object (one process) :class:`Turns` keeps the tasks waiting for a name in
the order they first asked, and:

* **hands off**: a release through this backend gives the row to the oldest waiter
  in the release statement itself (token + 1, its own ttl, identity and metadata);
  that waiter's next ``try_acquire`` is answered from :meth:`Turns.take` without a
  statement, and the time its grant's statement was sent is the grant's ``sent_at``;
* **wakes one**: a change seen otherwise (NOTIFY from another process) wakes only the
  oldest waiter; a woken waiter that leaves without retrying passes the wake on.

Driver-free and asyncio-only, like :mod:`aiolease.backends.sql`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Turn", "Turns"]

#: The most refused callers remembered between their refusal and their wait.
_MAX_ASKED = 4096


@dataclass(eq=False)
class Turn:
    """A task waiting for its turn at a name."""

    owner: str
    ttl: float
    identity: str
    metadata: str
    since: float
    #: Where the backend's listener stood when the refusal was sent (``None``: not up).
    mark: tuple[int, int] | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    #: (token, when the statement that grants it was sent); token 0 while in flight.
    grant: tuple[int, float] | None = None
    #: The backend's listener mark when that statement was sent.
    grant_mark: tuple[int, int] | None = None
    #: Set when a hand-off to it has ended, either way.
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    #: It left by an exception: a hand-off that ends later gives its grant back.
    cancelled: bool = False
    #: A hand-off to it failed midway (the statement may have committed): it may hold
    #: the row, so a waiter that stops gives it back.
    doubt: bool = False
    gone: bool = False


class Turns:
    """The waiters of one backend object, per name, oldest first."""

    def __init__(self) -> None:
        self._asked: dict[tuple[str, str], Turn] = {}
        self._queues: dict[str, list[Turn]] = {}
        self._handed: dict[tuple[str, str], Turn] = {}

    def refused(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: str,
        at: float,
        mark: tuple[int, int] | None = None,
    ) -> None:
        """Remember what a refused caller asked for, and since when it has been asking."""
        if len(self._asked) >= _MAX_ASKED:
            self._asked.clear()  # callers that never waited (acquire_nowait)
        first = self._asked.get((name, owner))
        since = at if first is None else first.since
        self._asked[(name, owner)] = Turn(owner, ttl, identity, metadata, since, mark)

    def done(self, name: str, owner: str) -> None:
        """``owner`` stopped asking for ``name`` (granted, or released)."""
        self._asked.pop((name, owner), None)
        self._handed.pop((name, owner), None)

    @contextmanager
    def queued(self, name: str, owner: str) -> Iterator[Turn | None]:
        """Queue a refused caller while it waits (``None``: it was not refused here)."""
        turn = self._asked.get((name, owner))
        if turn is None:
            yield None
            return
        turn.event, turn.settled = asyncio.Event(), asyncio.Event()
        queue = self._queues.setdefault(name, [])
        at = len(queue)
        while at and queue[at - 1].since > turn.since:
            at -= 1
        queue.insert(at, turn)
        try:
            yield turn
        except BaseException:
            turn.cancelled = True
            self._asked.pop((name, owner), None)
            if turn.grant is None and turn.event.is_set():
                self.wake_one(name)  # it will not retry: pass its wake on
            raise
        finally:
            turn.gone = True
            queue.remove(turn)
            if not queue and self._queues.get(name) is queue:
                del self._queues[name]
        if turn.grant is not None and turn.grant[0]:
            self._handed[(name, owner)] = turn

    async def wait(
        self,
        name: str,
        owner: str,
        turn_wait: Callable[[Turn], Awaitable[None]],
        change_wait: Callable[[], Awaitable[None]],
        give_back: Callable[[int | None], Awaitable[object]],
    ) -> None:
        """A backend's ``wait_turn``: queued oldest first, wait with ``turn_wait`` (or,
        when ``owner`` was not refused here, ``change_wait``); a hand-off to it that is
        in flight is seen to its end. A wait that ends by an exception never leaves a
        grant handed to it held: ``give_back(token)`` releases it (``None``: a hand-off
        failed midway and may have committed).
        """
        with self.queued(name, owner) as turn:
            if turn is None:
                await change_wait()
                return
            try:
                await turn_wait(turn)
                if turn.grant is not None:
                    await turn.settled.wait()  # a hand-off to us is in flight: see it end
            except BaseException:
                await asyncio.shield(_leave(turn, give_back))
                raise

    def next(self, name: str) -> Turn | None:
        """The oldest waiter for ``name`` that has no grant yet."""
        for turn in self._queues.get(name, ()):
            if turn.grant is None and not turn.gone:
                return turn
        return None

    def waiting(self, name: str) -> tuple[Turn, ...]:
        """The waiters for ``name``, oldest first."""
        return tuple(self._queues.get(name, ()))

    def take(self, name: str, owner: str) -> Turn | None:
        """The turn of ``owner`` whose ``grant`` was handed over, once."""
        handed = self._handed.pop((name, owner), None)
        if handed is not None:
            self._asked.pop((name, owner), None)
        return handed

    def handed(self, name: str, owner: str) -> bool:
        return (name, owner) in self._handed

    def wake_one(self, name: str) -> None:
        """Wake the oldest waiter for ``name`` that is not awake yet."""
        for turn in self._queues.get(name, ()):
            if not turn.event.is_set():
                turn.event.set()
                return

    def wake_all(self) -> None:
        """Wake every waiter (notifications may have been missed)."""
        for queue in self._queues.values():
            for turn in queue:
                turn.event.set()


async def _leave(turn: Turn, give_back: Callable[[int | None], Awaitable[object]]) -> None:
    """A waiter stops by an exception: never leave a grant handed to it held."""
    in_flight = turn.grant is not None and not turn.grant[0]
    turn.cancelled = True  # from here on, a hand-off that succeeds gives it back itself
    if in_flight:
        await turn.settled.wait()
    elif turn.grant is not None:
        await give_back(turn.grant[0])
        return
    if turn.doubt:  # a hand-off to it failed midway: it may hold the row
        await give_back(None)
