"""The time bounds of shielded releases under asyncio: one loop timer for all of them.

A release is awaited in a shielded cancel scope that is cancelled once its bound
(:meth:`Timing.release_bound`) has passed. anyio gives a scope with a deadline a timer
of the event loop's own, made on entering it and cancelled on leaving it: a handle
made, pushed on the loop's heap (whose entries compare in Python) and left there
cancelled until the loop sweeps it, per release. Here the scope has no deadline of its
own: its bound goes on a heap of this module's, one per event loop, and one loop timer,
at the earliest bound still in force, cancels the scopes whose bound has passed (as
anyio's timer would: ``scope.cancel()``, from the loop). A release that ends marks
its entry done; done entries are dropped when the timer fires, or swept once they
outnumber the releases in flight, so that the heap stays as small as what is in flight.

Under trio (which has no asyncio loop) the scope keeps its own deadline, as before.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import weakref

import anyio

__all__ = ["Bounds"]

#: One entry: (bound, sequence number, [the scope to cancel then, or ``None``: done]).
Entry = tuple[float, int, list["anyio.CancelScope | None"]]

_bounds: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Bounds] = weakref.WeakKeyDictionary()


class Bounds:
    """The release bounds of one event loop (see the module docstring)."""

    __slots__ = ("__weakref__", "_armed", "_heap", "_live", "_loop", "_seq", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._heap: list[Entry] = []
        self._seq = itertools.count()
        self._live = 0
        self._timer: asyncio.TimerHandle | None = None
        self._armed = 0.0

    @staticmethod
    def of(loop: asyncio.AbstractEventLoop) -> Bounds | None:
        """The bounds of ``loop`` (``None``: a loop that takes no weak reference)."""
        last = _last[0]
        if last is not None and last._loop() is loop:
            return last
        try:
            bounds = _bounds.get(loop)
            if bounds is None:
                bounds = _bounds[loop] = Bounds(loop)
        except TypeError:
            return None
        _last[0] = bounds
        return bounds

    def add(self, at: float, scope: anyio.CancelScope) -> Entry:
        """Cancel ``scope`` at ``at`` (loop time) unless :meth:`done` comes first."""
        entry: Entry = (at, next(self._seq), [scope])
        heapq.heappush(self._heap, entry)
        self._live += 1
        timer = self._timer
        if timer is None or at < self._armed:
            if timer is not None:
                timer.cancel()
            loop = self._loop()
            assert loop is not None
            self._timer = loop.call_at(at, self._fire)
            self._armed = at
        return entry

    def done(self, entry: Entry) -> None:
        """The release of ``entry`` ended (its scope was left): nothing to cancel."""
        cell = entry[2]
        if cell[0] is not None:
            cell[0] = None
            self._live -= 1
            heap = self._heap
            if len(heap) > 2 * self._live + 64:  # mostly done entries: sweep them
                heap[:] = [e for e in heap if e[2][0] is not None]
                heapq.heapify(heap)

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop()
        if loop is None:
            return
        now = loop.time()
        heap = self._heap
        while heap and (heap[0][2][0] is None or heap[0][0] <= now):
            cell = heapq.heappop(heap)[2]
            scope = cell[0]
            if scope is not None:
                cell[0] = None
                self._live -= 1
                scope.cancel()
        if heap:
            self._armed = heap[0][0]
            self._timer = loop.call_at(self._armed, self._fire)


#: The bounds of the loop used last (looked up first: one loop runs them all, often).
_last: list[Bounds | None] = [None]
