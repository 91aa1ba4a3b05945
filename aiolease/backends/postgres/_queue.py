"""The waiters of one PostgreSQL backend object: their asks, and the hand-offs to them.

The queue itself lives in the database (the waiters table, see
:class:`~aiolease.backends.postgres._statements.Sql`): a refused acquire writes its caller's row, a
release hands the lease row to the oldest live waiter in the release statement, and
says so by ``NOTIFY`` (``'h'``: token, the waiter's ask number, owner, name). This
keeps, per waiting caller of this backend, what a hand-off needs to be taken without
another statement:

* every ask is numbered, and its send time kept. The release statement echoes the
  number of the ask that wrote the row it saw; that ask's statement committed before
  the release's snapshot, so before the release read its clock: its send time is a
  safe start for the grant's local deadline (the grant lasts at least that ask's ttl
  from when it ran). The waiter's *latest* refused ask would not do: it may have run
  after the release read its clock, and still not seen its commit;
* the hand-offs, from the listener or from a release through this backend (which
  knows it before the notification arrives), and an event per ask that a hand-off,
  a release with nobody to hand to, or a reconnected listener sets;
* for the other waiters of the name, when the latest hand-off's grant runs out at
  the latest unless renewed (the ``'h'`` payload says how long it lasts): their wait
  ends then, so that a waiter that died while queued, handed the row, holds them up
  for no longer than what was left of its row (at most its own ttl). This re-times
  their wait without a statement; they ask again once, when it passes (granted if
  the handed owner never took it; refused and queued again, in their place, if it
  holds it and renews).

Driver-free and asyncio-only, like :mod:`aiolease.backends.sql`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from .._asyncio import now

__all__ = ["Asker", "Queue"]

#: The most callers remembered (those that never wait are forgotten by their release).
_MAX_ASKERS = 4096
#: The most asks remembered per caller (a hand-off sees one of the latest).
_MAX_ASKS = 16


@dataclass(eq=False, slots=True)
class Asker:
    """A caller of ``try_acquire`` on one name, from its first ask to its grant or release."""

    #: Ask number -> (send time, ttl asked for).
    asks: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: The send time of the latest refused ask (``None``: none refused yet).
    refused_at: float | None = None
    #: A hand-off to it: (token, send time of the ask it saw, that ask's ttl).
    handed: tuple[int, float, float] | None = None
    #: Set by a hand-off, a release, or a listener (re)connect after the latest ask
    #: (then ``woken`` too: ask again now), or by a hand-off to another waiter (which
    #: only re-times the wait: ``until``).
    event: asyncio.Event = field(default_factory=asyncio.Event)
    #: The wait ends: a hand-off to it, a release, or a listener (re)connect.
    woken: bool = False
    #: When (loop time) the grant of the latest hand-off to another waiter runs out
    #: unless renewed, and that hand-off's token.
    until: float = math.inf
    until_token: int = -1

    def wake(self) -> None:
        self.woken = True
        self.event.set()


class Queue:
    """The callers of one backend object that asked for a name and may wait for it."""

    def __init__(self) -> None:
        self._by_name: dict[str, dict[str, Asker]] = {}
        self._count = 0
        #: Ask numbers are unique per backend object, never per caller: a caller
        #: forgotten and met again cannot take an old hand-off for a later ask.
        self._asks = 0

    def sending(self, name: str, owner: str, ttl: float, at: float) -> int:
        """``owner`` sends an ask for ``name`` at ``at``: its number. Voids older hand-offs
        (the answer to this one says where it stands)."""
        askers = self._by_name.get(name)
        asker = None if askers is None else askers.get(owner)
        if asker is None:
            if self._count >= _MAX_ASKERS:
                self._by_name.clear()  # callers that never came back (a safety net)
                self._count = 0
            asker = Asker()
            self._by_name.setdefault(name, {})[owner] = asker
            self._count += 1
        else:
            asker.event = asyncio.Event()
            asker.handed = None
            asker.woken = False
            asker.until, asker.until_token = math.inf, -1
        self._asks += 1
        asker.asks[self._asks] = (at, ttl)
        if len(asker.asks) > _MAX_ASKS:
            del asker.asks[min(asker.asks)]
        return self._asks

    def refused(self, name: str, owner: str, ask: int) -> None:
        """Ask ``ask`` was refused (and wrote the caller's waiter row)."""
        asker = self.get(name, owner)
        if asker is not None and ask in asker.asks:
            asker.refused_at = asker.asks[ask][0]

    def get(self, name: str, owner: str) -> Asker | None:
        askers = self._by_name.get(name)
        return None if askers is None else askers.get(owner)

    def done(self, name: str, owner: str) -> None:
        """``owner`` stopped asking for ``name`` (granted, or released)."""
        askers = self._by_name.get(name)
        if askers is not None and askers.pop(owner, None) is not None:
            self._count -= 1
            if not askers:
                del self._by_name[name]

    def handed(
        self, name: str, owner: str, token: int, ask: int | None, lasts: float | None = None
    ) -> None:
        """The lease row of ``name`` was handed to ``owner`` with ``token``, from the row
        that its ask ``ask`` wrote, for ``lasts`` seconds at most unless renewed (from
        when the release ran: before now). Taken by ``owner`` if that ask is one of
        ours; the other waiters here wait no longer than that (without a statement)."""
        askers = self._by_name.get(name)
        if askers is None:
            return
        if lasts is not None:
            until = now() + lasts
            for who, other in askers.items():
                if who == owner or token < other.until_token:
                    continue  # the handed owner, or an older hand-off told late
                if token > other.until_token or until < other.until:
                    other.until, other.until_token = until, token
                other.event.set()  # re-timed: ``woken`` stays as it is
        asker = askers.get(owner)
        if asker is None or ask is None or ask not in asker.asks:
            return
        if asker.handed is None or asker.handed[0] < token:
            sent_at, ttl = asker.asks[ask]
            asker.handed = (token, sent_at, ttl)
        asker.wake()

    def take(self, name: str, owner: str, fresh_for: float) -> tuple[int, float, float] | None:
        """The hand-off to ``owner``, if the ask it saw was sent less than ``fresh_for``
        seconds ago (else the caller asks again: the retry is granted for a full ttl)."""
        asker = self.get(name, owner)
        if asker is None or asker.handed is None:
            return None
        handed, asker.handed = asker.handed, None
        return handed if now() - handed[1] < fresh_for else None

    def released(self, name: str) -> None:
        """``name`` was released with nobody to hand it to: every waiter asks again."""
        for asker in self._by_name.get(name, {}).values():
            asker.wake()

    def wake_all(self) -> None:
        """Wake every waiter (notifications may have been missed)."""
        for askers in self._by_name.values():
            for asker in askers.values():
                asker.wake()
