"""One Watch stream that tells a backend at once when a key it holds is deleted.

Without it the core would watch every held lease on its own: a read and a watch
per lease and ttl, some 2,000 round trips per ttl for 1,000 leases. Instead each
backend keeps one gRPC Watch stream, and one watcher on it per held key: etcd
multiplexes watchers on a stream, and each is created and cancelled by one
message, without waiting for an answer. So holding N leases costs no round trips
beyond the session's keepalive.

A ``DELETE`` of a held key (by an operator, by another client, or by etcd when the
session lease was revoked) ends the entry with ``STOLEN`` at once, and the core
hears it through :meth:`EtcdBackend.hold`'s callback (so it runs no takeover watch of
its own) or :meth:`EtcdBackend.wait_lost`.

Each watcher starts at the revision after the key was created (the grant's token),
so a delete that happens before the watcher exists is replayed, not missed. That
lets the requests wait a little (:data:`BATCH`) and go out together: a lease held
for less than that never costs a message (nor a task) at all. When
the stream breaks, it is opened again and every watcher is created anew from the
same revision; if etcd has compacted that history away, the key is read instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aetcd import rpc

from ..._exceptions import BackendError
from .._asyncio import now
from ._keys import Layout
from ._session import RETRY_MIN, Entry
from ._wire import Wire

__all__ = ["Takeovers"]

logger = logging.getLogger("aiolease.backends.etcd")

Spawn = Callable[[Coroutine[Any, Any, None], str], None]

#: Seconds that watcher requests wait to be sent together (and a watcher and its
#: cancellation, to cancel out): the longest a takeover of a fresh grant goes unseen.
BATCH = 0.02


#: In the queue of requests to send: a watcher's create request, built when sent.
_CREATE: Any = object()
#: Not in that queue: the request was sent.
_SENT: Any = object()


class Takeovers:
    """The watchers of one backend's held keys, on one Watch stream.

    :param wire: where to open the stream
    :param layout: the backend's keys
    :param spawn: runs a background task owned by the backend
    :param stolen: called with an entry whose key was deleted (once per entry)
    """

    def __init__(
        self, wire: Wire, layout: Layout, spawn: Spawn, stolen: Callable[[Entry], None]
    ) -> None:
        self._wire = wire
        self._layout = layout
        self._spawn = spawn
        self._stolen = stolen
        self._watched: dict[int, Entry] = {}
        self._after: dict[int, int] = {}  # watch id -> watch from the revision after this
        self._pending: dict[int, Any] = {}  # watch id -> the request still to send
        self._ids: dict[int, int] = {}  # id(entry) -> watch id
        self._next_id = 1
        self._wake = asyncio.Event()
        self._running = False
        self._starting: asyncio.TimerHandle | None = None
        #: Watch streams opened so far.
        self.streams = 0

    def watch(self, entry: Entry) -> None:
        """Watch ``entry``'s key from the revision after its grant."""
        if id(entry) in self._ids or entry.reason is not None:
            return
        watch_id = self._next_id
        self._next_id += 1
        self._ids[id(entry)] = watch_id
        self._watched[watch_id] = entry
        self._after[watch_id] = entry.token
        self._send(watch_id, _CREATE)  # built when sent: most leases end before that
        if not self._running and self._starting is None:
            # The stream's task starts only when a watcher has waited its batch: a lease
            # held for less than that costs no task either.
            self._starting = asyncio.get_running_loop().call_later(BATCH, self._start)

    def _start(self) -> None:
        self._starting = None
        if self._watched and not self._running:
            self._running = True
            self._spawn(self._run(), "etcd takeover watch")

    def unwatch(self, entry: Entry) -> None:
        """Stop watching ``entry``'s key (it ended)."""
        watch_id = self._ids.pop(id(entry), None)
        if watch_id is None:
            return
        del self._watched[watch_id], self._after[watch_id]
        if self._pending.pop(watch_id, _SENT) is _SENT:  # sent: cancel it on the server
            request = rpc.WatchRequest(cancel_request=rpc.WatchCancelRequest(watch_id=watch_id))
            self._send(watch_id, request)

    def _create(self, watch_id: int) -> Any:
        entry = self._watched[watch_id]
        key = self._layout.key(entry.name, entry.slot)
        create = self._layout.watch_delete(key, self._after[watch_id])
        create.watch_id = watch_id
        return rpc.WatchRequest(create_request=create)

    def _send(self, watch_id: int, request: Any) -> None:
        self._pending[watch_id] = request
        self._wake.set()

    # -- the stream -------------------------------------------------------------------

    async def _run(self) -> None:
        """Keep a stream open while anything is watched; reopen it after a failure."""
        delay = RETRY_MIN
        try:
            while self._watched:
                opened = now()
                try:
                    await self._stream()
                except BackendError as exc:
                    logger.info("etcd takeover watch stream failed, reopening: %r", exc)
                if now() - opened > 1.0:
                    delay = RETRY_MIN  # it was up for a while: a new failure
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        finally:
            self._running = False

    async def _stream(self) -> None:
        call = await self._wire.open_watch()
        self.streams += 1
        # A new stream knows no watcher: create every one again, cancel nothing.
        self._pending = {watch_id: self._create(watch_id) for watch_id in self._watched}
        self._wake.set()
        writer = asyncio.ensure_future(self._write(call))
        try:
            while True:
                reply = await self._wire.read_watch(call)
                self._answer(reply)
        finally:
            writer.cancel()
            call.cancel()

    async def _write(self, call: Any) -> None:
        """Send what :meth:`watch` and :meth:`unwatch` queued, in any order."""
        batch = 0.0  # a new stream sends what is pending at once: it waited already
        try:
            while True:
                await self._wake.wait()
                if batch:
                    await asyncio.sleep(batch)
                batch = BATCH
                self._wake.clear()
                while self._pending:
                    watch_id = next(iter(self._pending))
                    request = self._pending.pop(watch_id)
                    if request is _CREATE:
                        request = self._create(watch_id)
                    await self._wire.write_watch(call, request)
        except BackendError as exc:
            logger.info("etcd takeover watch: a write failed: %r", exc)
            call.cancel()  # the reader sees the stream end, and it is reopened

    def _answer(self, reply: Any) -> None:
        watch_id = int(reply.watch_id)
        entry = self._watched.get(watch_id)
        if entry is None:
            return  # unwatched meanwhile, or the answer to a cancel
        if any(event.type == rpc.Event.DELETE for event in reply.events):
            self.unwatch(entry)
            self._stolen(entry)
        elif reply.compact_revision:
            self._spawn(self._check(watch_id, entry), f"etcd takeover check {entry.name!r}")
        elif reply.canceled:
            logger.info(
                "etcd cancelled a takeover watcher (%s); creating it again", reply.cancel_reason
            )
            self._send(watch_id, self._create(watch_id))

    async def _check(self, watch_id: int, entry: Entry) -> None:
        """The history since the grant is compacted: read the key instead, and watch on
        from the revision read (retried until answered, or the entry is unwatched)."""
        delay = RETRY_MIN
        key = self._layout.key(entry.name, entry.slot)
        while self._watched.get(watch_id) is entry:
            try:
                reply = await self._wire.range(rpc.RangeRequest(key=key))
            except BackendError as exc:
                logger.info("etcd takeover check of %r failed: %r", entry.name, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if self._watched.get(watch_id) is not entry:
                return
            if not reply.kvs or int(reply.kvs[0].create_revision) != entry.token:
                self.unwatch(entry)
                self._stolen(entry)
                return
            self._after[watch_id] = int(reply.header.revision)
            self._send(watch_id, self._create(watch_id))
            return
