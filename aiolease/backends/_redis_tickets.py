"""Fair hand-offs confirmed by the grant's own pub/sub message, without another request.

In fair mode a release grants the lease straight to the queue's head, and publishes
``<owner>\\n<token>:<px>`` on the name's channel: the new owner, the token of the
grant, and the milliseconds the server keeps it (what is left of the waiter's queue
entry). Every process that uses the name stays subscribed to the channel anyway
(takeover watches, :mod:`aiolease.backends._redis_takeover`), so this message costs
nothing more, and the waiter needs no wake-up list and no ``BLPOP`` of its own: in
:meth:`RedisBackend.wait_turn` it listens to the channel (a :class:`Turn`), and its
next ``try_acquire`` is answered from the message.

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
where the channel stood then (a :class:`~aiolease.backends._redis_pubsub.Mark`);
without one (the channel was not subscribed throughout) the waiter subscribes and
tries again at once instead of waiting. A hand-off to another waiter tells how long
that grant lasts if it is not picked up (its waiter died): every waiter then
retries when it ends, and the first retry hands the lease on. A lost subscription
wakes the waiter once the channel is subscribed again, and its own time limit
(the holder's expiry, a third of its ttl) bounds the wait anyway.

A :class:`Turn` also serves the takeover watches' reading of a message
(:func:`granted_to`). Asyncio-only, like the backend.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from ..abc import Grant
from ._redis_pubsub import Mark, Subscriptions

__all__ = ["Handed", "Tickets", "Turn", "granted_to", "handed"]

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


#: The latest message parsed, and what it announced.
_last: tuple[bytes | None, Handed | None] = (None, None)


def granted_to(payload: bytes) -> bytes | None:
    """Whom a message of the channel announces a grant to (``None``: a release)."""
    if not payload:
        return None
    found = handed(payload)
    return payload if found is None else found.owner


class Turn:
    """One wait of a fair waiter for its turn, fed the name's messages.

    :param owner: the waiter's owner id
    :param after: the token of the holder its latest attempt was refused with
    :param deadline: the loop time by which it retries anyway
    """

    def __init__(self, owner: str, after: int, deadline: float) -> None:
        self.owner = owner.encode()
        self.after = after
        self.deadline = deadline
        #: The hand-off the waiter got: its token and ttl (ms).
        self.ticket: tuple[int, int] | None = None
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
            if found.token > self.after and found.px > 0:
                self.ticket = (found.token, found.px)
            self._end()
            return
        # handed to another waiter: if it never picks it up, retry once it ends
        at = self._loop.time() + found.px / 1000 + EXPIRY_SLACK
        if at < self.deadline:
            self.deadline = at
            self._timer.cancel()
            self._timer = self._loop.call_at(at, self._end)

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


class Tickets:
    """The attempts of fair waiters through one backend, and the hand-offs they got."""

    def __init__(self) -> None:
        self._attempts: dict[tuple[str, str], tuple[float, Mark | None]] = {}
        self._tickets: dict[tuple[str, str], Grant] = {}
        #: The owners waiting for their turn, by name.
        self._turns: dict[str, set[str]] = {}

    async def wait_turn(
        self,
        subscriptions: Subscriptions,
        name: str,
        owner: str,
        channel: bytes,
        after: int,
        timeout: float,
    ) -> bool:
        """Wait as :class:`Turn` does, from ``owner``'s latest attempt on ``name``, and
        keep the hand-off it heard; ``False`` at once if ``channel`` was not subscribed
        throughout since that attempt (a hand-off may have come unheard).

        :param after: the token of the holder that attempt was refused with
        """
        since = self.mark(name, owner, None)
        turn = Turn(owner, after, asyncio.get_running_loop().time() + timeout)
        listening = None if since is None else subscriptions.listen(channel, since, turn.message)
        if listening is None:
            turn.cancel()
            return False
        missed, stop = listening
        owners = self._turns.setdefault(name, set())
        owners.add(owner)
        try:
            for payload in missed:
                turn.message(payload)
            await turn.wait()
        finally:
            stop()
            owners.discard(owner)
            if not owners and self._turns.get(name) is owners:
                del self._turns[name]
        self.turned(name, owner, turn)
        return True

    def has_turns(self, name: str) -> bool:
        """Whether somebody waits for its turn on ``name``."""
        return name in self._turns

    def waits(self, name: str, owner: str) -> bool:
        """Whether ``owner`` waits for its turn on ``name``."""
        return owner in self._turns.get(name, ())

    def attempt(self, name: str, owner: str, mark: Mark | None) -> None:
        """``owner`` is about to send an attempt on ``name``, its channel being at
        ``mark``: older hand-offs are void."""
        key = (name, owner)
        self._tickets.pop(key, None)
        self._attempts[key] = (asyncio.get_running_loop().time(), mark)

    def mark(self, name: str, owner: str, default: Mark | None) -> Mark | None:
        """The channel's mark at ``owner``'s latest attempt on ``name`` (``default`` if
        it made none)."""
        attempt = self._attempts.get((name, owner))
        return default if attempt is None else attempt[1]

    def turned(self, name: str, owner: str, turn: Turn) -> None:
        """``owner``'s wait on ``name`` ended as ``turn`` did: keep the hand-off it
        heard, if any."""
        attempt = self._attempts.get((name, owner))
        if attempt is not None and turn.ticket is not None:
            token, px = turn.ticket
            self._tickets[name, owner] = Grant(token, px / 1000, sent_at=attempt[0])

    def take(self, name: str, owner: str) -> Grant | None:
        """The hand-off ``owner`` got on ``name``, if any (then forgotten)."""
        key = (name, owner)
        self._attempts.pop(key, None)
        return self._tickets.pop(key, None)

    def forget(self, name: str, owner: str) -> None:
        """``owner`` is done with ``name`` (granted, or released)."""
        key = (name, owner)
        self._attempts.pop(key, None)
        self._tickets.pop(key, None)
