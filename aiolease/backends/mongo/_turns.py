"""The fair waiters of one MongoDB backend object, and what wakes each.

The queue itself is in the lease document (see
:mod:`aiolease.backends.mongo._pipelines`); a release hands the lease to its head on
the server. Here, per waiting ``(name, owner)``, an event that the change stream sets:

* a grant to this owner (a hand-off): it is *woken*, and takes the grant without a
  command (see :meth:`MongoBackend.try_acquire
  <aiolease.backends.mongo.MongoBackend.try_acquire>`);
* a release with nobody to hand to, a lost stream, or closing: every waiter of the
  name is woken;
* a grant to anyone else: the waiter is not woken (it sends nothing), only re-timed:
  it asks again when that grant's ttl runs out, which the event tells on the server's
  clock (``expires`` minus the event's ``wallTime``), should its holder die.

Driver-free and asyncio-only.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

__all__ = ["Turn", "Turns"]


@dataclass(eq=False, slots=True)
class Turn:
    """One waiter's wait in the queue of a name."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by a hand-off to it or a release: ask again now.
    woken: bool = False
    #: The loop time the newest grant seen during this wait runs out (re-timing).
    until: float = math.inf
    #: The token of a hand-off to it (taken by its next ask without a command).
    handed: int | None = None


class Turns:
    """The waiters of one backend object, by name and owner."""

    def __init__(self) -> None:
        self._by_name: dict[str, dict[str, Turn]] = {}

    def __len__(self) -> int:
        return sum(len(turns) for turns in self._by_name.values())

    def start(self, name: str, owner: str) -> Turn:
        """``owner`` starts (or goes on) waiting for ``name``."""
        turn = self._by_name.setdefault(name, {}).setdefault(owner, Turn())
        turn.until = math.inf
        if turn.handed is None:  # a hand-off that came before this wait still wakes it
            turn.woken = False
            turn.event.clear()
        return turn

    def take(self, name: str, owner: str) -> int | None:
        """The token of a hand-off to ``owner`` of ``name`` since its wait began, once."""
        turn = self._by_name.get(name, {}).get(owner)
        if turn is None:
            return None
        handed, turn.handed = turn.handed, None
        return handed

    def forget(self, name: str, owner: str) -> None:
        turns = self._by_name.get(name)
        if turns is not None:
            turns.pop(owner, None)
            if not turns:
                del self._by_name[name]

    def wake(self, name: str, owner: str | None = None) -> None:
        """Wake ``owner`` of ``name`` (``None``: every waiter of the name)."""
        for who, turn in self._by_name.get(name, {}).items():
            if owner is None or who == owner:
                turn.woken = True
                turn.event.set()

    def granted(self, name: str, owner: str, token: int | None, until: float | None) -> None:
        """``name`` was granted to ``owner`` (``token``) until ``until`` (loop time, if
        known): wake ``owner`` with the hand-off, re-time the others."""
        for who, turn in self._by_name.get(name, {}).items():
            if who == owner:
                turn.woken = True
                if token is not None and (turn.handed is None or token > turn.handed):
                    turn.handed = token
                turn.event.set()
            elif until is not None:
                turn.until = until
                turn.event.set()

    def wake_all(self) -> None:
        for name in list(self._by_name):
            self.wake(name)
