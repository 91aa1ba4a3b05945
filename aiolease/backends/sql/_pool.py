"""A lean connection pool for SQL backends that open their own connections.

The drivers' pools carry machinery the lease statements do not need: a timeout
armed around every acquire and release, connection proxies, reset queries,
inactivity timers. On a statement of a few hundred microseconds that machinery is
a visible share of the cost. :class:`LeanPool` is a deque of idle connections with:

* **a bound**: at most ``max_size`` connections exist at once (open, in use, or being
  opened); a caller that finds none idle opens one while fewer exist, and otherwise
  waits, first come first served, for one to be handed back;
* **the renewal reserve**: other statements hold at most ``max_size - 1`` connections
  at once, so the renewal statement (one in flight at a time) never queues behind a
  burst of acquires until the leases it renews expire (``max_size == 1``: no reserve);
* **no reuse after an interruption**: a connection goes back with
  :meth:`LeanPool.release` only when its statement ended (an answer, or an error the
  server sent); one whose statement was interrupted (cancelled, timed out, cut off)
  goes to :meth:`LeanPool.discard`, which closes it at once, without waiting on the
  network. An idle connection found closed is dropped, never handed out;
* **close**: :meth:`LeanPool.aclose` closes the idle connections and refuses new use;
  a connection in use then is closed when it comes back.

Idle connections are reused newest first, so after a burst the extra ones stay idle
(they are kept open until :meth:`LeanPool.aclose`; a server that drops them is
noticed before reuse). Driver-free and asyncio-only, like :mod:`aiolease.backends.sql`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..._exceptions import BackendUnavailable
from .._asyncio import timeout_after

__all__ = ["LeanPool", "PoolStatistics"]

logger = logging.getLogger("aiolease.backends.sql")

C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """The state of one :class:`LeanPool` now.

    :param size: connections open, in use, or being opened
    :param idle: connections open and unused
    :param others: connections held (or being opened) for statements other than renewals
    :param waiting: callers queued for a connection
    :param opened: connections opened so far
    :param discarded: connections closed at once: their statement was interrupted,
        they were found closed when idle, or came back (or were idle) after a close
    """

    size: int
    idle: int
    others: int
    waiting: int
    opened: int
    discarded: int


class LeanPool(Generic[C]):
    """At most ``max_size`` connections of one server, with a reserve for renewals.

    :param connect: opens a connection (bounded by its own connect timeout)
    :param close: closes an idle connection politely
    :param terminate: closes a connection at once, without a round trip
    :param usable: whether an idle connection is still open
    :param max_size: the most connections open at once (>= 1)
    :param min_size: connections :meth:`fill` opens ahead of use
    :param close_timeout: seconds :meth:`aclose` waits for a polite close of each
    :param what: names the pool in errors
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[C]],
        *,
        close: Callable[[C], Awaitable[object]],
        terminate: Callable[[C], object],
        usable: Callable[[C], bool],
        max_size: int,
        min_size: int = 0,
        close_timeout: float = 10.0,
        what: str = "the pool",
    ) -> None:
        self._connect = connect
        self._close = close
        self._terminate = terminate
        self._usable = usable
        self._max = max_size
        self._min = min_size
        self._limit = max_size - 1 if max_size >= 2 else max_size
        self._close_timeout = close_timeout
        self._what = what
        self._idle: deque[C] = deque()
        self._size = 0
        self._others = 0
        self._waiting: deque[asyncio.Future[C | None]] = deque()
        self._renewals: deque[asyncio.Future[C | None]] = deque()
        self._opened = 0
        self._discarded = 0
        self._closed = False

    @property
    def max_size(self) -> int:
        """The most connections open at once."""
        return self._max

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    def statistics(self) -> PoolStatistics:
        """Counts of connections and waiters."""
        return PoolStatistics(
            size=self._size,
            idle=len(self._idle),
            others=self._others,
            waiting=len(self._waiting) + len(self._renewals),
            opened=self._opened,
            discarded=self._discarded,
        )

    async def fill(self) -> None:
        """Open ``min_size`` connections (all or none: a failure closes those opened).

        :raises Exception: what ``connect`` raised
        """
        opened: list[C] = []
        try:
            while len(opened) < self._min:
                opened.append(await self._connect())
        except BaseException:
            for conn in opened:
                self._terminate(conn)
            raise
        self._opened += len(opened)
        self._size += len(opened)
        self._idle.extend(opened)

    # -- taking and giving back ----------------------------------------------------------------

    async def acquire(self, renewal: bool = False) -> C:
        """A connection for one statement: an idle one, a new one, or the next given back.

        :param renewal: for the renewal statement (may use the reserved connection)
        :raises BackendUnavailable: the pool is closed
        :raises Exception: what ``connect`` raised (the caller maps it)
        """
        if self._closed:
            raise self._closed_error()
        queue = self._renewals if renewal else self._waiting
        if not queue and self._can(renewal):
            conn = self._claim(renewal)
        else:
            conn = await self._wait(queue, renewal)
        if conn is None:
            conn = await self._open(renewal)
        return conn

    def release(self, conn: C, renewal: bool = False) -> None:
        """Give back a connection whose statement ended (answered, or refused by the server)."""
        if not renewal:
            self._others -= 1
        if self._closed or not self._usable(conn):
            self._drop(conn)
        else:
            self._idle.append(conn)
        self._dispatch()

    def discard(self, conn: C, renewal: bool = False) -> None:
        """Close a connection whose statement was interrupted: it is never used again."""
        if not renewal:
            self._others -= 1
        self._drop(conn)
        self._dispatch()

    @asynccontextmanager
    async def connection(
        self, renewal: bool = False, *, reusable: Callable[[BaseException], bool]
    ) -> AsyncIterator[C]:
        """:meth:`acquire`, then :meth:`release` or :meth:`discard`: on an exception,
        the connection is reused only if ``reusable(exc)`` says it is in step with the
        server (for statements off the hot path)."""
        conn = await self.acquire(renewal)
        try:
            yield conn
        except BaseException as exc:
            if reusable(exc):
                self.release(conn, renewal)
            else:
                self.discard(conn, renewal)
            raise
        self.release(conn, renewal)

    def _can(self, renewal: bool) -> bool:
        if not renewal and self._others >= self._limit:
            return False
        return bool(self._idle) or self._size < self._max

    def _claim(self, renewal: bool) -> C | None:
        """Take a slot (``_can`` said yes): an idle connection, or ``None``: open one."""
        if not renewal:
            self._others += 1
        idle = self._idle
        while idle:
            conn = idle.pop()
            if self._usable(conn):
                return conn
            self._drop(conn)  # closed while idle (by the server, say)
        self._size += 1
        return None

    async def _wait(self, queue: deque[asyncio.Future[C | None]], renewal: bool) -> C | None:
        future: asyncio.Future[C | None] = asyncio.get_running_loop().create_future()
        queue.append(future)
        try:
            return await future
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._unclaim(future.result(), renewal)  # handed over as we were cancelled
            else:
                try:
                    queue.remove(future)
                except ValueError:
                    pass
            raise

    def _unclaim(self, conn: C | None, renewal: bool) -> None:
        if conn is not None:
            self.release(conn, renewal)
            return
        self._size -= 1
        if not renewal:
            self._others -= 1
        self._dispatch()

    async def _open(self, renewal: bool) -> C:
        try:
            conn = await self._connect()
        except BaseException:
            self._unclaim(None, renewal)
            raise
        self._opened += 1
        if self._closed:
            self.discard(conn, renewal)
            raise self._closed_error()
        return conn

    def _drop(self, conn: C) -> None:
        self._size -= 1
        self._discarded += 1
        try:
            self._terminate(conn)
        except Exception as exc:  # closing a broken connection may fail; it is gone anyway
            logger.debug("terminating a connection of %s: %r", self._what, exc)

    def _dispatch(self) -> None:
        """Hand slots to the waiters that can go now: renewals first, then the others."""
        for queue, renewal in ((self._renewals, True), (self._waiting, False)):
            while queue and self._can(renewal):
                future = queue.popleft()
                if not future.done():  # else its waiter was cancelled
                    future.set_result(self._claim(renewal))

    def _closed_error(self) -> BackendUnavailable:
        return BackendUnavailable(f"{self._what} is closed")

    # -- closing ---------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Refuse new use, fail the waiters, and close the idle connections (politely,
        else at once). Connections in use are closed when they come back. Idempotent."""
        self._refuse()
        while self._idle:
            conn = self._idle.popleft()
            self._size -= 1
            try:
                async with timeout_after(self._close_timeout):
                    await self._close(conn)
            except Exception as exc:  # timed out or failed: close it the hard way
                logger.debug("closing a connection of %s: %r", self._what, exc)
                self._terminate(conn)
            except BaseException:  # cancelled: close the rest at once, and stay cancelled
                self._terminate(conn)
                self.terminate()
                raise

    def terminate(self) -> None:
        """:meth:`aclose` without waiting: the idle connections are closed at once."""
        self._refuse()
        while self._idle:
            self._drop(self._idle.popleft())

    def _refuse(self) -> None:
        self._closed = True
        for queue in (self._renewals, self._waiting):
            while queue:
                future = queue.popleft()
                if not future.done():
                    future.set_exception(self._closed_error())
