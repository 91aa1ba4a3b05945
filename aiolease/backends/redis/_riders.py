"""Fair attempts that ride along with a local holder's release, in the same script.

In fair mode a task that asks for a lease which another task of the same backend
holds is refused and queued: its attempt is a request whose reply arrives while the
holder holds, and wakes the event loop then (asyncio rounds the remaining time of
the holder's sleep up to whole milliseconds again, so every such wake-up lengthens
a short hold). The holder's release is the next request on the same connection
anyway: the attempt waits for it, briefly, and goes with it
(:meth:`RedisBackend.release`): its ACQUIRE arguments follow the release's own, and
the RELEASE script runs the attempt right after the release, as ACQUIRE would run an
attempt that took that long to arrive: it joins the queue behind everybody already
in it, and gets the lease at once if nobody was. One script instead of two saves
the server a script call per attempt, while the new holder's message waits for the
request to end. The script runs each attempt under ``pcall``: an attempt that fails
gets its own error, and the release stands.

The wait is bounded by :data:`RIDE_WAIT`: a holder that keeps the lease longer (or
lost it without releasing) lets the attempt go on its own then. An attempt that
rides is counted as sent when it was made: earlier than it really leaves, which is
the safe side for the grant's deadline and for the takeover watch's mark.

A refusal that comes back with a release that handed the lease to a waiter here is
kept until the next release this backend writes (:meth:`Riders.flush`), or for
:data:`RIDE_WAIT` at most. The refused attempt's task has nothing to do but start
waiting for its turn, and it would do that while the new holder's hold has begun:
the same rounding lengthens the hold by that work. Run after the next release is
written, the work fits in that request's round trip, when the loop is idle. The
waiter loses nothing: it hears every message since its attempt (see
:meth:`~aiolease.backends.redis._tickets.Tickets.wait_turn`), and its turn comes
after that release at the earliest.

Asyncio-only, like the backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._exceptions import BackendUnavailable
from .._asyncio import retrieve

if TYPE_CHECKING:
    from ._transport import Transport

__all__ = ["RIDE_WAIT", "Rider", "Riders", "send_with"]

#: Seconds an attempt waits at most for the local holder's release.
RIDE_WAIT = 0.005

#: What a rider's future is given when it must go on its own.
_ALONE = object()


@dataclass(eq=False)
class Rider:
    """One attempt waiting for a release to ride with: the ACQUIRE script's arguments
    (the RELEASE script runs the attempt after the release), and its reply."""

    args: Sequence[Any]
    reply: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def settle(self, reply: Any) -> None:
        """The reply to its attempt (an error reply as an exception value)."""
        if not self.reply.done():
            self.reply.set_result(reply)

    def fail(self, error: BaseException) -> None:
        """Its attempt's fate is unknown."""
        if not self.reply.done():
            self.reply.set_exception(error)
            self.reply.add_done_callback(retrieve)

    def alone(self) -> None:
        """It must be sent on its own."""
        self.settle(_ALONE)


