"""The listening connection of the PostgreSQL backend: NOTIFY wake-ups.

:class:`Listener` connects, checks, reconnects and drops one backend's listening
connection, and turns each notification into wake-ups of that backend's waiters
(its :class:`~aiolease.backends.sql._wakeups.Wakeups`, its
:class:`~aiolease.backends.postgres._queue.Queue` and its
:class:`~aiolease.backends._takers.Takers`, given to it). It also tells
whether a name has had no notification since a given moment (:meth:`Listener.mark`,
:meth:`Listener.unchanged_since`), which lets the backend answer a read of a grant
it made without a statement (:class:`Held`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._exceptions import BackendUnavailable
from ..._urls import scrub
from .._asyncio import now, timeout_after
from .._takers import Takers
from ..sql._renewals import Held as _Held
from ..sql._wakeups import Wakeups
from ._queue import Queue
from ._statements import parse_notice, permit_key

__all__ = ["LISTEN_CHECK", "Held", "Listener"]

logger = logging.getLogger("aiolease.backends.postgres")

#: While listening, waits still return this often, and the listener is checked as often.
LISTEN_CHECK = 10.0
#: Names whose latest notification is remembered (see ``_unchanged_since``).
_MAX_NOTED = 4096
#: The longest pause between attempts to reconnect the listener.
_MAX_LISTEN_BACKOFF = 5.0


@dataclass(slots=True)
class Held(_Held):
    """A grant made through this backend, to answer ``read`` without a statement.

    Valid while the listener has been up since ``mark`` (taken before the statement
    that granted or confirmed it was sent) with no notification for the name but our
    own grant's: every release and every takeover notifies, and renewals (which do
    not) only move the expiry. ``remaining`` is counted from ``sent_at``, the send time
    of the newest confirming statement, so it never exceeds the server's.
    """

    mark: tuple[int, int] | None


class Listener:
    """Connects, checks, reconnects and drops one PostgreSQL backend's listener.

    :param db: the user's ``asyncpg`` pool or connection (``None``: a backend made from
        a URL, which listens on a connection of its own to ``url``)
    :param conn_lock: serialises the statements on the user's one connection, if ``db``
        is one (its listener is that connection itself)
    :param channel: the channel of releases, hand-offs and takeovers
    :param grants_channel: the channel of grants of free names (listened to once a wait
        for a holder to appear asks for it: :meth:`for_grants`)
    :param enabled: listen at all (else every wait polls)
    :param url: where the listening connection goes (default: from ``db``)
    :param connect_timeout: seconds to connect, check or listen
    :param connect_options: keyword arguments of ``asyncpg.connect``
    :param poll_interval: the shortest pause before a failed connect is tried again
    :param closed: whether the backend is closed (then it never connects)
    :param wakeups: wakes the backend's ``wait_changed``
    :param queue: the backend's waiters, woken by hand-offs and releases
    :param takers: the backend's held leases that a takeover ends
    :param what: names the backend in log messages
    """

    def __init__(
        self,
        db: Any,
        conn_lock: asyncio.Lock | None,
        *,
        channel: str,
        grants_channel: str,
        enabled: bool,
        url: str | None,
        connect_timeout: float,
        connect_options: dict[str, Any],
        poll_interval: float,
        closed: Callable[[], bool],
        wakeups: Wakeups,
        queue: Queue,
        takers: Takers,
        what: str,
    ) -> None:
        self._db = db
        self._conn_lock = conn_lock
        self._channel = channel
        self._grants_channel = grants_channel
        self._enabled = enabled
        self._url = url
        self._connect_timeout = connect_timeout
        self._connect_options = connect_options
        self._poll_interval = poll_interval
        self._closed = closed
        self._wakeups = wakeups
        self._queue = queue
        self._takers = takers
        #: Told the owners whose permit queue entries a release granted (set by the
        #: backend's permits: :meth:`~aiolease.backends.sql._handed.Handed.told`).
        self.permits_granted: Callable[[str, list[str]], None] | None = None
        #: Told the names whose permit or queue entry went without a grant (``'p:'``).
        self.permits_released: Callable[[str], None] | None = None
        self._what = what
        self._want_grants = False  # once a wait for a holder to appear asked for them
        self._grants_on: Any = None  # the connection that listens to the grants channel
        self._lock = asyncio.Lock()
        self._conn: Any = None
        self._on_lost: Any = None
        self._checked = 0.0
        self._retry_at = -1.0
        self._backoff = 0.0
        #: How many times it (re)connected.
        self.connects = 0
        #: Notifications received; per name, the count at its latest one and the owner
        #: it granted to (``None``: released), remembered since the floor.
        self.notes = 0
        self._noted: dict[str, tuple[int, str | None]] = {}
        self._noted_floor = 0

    def __repr__(self) -> str:
        return f"<Listener of {self._what}>"

    @property
    def up(self) -> bool:
        """Whether the listening connection is up now."""
        return self._conn is not None

    def _log_failure(self, what: str, exc: BaseException) -> None:
        """Log that the listener ``what`` (failed a check, ...), with ``exc`` masked: a
        driver's message may quote the listening URL or a piece of its password."""
        shown = scrub(repr(exc), self._url)
        logger.info("PostgreSQL listener of %s %s: %s", self._what, what, shown)

    def own_connections(self, url: str) -> None:
        """From now on, listen on connections of its own to ``url`` (a backend made from a
        URL, once its pool is open), unless it was given a ``listen_url``."""
        self._db = None
        if self._url is None:
            self._url = url

    async def ensure(self) -> bool:
        """Whether a listener is up; (re)connect it, or check it, when due. Never raises."""
        if not self._enabled or self._closed():
            return False
        at = now()
        if self._conn is not None and at < self._checked + LISTEN_CHECK:
            return True
        if self._lock.locked() or (self._conn is None and at < self._retry_at):
            return self._conn is not None  # another task is at it, or it is too soon
        async with self._lock:
            if self._conn is not None and await self._healthy():
                return True
            return await self._connect()

    async def _healthy(self) -> bool:
        try:
            async with timeout_after(self._connect_timeout):
                await self._conn.fetchval("SELECT 1")
        except Exception as exc:  # any failure (a timeout too): drop it and connect anew
            self._log_failure("failed a check", exc)
            await self._drop(terminate=True)
            return False
        self._checked = now()
        return True

    async def _connect(self) -> bool:
        try:
            async with timeout_after(self._connect_timeout):
                conn = await self._open_and_listen()
        except Exception as exc:  # refused, reset, timed out, ...: poll, and try again later
            self._backoff = min(max(self._backoff * 2, self._poll_interval), _MAX_LISTEN_BACKOFF)
            self._retry_at = now() + self._backoff
            self._log_failure("cannot connect", exc)
            return False
        self._on_lost = lambda _conn: self._lost(conn)
        conn.add_termination_listener(self._on_lost)
        self._conn = conn
        self._checked = now()
        self._backoff = 0.0
        self.connects += 1
        self._wakeups.wake_all()  # notifications sent while nobody listened are lost
        self._queue.wake_all()
        return True

    async def _open_and_listen(self) -> Any:
        conn = await self._open()
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

    async def for_grants(self) -> bool:
        """:meth:`ensure`, and listen to grants of free names too (from now on, on every
        listener): what a wait for a holder to appear needs. Never raises."""
        self._want_grants = True
        if not await self.ensure():
            return False
        if self._grants_on is self._conn:
            return True
        async with self._lock:
            conn = self._conn
            if conn is None or self._grants_on is conn:
                return conn is not None
            try:
                async with timeout_after(self._connect_timeout):
                    await self._listen_on(conn, self._grants_channel)
            except Exception as exc:  # as a failed check: drop it, connect anew later
                self._log_failure("cannot listen", exc)
                await self._drop(terminate=True)
                return False
            self._grants_on = conn
            self._wakeups.wake_all()  # a grant just before may have been missed
        return True

    async def _open(self) -> Any:
        import asyncpg

        if self._url is not None:
            return await asyncpg.connect(
                self._url, timeout=self._connect_timeout, **self._connect_options
            )
        if self._conn_lock is not None:
            if self._db.is_closed():
                raise BackendUnavailable("the connection given to the backend is closed")
            return self._db
        return await self._db.acquire()

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        """A grant (a takeover or a hand-off; on the grants channel, of a free name), a
        release, or new metadata of a grant (see
        :func:`~aiolease.backends.postgres._statements.parse_payload`). Watchers wake on
        each; a waiter here on a hand-off to it, and every waiter for
        the name on a release (with nobody queued to hand it to, as the release saw it).
        A hand-off to another waiter re-times the name's other waiters here (they wait
        no longer than the handed grant lasts unless renewed)."""
        kind, name, owner, token, ask, lasts = parse_notice(payload)
        if kind == "q":  # a release granted queue entries of permits: their waiters ask
            self.notes += 1
            if self.permits_granted is not None and owner:
                self.permits_granted(name, owner.split(","))
            return
        if kind == "p":  # a permit or queue entry went: the name's permit waiters look
            if self.permits_released is not None:
                self.permits_released(name)
            name = permit_key(name)
        self.notes += 1
        if len(self._noted) >= _MAX_NOTED:
            self._noted.clear()
            self._noted_floor = self.notes
        self._noted[name] = (self.notes, owner)
        self._wakeups.wake(name)
        if kind in ("m", "p"):
            return  # new metadata of the same grant: watchers look, nobody is taken
        if kind != "g":
            self._queue.released(name)
        elif ask is not None and owner is not None and token is not None:
            self._queue.handed(name, owner, token, ask, lasts)
        self._takers.notified(name, owner, token)

    def _lost(self, conn: Any) -> None:
        if conn is self._conn:
            logger.info("PostgreSQL listener of %s was disconnected", self._what)
            self._conn = None
            self._retry_at = -1.0  # reconnect on the next wait
            self._wakeups.wake_all()
            self._queue.wake_all()

    async def aclose(self) -> None:
        """Stop listening: close the connection (or hand it back, or unlisten on it)."""
        async with self._lock:
            await self._drop(terminate=False)

    async def _drop(self, *, terminate: bool) -> None:
        conn, self._conn = self._conn, None
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
            elif self._url is not None:
                if terminate:
                    conn.terminate()
                else:
                    await conn.close(timeout=self._connect_timeout)
            else:
                await self._db.release(conn, timeout=self._connect_timeout)
        except Exception as exc:  # closing a broken connection may fail; it is gone anyway
            logger.debug("closing the listener of %s: %r", self._what, exc)
            if conn is not self._db:
                conn.terminate()

    def mark(self) -> tuple[int, int] | None:
        """Where the listener stands now (``None``: not listening), for
        :meth:`unchanged_since`."""
        return None if self._conn is None else (self.connects, self.notes)

    def unchanged_since(
        self, name: str, mark: tuple[int, int] | None, owner: str | None = None
    ) -> bool:
        """Whether no notification for ``name`` came since ``mark``, with the listener up
        all along: then a statement sent at ``mark`` saw the latest release or grant (any
        later one notifies), and a read would tell nothing new. With ``owner``: or the
        latest was ``owner``'s own grant (notifications come in commit order)."""
        if mark is None or self._conn is None or mark[0] != self.connects:
            return False
        seq, granted_to = self._noted.get(name, (self._noted_floor, None))
        return seq <= mark[1] or (owner is not None and granted_to == owner)
