"""The SQLite backend: leases in one file, shared by every process on one host.

URLs follow SQLAlchemy::

    sqlite:///leases.db              relative to the working directory at open time
    sqlite:////var/lib/app/leases.db absolute (four slashes)
    sqlite:///leases.db?table=my_leases&busy_timeout=2&poll_interval=0.1

**Which clock is "server time" here.** Every process that opens the file runs on
the same host, so the host's clock plays the server. Expiry is stored as a
``time.monotonic()`` value: on Linux that is ``CLOCK_MONOTONIC``, one system-wide
clock that never jumps (NTP slews its rate by at most 0.05 %, well inside the
core's margin), so a value written by one process means the same instant to all
others. ``time.time()`` is never used: a wall-clock step would expire or revive
leases at random. A monotonic clock restarts at boot, so each row also records
the host's boot id (``/proc/sys/kernel/random/boot_id``); a row written under
another boot counts as expired. Where there is no boot id (macOS, Windows, BSD;
their monotonic clocks are system-wide too) the boot id is empty, and a second
guard applies everywhere: a row whose expiry lies further ahead than its own ttl
was written on another clock epoch, so it counts as expired. Containers that
share the file must share the host's clock (no time namespaces) and its boot id.

**Atomicity.** Each operation is one transaction on one connection: a single
``UPDATE ... RETURNING`` for renew and release, and for acquire a
``BEGIN IMMEDIATE`` transaction (an idempotent-retry ``UPDATE``, then an
``INSERT ... ON CONFLICT DO UPDATE ... WHERE expired``, then the holder read). The
clock is read after the write lock is taken, so the expiry never starts before
the request was sent. The database runs in WAL mode with ``synchronous=FULL``:
a committed token survives a crash and a power cut.

**Tokens.** A row per name is kept forever; release clears its owner and keeps
its ``token`` column, which every new grant increments. Tokens therefore
strictly increase across release, expiry and restarts.

**Wake-ups and hand-offs.** A release through this backend object hands the name to
the first of its waiters, in the release's own transaction, and wakes that waiter
alone (:mod:`._sqlite_turns`); acquire and release set an in-process event per
(file, name), which observers and each name's first waiter watch. Changes made by
other processes are found by polling every ``poll_interval`` (and never later than
the seen holder's expiry). Renewals wake nobody. This is why the backend lacks
``PUSH_WAKEUP``; waiters of different processes are not queued together (no
``FAIR_QUEUE``).

**One transaction for the calls that wait.** The backend has one connection; calls
that wait for it run together, in one transaction with one commit, whichever caller
gets it first running them all (:mod:`._sqlite_group`); a group of permit requests
expected to be queued commits without a sync, unless it issues a token.

SQLite on a network file system is not safe (its locking is unreliable there),
and several hosts do not share a monotonic clock: use one host.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from .._checked import derived
from .._clock import cancel_scope, current_time, move_on_after
from .._exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    NotOwnerError,
)
from .._records import state_of
from .._validate import check_seconds
from ..abc import (
    Backend,
    Capability,
    Grant,
    HolderInfo,
    PermitHolders,
    Renewal,
    RenewedAsAsked,
    RenewResult,
    is_permit_owner,
)
from ._priority import PriorityLock
from ._sqlite_group import MOST, Call, run_group
from ._sqlite_permits import PERMIT_LIVE, PermitTables, QueuedHere
from ._sqlite_renewals import Encoded, encode_batches, renew_batch
from ._sqlite_thread import ConnectionThread
from ._sqlite_turns import Ask, LockTurns
from ._sqlite_turns import notify as _notify
from ._sqlite_turns import watching as _watching
from ._sqlite_url import URL_OPTIONS as _URL_OPTIONS
from ._sqlite_url import check_path as _check_path
from ._sqlite_url import check_table as _check_table
from ._sqlite_url import parse_url as _parse_url
from .sql._handed import Handed, turn_key
from .sql._rows import check_token, foreign, row_holder

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["SQLiteBackend", "host_boot_id"]

T = TypeVar("T")

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6

#: A row is live when it has an owner, was written in this boot, has not expired,
#: and its expiry is no further ahead than its ttl (else it is from another clock epoch).
_LIVE = (
    "owner IS NOT NULL AND boot_id = :boot AND expires_at > :now"
    " AND expires_at - :now <= ttl + 0.001"
)


def host_boot_id() -> str:
    """The id of the current boot of this host, or ``""`` where the OS has none to read."""
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)
    message = str(exc).lower()
    return "locked" in message or "busy" in message


def _map_error(exc: sqlite3.Error) -> BackendError:
    """The aiolease error for a ``sqlite3`` error: busy/locked is a timeout."""
    if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
        return BackendTimeout(f"SQLite database is busy: {exc}")
    return BackendUnavailable(f"SQLite error: {exc}")


class _Release(Call):
    """A release waiting to be sent, and the waiter here it may hand the name to."""

    __slots__ = ("handed", "name", "next", "owner", "token")

    def __init__(
        self, release: Callable[[Any, _Release], bool], name: str, owner: str, token: int | None
    ) -> None:
        super().__init__(lambda conn: release(conn, self))
        self.name, self.owner, self.token = name, owner, token
        #: The waiter here that the release hands the name to, if it frees it.
        self.next: Ask | None = None
        #: The token it handed the name on with.
        self.handed: int | None = None


#: The "limit" of a lock waiter's grants in :class:`Handed` (a permit's is at least 1).
_LOCK = 0


class SQLiteBackend(Backend):
    """Leases in a SQLite file, safe across the processes of one host.

    The file is opened on first use, by ``async with``, or by :meth:`from_url`.

    :param path: the database file (created if missing; its directory must exist)
    :param table: the table to keep leases in (created if missing)
    :param busy_timeout: seconds to wait for another process's write lock before
        :class:`BackendTimeout`
    :param poll_interval: seconds between checks for changes made by other processes
    :raises InvalidArgument: a bad table name or timeout, or an unusable path
        (nothing is created)
    """

    capabilities = frozenset(
        {
            Capability.SERVER_TIME,
            Capability.DURABLE_TOKENS,
            Capability.MULTI_PROCESS,
            Capability.PROCLAIM,
            Capability.SEMAPHORE,
            Capability.FAIR_PERMITS,
            Capability.PERMIT_RETRY_KEEPS_ENTRY,
        }
    )

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        table: str = "aiolease_leases",
        busy_timeout: float = 5.0,
        poll_interval: float = 0.05,
    ) -> None:
        self._table = _check_table(table)
        self._busy_timeout = check_seconds("busy_timeout", busy_timeout, allow_zero=True)
        self.poll_interval = check_seconds("poll_interval", poll_interval)
        self._path = _check_path(path)
        self._lock = PriorityLock()
        #: Calls waiting for the connection (urgent ones apart): the next caller to get
        #: it runs them all, in one transaction (see :mod:`._sqlite_group`).
        self._calls: list[Call] = []
        self._urgent_calls: list[Call] = []
        self._conn: sqlite3.Connection | None = None
        #: Where the groups of calls run (see :mod:`._sqlite_thread`).
        self._thread = ConnectionThread(f"aiolease-sqlite-{os.path.basename(self._path)}")
        self._closed = False
        # Host time; tests replace these to move time or simulate a reboot.
        self._clock: Callable[[], float] = time.monotonic
        self._boot_id = host_boot_id()
        self._permits = PermitTables(self._table, lambda: self._boot_id, lambda: self._clock())
        #: The grants that releases here made to queue entries (of permits) or to lock
        #: waiters, until their waiters take them.
        self._handed = Handed(lambda key: _notify(self._path, key), current_time)
        #: This backend's lock waiters, which its releases hand the name to.
        self._turns = LockTurns()
        #: The permit requests refused here, not yet granted or released.
        self._queued = QueuedHere()

    def __repr__(self) -> str:
        return f"<SQLiteBackend {self._path!r} table={self._table!r}>"

    @property
    def path(self) -> str:
        """The absolute path of the database file."""
        return self._path

    @property
    def table(self) -> str:
        """The table the leases live in."""
        return self._table

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> SQLiteBackend:
        """Open ``sqlite:///relative.db`` or ``sqlite:////absolute.db``.

        Options come from the URL query or keyword arguments (not both):
        ``table``, ``busy_timeout``, ``poll_interval``.

        :raises InvalidArgument: a malformed URL or option, or an unusable file
        :raises BackendError: the file could not be opened
        """
        path, from_query = _parse_url(url)
        for key in options:
            if key not in _URL_OPTIONS or key in from_query:
                raise InvalidArgument(f"SQLite option {key!r} is unknown or given twice")
        backend = cls(path, **from_query, **options)
        await backend.open()
        return backend

    async def open(self) -> None:
        """Open the file and create the table now (otherwise the first operation does).

        :raises InvalidArgument: the file cannot be opened or is not a SQLite database
        :raises BackendTimeout: another process kept the database locked
        """
        async with self._lock.hold():
            await self._connection()

    async def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        if self._conn is None:
            try:
                self._conn = await anyio.to_thread.run_sync(self._connect)
            except sqlite3.Error as exc:
                if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
                    raise _map_error(exc) from exc
                # Anything else at open time is about the file the caller named.
                raise InvalidArgument(
                    f"{self._path!r} cannot be used as a SQLite database: {exc}"
                ) from exc
        return self._conn

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self._path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self._table} ("
                " name TEXT PRIMARY KEY NOT NULL, token INTEGER NOT NULL,"
                " owner TEXT, identity TEXT, metadata TEXT,"
                " ttl REAL, expires_at REAL, boot_id TEXT)"
            )
            for create in self._permits.create:  # see _sqlite_permits
                conn.execute(create)
        except BaseException:
            conn.close()
            raise
        return conn

    async def _run(
        self, fn: Callable[[sqlite3.Connection], T], *, urgent: bool = False, light: bool = False
    ) -> T:
        """Run ``fn`` on the connection in a worker thread; an ``urgent`` call (a
        renewal) goes before the calls waiting without it. Calls that wait for the
        connection run together, in one transaction (:mod:`._sqlite_group`); a
        ``light`` one's commit needs no sync unless it issues a token."""
        result: T = await self._call(Call(fn, light=light), urgent)
        return result

    async def _call(self, call: Call, urgent: bool = False) -> Any:
        queue = self._urgent_calls if urgent else self._calls
        queue.append(call)
        try:
            async with self._lock.hold(urgent=urgent):
                if not call.done:
                    await self._send_calls()
        finally:
            if not call.done and call in queue:  # cancelled, or failed, before it was sent
                queue.remove(call)
        error = call.error
        if error is not None:
            if isinstance(error, sqlite3.Error):
                raise _map_error(error) from error
            raise error
        return call.result

    async def _send_calls(self) -> None:
        """Run every call waiting (the connection is held), as one transaction; the
        releases among them hand the names they free to their first waiters here
        (:mod:`._sqlite_turns`)."""
        conn = await self._connection()
        urgent, others = self._urgent_calls, self._calls
        n = min(len(urgent), MOST)
        m = min(len(others), MOST - n)
        batch = urgent[:n] + others[:m]
        del urgent[:n], others[:m]
        releases = [call for call in batch if isinstance(call, _Release)]
        self._pick_next(releases)
        sent_at = current_time()
        try:
            # Shielded: once sent, the group's outcome is every caller's (a cancel of the
            # sender is raised after it, at the next checkpoint).
            with cancel_scope(shield=True):
                await self._thread.run(run_group, conn, batch, self._issued)
        except BaseException as exc:
            for entry in releases:
                if entry.next is not None:
                    self._turns.put_back(entry.name, entry.next)
                    entry.next = None
            if not isinstance(exc, sqlite3.Error):
                urgent[:0], others[:0] = batch[:n], batch[n:]  # the next holder sends them
                raise
            for call in batch:
                call.error, call.done = exc, True
            return
        for call in batch:
            call.done = True
        for entry in releases:
            ask = entry.next
            if ask is None:
                continue
            if entry.handed is None:
                self._turns.put_back(entry.name, ask)
            else:
                self._turns.handed(entry.name, ask)
                self._handed.granted(entry.name, [ask.owner], [entry.handed], [ask.ttl], sent_at)

    def _issued(self) -> int:
        return self._permits.issued

    def _pick_next(self, releases: Sequence[_Release]) -> None:
        """For each release, the first waiter here of its name, to hand it to (a name
        once per group; never to an owner that releases in it)."""
        releasing = {entry.owner for entry in releases}
        handing: set[str] = set()
        for entry in releases:
            if entry.name not in handing:
                entry.next = self._turns.take_next(entry.name, releasing)
                if entry.next is not None:
                    handing.add(entry.name)

    def _params(self, name: str, now: float, **extra: object) -> dict[str, object]:
        return {"name": name, "now": now, "boot": self._boot_id, **extra}

    def _holder(self, name: str, row: tuple[Any, ...], now: float) -> HolderInfo | None:
        """The holder that row ``name`` (as :meth:`_read_sync` selects it) stands for, or
        ``None`` when it is free or expired.

        SQLite keeps any value in any column: a token that is not an integer (the next
        grant would restart it at 1), or a row with an owner whose expiry or ttl is not a
        number (its liveness cannot be judged), is foreign, free or not.

        :raises ForeignDataError: the row holds what aiolease did not write
        """
        owner, identity, token, metadata, expires_at, ttl, live = row
        where = f"{self._table!r} of {self._path!r}"
        check_token(where, name, token)
        if owner is not None:
            for what, value in (("expiry", expires_at), ("ttl", ttl)):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise foreign(where, name, f"its {what} is {value!r}")
        if not live:
            return None
        return row_holder(where, name, owner, identity, token, metadata, expires_at, since=now)

    # -- the operations, each run in a worker thread on the one connection ------------

    def _try_acquire_sync(
        self, conn: sqlite3.Connection, name: str, owner: str, ttl: float, identity: str, meta: str
    ) -> Grant | HolderInfo:
        t = self._table
        conn.execute("BEGIN IMMEDIATE")
        try:
            now = self._clock()  # read only now that the write lock is ours
            p = self._params(name, now, owner=owner, ttl=ttl, identity=identity, metadata=meta)
            # The row first: one aiolease did not write is never granted over.
            current = self._read_sync(conn, name, now)
            if current is not None and current.owner != owner:
                conn.execute("COMMIT")
                return current
            if current is not None:  # a retry by the live holder
                rows = conn.execute(
                    f"UPDATE {t} SET expires_at = :now + :ttl, ttl = :ttl"
                    f" WHERE name = :name AND owner = :owner AND {_LIVE} RETURNING token",
                    p,
                ).fetchall()
                conn.execute("COMMIT")
                return Grant(rows[0][0], ttl)
            rows = conn.execute(
                f"INSERT INTO {t}"
                " (name, token, owner, identity, metadata, ttl, expires_at, boot_id)"
                " VALUES (:name, 1, :owner, :identity, :metadata, :ttl, :now + :ttl, :boot)"
                " ON CONFLICT (name) DO UPDATE SET token = token + 1, owner = excluded.owner,"
                " identity = excluded.identity, metadata = excluded.metadata, ttl = excluded.ttl,"
                f" expires_at = excluded.expires_at, boot_id = excluded.boot_id WHERE NOT ({_LIVE})"
                " RETURNING token",
                p,
            ).fetchall()
            conn.execute("COMMIT")
        except BaseException:
            conn.rollback()
            raise
        if not rows:  # pragma: no cover - the row read above cannot change under our lock
            raise BackendUnavailable(f"lease {name!r} neither granted nor held")
        return Grant(rows[0][0], ttl)

    def _renew_sync(
        self, conn: sqlite3.Connection, name: str, owner: str, token: int, ttl: float
    ) -> bool:
        rows = conn.execute(
            f"UPDATE {self._table} SET expires_at = :now + :ttl, ttl = :ttl"
            f" WHERE name = :name AND owner = :owner AND token = :token AND {_LIVE}"
            " RETURNING token",
            self._params(name, self._clock(), owner=owner, token=token, ttl=ttl),
        ).fetchall()
        return bool(rows)

    def _renew_many_sync(
        self, conn: sqlite3.Connection, batch: Encoded, *, permits: bool = False
    ) -> set[tuple[str, str, int]] | None:
        """Renew every lease of ``batch`` (all locks, or all ``permits``): see
        :func:`renew_batch`."""
        table, live = self._table, _LIVE
        if permits:
            table, live = self._permits.permits, f"granted = 1 AND {PERMIT_LIVE}"
        return renew_batch(conn, batch, table, live, self._clock(), self._boot_id)

    def _release_sync(self, conn: sqlite3.Connection, entry: _Release) -> bool:
        """Free the name if ``entry.owner`` holds it, or hand it to ``entry.next`` (the
        waiter's grant: the next token, its ttl, identity and metadata)."""
        entry.handed = None  # not from an earlier run of its group, rolled back
        ask = entry.next
        if ask is None:
            sets = "owner = NULL, identity = NULL, metadata = NULL, expires_at = NULL"
            extra: dict[str, object] = {}
        else:
            sets = (
                "token = token + 1, owner = :next, identity = :identity,"
                " metadata = :metadata, ttl = :ttl, expires_at = :now + :ttl"
            )
            extra = {"next": ask.owner, "identity": ask.identity, "metadata": ask.metadata}
            extra["ttl"] = ask.ttl
        rows = conn.execute(
            f"UPDATE {self._table} SET {sets} WHERE name = :name AND owner = :owner"
            f" AND (:token IS NULL OR token = :token) AND {_LIVE} RETURNING token",
            self._params(entry.name, self._clock(), owner=entry.owner, token=entry.token, **extra),
        ).fetchall()
        if rows and ask is not None:
            entry.handed = int(rows[0][0])
        return bool(rows)

    def _update_metadata_sync(
        self, conn: sqlite3.Connection, name: str, owner: str, token: int, meta: str
    ) -> bool:
        rows = conn.execute(
            f"UPDATE {self._table} SET metadata = :metadata"
            f" WHERE name = :name AND owner = :owner AND token = :token AND {_LIVE}"
            " RETURNING token",
            self._params(name, self._clock(), owner=owner, token=token, metadata=meta),
        ).fetchall()
        return bool(rows)

    def _read_sync(self, conn: sqlite3.Connection, name: str, now: float) -> HolderInfo | None:
        rows = conn.execute(
            f"SELECT owner, identity, token, metadata, expires_at, ttl, {_LIVE}"
            f" FROM {self._table} WHERE name = :name",
            {"name": name, "now": now, "boot": self._boot_id},
        ).fetchall()
        return self._holder(name, rows[0], now) if rows else None

    # -- permits (docs/internals/semaphores.md: see ``_sqlite_permits``) ----------------

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        """One ``BEGIN IMMEDIATE`` transaction (see :meth:`PermitTables.acquire`), or
        none for a grant that a release through this backend made."""
        handed = self._handed.take(name, owner, float(ttl), limit)
        if handed is not None:
            self._queued.discard(name, owner)
            return handed
        meta = json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True)
        result = await self._run(
            lambda conn: self._permits.acquire(
                conn, name, owner, ttl, identity, meta, limit, weight
            ),
            light=name in self._queued,  # expected to be queued: no sync (._sqlite_group)
        )
        if isinstance(result, Grant):
            self._queued.discard(name, owner)
            self._handed.forget(name, owner)
        else:
            self._queued.add(name, owner)
            self._handed.refused(name, owner, limit)
        return result

    async def _release_permit(self, name: str, owner: str, token: int | None) -> bool:
        """One ``BEGIN IMMEDIATE`` transaction that also grants the queue entries that
        then fit (see :meth:`PermitTables.release`): their waiters here take the grants
        without a call, and only they wake."""
        self._handed.forget(name, owner)
        self._queued.discard(name, owner)
        sent_at = current_time()
        freed, grants = await self._run(
            lambda conn: self._permits.release(conn, name, owner, token)
        )
        if grants:
            owners, tokens, ttls = zip(*grants, strict=True)
            self._handed.granted(name, owners, tokens, ttls, sent_at)
        return freed

    async def read_permits(self, name: str) -> PermitHolders | None:
        return await self._run(lambda conn: self._permits.read(conn, name))

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a release in this process grants the caller's queue entry, or
        after :attr:`poll_interval` (changes by other processes), or when the first
        permit expires; never later than a third of ``ttl``."""
        timeout = min(self.poll_interval, ttl / 3)
        if seen.remaining is not None:
            timeout = min(timeout, max(seen.remaining, 0.001))
        with _watching(self._path, turn_key(name, owner)) as event:
            if self._handed.waiting(name, owner):
                return  # granted after the refusal
            with move_on_after(timeout):
                await event.wait()

    # -- the contract ------------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        handed = self._handed.take(name, owner, float(ttl), _LOCK)
        if handed is not None:  # handed over by a release here while it waited
            self._turns.leave(name, owner)
            return handed
        meta = json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True)
        result = await self._run(
            lambda conn: self._try_acquire_sync(conn, name, owner, ttl, identity, meta)
        )
        if isinstance(result, Grant):
            self._turns.leave(name, owner)
            self._handed.forget(name, owner)
            # A retry by the holder changes nothing a waiter cares about; waking is harmless.
            _notify(self._path, name)
        else:
            self._turns.refused(name, owner, ttl, identity, meta)
            self._handed.refused(name, owner, _LOCK)
        return result

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a release here hands the name to the caller, or, for the first
        waiter of the name here, when the name changes in this process; and after
        :attr:`poll_interval` (changes by other processes), when ``seen`` expires,
        never later than a third of ``ttl`` (see :mod:`._sqlite_turns`)."""
        first = self._turns.join(name, owner)
        timeout = min(self.poll_interval, ttl / 3)
        if seen.remaining is not None:
            timeout = min(timeout, max(seen.remaining, 0.001))
        key = name if first else turn_key(name, owner)
        with _watching(self._path, key) as event:
            if self._handed.waiting(name, owner):
                return  # handed over after the refusal
            with move_on_after(timeout):
                await event.wait()

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        renew = self._permits.renew if is_permit_owner(owner) else self._renew_sync
        if not await self._run(lambda conn: renew(conn, name, owner, token, ttl), urgent=True):
            raise NotOwnerError(name)
        return Grant(token, ttl)

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        """Every lease the core's scheduler finds due, in one statement (one more for
        the permits among them); the batches' JSON made once per list of the core's
        (:func:`derived`)."""
        locks, permits = derived(renewals, "sqlite", encode_batches)

        def renew(
            conn: sqlite3.Connection,
        ) -> tuple[set[tuple[str, str, int]] | None, set[tuple[str, str, int]] | None]:
            renewed = None if locks is None else self._renew_many_sync(conn, locks)
            if permits is None:
                return renewed, None
            return renewed, self._renew_many_sync(conn, permits, permits=True)

        renewed_locks, renewed_permits = await self._run(renew, urgent=True)
        if renewed_locks is None and renewed_permits is None:
            return RenewedAsAsked(renewals)
        failed: dict[int, NotOwnerError] = {}
        for index, (n, o, t, _) in enumerate(renewals):
            renewed = renewed_permits if is_permit_owner(o) else renewed_locks
            if renewed is not None and (n, o, t) not in renewed:
                failed[index] = NotOwnerError(n)
        return RenewedAsAsked(renewals, failed=failed)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Free ``name`` if ``owner`` holds it, handing it to the first waiter here if
        any (:mod:`._sqlite_turns`). Like every call, one that waits for the connection
        goes with the others waiting, in one transaction (:mod:`._sqlite_group`); one
        cancelled before its turn is not sent (the lease runs out at its expiry, as if
        the release timed out)."""
        if is_permit_owner(owner):
            return await self._release_permit(name, owner, token)
        self._handed.forget(name, owner)  # (one handed to a waiter that gave up: freed here)
        self._turns.leave(name, owner)
        freed: bool = await self._call(_Release(self._release_sync, name, owner, token))
        if freed:
            _notify(self._path, name)  # observers, and the first waiter of the name
        return freed

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        meta = json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True)
        if not await self._run(
            lambda conn: self._update_metadata_sync(conn, name, owner, token, meta)
        ):
            raise NotOwnerError(name)
        _notify(self._path, name)

    async def read(self, name: str) -> HolderInfo | None:
        return await self._run(lambda conn: self._read_sync(conn, name, self._clock()))

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Return when ``name``'s holder or its metadata differs from ``seen`` (renewals
        do not count).

        Wakes at once for changes made in this process, within :attr:`poll_interval`
        for changes made by others, and no later than ``seen``'s expiry.
        """
        seen_key = state_of(seen)
        give_up = None
        if seen is not None and seen.remaining is not None:
            give_up = current_time() + seen.remaining
        # Watch before reading, so a change made between the read and the wait wakes us.
        with _watching(self._path, name) as event:
            while True:
                current = await self.read(name)
                if state_of(current) != seen_key:
                    return
                timeout = self.poll_interval
                if current is not None and current.remaining is not None:
                    timeout = min(timeout, current.remaining)
                if give_up is not None:
                    timeout = min(timeout, give_up - current_time())
                    if timeout <= 0:
                        return
                with move_on_after(timeout):
                    await event.wait()
                if event.is_set():
                    return

    async def aclose(self) -> None:
        """Close the connection. Idempotent."""
        with cancel_scope(shield=True):
            async with self._lock.hold(urgent=True):
                self._closed = True
                conn, self._conn = self._conn, None
                if conn is not None:
                    await anyio.to_thread.run_sync(conn.close)
                self._thread.stop()

    async def __aenter__(self) -> Self:
        await self.open()
        return self
