"""Deliberately broken backends for the safety harness's negative tests.

Worker processes import them by path (``tests.testing.broken_backends:IgnoresTtl``): the harness
puts this directory on their ``PYTHONPATH``.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from aiolease.abc import Grant, HolderInfo
from aiolease.backends._sqlite_permits import PermitTables
from aiolease.backends.sqlite import SQLiteBackend


class IgnoresTtl(SQLiteBackend):
    """A SQLite backend whose ``try_acquire`` treats every other holder's lease as expired.

    Whoever asks gets the name at once, with a new (higher) token, while the old
    holder still believes it holds it until its next renewal is refused.
    """

    def _try_acquire_sync(
        self, conn: sqlite3.Connection, name: str, owner: str, ttl: float, identity: str, meta: str
    ) -> Grant | HolderInfo:
        conn.execute(
            f"UPDATE {self.table} SET expires_at = 0 WHERE name = ? AND owner != ?", (name, owner)
        )
        return super()._try_acquire_sync(conn, name, owner, ttl, identity, meta)


class _OneMore(PermitTables):
    """Permit statements that grant within one more than the limit asked."""

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
        return super().acquire(conn, name, owner, ttl, identity, meta, limit + 1, weight)


class IgnoresLimit(SQLiteBackend):
    """A SQLite backend that grants one permit more than the semaphore's limit.

    Every client asks with the same (wrong) limit, so no :class:`LimitMismatchError`
    gives it away: ``limit + 1`` bodies run at once.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._permits = _OneMore(self.table, lambda: self._boot_id, lambda: self._clock())
