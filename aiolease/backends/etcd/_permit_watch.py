"""The permit waits of one etcd backend, on one Watch stream (``docs/internals/etcd.md#permits``).

A refused permit request waits for the events on its name's permit keys after the
revision of its read (:class:`._permit_turn.Turn` counts them). It used to open a
Watch stream of its own per wait: three gRPC operations (the call, its create
message, its cancellation) and a stream's tasks in the client, and with ``n`` waiters
on a name every change reached the process ``n`` times. With 16 tasks on a semaphore
of limit 4, that was a stream per acquisition.

Instead the backend keeps one Watch stream for its permit waits, and on it one watcher
per name (a *feed*; etcd multiplexes watchers on a stream, each created and cancelled
by one message). A feed starts at the revision after the read of the waiter that
made it, and keeps the replies it delivered (the last :data:`FEED_HISTORY`): a waiter
that comes later, from a read at revision ``r``, is shown first the kept events after
``r``, then those that come, in order, each reply's events after ``r`` at once (etcd
never splits a revision). A waiter whose read is older than what a feed keeps gets a
feed of its own on the same stream, from its own revision. A feed that no waiter
needs for :data:`FEED_LINGER` seconds is cancelled; the stream is closed once it has
carried no feed for :data:`STREAM_LINGER` seconds.

Failures reach the waiters as with a stream each: a feed whose history was compacted
away ends its waiters' waits (they read the keys again); a feed cancelled by the
server (the member lost its leader), a broken stream or a closed backend raise
:class:`~aiolease.BackendUnavailable` in them (the core retries).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from aetcd import rpc

from ..._exceptions import BackendError, BackendUnavailable
from ._keys import Layout
from ._permit_turn import Change, decode
from ._wire import Wire

__all__ = ["PermitWaiter", "PermitWatches"]

logger = logging.getLogger("aiolease.backends.etcd")

Spawn = Callable[[Coroutine[Any, Any, None], str], None]
Accept = Callable[[Sequence[Change]], bool]

#: Replies a feed keeps for the waiters that come after them.
FEED_HISTORY = 64
#: Seconds a feed that no waiter needs is kept, for the name's next waiter.
FEED_LINGER = 1.0
#: Seconds the stream is kept open without a feed.
STREAM_LINGER = 5.0


class PermitWaiter:
    """One wait on a feed: :attr:`done` when ``accept`` took the events after
    ``after`` (or the feed was compacted); its exception if the feed failed."""

    __slots__ = ("accept", "after", "done", "feed")

    def __init__(self, after: int, accept: Accept, feed: _Feed) -> None:
        self.after = after
        self.accept = accept
        self.feed = feed
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def offer(self, changes: Sequence[Change]) -> bool:
        """Show it ``changes`` (one reply's), those after its read; whether it is done."""
        after = self.after
        if changes[-1].revision <= after:
            return False
        if changes[0].revision <= after:
            changes = [change for change in changes if change.revision > after]
        if self.accept(changes):
            self.done.set_result(None)
            return True
        return False


class _Feed:
    """The watcher of one name's permit keys on a stream, and the replies it kept."""

    __slots__ = ("history", "linger", "name", "since", "stream", "waiters", "watch_id")

    def __init__(self, stream: _Stream, name: str, watch_id: int, after: int) -> None:
        self.stream = stream
        self.name = name
        self.watch_id = watch_id
        #: Every event of revision ``>= since`` that the feed delivered is in ``history``.
        self.since = after + 1
        self.history: collections.deque[Sequence[Change]] = collections.deque()
        self.waiters: dict[PermitWaiter, None] = {}
        self.linger: asyncio.TimerHandle | None = None

    def covers(self, after: int) -> bool:
        """Whether a waiter that read at revision ``after`` can wait on it."""
        return self.since <= after + 1

    def deliver(self, changes: Sequence[Change]) -> None:
        """One reply's changes: keep them, and wake the waiters they end."""
        if len(self.history) >= FEED_HISTORY:
            dropped = self.history.popleft()
            self.since = dropped[-1].revision + 1
        self.history.append(changes)
        for waiter in [w for w in self.waiters if w.offer(changes)]:
            del self.waiters[waiter]


class _Stream:
    """One Watch stream and the feeds on it."""

    def __init__(self) -> None:
        self.feeds: dict[int, _Feed] = {}
        self.pending: list[Any] = []  # requests to send, in order
        self.wake = asyncio.Event()
        self.call: Any = None
        self.closing = False
        self.idle: asyncio.TimerHandle | None = None

    def send(self, request: Any) -> None:
        self.pending.append(request)
        self.wake.set()


class PermitWatches:
    """The feeds of one backend's permit waits, on one Watch stream.

    :param wire: where to open the stream
    :param layout: the backend's keys
    :param spawn: runs a background task owned by the backend
    """

    def __init__(self, wire: Wire, layout: Layout, spawn: Spawn) -> None:
        self._wire = wire
        self._layout = layout
        self._spawn = spawn
        self._stream: _Stream | None = None
        self._names: dict[str, list[_Feed]] = {}
        self._next_id = 1
        #: Feeds created so far (watchers on the stream).
        self.feeds = 0

    def wait(self, name: str, after: int, accept: Accept) -> PermitWaiter:
        """Wait for the events on ``name``'s permit keys after revision ``after``
        until ``accept`` takes them; :meth:`leave` the waiter when done with it."""
        feed = next((f for f in self._names.get(name, ()) if f.covers(after)), None)
        if feed is None:
            feed = self._open_feed(name, after)
        elif feed.linger is not None:
            feed.linger.cancel()
            feed.linger = None
        waiter = PermitWaiter(after, accept, feed)
        history = feed.history
        first = len(history)  # the first kept reply with an event after its read
        while first and history[first - 1][-1].revision > after:
            first -= 1
        for index in range(first, len(history)):
            if waiter.offer(history[index]):
                return waiter
        feed.waiters[waiter] = None
        return waiter

    def leave(self, waiter: PermitWaiter) -> None:
        """End ``waiter``'s wait (whether done or not)."""
        done = waiter.done
        if done.done():
            if not done.cancelled():
                done.exception()  # retrieved: whoever wanted it saw it
        else:
            done.cancel()
        feed = waiter.feed
        feed.waiters.pop(waiter, None)
        if (
            not feed.waiters
            and feed.linger is None
            and feed.stream.feeds.get(feed.watch_id) is feed
        ):
            loop = asyncio.get_running_loop()
            feed.linger = loop.call_later(FEED_LINGER, self._unneeded, feed)

    # -- feeds ----------------------------------------------------------------------------

    def _open_feed(self, name: str, after: int) -> _Feed:
        stream = self._stream
        if stream is None:
            stream = self._stream = _Stream()
            self._spawn(self._run(stream), "etcd permit watch")
        elif stream.idle is not None:
            stream.idle.cancel()
            stream.idle = None
        watch_id = self._next_id
        self._next_id += 1
        self.feeds += 1
        feed = _Feed(stream, name, watch_id, after)
        stream.feeds[watch_id] = feed
        self._names.setdefault(name, []).append(feed)
        create = self._layout.watch_permits(name, after)
        create.watch_id = watch_id
        stream.send(rpc.WatchRequest(create_request=create))
        return feed

    def _unneeded(self, feed: _Feed) -> None:
        """A feed no waiter needed for a while: cancel it on the server."""
        feed.linger = None
        if feed.waiters or not self._drop(feed):
            return
        stream = feed.stream
        cancel = rpc.WatchCancelRequest(watch_id=feed.watch_id)
        stream.send(rpc.WatchRequest(cancel_request=cancel))
        if not stream.feeds and stream.idle is None:
            loop = asyncio.get_running_loop()
            stream.idle = loop.call_later(STREAM_LINGER, self._close_idle, stream)

    def _drop(self, feed: _Feed) -> bool:
        """Take ``feed`` off its stream and its name; ``False`` if it was off already."""
        if feed.stream.feeds.pop(feed.watch_id, None) is None:
            return False
        if feed.linger is not None:
            feed.linger.cancel()
            feed.linger = None
        feeds = self._names.get(feed.name, [])
        if feed in feeds:
            feeds.remove(feed)
            if not feeds:
                del self._names[feed.name]
        return True

    def _end(self, feed: _Feed, error: BackendError | None) -> None:
        """``feed`` is over on the server: its waiters' waits end (``error`` raised)."""
        self._drop(feed)
        for waiter in feed.waiters:
            if not waiter.done.done():
                if error is None:
                    waiter.done.set_result(None)
                else:
                    waiter.done.set_exception(error)
        feed.waiters.clear()

    def _close_idle(self, stream: _Stream) -> None:
        stream.idle = None
        if stream.feeds or self._stream is not stream:
            return
        self._stream = None
        stream.closing = True
        if stream.call is not None:
            stream.call.cancel()

    # -- the stream -----------------------------------------------------------------------

    async def _run(self, stream: _Stream) -> None:
        """Open ``stream``, send what is queued and deliver what comes, until it fails or
        is closed for being idle; then end every feed left on it."""
        error: BackendError = BackendUnavailable("etcd permit watch: the backend closed")
        try:
            stream.call = call = await self._wire.open_watch()
            writer = asyncio.ensure_future(self._write(stream))
            try:
                while not stream.closing:
                    self._answer(stream, await self._wire.read_watch(call))
            finally:
                writer.cancel()
                call.cancel()
        except BackendError as exc:
            # A broken stream (gRPC says INTERNAL when a write fails as the server goes)
            # is the server unreachable, for every wait on it: they try again.
            error = exc
            if not isinstance(exc, BackendUnavailable):
                error = BackendUnavailable(f"etcd permit watch: the stream broke: {exc}")
                error.__cause__ = exc
            if not stream.closing:
                logger.info("etcd permit watch stream failed: %r", exc)
        finally:
            if self._stream is stream:
                self._stream = None
            stream.closing = True
            if stream.idle is not None:
                stream.idle.cancel()
            for feed in list(stream.feeds.values()):
                self._end(feed, error)

    async def _write(self, stream: _Stream) -> None:
        """Send the creates and cancellations queued, in order."""
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                while stream.pending:
                    await self._wire.write_watch(stream.call, stream.pending.pop(0))
        except BackendError as exc:
            logger.info("etcd permit watch: a write failed: %r", exc)
            stream.call.cancel()  # the reader sees the stream end

    def _answer(self, stream: _Stream, reply: Any) -> None:
        feed = stream.feeds.get(int(reply.watch_id))
        if feed is None:
            return  # cancelled meanwhile, or the answer to a cancel
        if reply.compact_revision:
            self._end(feed, None)  # its waiters read the keys again
        elif reply.canceled:
            self._end(feed, BackendUnavailable(f"etcd watch canceled: {reply.cancel_reason}"))
        elif reply.events:
            feed.deliver(decode(reply.events))  # once, for every waiter of the feed
