"""The MySQL / MariaDB waiter queue: fair hand-offs across processes (no driver).

A lease row has no queue, and MySQL has no push: waiters in other processes used to
poll every ``poll_interval`` while the releasing process, already running, asked
again at once and kept winning. So refused callers that wait queue in a second
table, ``<table>_waiters`` (one entry per waiter: its owner, identity, metadata and
ttl, and ``seq``, its place, kept when it refreshes the entry), after marking the
row ``queued`` (until a second after the entry runs out), and

* a row that expired, or a free one marked ``queued``, is granted only to the
  oldest live waiter, or to anyone when none waits (a newcomer, the releaser too,
  queues);
* a release of a marked row hands it to the oldest live waiter (token + 1, the
  waiter's ttl, identity and metadata) or, with nobody waiting, frees it;
* an entry lives a ttl after it was last written (``UTC_TIMESTAMP(6)`` + the waiter's
  own ttl): a waiter that died holds up the queue no longer than that.

A waiter elsewhere learns of its hand-off by looking: of one backend's waiters for a
name only the oldest in the queue (:meth:`Queue.poller`) does, with a plain
``SELECT`` (no lock, no write) that also tells how many live waiters are ahead of
it. It looks the more often, the nearer it is to the head and the more recently its
place changed (:func:`pause`), from every 0.2 ms to every ``poll_interval``. A row
handed to it is its grant as it stands: its local deadline counts from the send time
of its newest look that found the row not its own (the hand-off came after, and the
server's expiry counts from the hand-off).

Driver-free and asyncio-only, like :mod:`aiolease.backends._sql_turns`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ._my_sql import Sql
from ._sql import finished, now, wait_event
from ._sql_turns import Turn, Turns

__all__ = ["Place", "Queue", "pause"]

#: The share of a waiter's ttl after which it refreshes its entry (and the longest a
#: poll lasts): well within the ttl that keeps the entry alive.
REFRESH = 0.25
#: The shortest pause between two polls of the head of the queue; a waiter with
#: ``k`` ahead of it pauses ``1 + 2k`` times as long.
POLL_FLOOR = 0.0002
#: The head asks again after this share of the time its place has not changed (the
#: longer the holder has held, the longer it may go on); a waiter with ``k`` ahead of
#: it, ``1 + k`` times this share: it is not its turn before the head's.
BACKOFF = 0.25


@dataclass(slots=True)
class Place:
    """A waiter's entry in the waiters table, as this backend last wrote and saw it."""

    #: When the newest statement that wrote the entry was sent (it lives a ttl after).
    joined: float
    #: Its place: the table's ``seq`` (``None`` until the first write returns).
    seq: int | None = None
    #: Live waiters ahead of it at its last poll (``None``: not polled yet).
    ahead: int | None = None
    #: When ``ahead`` last changed.
    since: float = 0.0
    #: When the newest statement was sent that found the row not this waiter's: a
    #: hand-off to it found later was made after, so its expiry is later than this
    #: plus the ttl (the first join counts too: no hand-off before the entry exists).
    refused_at: float = 0.0


def pause(place: Place, at: float, poll_interval: float) -> float:
    """How long a waiter waits before it asks again: a share of the time its place has
    not changed (the longer a holder has held it, the longer it may go on), at least
    a floor, at most ``poll_interval``."""
    if place.ahead is None:
        return POLL_FLOOR
    floor = POLL_FLOOR * (1 + 2 * place.ahead)
    backoff = BACKOFF * (1 + place.ahead)
    return min(max(backoff * (at - place.since), floor), poll_interval)


Execute = Callable[..., Awaitable[Any]]


