"""Takeover watches without a task: held leases that the name's pub/sub messages end.

The core asks a push backend to report a takeover of each lease it holds
(:meth:`Backend.on_taken`); otherwise it runs a watch task per held lease, which
waits in ``wait_taken`` and reads the name after each message. The Redis backend
answers it from the messages its :class:`~aiolease.backends.redis._pubsub.Subscriptions`
already receive: every grant publishes the new owner on the name's channel (a
hand-off to a waiter goes on that waiter's backend's turns channel instead, with the
grant's token and ttl, see :mod:`aiolease.backends.redis._tickets`), and every
release without a hand-off publishes ``""``.

A message ends the lease only when it is known to be newer than the lease's own
grant. Messages arrive in publishing order, so the holder's *own* grant message (an
owner id is unique to one acquisition) marks the point from which any other message,
a release or a grant to another owner, means the lease is gone. That message is
sure to come only if the channel was subscribed, without a failure in between, from
before the acquisition attempt that led to the grant was sent (a hand-off is
published after the waiter's latest attempt ran): the backend marks the channel then
(:meth:`Subscriptions.mark`), and a grant without such a mark gets no callback (the
core then watches with its task, whose subscription then lingers for the next grants).
The messages already received since the mark are replayed first: the own grant's
message usually arrives with the grant's reply.
A grant heard as a hand-off on the turns channel is followed from where the name's
channel stood then: the same connection delivers both channels' messages in
publishing order, so every later message of the name's channel is newer than it.

After a failure of the pub/sub connection the lost messages are unknown: once the
channel is subscribed again, every later message counts (the holder's grant is older
than that subscription). A takeover whose message was lost ends nothing here; the
holder's next renewal finds the lease gone, within one renew interval, as with the
PostgreSQL backend's listener.

Asyncio-only like the backend; :meth:`Followers.follow` and the function it
returns are plain calls, which the core makes from trio's side of the bridge too.
"""

from __future__ import annotations

from collections.abc import Callable

from ...abc import LossReason
from ._pubsub import Mark, Subscriptions
from ._tickets import granted_to

__all__ = ["Followers"]

#: Grants remembered until the core follows them.
MAX_GRANTED = 1024


class _Follower:
    """One held lease: ``taken`` is called once, on the first message after its own
    grant's that is not its own."""

    def __init__(self, owner: bytes, taken: Callable[[LossReason], object], armed: bool) -> None:
        self.owner = owner
        self.taken: Callable[[LossReason], object] | None = taken
        self.armed = armed
        self.stop: Callable[[], None] | None = None

    def message(self, payload: bytes | None) -> None:
        if self.taken is None:
            return
        if payload is None:  # subscribed again after a gap: every later message counts
            self.armed = True
        elif payload.startswith(self.owner) and granted_to(payload) == self.owner:
            self.armed = True  # its own grant: later messages are newer than it
        elif self.armed:
            taken, self.taken = self.taken, None
            self.cancel()
            taken(LossReason.STOLEN)

    def cancel(self) -> None:
        self.taken = None
        stop, self.stop = self.stop, None
        if stop is not None:
            stop()


class Followers:
    """The held leases of one backend whose takeovers its pub/sub messages report.

    :param subscriptions: the backend's subscriptions
    """

    def __init__(self, subscriptions: Subscriptions) -> None:
        self._subscriptions = subscriptions
        #: Grants not yet followed (or released): the channel's mark from before each,
        #: and whether every message after that mark is newer than the grant.
        self._granted: dict[tuple[str, str], tuple[Mark, bool]] = {}

    def granted(self, name: str, owner: str, since: Mark | None, *, after: bool = False) -> None:
        """``owner`` was granted ``name`` by an attempt sent when its channel was at
        ``since`` (``None``: not subscribed then); or, ``after``, the grant was heard of
        (a hand-off on the waiter's turns channel, which the same connection receives
        in publishing order) when the channel was at ``since``."""
        if since is None:
            return
        if len(self._granted) >= MAX_GRANTED:  # grants the core never held: forget the oldest
            del self._granted[next(iter(self._granted))]
        self._granted[name, owner] = (since, after)

    def forget(self, name: str, owner: str) -> None:
        """``owner`` released ``name`` (or gave up its grant)."""
        self._granted.pop((name, owner), None)

    def follow(
        self, name: str, owner: str, channel: bytes, taken: Callable[[LossReason], object]
    ) -> Callable[[], None] | None:
        """Call ``taken(STOLEN)`` on the first message of ``channel`` after ``owner``'s
        grant of ``name`` that is not that grant's, until the returned function is called.

        :returns: how to stop; ``None`` if the grant's message may not be heard: the
            channel was not subscribed throughout since before the attempt that led to
            the grant (or the messages since are no longer kept)
        """
        found = self._granted.pop((name, owner), None)
        if found is None:
            return None
        since, armed = found
        follower = _Follower(owner.encode(), taken, armed)
        listening = self._subscriptions.listen(channel, since, follower.message)
        if listening is None:
            return None
        missed, follower.stop = listening
        for payload in missed:
            follower.message(payload)
        return follower.cancel
