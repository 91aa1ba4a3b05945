"""Fair hand-offs confirmed by the waiter's own wake-up signal, without another round trip.

In fair mode a release grants the lease straight to the queue's head, and pushes
``<token>:<px>`` onto that waiter's signal list: the token of the grant, and the
milliseconds the server keeps it (what is left of the waiter's queue entry). The
waiter's ``BLPOP`` reply is then the server's confirmation of the grant, and the
next ``try_acquire`` of that waiter is answered from it.

The grant's clock starts, safely, at the send time of the waiter's latest attempt:
every attempt deletes the waiter's signals, so the hand-off came after the server
ran that attempt, and so after it was sent. The core counts the lease's deadline
from there (:attr:`Grant.sent_at`) with the shorter ttl, and renews it early.

A plain wake-up (``0``, or a signal from an older aiolease) only wakes the waiter,
which then asks the server as before. Each attempt also keeps where the name's
channel stood when it was sent (a :class:`~aiolease.backends._redis_pubsub.Mark`),
from which a takeover watch of the grant can count (see
:mod:`aiolease.backends._redis_takeover`). Asyncio-only, like the backend.
"""

from __future__ import annotations

import asyncio

from ..abc import Grant
from ._redis_pubsub import Mark

__all__ = ["Tickets"]


class Tickets:
    """The attempts of fair waiters through one backend, and the hand-offs they got."""

    def __init__(self) -> None:
        self._attempts: dict[tuple[str, str], tuple[float, Mark | None]] = {}
        self._tickets: dict[tuple[str, str], Grant] = {}

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

    def signalled(self, name: str, owner: str, reply: object) -> None:
        """``owner``'s ``BLPOP`` on ``name`` returned ``reply``: keep the hand-off it
        confirms, if it is one."""
        attempt = self._attempts.get((name, owner))
        if attempt is None or not isinstance(reply, (list, tuple)) or len(reply) != 2:
            return
        sent_at = attempt[0]
        value = reply[1]
        if isinstance(value, str):
            value = value.encode()
        if not isinstance(value, bytes):
            return
        token, colon, px = value.partition(b":")
        if colon and token.isdigit() and px.isdigit() and int(token) > 0 and int(px) > 0:
            self._tickets[name, owner] = Grant(int(token), int(px) / 1000, sent_at=sent_at)

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
