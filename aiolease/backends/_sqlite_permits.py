"""The SQLite backend's permits (semaphores and read-write locks,
``docs/internals/semaphores.md``): :class:`PermitTables`, the statements that
:class:`~aiolease.backends.sqlite.SQLiteBackend` runs on its connection (in a worker
thread, one call at a time) for them.

Two tables beside the lease table: ``<table>_permits`` (a row per held or queued
request, keyed ``(name, owner)``) and ``<table>_permit_names`` (per name the token
counter and the arrival sequence of the queue). An acquire is one ``BEGIN
IMMEDIATE`` transaction, which holds the database's write lock from its start: the
rows it reads are the latest, and its clock is read once the lock is held. So is a
release, which also grants the queue entries that then fit (in arrival order), so
that only their waiters need waking (see :mod:`aiolease.backends.sql._handed`).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from typing import Any

from .._exceptions import ForeignDataError, LimitMismatchError
from .._permits import PermitHolders
from ..abc import Grant, HolderInfo
from .sql._permits import CheckedRows

__all__ = ["PERMIT_LIVE", "PermitTables", "QueuedHere"]

#: A permit's row (held or queued) is live when written in this boot, not expired, and
#: no further ahead than its ttl.
PERMIT_LIVE = "boot_id = :boot AND expires_at > :now AND expires_at - :now <= ttl + 0.001"
#: The columns of a permit's row, as :meth:`PermitTables.rows` selects them.
_COLUMNS = "owner, weight, lim, granted, seq, token, identity, metadata, expires_at"


class PermitTables:
    """The permit statements of one lease table of one SQLite database.

    :param table: the lease table (validated)
    :param boot_id: the backend's boot id of the host, read at each use (rows of another
        boot are dead)
    :param clock: the backend's clock (seconds), read at each use
    """

    def __init__(self, table: str, boot_id: Callable[[], str], clock: Callable[[], float]) -> None:
        self.permits = f"{table}_permits"
        self._names = f"{table}_permit_names"
        self._boot_id = boot_id
        self._clock = clock
        #: How many tokens the statements here issued (rolled back or not): a group
        #: that runs without a sync is run again with one if it moved
        #: (:mod:`._sqlite_group`).
        self.issued = 0
        #: The rows checked lately (the name's queue, mostly the same from one
        #: statement to the next, is not decoded again).
        self._checked = CheckedRows(repr(self.permits))
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {self.permits} ("
            " name TEXT NOT NULL, owner TEXT NOT NULL, weight INTEGER NOT NULL,"
            " lim INTEGER NOT NULL, granted INTEGER NOT NULL, seq INTEGER NOT NULL,"
            " token INTEGER, identity TEXT, metadata TEXT, ttl REAL NOT NULL,"
            " expires_at REAL NOT NULL, boot_id TEXT NOT NULL, PRIMARY KEY (name, owner))",
            f"CREATE TABLE IF NOT EXISTS {self._names} ("
            " name TEXT PRIMARY KEY NOT NULL, token INTEGER NOT NULL, seq INTEGER NOT NULL)",
        )

    def _params(self, name: str, now: float, **extra: object) -> dict[str, object]:
        return {"name": name, "now": now, "boot": self._boot_id(), **extra}

    def rows(self, conn: sqlite3.Connection, name: str, now: float) -> list[tuple[Any, ...]]:
        """The live rows of ``name``'s permits, held and queued, in arrival order.

        :raises ForeignDataError: a row holds what aiolease would not have written (it
            is left as it is, and nothing is granted over it)
        """
        found = conn.execute(
            f"SELECT {_COLUMNS} FROM {self.permits}"
            f" WHERE name = :name AND {PERMIT_LIVE} ORDER BY seq",
            self._params(name, now),
        ).fetchall()
        self._check(name, found, now)
        return found

    def _check(self, name: str, rows: list[tuple[Any, ...]], now: float) -> None:
        checked = self._checked
        for row in rows:
            owner, weight, lim, granted, seq, token, identity, metadata, expires = row
            # A row checked before, with an expiry that is a float, passes at a look-up.
            if type(expires) is float and checked.seen((name, *row[:8])):
                continue
            left = expires - now if isinstance(expires, (int, float)) else expires
            checked.check(name, owner, weight, lim, granted, seq, token, identity, metadata, left)

    def _live_rows(self, conn: sqlite3.Connection, name: str, now: float) -> list[tuple[Any, ...]]:
        """:meth:`rows`, once the expired rows of ``name`` are deleted (one statement when
        none has: the rows are read with their liveness, and deleted only if some is 0)."""
        found = conn.execute(
            f"SELECT {_COLUMNS}, {PERMIT_LIVE} FROM {self.permits} WHERE name = :name ORDER BY seq",
            self._params(name, now),
        ).fetchall()
        if any(row[-1] == 0 for row in found):
            conn.execute(
                f"DELETE FROM {self.permits} WHERE name = :name AND NOT ({PERMIT_LIVE})",
                self._params(name, now),
            )
        live = [row[:-1] for row in found if row[-1]]
        self._check(name, live, now)
        return live

    def _next(self, conn: sqlite3.Connection, name: str, column: str) -> int:
        """The next value of ``name``'s token counter or queue sequence (``column``)."""
        if column == "token":
            self.issued += 1
        row = conn.execute(
            f"INSERT INTO {self._names} (name, token, seq) VALUES (:name, 1, 1)"
            f" ON CONFLICT (name) DO UPDATE SET {column} = {column} + 1 RETURNING {column}",
            {"name": name},
        ).fetchone()
        return int(row[0])

    @staticmethod
    def _holder(name: str, row: tuple[Any, ...], now: float) -> HolderInfo:
        owner, _, _, _, _, token, identity, metadata, expires_at = row
        return HolderInfo(
            name,
            owner,
            identity,
            0 if token is None else token,
            json.loads(metadata) if metadata else {},
            max(expires_at - now, 0.0),
        )

    def acquire(
        self,
        conn: sqlite3.Connection,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        meta: str,
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        """One ``BEGIN IMMEDIATE`` transaction: drop the expired rows, check the limit,
        grant if the held weight, the weight queued ahead and ``weight`` fit, else queue."""
        t = self.permits
        conn.execute("BEGIN IMMEDIATE")
        try:
            now = self._clock()  # read only now that the write lock is ours
            p = self._params(name, now, owner=owner, ttl=ttl)
            rows = self._live_rows(conn, name, now)
            if rows and rows[0][2] != limit:
                conn.execute("COMMIT")
                raise LimitMismatchError(name, limit, rows[0][2])
            mine = next((row for row in rows if row[0] == owner), None)
            if mine is not None and mine[3]:  # a retry by the holder
                self._refresh(conn, p)
                conn.execute("COMMIT")
                return Grant(mine[5], ttl)
            used = sum(row[1] for row in rows if row[3])
            ahead = sum(row[1] for row in rows if not row[3] and (mine is None or row[4] < mine[4]))
            if used + ahead + weight <= limit:
                token = self._next(conn, name, "token")
                conn.execute(
                    f"INSERT OR REPLACE INTO {t} (name, owner, weight, lim, granted, seq, token,"
                    " identity, metadata, ttl, expires_at, boot_id) VALUES (:name, :owner,"
                    " :weight, :lim, 1, :seq, :token, :identity, :metadata, :ttl, :now + :ttl,"
                    " :boot)",
                    {
                        **p,
                        "weight": weight,
                        "lim": limit,
                        "seq": 0 if mine is None else mine[4],
                        "token": token,
                        "identity": identity,
                        "metadata": meta,
                    },
                )
                conn.execute("COMMIT")
                return Grant(token, ttl)
            if mine is None:  # its identity and metadata kept for a grant by a release
                seq = self._next(conn, name, "seq")
                conn.execute(
                    f"INSERT INTO {t} (name, owner, weight, lim, granted, seq, identity,"
                    " metadata, ttl, expires_at, boot_id) VALUES (:name, :owner, :weight, :lim,"
                    " 0, :seq, :identity, :metadata, :ttl, :now + :ttl, :boot)",
                    {
                        **p,
                        "weight": weight,
                        "lim": limit,
                        "seq": seq,
                        "identity": identity,
                        "metadata": meta,
                    },
                )
            else:
                self._refresh(conn, p)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
        held = [row for row in rows if row[3]]
        if held:
            return self._holder(name, min(held, key=lambda row: row[8]), now)
        return self._holder(name, rows[0], now)  # only the queue blocks

    def _refresh(self, conn: sqlite3.Connection, params: dict[str, object]) -> None:
        conn.execute(
            f"UPDATE {self.permits} SET expires_at = :now + :ttl, ttl = :ttl"
            " WHERE name = :name AND owner = :owner",
            params,
        )

    def renew(
        self, conn: sqlite3.Connection, name: str, owner: str, token: int, ttl: float
    ) -> bool:
        """Reset the expiry of ``owner``'s live permit of ``token``; whether it was."""
        rows = conn.execute(
            f"UPDATE {self.permits} SET expires_at = :now + :ttl, ttl = :ttl"
            " WHERE name = :name AND owner = :owner AND token = :token AND granted = 1"
            f" AND {PERMIT_LIVE} RETURNING token",
            self._params(name, self._clock(), owner=owner, token=token, ttl=ttl),
        ).fetchall()
        return bool(rows)

    def release(
        self, conn: sqlite3.Connection, name: str, owner: str, token: int | None
    ) -> tuple[bool, list[tuple[str, int, float]]]:
        """One ``BEGIN IMMEDIATE`` transaction: delete ``owner``'s permit (if ``token``
        matches) or queue entry; then, if live queue entries are left, grant those that
        fit in arrival order (the first that does not fit stops it), each with the
        name's next token and an expiry of its own ttl from now. Whether a live permit
        was freed, and the grants: (owner, token, ttl) each."""
        t = self.permits
        conn.execute("BEGIN IMMEDIATE")
        try:
            now = self._clock()
            p = self._params(name, now, owner=owner, token=token)
            # Read, then delete: SQLite 3.40 answers the rule wrongly inside DELETE ...
            # RETURNING for some readings (a ttl-600 permit taken with the clock at 500
            # came back expired, so its release said False), never in a SELECT. The
            # name's rows are read at once: the queue entries left are among them.
            found = conn.execute(
                f"SELECT {_COLUMNS}, {PERMIT_LIVE} FROM {t} WHERE name = :name ORDER BY seq",
                p,
            ).fetchall()
            deleted = [
                (row[3], row[-1])
                for row in found
                if row[0] == owner and (row[3] == 0 or token is None or row[5] == token)
            ]
            grants: list[tuple[str, int, float]] = []
            if deleted:
                conn.execute(f"DELETE FROM {t} WHERE name = :name AND owner = :owner", p)
                left = [row[:-1] for row in found if row[0] != owner and row[-1]]
                grants = self._grant_queued(conn, name, left, now)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
        return any(granted and live for granted, live in deleted), grants

    def _grant_queued(
        self, conn: sqlite3.Connection, name: str, rows: list[tuple[Any, ...]], now: float
    ) -> list[tuple[str, int, float]]:
        """Grant the live queue entries among ``rows`` (the live rows of ``name``, in
        arrival order) that fit, in arrival order (none over a row aiolease would not
        have written: the next acquire reports it)."""
        if not any(not row[3] for row in rows) or any(row[2] != rows[0][2] for row in rows):
            return []  # nobody queued, or limits that differ
        try:
            self._check(name, rows, now)
        except ForeignDataError:
            return []
        free = rows[0][2] - sum(row[1] for row in rows if row[3])
        grants: list[tuple[str, int, float]] = []
        for row in rows:
            if row[3]:
                continue
            if row[1] > free:
                break
            free -= row[1]
            token = self._next(conn, name, "token")
            (ttl,) = conn.execute(
                f"UPDATE {self.permits} SET granted = 1, token = :token,"
                " metadata = coalesce(metadata, '{}'), expires_at = :now + ttl"
                " WHERE name = :name AND owner = :owner RETURNING ttl",
                {"name": name, "owner": row[0], "token": token, "now": now},
            ).fetchone()
            grants.append((row[0], token, float(ttl)))
        return grants

    def read(self, conn: sqlite3.Connection, name: str) -> PermitHolders | None:
        """:meth:`~aiolease.abc.Backend.read_permits`' answer."""
        now = self._clock()
        rows = self.rows(conn, name, now)
        if not rows:
            return None
        held = sorted((row for row in rows if row[3]), key=lambda row: row[5])
        return PermitHolders(
            name,
            rows[0][2],
            tuple(self._holder(name, row, now) for row in held),
            tuple(row[1] for row in held),
            sum(1 for row in rows if not row[3]),
        )


#: The most names :class:`QueuedHere` remembers (past it, it forgets them all).
_MAX_QUEUED_NAMES = 4096


class QueuedHere:
    """Per name, the permit requests that one backend object saw refused (so queued)
    and not yet granted or released. A request of a name that has some is expected to
    be queued behind them: its call is light (:mod:`._sqlite_group`). A guess only: a
    request granted after all makes its group run again, with a sync."""

    def __init__(self) -> None:
        self._owners: dict[str, set[str]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._owners

    def add(self, name: str, owner: str) -> None:
        if len(self._owners) >= _MAX_QUEUED_NAMES and name not in self._owners:
            self._owners.clear()  # names whose requests never came back (a safety net)
        self._owners.setdefault(name, set()).add(owner)

    def discard(self, name: str, owner: str) -> None:
        owners = self._owners.get(name)
        if owners is not None:
            owners.discard(owner)
            if not owners:
                del self._owners[name]
