"""The fenced resource: a SQLite file that rejects writes with a token lower than
the highest it has seen.

A write may also be *unfenced*: logged and accepted whatever its token, while it
still raises the highest token seen. The semaphore form writes only so (``N``
holders write at once, each with its own token: no single highest token can tell a
stale one from a live one); the read-write form's readers write so, its writers
fenced (a writer is alone, so a write with a token lower than one registered since
is a stale writer's).

One table holds the highest token accepted and a count of rejections; an
append-only log keeps every accepted write, and its ``AUTOINCREMENT`` sequence is
the true order in which the fence accepted them. Each write is one ``BEGIN
IMMEDIATE`` transaction around one conditional ``UPDATE ... WHERE max_token <=
:token``. The checker does not trust the fence's verdicts: it recomputes them from
the log and from the workers' own records (see :mod:`._check`).
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from types import TracebackType

from ._records import Accepted

__all__ = ["Fence", "FenceWrite"]

#: Seconds a writer waits for another process's write lock (a paused holder may keep it).
BUSY_TIMEOUT = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS fence (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    max_token INTEGER NOT NULL,
    rejected INTEGER NOT NULL
);
INSERT OR IGNORE INTO fence (id, max_token, rejected) VALUES (1, 0, 0);
CREATE TABLE IF NOT EXISTS accepted (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    pid INTEGER NOT NULL,
    token INTEGER NOT NULL,
    at REAL NOT NULL,
    fenced INTEGER NOT NULL DEFAULT 1
);
"""


@dataclass(frozen=True, slots=True)
class FenceWrite:
    """The fence's answer to one write: ``seq`` is its log position when accepted."""

    accepted: bool
    seq: int | None


class Fence:
    """One process's connection to the fence file (created on first open).

    :param path: the SQLite file
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode = WAL")
        # Durability against power loss is not what is tested; commits reach the OS.
        self._conn.execute("PRAGMA synchronous = NORMAL")
        self._conn.executescript(_SCHEMA)

    def write(self, pid: int, token: int, *, fenced: bool = True) -> FenceWrite:
        """Write with ``token``: accepted unless a higher token was accepted before
        (unless not ``fenced``: then accepted, and the highest token raised if lower)."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            updated = conn.execute(
                "UPDATE fence SET max_token = :token WHERE id = 1 AND max_token <= :token",
                {"token": token},
            ).rowcount or int(not fenced)
            seq: int | None = None
            if updated:
                cursor = conn.execute(
                    "INSERT INTO accepted (pid, token, at, fenced) VALUES (?, ?, ?, ?)",
                    (pid, token, time.monotonic(), int(fenced)),
                )
                seq = cursor.lastrowid
            else:
                conn.execute("UPDATE fence SET rejected = rejected + 1 WHERE id = 1")
            conn.execute("COMMIT")
        except BaseException:
            conn.rollback()
            raise
        return FenceWrite(bool(updated), seq)

    def log(self) -> list[Accepted]:
        """Every accepted write, in the order the fence accepted them."""
        rows = self._conn.execute("SELECT seq, pid, token, at, fenced FROM accepted ORDER BY seq")
        return [Accepted(seq, pid, token, at, bool(fenced)) for seq, pid, token, at, fenced in rows]

    def highest(self) -> int:
        """The highest token accepted so far (0 before any write)."""
        row = self._conn.execute("SELECT max_token FROM fence WHERE id = 1").fetchone()
        return int(row[0])

    def rejections(self) -> int:
        """How many writes the fence rejected."""
        row = self._conn.execute("SELECT rejected FROM fence WHERE id = 1").fetchone()
        return int(row[0])

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def __enter__(self) -> Fence:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