class Queue:
    """The entries of one backend's waiters, and their polls."""

    def __init__(self, sql: Sql, execute: Execute, ask: Execute, turns: Turns) -> None:
        self._sql = sql
        self._execute = execute
        #: The acquire statement (and take-over, for a row that expired): the token or 0.
        self._ask = ask
        self._turns = turns
        self.places: dict[tuple[str, str], Place] = {}
        #: Acquire statements sent by polling waiters.
        self.polls = 0
        #: Statements that wrote entries (join, refresh, leave).
        self.writes = 0

    def poller(self, name: str) -> Turn | None:
        """The waiter here that is oldest in the queue (the one a hand-off from
        elsewhere would go to): the one that polls, and the one a release here hands
        to. By ``seq`` where known, else the oldest to have asked."""
        best: Turn | None = None
        best_seq: int | None = None
        for turn in self._turns.waiting(name):
            if turn.grant is not None or turn.gone:
                continue
            place = self.places.get((name, turn.owner))
            seq = None if place is None else place.seq
            if best is None or (seq is not None and (best_seq is None or seq < best_seq)):
                best, best_seq = turn, seq
        return best

    def wake_poller(self, name: str) -> None:
        """Wake the poller (it may have changed, or have been handed the name)."""
        turn = self.poller(name)
        if turn is not None:
            turn.event.set()

    async def join(self, name: str, owner: str, ttl: float, turn: Turn) -> Place:
        """Join the queue, or refresh the entry once a quarter of its ttl has passed."""
        key = (name, owner)
        sent_at = now()
        place = self.places.get(key)
        if place is not None and sent_at - place.joined < ttl * REFRESH:
            return place
        if place is None:  # before the statement: a release (of a cancelled wait) removes it
            place = self.places[key] = Place(sent_at, since=sent_at, refused_at=sent_at)
        self.writes += 2
        # Seen to its end even if the caller is cancelled: a cut-off write still commits
        # on the server, possibly after the release that takes the entry out again.
        place.seq = await finished(self._join(_params(name, owner, ttl, turn)))
        place.joined = sent_at
        return place

    async def _join(self, params: dict[str, Any]) -> int:
        """Mark the row as having waiters (first: the mark covers every entry), then
        write the entry; its ``seq``."""
        await self._execute(self._sql.mark, params)
        return int(await self._execute(self._sql.wait, params))

    async def leave(self, name: str, owner: str) -> bool:
        """Delete ``owner``'s entry; whether it had one."""
        if self.places.pop((name, owner), None) is None:
            return False
        self.writes += 1
        await self._execute(self._sql.leave, {"name": name.encode(), "owner": owner.encode()})
        return True

    async def poll(
        self,
        name: str,
        owner: str,
        ttl: float,
        turn: Turn,
        place: Place,
        expiry: float | None,
        poll_interval: float,
    ) -> tuple[int, float] | None:
        """Look again and again until a grant (its token, and a time before the server
        set its expiry), a change here (``turn.event``), or a quarter of ``ttl``
        (``None``).

        A look is a plain ``SELECT`` (no lock, no write). A row handed to this waiter
        is its grant as it stands; a free row with nobody ahead is asked for with the
        acquire statement. ``expiry``: when the holder's ttl runs out.
        """
        params = _params(name, owner, ttl, turn)
        end = now() + min(ttl * REFRESH, 60.0)
        while True:
            at = now()
            wait = pause(place, at, poll_interval)
            if expiry is not None and expiry > at:
                wait = min(wait, expiry - at)
            if await wait_event(turn.event, min(wait, end - at)) or turn.grant is not None:
                return None
            sent_at = now()
            self.polls += 1
            rows = await self._execute(self._sql.peek, params, "rows")
            token, mine, free, ahead = rows[0] if rows else (0, 0, 1, 0)
            if mine:
                return int(token), place.refused_at
            if free and not ahead:
                sent_at = now()
                # Seen to its end even if the caller is cancelled (see ``finished``).
                result = int(await finished(self._ask(params)))
                if result:
                    return result, sent_at
            place.refused_at = sent_at
            if ahead != place.ahead:
                place.ahead, place.since = int(ahead), sent_at
            if now() >= end:
                return None


def _params(name: str, owner: str, ttl: float, turn: Turn) -> dict[str, Any]:
    return {
        "name": name.encode(),
        "owner": owner.encode(),
        "identity": turn.identity.encode(),
        "metadata": turn.metadata.encode(),
        "ttl": float(ttl),
        "us": max(round(ttl * 1_000_000), 1),
    }
