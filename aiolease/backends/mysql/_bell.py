"""Bells: wake-ups across processes for the MySQL / MariaDB waiter queue.

MySQL has no push, but a session blocked in ``GET_LOCK(bell, timeout)`` returns the
moment the session holding ``bell`` lets it go. So each entry of the waiters table
has a bell, a user-level lock named after its place (``seq``), which the backend
that wrote the entry holds from its join to its release (or its leaving the queue)
on a connection of its own that never blocks (the *keeper*). A waiter of another
process waits on the bell of the entry just ahead of it (its predecessor: the
holder's entry, for the head of the queue), with
``SELECT IF(GET_LOCK(bell, t), RELEASE_LOCK(bell), 0)`` on a connection of its own;
the predecessor's release (which hands the row on first) or leaving rings it, and
the waiter looks. As in a CLH queue lock, each waiter wakes when its turn may have
come, and none polls meanwhile. The statement lets the bell go in the step it gets
it: a waiter never holds another's bell.

The bell only wakes; every decision stays with the row statements, and every path
falls back to polling: a predecessor without a bell (a holder that never queued, a
backend on a pool of the user's) lets ``GET_LOCK`` return at once, after which the
waiter polls on its pause; a wait lasts at most ``t``; a keeper that fails is
closed, and the server frees a dead session's bells, which wakes its successors to
look. A cancelled wait kills its blocked session (``COM_PROCESS_KILL`` from the
keeper: closing the socket alone leaves the server blocked until ``t``).

MySQL 8 takes whole seconds in ``GET_LOCK``; MariaDB, microseconds. On MySQL a wait is
sent rounded up, and bounded here instead: a later wait on the same bell takes over
the one still in flight. Driver-light (statements on asyncmy connections) and
asyncio-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._asyncio import now, timeout_after, wait_any
from ..sql._running import finished
from ._statements import Prepared

__all__ = ["Bells"]

logger = logging.getLogger("aiolease.backends.mysql")

#: The most waits in flight at once per backend (each on a connection of its own);
#: beyond that, waiters poll.
MAX_WAITS = 8
#: The longest a kill of a blocked session may take (else it ends by its own timeout).
KILL_TIMEOUT = 2.0
#: The prefix of bell names (a user-level lock name is at most 64 characters).
PREFIX = "aiolease:"


@dataclass(eq=False, slots=True)
class _Wait:
    """A ``GET_LOCK`` in flight on a connection of its own."""

    conn: Any
    #: The ring (1: the bell was let go, or free; 0: not) and the look after it.
    task: asyncio.Future[tuple[int, Any]]
    #: When it was sent (before the server ran its look).
    sent_at: float
    #: Its session is being killed: its connection is never reused.
    killed: bool = False


class Bells:
    """The bells of one backend: those it holds, and the waits on others'.

    :param connect: opens a connection of the backend's (outside its pool)
    :param scope: names the table (database and table), so that bells of different
        tables never meet
    """

    def __init__(self, connect: Callable[[], Awaitable[Any]], scope: str) -> None:
        self._connect = connect
        self._scope = scope
        self._keeper: Any = None
        self._keeper_lock = asyncio.Lock()
        #: Calls for the keeper not sent yet (a bell call, the bell, its answer).
        self._calls: list[tuple[str, str, asyncio.Future[int]]] = []
        #: The bells the keeper holds.
        self._held: set[str] = set()
        self._idle: list[Any] = []
        self._waits: dict[str, _Wait] = {}
        #: Whether the server takes fractions of a second in ``GET_LOCK`` (MariaDB).
        self._fractions = True
        self._closed = False
        #: Waits sent, waits that returned because their bell was let go (or was
        #: free), and statements sent on the keeper (take, let go, kill).
        self.waits = 0
        self.rings = 0
        self.kept = 0

    def bell(self, name: str, seq: int) -> str:
        """The bell of entry ``seq`` of lease ``name`` (a hash: at most 64 characters)."""
        digest = hashlib.blake2b(f"{self._scope}\0{name}".encode(), digest_size=16)
        return f"{PREFIX}{digest.hexdigest()}:{seq}"

    def holds(self, name: str, seq: int) -> bool:
        """Whether the keeper holds the bell of entry ``seq``."""
        return self.bell(name, seq) in self._held

    @property
    def held(self) -> int:
        """Bells the keeper holds now."""
        return len(self._held)

    @property
    def in_flight(self) -> int:
        """Waits in flight now (each blocks a session of its own)."""
        return sum(not wait.task.done() for wait in self._waits.values())

    @property
    def sessions(self) -> list[int]:
        """The sessions (server thread ids) of the waits in flight now."""
        return [int(w.conn.thread_id()) for w in self._waits.values() if not w.task.done()]

    @property
    def keeper(self) -> int | None:
        """The keeper's session (its server thread id), if open."""
        return None if self._keeper is None else int(self._keeper.thread_id())

    # -- the keeper: the bells of this backend's entries ----------------------------------

    async def hold(self, name: str, seq: int) -> bool:
        """Take the bell of this backend's new entry ``seq``; whether it is held."""
        bell = self.bell(name, seq)
        got = await finished(self._on_keeper("GET_LOCK(%s, 0)", bell))
        if got:
            self._held.add(bell)
        return bool(got)

    async def drop(self, name: str, seq: int) -> None:
        """Let go of the bell of entry ``seq`` (rings its successor), if held."""
        bell = self.bell(name, seq)
        if bell in self._held:
            self._held.discard(bell)
            await finished(self._on_keeper("RELEASE_LOCK(%s)", bell))

    async def _on_keeper(self, call: str, bell: str) -> int:
        """Run ``call`` (of one bell) on the keeper (opened on first use): with the calls
        that came while the keeper was busy, in one ``SELECT`` (each bell's calls come
        from one task, one after the other: never two of one bell in one statement); 0
        when it fails (closed, which frees its bells: their waiters look, and poll)."""
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._calls.append((call, bell, answer))
        async with self._keeper_lock:
            if answer.done():  # sent with an earlier statement
                return answer.result()
            calls, self._calls = self._calls, []
            try:
                if self._closed:
                    raise ConnectionError("closed")
                if self._keeper is None:
                    self._keeper = await self._open()
                self.kept += 1
                async with self._keeper.cursor() as cur:
                    sql = "SELECT " + ", ".join(c for c, _, _ in calls)
                    bells = [b for _, b, _ in calls]
                    if len(calls) == 1:  # prepared (its text is one of two)
                        await cur.execute(sql, bells)
                    else:  # as text: a prepared one of each length would push the
                        # connection's others out of its statement cache
                        await cur.execute(cur.mogrify(sql, bells))
                    rows = await cur.fetchall()
                for (_, _, future), got in zip(calls, rows[0], strict=True):
                    future.set_result(int(got or 0))
            except BaseException as exc:
                if not isinstance(exc, asyncio.CancelledError) and not self._closed:
                    logger.debug("bell keeper failed: %r", exc)
                self._close_keeper()
                for _, _, future in calls:
                    if not future.done():
                        future.set_result(0)
                if not isinstance(exc, Exception):
                    raise
            return answer.result()

    def _close_keeper(self) -> None:
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
        self._held.clear()

    # -- waits on others' bells ----------------------------------------------------------

    async def wait(
        self,
        name: str,
        seq: int,
        timeout: float,
        event: asyncio.Event,
        ring: Prepared,
        params: Mapping[str, Any],
        who: str,
    ) -> tuple[int, Any, float] | None:
        """Wait at most ``timeout`` seconds for the bell of entry ``seq`` to be let go, or
        for ``event``, with ``ring`` (:attr:`~aiolease.backends.mysql._statements.Sql.ring`, on
        ``params``: it looks at the row the moment the wait ends, no round trip later).
        ``None``: no wait could be sent (poll instead); else (1 when the bell was let go
        or was free, else 0; the rest of the row ``ring`` returned, ``None`` if the wait
        is not over; when the wait was sent).

        A wait cut short by ``event`` or the timeout stays in flight (a later wait by
        the same waiter, ``who``, on the same bell takes it over); a cancelled one is
        left to :meth:`abandon`.
        """
        key = f"{self.bell(name, seq)} {who}"
        wait = self._waits.get(key)
        if wait is None:
            if event.is_set() or timeout <= 0:
                return 0, None, 0.0
            wait = await self._send(key, self.bell(name, seq), timeout, ring, params)
            if wait is None:
                return None
        if not wait.task.done():
            await wait_any([wait.task], event, timeout)
        if not wait.task.done():
            return 0, None, wait.sent_at
        if wait.task.cancelled() or wait.task.exception() is not None:
            return None
        rung, rest = wait.task.result()
        self.rings += rung
        return rung, rest, wait.sent_at

    async def _send(
        self, key: str, bell: str, timeout: float, ring: Prepared, params: Mapping[str, Any]
    ) -> _Wait | None:
        if self._closed or len(self._waits) >= MAX_WAITS:
            return None
        try:
            conn = self._idle.pop() if self._idle else await self._open()
        except Exception as exc:
            logger.debug("bell connection failed: %r", exc)
            return None
        seconds = max(timeout if self._fractions else float(math.ceil(timeout)), 0.000001)
        sent_at = now()
        args = {**params, "bell": bell, "seconds": seconds}
        task = asyncio.ensure_future(self._ring(conn, ring.sql, [args[n] for n in ring.names]))
        wait = self._waits[key] = _Wait(conn, task, sent_at)
        task.add_done_callback(lambda _: self._settled(key, wait))
        self.waits += 1
        return wait

    @staticmethod
    async def _ring(conn: Any, sql: str, args: Sequence[Any]) -> tuple[int, Any]:
        async with conn.cursor() as cur:
            await cur.execute(sql, args)
            rows = await cur.fetchall()
        return int(rows[0][0] or 0), tuple(rows[0][1:])

    def _settled(self, key: str, wait: _Wait) -> None:
        """A wait ended: its connection goes back (closed, if the wait failed)."""
        if self._waits.get(key) is wait:
            del self._waits[key]
        ok = not wait.task.cancelled() and wait.task.exception() is None
        if ok and not wait.killed and not self._closed:
            self._idle.append(wait.conn)
        else:
            wait.conn.close()

    async def abandon(self, who: str) -> None:
        """End the waits of ``who`` in flight: their sessions are killed from the
        keeper (never left blocked), their connections closed."""
        for key in [key for key in self._waits if key.endswith(f" {who}")]:
            wait = self._waits.pop(key)
            if not wait.task.done():
                await finished(self._kill(wait))

    async def _kill(self, wait: _Wait, opening: bool = True) -> None:
        """Kill ``wait``'s session from the keeper (opened for it, if ``opening``)."""
        wait.killed = True
        async with self._keeper_lock:
            try:
                async with timeout_after(KILL_TIMEOUT):
                    if self._keeper is None and opening:
                        self._keeper = await self._open()
                    if self._keeper is not None:
                        self.kept += 1
                        await self._keeper.kill(wait.conn.thread_id())
            except Exception as exc:  # (the wait ends by its own timeout instead)
                logger.debug("could not end a bell wait: %r", exc)
                self._close_keeper()
        wait.task.cancel()  # (its connection is closed: see ``_settled``)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({wait.task})
        if wait.conn in self._idle:  # it ended just before the kill
            self._idle.remove(wait.conn)
            wait.conn.close()

    async def _open(self) -> Any:
        conn = await self._connect()
        self._fractions = "mariadb" in conn.get_server_info().lower()
        return conn

    async def aclose(self) -> None:
        """End every wait, close every connection (which frees the bells held)."""
        for key in list(self._waits):
            wait = self._waits.pop(key)
            if not wait.task.done():
                await self._kill(wait, opening=False)
        self._closed = True
        async with self._keeper_lock:
            self._close_keeper()
        for conn in self._idle:
            conn.close()
        self._idle.clear()
