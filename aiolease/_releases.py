"""The releases of blocks that end in one step of the event loop, sent after it.

A block that ends sends its release at once where the backend can
(:meth:`Backend.release_now`: a waiter served by it gets the lease sooner). When
thousands of blocks end in the same step (all woken by one event), each such send
(a write to a socket) would run in that step, before the next block could judge its
lease: the last ones were judged after the others' sends, and the leases still held
got no renewal until all were sent. So only the first block of a step sends at once;
the others that end before it resumes join its :class:`Batch` (a list append), and
their releases are sent after the step, by one of them, a slice at a time with a
turn of the event loop in between: the renewals of the leases still held go out
between slices.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable

import anyio

from ._clock import current_time
from ._lease import log_fields
from .abc import Backend

__all__ = ["SLICE", "Batch", "Releases"]

logger = logging.getLogger("aiolease.lease")

#: How many deferred releases are sent between two turns of the event loop, at most.
SLICE = 64
#: How long the sends between two turns of the event loop may take, at most, in
#: seconds: a loaded process takes that long for fewer than :data:`SLICE` of them.
SLICE_TIME = 0.002

_releases: weakref.WeakKeyDictionary[Backend, Releases] = weakref.WeakKeyDictionary()


class Batch:
    """The releases deferred in one step: sent by the first of its blocks to resume."""

    __slots__ = ("_sending", "_sent_upto", "_slices", "entries", "sent")

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, int]] = []
        #: What :meth:`Backend.release_now` returned for each entry, once sent.
        self.sent: list[Awaitable[bool] | None] = []
        self._sending = False
        self._sent_upto = 0
        self._slices: dict[int, anyio.Event] = {}  # per slice, set once it is sent

    def add(self, name: str, owner: str, token: int) -> int:
        """Defer one release; its index."""
        self.entries.append((name, owner, token))
        return len(self.entries) - 1

    async def sent_for(self, backend: Backend, index: int) -> Awaitable[bool] | None:
        """The release of entry ``index``, as :meth:`Backend.release_now` returned it
        (``None``: call :meth:`Backend.release`): sent by this caller, with the rest of
        the batch, if nobody is sending them; else once its slice is sent. Call it
        shielded from cancellation."""
        while self._sent_upto <= index:
            if not self._sending:
                self._sending = True
                try:
                    await self._send(backend)
                finally:
                    self._sending = False
                    for sent in self._slices.values():  # (none left, normally)
                        sent.set()
                    self._slices.clear()
            else:
                event = self._slices.get(index // SLICE)
                if event is None:
                    event = self._slices[index // SLICE] = anyio.Event()
                await event.wait()
        return self.sent[index]

    async def _send(self, backend: Backend) -> None:
        entries, sent = self.entries, self.sent
        turned, since = current_time(), 0  # the last turn of the loop, and sends since
        while len(sent) < len(entries):  # (entries may still be added meanwhile)
            if since == SLICE or (since and current_time() - turned >= SLICE_TIME):
                await anyio.lowlevel.cancel_shielded_checkpoint()  # the loop turns
                turned, since = current_time(), 0
            since += 1
            name, owner, token = entries[len(sent)]
            try:
                sent.append(backend.release_now(name, owner, token))
            except Exception:  # a backend's bug: release() is called instead
                logger.exception(
                    "release_now of lease %r failed", name, extra=log_fields(name, token)
                )
                sent.append(None)
            self._sent_upto = len(sent)
            if len(sent) % SLICE == 0 or len(sent) == len(entries):
                event = self._slices.pop((len(sent) - 1) // SLICE, None)
                if event is not None:
                    event.set()


class Releases:
    """The releases of one backend object's blocks (see the module docstring)."""

    __slots__ = ("__weakref__", "batch")

    def __init__(self) -> None:
        #: The batch that blocks ending now join; ``None``: the next one sends at once.
        self.batch: Batch | None = None

    @classmethod
    def of(cls, backend: Backend) -> Releases:
        releases = _releases.get(backend)
        if releases is None:
            releases = _releases[backend] = cls()
        return releases

    def close(self, batch: Batch) -> None:
        """The step in which ``batch`` was opened is over: the next block sends at once."""
        if self.batch is batch:
            self.batch = None
