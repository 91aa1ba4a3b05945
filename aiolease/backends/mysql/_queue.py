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
  own ttl): a waiter that died holds up the queue no longer than that, and its entry
  is deleted by a sweep of the table (:meth:`Queue.sweep`).

A waiter elsewhere learns of its hand-off by looking: of one backend's waiters for a
name only the oldest in the queue (:meth:`Queue.poller`) does, with a plain
``SELECT`` (no lock, no write) that also tells how many live waiters are ahead of
it. It looks the more often, the nearer it is to the head and the more recently its
place changed (:func:`pause`), from every 0.2 ms to every ``poll_interval``. A row
handed to it is its grant as it stands: its local deadline counts from the send time
of its newest look that found the row not its own (the hand-off came after, and the
server's expiry counts from the hand-off).

Driver-free and asyncio-only, like :mod:`aiolease.backends.mysql._turns`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .._asyncio import now, wait_event
from ..sql._running import finished
from ..sql._sweeps import SWEEP_AFTER, SWEEP_LIMIT, Sweeps
from ._bell import Bells
from ._statements import Sql
from ._turns import Turn, Turns

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
        #: The bells (a backend made from a URL), else ``None``: waiters only poll.
        self.bells: Bells | None = None
        #: Acquire statements sent by polling waiters.
        self.polls = 0
        #: Statements that wrote entries (join, refresh, leave, sweep).
        self.writes = 0
        self._sweeps = Sweeps()

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
        new = place.seq is None
        place.seq = await finished(self._join(_params(name, owner, ttl, turn)))
        place.joined = sent_at
        if new and self.bells is not None:  # the bell its successor waits on
            await self.bells.hold(name, place.seq)
            if self.places.get(key) is not place:  # it left meanwhile
                await self.bells.drop(name, place.seq)
        if new and self._sweeps.due():
            await self.sweep()
        return place

    async def sweep(self) -> int:
        """Delete expired entries (of dead waiters) of any name (see
        :class:`~aiolease.backends.sql._sweeps.Sweeps`); how many."""
        after = round(SWEEP_AFTER * 1_000_000)
        rows = await self._execute(self._sql.expired, [after, SWEEP_LIMIT], "rows")
        if not rows:
            return 0
        seqs = [int(row[0]) for row in rows]
        self.writes += 1
        return int(await self._execute(self._sql.sweep(len(seqs)), [*seqs, after], "count"))

    async def _join(self, params: dict[str, Any]) -> int:
        """Mark the row as having waiters (first: the mark covers every entry), then
        write the entry; its ``seq``."""
        await self._execute(self._sql.mark, params)
        return int(await self._execute(self._sql.wait, params))

    async def leave(self, name: str, owner: str) -> Place | None:
        """Delete ``owner``'s entry; the entry, if it had one (its bell is still held:
        :meth:`ring` it once the row is handed on)."""
        place = self.places.pop((name, owner), None)
        if place is None:
            return None
        self.writes += 1
        await self._execute(self._sql.leave, {"name": name.encode(), "owner": owner.encode()})
        return place

    def bell_statistics(self) -> dict[str, int]:
        """Waits sent on bells, and those that returned because the bell was let go."""
        bells = self.bells
        return {
            "bell_waits": 0 if bells is None else bells.waits,
            "rings": 0 if bells is None else bells.rings,
        }

    async def aclose(self) -> None:
        """End the waits on bells in flight, close the bells' connections."""
        if self.bells is not None:
            await self.bells.aclose()

    async def ring(self, name: str, place: Place) -> None:
        """Let go of the bell of an entry that left: its successor wakes and looks."""
        if self.bells is not None and place.seq is not None:
            await self.bells.drop(name, place.seq)

    def _ours(self, name: str, seq: int) -> bool:
        """Whether entry ``seq`` is one of this backend's (a waiter here, or a holder
        that was one)."""
        return any(p.seq == seq and n == name for (n, _), p in self.places.items())

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
        acquire statement. ``expiry``: when the holder's ttl runs out. Between looks
        it waits on the bell of the entry ahead of it (see
        :mod:`aiolease.backends.mysql._bell`), else (no such entry, or one whose bell
        was found free with nothing changed: nobody rings it) for its pause.
        """
        params = _params(name, owner, ttl, turn)
        params["seq"] = place.seq
        end = now() + min(ttl * REFRESH, 60.0)
        bells = self.bells if place.seq is not None else None
        #: The entry ahead (its ``seq``) and the token, at the last look.
        ahead_of: int | None = None
        token: int | None = None
        #: An entry ahead whose bell nobody rings (found free with nothing changed).
        silent: int | None = None
        first = True
        try:
            while True:
                at = now()
                wait = min(poll_interval, end - at)
                if expiry is not None and expiry > at:
                    wait = min(wait, expiry - at)
                rows: Any = None
                rung = False
                if bells is not None and first:
                    wait = 0.0  # look at once: which bell to wait on
                elif ahead_of is not None and self._ours(name, ahead_of):
                    pass  # a release here wakes it (``turn.event``): no bell needed
                elif bells is not None and ahead_of is not None and ahead_of != silent:
                    rang = await bells.wait(
                        name, ahead_of, wait, turn.event, self._sql.ring, params, owner
                    )
                    if rang is None:  # no wait could be sent: poll
                        silent = ahead_of
                        wait = min(wait, pause(place, at, poll_interval))
                    else:
                        wait = 0.0
                        rung, rows, sent_at = rang[0] == 1, rang[1], rang[2]
                else:
                    wait = min(wait, pause(place, at, poll_interval))
                first = False
                if rows is None:
                    woken = await wait_event(turn.event, wait)
                else:  # (the wait was the checkpoint)
                    woken = turn.event.is_set()
                if woken or turn.grant is not None:
                    return None
                if rows is not None:  # the look that came with the ring
                    seen, left = rows
                    mine = left is not None and left >= 0
                if rows is None or not mine:
                    sent_at = now()
                    self.polls += 1
                    rows = await self._execute(self._sql.peek, params, "rows")
                    seen, mine, free, ahead, before, left = (
                        rows[0] if rows else (0, 0, 1, 0, None, 0)
                    )
                if mine:
                    # Handed to it after its last look that found it not its own, and
                    # with ``left`` to run when this look ran (after ``sent_at``).
                    since = sent_at + min(float(left or 0) / 1e6 - ttl, 0.0)
                    return int(seen), max(place.refused_at, since)
                if free and not ahead:
                    sent_at = now()
                    # Seen to its end even if the caller is cancelled (see ``finished``).
                    result = int(await finished(self._ask(params)))
                    if result:
                        return result, sent_at
                place.refused_at = sent_at
                if ahead != place.ahead:
                    place.ahead, place.since = int(ahead), sent_at
                if rung and before == ahead_of and seen == token:
                    silent = ahead_of  # its bell was free, and nothing changed
                ahead_of, token = before, seen
                if now() >= end:
                    return None
        except BaseException:
            if bells is not None:
                await bells.abandon(owner)  # no session left blocked
            raise


def _params(name: str, owner: str, ttl: float, turn: Turn) -> dict[str, Any]:
    return {
        "name": name.encode(),
        "owner": owner.encode(),
        "identity": turn.identity.encode(),
        "metadata": turn.metadata.encode(),
        "ttl": float(ttl),
        "us": max(round(ttl * 1_000_000), 1),
    }
