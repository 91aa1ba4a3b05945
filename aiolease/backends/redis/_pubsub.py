"""Change notifications for the Redis backend: one pub/sub connection, shared by all waiters.

Every task in :meth:`RedisBackend.wait_changed` watches the name's channel through
one :class:`Subscriptions` object per backend. A channel is subscribed while somebody
watches it. Its subscription is sent as ``SUBSCRIBE`` followed by ``PING <token>`` on
the same connection; the server answers in order, so the pong proves the subscription
is in place, and a change made after the watcher's next read cannot be missed.

**One owner task does all the I/O.** A watcher never touches the connection: it
records what it wants and waits for the owner's confirmation. The owner writes, its
listener (a child task) reads, and neither ever reconnects the connection: redis-py's
``PubSub`` reconnects from whichever task hit the failure, so a watcher sending
``SUBSCRIBE`` and the reader could reconnect, write and read one socket at once (a
write on a connection just closed, two reads of one stream). Instead, any failure ends
the connection's *generation*: the owner disconnects it, gives it back to the pool
(which connects afresh before reusing it), and opens a new one for the channels still
wanted. Messages can be lost while the connection is down, so a failure wakes every
watcher (a spurious wake-up only costs the watcher one read), and fails the
subscriptions not yet confirmed.

**Lingering, and reads that need no repeating.** A channel stays subscribed for
:data:`LINGER` seconds after its last watcher left, since a holder's watch and the
next waiter come back to it at once. Each channel counts the messages it got (a
failure of the connection counts too). A read of the name sent while the channel
was confirmed subscribed is recorded with that count (:meth:`Subscriptions.note_read`):
as long as the count has not moved, nothing has changed since that read on the
server, and a watcher that starts from it need not read again
(:meth:`Subscriptions.unchanged_since`).

**Listeners.** A held lease's takeover watch listens to its channel's messages
without a task (:meth:`Subscriptions.listen`, see
:mod:`aiolease.backends.redis._takeover`): each channel keeps its latest
:data:`RECENT` payloads, and a listener gets those since a :class:`Mark` it took
while the channel was confirmed subscribed, then every later one from the listener's
dispatch; a listener keeps the channel subscribed, as a watcher does.

**Connections.** The backend's transport opens the connection
(:mod:`aiolease.backends.redis._transport`): a lean one, whose messages hiredis parses
and the protocol callback dispatches without redis-py's read path, or one of
redis-py's pool.

Like the rest of the backend this module is asyncio-only (the core bridges it under
trio), so it uses asyncio's primitives, never anyio's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError

from .._asyncio import now, wait_event

__all__ = ["Connect", "Dispatch", "Listener", "Mark", "Subscriptions", "Wire"]

logger = logging.getLogger("aiolease.backends.redis")

#: Seconds a channel stays subscribed after its last watcher left.
LINGER = 5.0
#: Seconds between attempts to connect again after the connection failed.
RETRY_MIN = 0.05
RETRY_MAX = 1.0
#: Latest messages each channel keeps, for a listener that starts after them.
RECENT = 64

#: Given each message's payload; ``None`` when the channel was subscribed again after
#: the connection failed (messages in between were lost; later ones will come).
Listener = Callable[[bytes | None], None]


@dataclass(eq=False)
class _Attempt:
    """One subscription of a channel on one connection, until confirmed or failed."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None

    def settle(self, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class Mark(NamedTuple):
    """Where a channel stood at one moment while it was confirmed subscribed (see
    :meth:`Subscriptions.mark`)."""

    attempt: _Attempt
    messages: int


@dataclass(eq=False)
class _Channel:
    watchers: set[asyncio.Event] = field(default_factory=set)
    listeners: list[Listener] = field(default_factory=list)
    attempt: _Attempt = field(default_factory=_Attempt)
    #: Messages received, plus failures of the connection: any change moves it.
    messages: int = 0
    #: The payloads of the latest messages (a failure clears them).
    recent: deque[bytes] = field(default_factory=lambda: deque(maxlen=RECENT))
    #: Whether the listeners must be told, once subscribed again, that messages were lost.
    gap: bool = False
    #: The latest read noted: (its result, when it was sent, ``messages`` then).
    last_read: tuple[object, float, int] | None = None
    idle_since: float = 0.0
    prune: asyncio.TimerHandle | None = None

    def wake(self, payload: bytes | None = None) -> None:
        """A message (``payload``), or a failure (``None``)."""
        self.messages += 1
        if payload is None:
            self.recent.clear()
        else:
            self.recent.append(payload)
            for listener in list(self.listeners):
                listener(payload)
        for event in self.watchers:
            event.set()

    @property
    def idle(self) -> bool:
        return not self.watchers and not self.listeners

    @property
    def confirmed(self) -> bool:
        return self.attempt.done.is_set() and self.attempt.error is None


def _as_bytes(value: object) -> bytes | None:
    if isinstance(value, str):
        return value.encode()
    return value if isinstance(value, bytes) else None


Release = Callable[[], Awaitable[None]]
Dispatch = Callable[[object], None]


class Wire(Protocol):
    """One pub/sub connection, as the owner task uses it (each transport of
    :mod:`aiolease.backends.redis._transport` opens its own kind)."""

    @property
    def alive(self) -> bool:
        """Whether the connection is still open (writing must not reconnect it)."""

    async def write(self, commands: Sequence[tuple[Any, ...]]) -> None:
        """Send ``commands``; their replies go to the listener."""

    async def listen(self, dispatch: Dispatch) -> None:
        """Give every reply to ``dispatch`` until the connection fails (raises)."""

    async def release(self) -> None:
        """Disconnect it (and give it back to its pool)."""


#: Opens a connected pub/sub connection.
Connect = Callable[[], Awaitable[Wire]]


class Subscriptions:
    """Watch Redis pub/sub channels from many tasks over one connection.

    :param connect: opens the connection (a new one after each failure)
    :param confirm_timeout: seconds to wait for the server to confirm a subscription
    """

    def __init__(self, connect: Connect, confirm_timeout: float) -> None:
        self._connect = connect
        self._confirm_timeout = confirm_timeout
        #: The channels somebody watches: the owner makes the connection's match it.
        self._channels: dict[bytes, _Channel] = {}
        #: PING tokens awaiting their pong -> the subscriptions they confirm.
        self._pings: dict[bytes, list[tuple[_Channel, _Attempt]]] = {}
        self._changed = asyncio.Event()
        self._owner: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._delay = RETRY_MIN
        self._closed = False
        #: A channel subscribed along with the first one watched, and kept (a fair
        #: backend's turns channel: its waiters then need no subscription of their own).
        self.companion = b""

    @asynccontextmanager
    async def watch(self, channel: bytes) -> AsyncIterator[asyncio.Event]:
        """Subscribe to ``channel`` (if nobody does yet) and yield an event set on a message.

        Returns from entering only once the subscription is confirmed.

        :raises redis.exceptions.ConnectionError: the backend is closed, or the
            connection failed before the subscription was confirmed
        :raises TimeoutError: the server did not confirm it in time
        """
        if self._closed:
            raise RedisConnectionError("the backend is closed")
        entry = self._channels.get(channel)
        if entry is None:
            entry = self._channels[channel] = _Channel()
            if self.companion and self.companion not in self._channels:
                self._channels[self.companion] = _Channel()  # never pruned
            self._start()
        event = asyncio.Event()
        entry.watchers.add(event)
        try:
            attempt = entry.attempt
            if not await wait_event(attempt.done, self._confirm_timeout):
                raise TimeoutError(f"Redis did not confirm the subscription to {channel!r}")
            if attempt.error is not None:
                raise RedisConnectionError(
                    f"the Redis pub/sub connection failed: {attempt.error}"
                ) from attempt.error
            yield event
        finally:
            entry.watchers.discard(event)
            self._left(channel, entry)

    def _left(self, channel: bytes, entry: _Channel) -> None:
        """A watcher or listener left ``channel``: unsubscribe it after :data:`LINGER`
        seconds without any."""
        loop = self._loop
        if channel == self.companion:
            return  # kept
        if entry.idle and self._channels.get(channel) is entry and loop is not None:
            entry.idle_since = loop.time()
            if entry.prune is None:
                entry.prune = loop.call_later(LINGER, self._prune, channel, entry)

    def _prune(self, channel: bytes, entry: _Channel) -> None:
        """Unsubscribe ``channel`` if nobody watched it for :data:`LINGER` seconds."""
        entry.prune = None
        if not entry.idle or self._channels.get(channel) is not entry:
            return
        idle = now() - entry.idle_since
        if idle < LINGER:
            entry.prune = asyncio.get_running_loop().call_later(
                LINGER - idle, self._prune, channel, entry
            )
            return
        del self._channels[channel]
        self._changed.set()

    def stamp(self, channel: bytes) -> int | None:
        """A read of the name of ``channel`` is about to be sent: a stamp to give
        :meth:`noted` with its result, or ``None`` if the channel is not confirmed
        subscribed (then the read proves nothing about later changes)."""
        entry = self._channels.get(channel)
        return entry.messages if entry is not None and entry.confirmed else None

    def noted(self, channel: bytes, result: object, sent_at: float, stamp: int | None) -> None:
        """Record the result of the read stamped ``stamp``."""
        entry = self._channels.get(channel)
        if entry is not None and stamp is not None:
            entry.last_read = (result, sent_at, stamp)

    def mark(self, channel: bytes) -> Mark | None:
        """Where ``channel`` stands now, if it is confirmed subscribed: give it to
        :meth:`listen` to hear every message from this moment on."""
        entry = self._channels.get(channel)
        return (
            Mark(entry.attempt, entry.messages) if entry is not None and entry.confirmed else None
        )

    def missed(self, channel: bytes, since: Mark) -> list[bytes] | None:
        """The messages of ``channel`` received since ``since``; ``None`` if the channel
        did not stay subscribed since then, or those messages are no longer kept."""
        entry = self._channels.get(channel)
        if entry is None or entry.attempt is not since.attempt or not entry.confirmed:
            return None
        count = entry.messages - since.messages
        if count > len(entry.recent):
            return None
        return list(entry.recent)[len(entry.recent) - count :] if count else []

    def listen(
        self, channel: bytes, since: Mark, listener: Listener
    ) -> tuple[list[bytes], Callable[[], None]] | None:
        """Call ``listener`` with each message of ``channel`` from now on, keeping the
        channel subscribed, until the returned function is called; with it, the
        messages received since ``since``. ``None`` if the channel did not stay
        subscribed since then, or those messages are no longer kept.

        A plain call: the core makes it from trio's side of the bridge too.
        """
        missed = self.missed(channel, since)
        if missed is None:
            return None
        entry = self._channels[channel]
        entry.listeners.append(listener)

        def stop() -> None:
            if listener in entry.listeners:
                entry.listeners.remove(listener)
                self._left(channel, entry)

        return missed, stop

    def unchanged_since(self, channel: bytes, result: object) -> float | None:
        """If ``result`` is the latest read noted on ``channel`` and nothing changed since
        it was sent (the channel stayed subscribed, no message came), its send time."""
        entry = self._channels.get(channel)
        if entry is None or entry.last_read is None or not entry.confirmed:
            return None
        seen, sent_at, stamp = entry.last_read
        return sent_at if seen is result and stamp == entry.messages else None

    def _start(self) -> None:
        self._changed.set()
        if self._owner is None:
            self._loop = asyncio.get_running_loop()
            self._owner = self._loop.create_task(self._run())

    async def _run(self) -> None:
        while not self._closed:
            if not self._channels:
                self._changed.clear()
                await self._changed.wait()
                continue
            try:
                await self._generation()
            except Exception as exc:  # the owner must outlive any failure
                logger.info("Redis pub/sub connection failed, reconnecting: %r", exc)
                self._fail(exc)
                if not self._closed:
                    await asyncio.sleep(self._delay)
                    self._delay = min(self._delay * 2, RETRY_MAX)

    async def _generation(self) -> None:
        """Keep one connection's subscriptions in step with the watched channels, until
        it fails (raises) or the backend closes: the connection is then disconnected,
        never used again."""
        wire = await self._connect()
        self._delay = RETRY_MIN
        listener = asyncio.get_running_loop().create_task(wire.listen(self._dispatch))
        listener.add_done_callback(lambda _: self._changed.set())
        subscribed: dict[bytes, _Channel] = {}
        try:
            # Checked on every turn: redis-py may swallow the cancellation from aclose().
            while not self._closed:
                self._changed.clear()
                if listener.done():
                    listener.result()
                    raise RedisConnectionError("the pub/sub listener stopped")
                await self._sync(wire, subscribed)
                await self._changed.wait()
        finally:
            await asyncio.shield(self._end(listener, wire.release))

    async def _end(self, listener: asyncio.Task[None], release: Release) -> None:
        """Stop reading, then disconnect and give the connection back: nothing holds it
        once the pool can hand it out again."""
        listener.cancel()
        await asyncio.wait([listener])
        if not listener.cancelled():
            listener.exception()  # retrieved: asyncio does not log it as lost
        self._pings.clear()
        await release()

    async def _sync(self, wire: Wire, subscribed: dict[bytes, _Channel]) -> None:
        """Send what makes the connection's subscriptions those of ``self._channels``."""
        new = {ch: e for ch, e in self._channels.items() if subscribed.get(ch) is not e}
        gone = [ch for ch in subscribed if ch not in self._channels]
        if not new and not gone:
            return
        for ch in gone:
            del subscribed[ch]
        subscribed.update(new)
        commands: list[tuple[Any, ...]] = []
        if gone:
            commands.append(("UNSUBSCRIBE", *gone))
        if new:
            token = uuid.uuid4().hex.encode()
            self._pings[token] = [(e, e.attempt) for e in new.values()]
            commands += [("SUBSCRIBE", *new), ("PING", token)]
        if not wire.alive:  # sending would reconnect it
            raise RedisConnectionError("the pub/sub connection was closed")
        await wire.write(commands)

    def _dispatch(self, reply: object) -> None:
        if type(reply) is list and len(reply) == 3 and reply[0] == b"message":
            watched = self._channels.get(reply[1])  # the common case, said shortly
            if watched is not None:
                watched.wake(reply[2])
            return
        if isinstance(reply, (bytes, str)):  # a pong outside subscribed mode (RESP3)
            reply = [b"pong", reply]
        if not isinstance(reply, list) or len(reply) < 2:
            return
        kind = _as_bytes(reply[0]) or b""
        if kind.lower() == b"pong":
            for entry, attempt in self._pings.pop(_as_bytes(reply[1]) or b"", []):
                if entry.attempt is attempt:
                    attempt.settle()
                    if entry.gap:
                        entry.gap = False
                        for listener in list(entry.listeners):
                            listener(None)
            return
        watched = self._channels.get(_as_bytes(reply[1]) or b"")
        if watched is not None and kind.lower() == b"message" and len(reply) > 2:
            watched.wake(_as_bytes(reply[2]) or b"")

    def _fail(self, error: BaseException) -> None:
        """The connection is gone: fail what it did not confirm, wake every watcher."""
        self._pings.clear()
        for entry in self._channels.values():
            old, entry.attempt = entry.attempt, _Attempt()
            old.settle(error)
            entry.last_read = None
            entry.gap = True
            entry.wake()

    async def aclose(self) -> None:
        """Stop the owner and close the connection. Idempotent."""
        self._closed = True
        self._changed.set()
        for entry in self._channels.values():
            if entry.prune is not None:
                entry.prune.cancel()
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.cancel()
            await asyncio.wait([owner])  # unlike awaiting it, never raises its CancelledError
        self._fail(RedisConnectionError("the backend is closed"))
