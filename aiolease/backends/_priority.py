"""A mutex whose urgent waiters go first (anyio; asyncio and trio).

A backend with one connection serialises its calls on a lock. With a FIFO lock, a
renewal that arrives behind a burst of a thousand acquires waits for all of them,
and the leases it renews run out meanwhile: SQLite lost 882 of 1,000 leases (ttl 1 s)
acquired at once that way. Renewals are urgent: they go before every waiting
acquire, read and release (FIFO within each class).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel

from .._clock import event

__all__ = ["PriorityLock"]


class PriorityLock:
    """A mutex: :meth:`hold` waits its turn, ``urgent=True`` ahead of the others."""

    def __init__(self) -> None:
        self._held = False
        self._urgent: deque[anyio.Event] = deque()
        self._others: deque[anyio.Event] = deque()

    @property
    def waiting(self) -> int:
        """How many callers wait for the lock."""
        return len(self._urgent) + len(self._others)

    @asynccontextmanager
    async def hold(self, *, urgent: bool = False) -> AsyncIterator[None]:
        """Hold the lock for the block.

        :param urgent: go before every caller waiting without it
        """
        await self._acquire(urgent)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, urgent: bool) -> None:
        await anyio.lowlevel.checkpoint_if_cancelled()
        if not self._held:
            self._held = True
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return
        turn = event()
        queue = self._urgent if urgent else self._others
        queue.append(turn)
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # handed over just as it was cancelled: pass it on
                self._release()
            else:
                queue.remove(turn)
            raise

    def _release(self) -> None:
        """Hand the lock to the first urgent waiter, else the first other one."""
        for queue in (self._urgent, self._others):
            if queue:
                queue.popleft().set()  # it holds the lock from now on
                return
        self._held = False