class Riders:
    """The leases held through one backend, the attempts waiting to ride with their
    release, and the refusals kept until the next release (see the module).

    :param refused: whether a reply to an attempt is a refusal
    :param wait: seconds an attempt waits at most, and a refusal is kept at most
    """

    def __init__(self, refused: Callable[[Any], bool], wait: float = RIDE_WAIT) -> None:
        self._refused = refused
        self._wait = wait
        self._holders: dict[str, str] = {}
        self._waiting: dict[str, list[Rider]] = {}
        self._kept: list[tuple[Rider, Any]] = []
        self._flush_at: asyncio.TimerHandle | None = None

    def granted(self, name: str, owner: str) -> None:
        """``owner`` was granted ``name`` through this backend (or a release through it
        handed ``name`` to ``owner``, which waits through it)."""
        self._holders[name] = owner

    def must_wait(self, name: str, owner: str) -> bool:
        """Whether an attempt by ``owner`` on ``name`` waits for the local holder's release."""
        holder = self._holders.get(name)
        return holder is not None and holder != owner

    def holds(self, name: str, owner: str) -> bool:
        """Whether ``owner`` holds ``name`` through this backend."""
        return self._holders.get(name) == owner

    def released(self, name: str, owner: str) -> list[Rider]:
        """``owner`` is releasing ``name``: if it holds it through this backend, the
        attempts to send right after the release (the caller settles each)."""
        if self._holders.get(name) != owner:
            return []
        del self._holders[name]
        return self._waiting.pop(name, [])

    async def ride(
        self, name: str, args: Sequence[Any], alone: Callable[[], Awaitable[Any]]
    ) -> Any:
        """The reply to the attempt of ACQUIRE arguments ``args``, run by the local
        holder's release of ``name``,
        or by ``alone()`` once :data:`RIDE_WAIT` has passed.

        :returns: the reply; an error reply as an exception value
        """
        rider = Rider(args)
        self._waiting.setdefault(name, []).append(rider)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self._wait, self._due, name)
        try:
            reply = await rider.reply
        finally:
            timer.cancel()
            waiting = self._waiting.get(name)
            if waiting is not None and rider in waiting:
                waiting.remove(rider)
                if not waiting:
                    del self._waiting[name]
        return await alone() if reply is _ALONE else reply

    def _due(self, name: str) -> None:
        """An attempt on ``name`` waited long enough: all of them go on their own."""
        for rider in self._waiting.pop(name, []):
            rider.alone()

    def settle(self, riders: Sequence[Rider], replies: Sequence[Any], *, keep: bool) -> None:
        """Give each of ``riders`` its reply; if ``keep`` (the release handed the lease
        to a waiter here), keep the refusals until :meth:`flush`."""
        for rider, reply in zip(riders, replies, strict=True):
            if keep and self._refused(reply):
                self._kept.append((rider, reply))
            else:
                rider.settle(reply)
        if self._kept and self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(self._wait, self.flush)

    def flush(self) -> None:
        """Give the kept refusals to their attempts (a release was just written)."""
        if not self._kept:
            return
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        kept, self._kept = self._kept, []
        for rider, reply in kept:
            rider.settle(reply)

    @staticmethod
    def go_alone(riders: Sequence[Rider]) -> None:
        """Have each of ``riders`` send its attempt on its own."""
        for rider in riders:
            rider.alone()


#: Settles the riders of a request, given their replies and the release's reply.
Settle = Callable[[Sequence[Rider], Sequence[Any], Any], None]


async def send_with(
    transport: Transport,
    command: tuple[Any, ...],
    riders: Sequence[Rider],
    settle: Settle,
    *,
    announce_first: bool,
) -> Any:
    """Send the RELEASE ``command`` with the attempts of ``riders`` (their arguments
    after its own: the script runs them after the release), and settle the riders;
    the release's reply (an error reply as an exception value).

    :param announce_first: start with a ``PING``. Redis writes its pending replies
        newest client first, so a client with a reply pending before the script runs
        is written after the subscribers the script published to: a waiter in another
        process, handed the lease, wakes one server write sooner. (Same-process
        waiters are better served the other way: the releaser makes its next attempt,
        which may ride with the new holder's release, before the waiter starts its
        turn.) The ``PING`` costs the server a few microseconds.
    :param settle: gives the riders their replies (:meth:`Riders.settle`)
    :raises redis.exceptions.RedisError: the transport failed (the riders fail too)
    """
    request = _request(command, riders, announce_first)
    return await _settled(transport.batch(request, guard=True), riders, settle)


def sent_with(
    transport: Transport,
    command: tuple[Any, ...],
    riders: Sequence[Rider],
    settle: Settle,
    *,
    announce_first: bool,
) -> Awaitable[Any] | None:
    """:func:`send_with`'s request, written before returning if the transport can
    (:meth:`Transport.batch_now`); what awaits its reply (``None``: nothing was sent)."""
    request = _request(command, riders, announce_first)
    sent = transport.batch_now(request)
    return None if sent is None else _settled(sent, riders, settle)


def _request(
    command: tuple[Any, ...], riders: Sequence[Rider], announce_first: bool
) -> list[tuple[Any, ...]]:
    """The commands of a release request: the RELEASE script last."""
    if riders:
        command = (*command, *(arg for rider in riders for arg in rider.args))
    return [("PING",), command] if announce_first else [command]


async def _settled(replies: Awaitable[list[Any]], riders: Sequence[Rider], settle: Settle) -> Any:
    try:
        got = await replies
    except BaseException as exc:
        for rider in riders:
            rider.fail(BackendUnavailable(f"the request this attempt rode with failed: {exc!r}"))
        raise
    reply = got[-1]
    if not riders:
        return reply
    if not isinstance(reply, list):  # the script failed as a whole (NOSCRIPT, say)
        settle(riders, [reply] * len(riders), reply)
        return reply
    # {the release's reply, each attempt's}
    settle(riders, reply[1:], reply[0])
    return reply[0]
