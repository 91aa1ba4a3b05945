"""Fair hand-offs confirmed by the grant's own pub/sub message, without another request.

In fair mode a release grants the lease straight to the queue's head, and publishes
``<owner>\\n<token>:<px>``: the new owner, the token of the grant, and the
milliseconds the server keeps it (what is left of the waiter's queue entry). It goes
on the *turns* channel of the waiter's backend object, named in its queue entry,
which only that backend subscribes (it subscribes it with the first channel it
watches, and keeps it); on the name's channel only while somebody watches the name
(see :mod:`aiolease.backends.redis._scripts`). The waiter needs no wake-up list and
no ``BLPOP`` of its own: in :meth:`RedisBackend.wait_turn` it listens to both
channels (a :class:`Turn`), and its next ``try_acquire`` is answered from the
message. Processes that wait further back hear nothing of it.

**Which message counts.** A message naming the waiter confirms a grant only if its
token is greater than the holder's that the waiter's latest attempt was refused
with: tokens rise with every grant, and the holder an attempt sees is the latest
grant when it ran, so such a grant came after the attempt ran, and so after it was
sent. The grant's clock starts, safely, at that send time: the core counts the
lease's deadline from there (:attr:`Grant.sent_at`) with the shorter ttl, and renews
it early. A message naming the waiter without a usable token (an older aiolease, a
counter reset by a restart) only wakes it, and it then asks the server as before.

**What the waiter needs to hear.** The hand-off may come before the waiter listens:
it hears the messages since its latest attempt was sent, so each attempt keeps
where both channels stood then (:class:`Marks`); without them (a channel was not
subscribed throughout) the waiter subscribes and tries again at once instead of
waiting. The waiter next in line behind the head is told (``<owner>\\n+<px>``) how
long the head's grant lasts if it is not picked up (its waiter died), and retries
when it ends, which hands the lease on; unless the head waits through the same
backend, whose process is then alive (a head that gives up releases its grant). A
lost subscription wakes the waiter once the channel is subscribed again, and its own
time limit (the holder's expiry, a third of its ttl) bounds the wait anyway.

**The new holder's takeover watch.** Messages reach a backend over one connection,
in publishing order, whatever their channel: a hand-off heard on the turns channel
comes after every message of the name's channel published before it, so the
holder's watch counts every later message of the name's channel as newer than its
grant (the ticket keeps where the name's channel stood when the hand-off was heard;
:mod:`aiolease.backends.redis._takeover`).

The waits of one backend share one listener of its turns channel, which hands each
message to the wait of the owner it starts with: with many local waiters, a hand-off
costs one call, not one per wait.

A :class:`Turn` also serves the takeover watches' reading of a message
(:func:`granted_to`). Asyncio-only, like the backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

from ...abc import Grant
from .._asyncio import now
from ._pubsub import Mark, Subscriptions

__all__ = ["Handed", "Marks", "Tickets", "Turn", "granted_to", "handed", "next_in_line"]

#: Added to a hand-off's px before a waiter retries for it: Redis expires a key only
#: once its millisecond clock has passed it.
EXPIRY_SLACK = 0.002


class Handed(NamedTuple):
    """A hand-off read from a message: to whom, its token, and its server-side ttl (ms)."""

    owner: bytes
    token: int
    px: int


def handed(payload: bytes) -> Handed | None:
    """The hand-off that ``payload`` announces, if it is one (``<owner>\\n<token>:<px>``)."""
    global _last
    if payload is _last[0]:  # every listener of the channel is given the same message
        return _last[1]
    found = _handed(payload)
    _last = (payload, found)
    return found


def _handed(payload: bytes) -> Handed | None:
    owner, newline, rest = payload.rpartition(b"\n")
    if not newline:
        return None
    token, colon, px = rest.partition(b":")
    if colon and token.isdigit() and px.isdigit():
        return Handed(owner, int(token), int(px))
    return None


def next_in_line(payload: bytes) -> tuple[bytes, int] | None:
    """The waiter that ``payload`` tells it is next in line (``<owner>\\n+<px>``), and
    how many ms the grant to the waiter ahead of it lasts if never picked up."""
    owner, newline, rest = payload.rpartition(b"\n")
    if newline and rest[:1] == b"+" and rest[1:].isdigit():
        return owner, int(rest[1:])
    return None


#: The latest message parsed, and what it announced.
_last: tuple[bytes | None, Handed | None] = (None, None)


def granted_to(payload: bytes) -> bytes | None:
    """Whom a message of the channel announces a grant to (``None``: a release)."""
    if not payload:
        return None
    found = handed(payload)
    return payload if found is None else found.owner


class Turn:
    """One wait of a fair waiter for its turn, fed the name's messages (:meth:`message`)
    and those of its backend's turns channel (:meth:`turn`).

    :param owner: the waiter's owner id
    :param after: the token of the holder its latest attempt was refused with
    :param deadline: the loop time by which it retries anyway
    :param mark: where the name's channel stands now (for the holder's takeover watch)
    """

    def __init__(
        self, owner: str, after: int, deadline: float, mark: Callable[[], Mark | None]
    ) -> None:
        self.owner = owner.encode()
        self.after = after
        self.deadline = deadline
        self._mark = mark
        #: The hand-off the waiter got: its token and ttl (ms), and where the name's
        #: channel stood when it was heard.
        self.ticket: tuple[int, int, Mark | None] | None = None
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._timer = self._loop.call_at(deadline, self._end)

    def message(self, payload: bytes | None) -> None:
        """A message of the channel (``None``: subscribed again after messages were lost)."""
        if self._done.done():
            return
        if payload is None or payload == b"":
            self._end()  # messages lost, or the lease was freed: look
            return
        found = handed(payload)
        if found is None:
            if payload == self.owner:
                self._end()  # a grant to this waiter announced without its token: look
            return
        if found.owner == self.owner:
            self._mine(found)
            return
        self._behind(found.px)  # handed to another waiter

    def _behind(self, px: int) -> None:
        """The lease was handed to a waiter ahead, for ``px`` ms if it never picks it
        up: retry once that ends."""
        at = self._loop.time() + px / 1000 + EXPIRY_SLACK
        if at < self.deadline:
            self.deadline = at
            self._timer.cancel()
            self._timer = self._loop.call_at(at, self._end)

    def turn(self, payload: bytes | None) -> None:
        """A message of the backend's turns channel: hand-offs to its waiters, of any
        name (those to other waiters are none of this one's business); ``None``:
        subscribed again after messages were lost."""
        if self._done.done():
            return
        if payload is None:
            self._end()  # look
            return
        if not payload.startswith(self.owner):
            return  # another waiter's (the check that most messages end at)
        found = handed(payload)
        if found is not None:
            if found.owner == self.owner:
                self._mine(found)
            return
        after = next_in_line(payload)
        if after is not None and after[0] == self.owner:
            self._behind(after[1])

    def _mine(self, found: Handed) -> None:
        if found.token > self.after and found.px > 0:
            self.ticket = (found.token, found.px, self._mark())
        self._end()

    def _end(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    def cancel(self) -> None:
        """Nobody will wait: drop the timer."""
        self._timer.cancel()

    async def wait(self) -> None:
        """Until a message ends the wait, or the deadline passes."""
        try:
            await self._done
        finally:
            self._timer.cancel()


class Marks(NamedTuple):
    """Where a name's channel and the backend's turns channel stood at an attempt."""

    name: Mark | None
    turns: Mark | None


class Tickets:
    """The attempts of fair waiters through one backend, and the hand-offs they got."""

    def __init__(self) -> None:
        self._attempts: dict[tuple[str, str], tuple[float, Marks]] = {}
        self._tickets: dict[tuple[str, str], tuple[Grant, Mark | None]] = {}
        #: The owners waiting for their turn, by name.
        self._turns: dict[str, set[str]] = {}
        #: The waits that the turns channel's messages go to, by owner (a message
        #: starts with the owner it concerns), and how to stop listening to it.
        self._routes: dict[bytes, Turn] = {}
        self._routing: Callable[[], None] | None = None

    async def wait_turn(
        self,
        subscriptions: Subscriptions,
        name: str,
        owner: str,
        channel: bytes,
        turns: bytes,
        after: int,
        timeout: float,
    ) -> bool:
        """Wait as :class:`Turn` does, from ``owner``'s latest attempt on ``name``, and
        keep the hand-off it heard; ``False`` at once if ``channel`` (the name's) or
        ``turns`` (the backend's) was not subscribed throughout since that attempt (a
        hand-off may have come unheard).

        :param after: the token of the holder that attempt was refused with
        """
        attempt = self._attempts.get((name, owner))
        since = Marks(None, None) if attempt is None else attempt[1]
        loop = asyncio.get_running_loop()
        turn = Turn(owner, after, loop.time() + timeout, lambda: subscriptions.mark(channel))
        listen = subscriptions.listen
        heard = None if since.name is None else listen(channel, since.name, turn.message)
        told = None if since.turns is None else self._route(subscriptions, turns, since.turns, turn)
        if heard is None or told is None:
            for listening in (heard, told):
                if listening is not None:
                    listening[1]()
            turn.cancel()
            return False
        owners = self._turns.setdefault(name, set())
        owners.add(owner)
        try:
            for payload in heard[0]:
                turn.message(payload)
            for payload in told[0]:
                turn.turn(payload)
            await turn.wait()
        finally:
            heard[1]()
            told[1]()
            owners.discard(owner)
            if not owners and self._turns.get(name) is owners:
                del self._turns[name]
        self.turned(name, owner, turn)
        return True

    def _route(
        self, subscriptions: Subscriptions, turns: bytes, since: Mark, turn: Turn
    ) -> tuple[list[bytes], Callable[[], None]] | None:
        """:meth:`Subscriptions.listen` to ``turns`` for ``turn``, through one listener
        for all the waits of this backend, which hands each message to the wait it
        concerns only."""
        if self._routing is None:
            listening = subscriptions.listen(turns, since, self._routed)
            if listening is None:
                return None
            missed, self._routing = listening
        else:
            found = subscriptions.missed(turns, since)
            if found is None:
                return None
            missed = found
        self._routes[turn.owner] = turn

        def stop() -> None:
            if self._routes.get(turn.owner) is turn:
                del self._routes[turn.owner]
            if not self._routes and self._routing is not None:
                routing, self._routing = self._routing, None
                routing()

        return missed, stop

    def _routed(self, payload: bytes | None) -> None:
        """A message of the turns channel: to the wait of the owner it starts with
        (``None``, subscribed again after messages were lost: to every wait)."""
        if payload is None:
            for waiting in list(self._routes.values()):
                waiting.turn(None)
            return
        turn = self._routes.get(payload.partition(b"\n")[0])
        if turn is not None:
            turn.turn(payload)

    def has_turns(self, name: str) -> bool:
        """Whether somebody waits for its turn on ``name``."""
        return name in self._turns

    def waits(self, name: str, owner: str) -> bool:
        """Whether ``owner`` waits for its turn on ``name``."""
        return owner in self._turns.get(name, ())

    def attempt(self, name: str, owner: str, marks: Marks) -> None:
        """``owner`` is about to send an attempt on ``name``, the channels being at
        ``marks``: older hand-offs are void."""
        key = (name, owner)
        self._tickets.pop(key, None)
        self._attempts[key] = (now(), marks)

    def turned(self, name: str, owner: str, turn: Turn) -> None:
        """``owner``'s wait on ``name`` ended as ``turn`` did: keep the hand-off it
        heard, if any."""
        attempt = self._attempts.get((name, owner))
        if attempt is not None and turn.ticket is not None:
            token, px, mark = turn.ticket
            self._tickets[name, owner] = (Grant(token, px / 1000, sent_at=attempt[0]), mark)

    def take(self, name: str, owner: str) -> tuple[Grant, Mark | None] | None:
        """The hand-off ``owner`` got on ``name``, if any (then forgotten), and where the
        name's channel stood when it was heard."""
        key = (name, owner)
        self._attempts.pop(key, None)
        return self._tickets.pop(key, None)

    def forget(self, name: str, owner: str) -> None:
        """``owner`` is done with ``name`` (granted, or released)."""
        key = (name, owner)
        self._attempts.pop(key, None)
        self._tickets.pop(key, None)
