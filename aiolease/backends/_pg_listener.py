"""The listening connection of the PostgreSQL backend: NOTIFY wake-ups.

A mixin of :class:`~aiolease.backends.postgres.PostgresBackend`, which owns the state
declared here (see its ``__init__``) and the wait logic that uses it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from .._exceptions import BackendUnavailable
from ._asyncio import now, timeout_after
from ._pg_queue import Queue
from ._pg_sql import parse_notice
from ._sql import Takers, Wakeups

__all__ = ["LISTEN_CHECK", "Held", "Listening"]

logger = logging.getLogger("aiolease.postgres")

#: While listening, waits still return this often, and the listener is checked as often.
LISTEN_CHECK = 10.0
#: Names whose latest notification is remembered (see ``_unchanged_since``).
_MAX_NOTED = 4096
#: The longest pause between attempts to reconnect the listener.
_MAX_LISTEN_BACKOFF = 5.0


@dataclass(slots=True)
class Held:
    """A grant made through this backend, to answer ``read`` without a statement.

    Valid while the listener has been up since ``mark`` (taken before the statement
    that granted or confirmed it was sent) with no notification for the name but our
    own grant's: every release and every takeover notifies, and renewals (which do
    not) only move the expiry. ``remaining`` is counted from ``sent_at``, the send time
    of the newest confirming statement, so it never exceeds the server's.
    """

    owner: str
    token: int
    identity: str
    meta: str
    ttl: float
    sent_at: float
    mark: tuple[int, int] | None


class Listening:
    """Connects, checks, reconnects and drops a PostgreSQL backend's listener."""

    _closed: bool
    _db: Any
    _conn_lock: asyncio.Lock | None
    _channel: str
    _grants_channel: str
    _want_grants: bool
    _grants_on: Any
    _connect_timeout: float
    _connect_options: dict[str, Any]
    poll_interval: float
    _wakeups: Wakeups
    _queue: Queue
    _takers: Takers
    _listen: bool
    _listen_url: str | None
    _listen_lock: asyncio.Lock
    _listener: Any
    _on_lost: Any
    _listener_checked: float
    _listener_retry_at: float
    _listener_backoff: float
    _listener_connects: int
    _notes: int
    _noted: dict[str, tuple[int, str | None]]
    _noted_floor: int

    async def _ensure_listening(self) -> bool:
        """Whether a listener is up; (re)connect it, or check it, when due. Never raises."""
        if not self._listen or self._closed:
            return False
        at = now()
        if self._listener is not None and at < self._listener_checked + LISTEN_CHECK:
            return True
        if self._listen_lock.locked() or (self._listener is None and at < self._listener_retry_at):
            return self._listener is not None  # another task is at it, or it is too soon
        async with self._listen_lock:
            if self._listener is not None and await self._listener_healthy():
                return True
            return await self._connect_listener()

    async def _listener_healthy(self) -> bool:
        try:
            async with timeout_after(self._connect_timeout):
                await self._listener.fetchval("SELECT 1")
        except Exception as exc:  # any failure (a timeout too): drop it and connect anew
            logger.info("PostgreSQL listener of %r failed a check: %r", self, exc)
            await self._drop_listener(terminate=True)
            return False
        self._listener_checked = now()
        return True

    async def _connect_listener(self) -> bool:
        try:
            async with timeout_after(self._connect_timeout):
                conn = await self._open_and_listen()
        except Exception as exc:  # refused, reset, timed out, ...: poll, and try again later
            self._listener_backoff = min(
                max(self._listener_backoff * 2, self.poll_interval), _MAX_LISTEN_BACKOFF
            )
            self._listener_retry_at = now() + self._listener_backoff
            logger.info("PostgreSQL listener of %r cannot connect: %r", self, exc)
            return False
        self._on_lost = lambda _conn: self._listener_lost(conn)
        conn.add_termination_listener(self._on_lost)
        self._listener = conn
        self._listener_checked = now()
        self._listener_backoff = 0.0
        self._listener_connects += 1
        self._wakeups.wake_all()  # notifications sent while nobody listened are lost
        self._queue.wake_all()
        return True

    async def _open_and_listen(self) -> Any:
        conn = await self._open_listener()
        try:
            await self._listen_on(conn, self._channel)
            if self._want_grants:
                await self._listen_on(conn, self._grants_channel)
                self._grants_on = conn
        except BaseException:
            await self._give_back(conn, terminate=True)
            raise
        return conn

    async def _listen_on(self, conn: Any, channel: str) -> None:
        if conn is self._db and self._conn_lock is not None:
            async with self._conn_lock:  # the user's one connection: no statement meanwhile
                await conn.add_listener(channel, self._notified)
        else:
            await conn.add_listener(channel, self._notified)

    async def _listen_for_grants(self) -> bool:
        """:meth:`_ensure_listening`, and listen to grants of free names too (from now on,
        on every listener): what a wait for a holder to appear needs. Never raises."""
        self._want_grants = True
        if not await self._ensure_listening():
            return False
        if self._grants_on is self._listener:
            return True
        async with self._listen_lock:
            conn = self._listener
            if conn is None or self._grants_on is conn:
                return conn is not None
            try:
                async with timeout_after(self._connect_timeout):
                    await self._listen_on(conn, self._grants_channel)
            except Exception as exc:  # as a failed check: drop it, connect anew later
                logger.info("PostgreSQL listener of %r cannot listen: %r", self, exc)
                await self._drop_listener(terminate=True)
                return False
            self._grants_on = conn
            self._wakeups.wake_all()  # a grant just before may have been missed
        return True

    async def _open_listener(self) -> Any:
        import asyncpg

        if self._listen_url is not None:
            return await asyncpg.connect(
                self._listen_url, timeout=self._connect_timeout, **self._connect_options
            )
        if self._conn_lock is not None:
            if self._db.is_closed():
                raise BackendUnavailable("the connection given to the backend is closed")
            return self._db
        return await self._db.acquire()

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        """A grant (a takeover or a hand-off; on the grants channel, of a free name) or a
        release (see :func:`~aiolease.backends._pg_sql.parse_payload`). Watchers wake on
        both; a waiter here on a hand-off to it, and every waiter for the name on a
        release (with nobody queued to hand it to, as the release saw it)."""
        kind, name, owner, token, ask = parse_notice(payload)
        self._notes += 1
        if len(self._noted) >= _MAX_NOTED:
            self._noted.clear()
            self._noted_floor = self._notes
        self._noted[name] = (self._notes, owner)
        self._wakeups.wake(name)
        if kind != "g":
            self._queue.released(name)
        elif ask is not None and owner is not None and token is not None:
            self._queue.handed(name, owner, token, ask)
        self._takers.notified(name, owner, token)

    def _listener_lost(self, conn: Any) -> None:
        if conn is self._listener:
            logger.info("PostgreSQL listener of %r was disconnected", self)
            self._listener = None
            self._listener_retry_at = -1.0  # reconnect on the next wait
            self._wakeups.wake_all()
            self._queue.wake_all()

    async def _drop_listener(self, *, terminate: bool) -> None:
        conn, self._listener = self._listener, None
        self._grants_on = None
        if conn is not None:
            conn.remove_termination_listener(self._on_lost)
            await self._give_back(conn, terminate=terminate)

    async def _give_back(self, conn: Any, *, terminate: bool) -> None:
        """Close a listener we opened, hand one back to the user's pool, or just unlisten."""
        try:
            if conn is self._db:
                if not conn.is_closed():
                    await conn.remove_listener(self._channel, self._notified)
                    await conn.remove_listener(self._grants_channel, self._notified)
            elif self._listen_url is not None:
                if terminate:
                    conn.terminate()
                else:
                    await conn.close(timeout=self._connect_timeout)
            else:
                await self._db.release(conn, timeout=self._connect_timeout)
        except Exception as exc:  # closing a broken connection may fail; it is gone anyway
            logger.debug("closing the listener of %r: %r", self, exc)
            if conn is not self._db:
                conn.terminate()

    def _mark(self) -> tuple[int, int] | None:
        """Where the listener stands now (``None``: not listening), for ``_unchanged_since``."""
        return None if self._listener is None else (self._listener_connects, self._notes)

    def _unchanged_since(
        self, name: str, mark: tuple[int, int] | None, owner: str | None = None
    ) -> bool:
        """Whether no notification for ``name`` came since ``mark``, with the listener up
        all along: then a statement sent at ``mark`` saw the latest release or grant (any
        later one notifies), and a read would tell nothing new. With ``owner``: or the
        latest was ``owner``'s own grant (notifications come in commit order)."""
        if mark is None or self._listener is None or mark[0] != self._listener_connects:
            return False
        seq, granted_to = self._noted.get(name, (self._noted_floor, None))
        return seq <= mark[1] or (owner is not None and granted_to == owner)
