"""The SQLite backend's calls that wait for its one connection, run together.

A backend object runs one call at a time on its connection, each a transaction of
its own with a synced commit (``synchronous=FULL``). Calls that wait meanwhile (many
tasks acquiring, releasing and renewing at once) would each pay a commit, one after
the other: 10,000 blocks that ended at once took longer than their 3 s release
bound, and the permits of a semaphore that 16 tasks share went no faster than the
lock. So whichever waiting caller gets the connection runs every call waiting, in
order, as one transaction (:func:`run_group`): one commit for all. Each call runs as
it would alone, its own ``BEGIN IMMEDIATE`` and ``COMMIT`` those of the group's
transaction (:class:`InGroup`). Should a call fail (or roll back), the group's
transaction is rolled back and run again from its start with each call's
transaction a savepoint of the group's (:class:`Savepoints`), so that the failed
call undoes only its own writes, and its caller alone gets its error (a savepoint
per call costs two statements of its own: 16 tasks on a semaphore of 4 spent a
third of their statements on them); each caller is answered only once the group's
commit is done. A call that runs alone runs exactly as before. A caller cancelled
before its call was sent takes it out of the queue.

**Commits that need no sync.** ``synchronous=FULL`` is for the tokens: a grant's token
must survive a power cut, or the next boot would issue it again. Nothing else needs
it: every row aiolease writes names the boot it was written in, and a power cut
starts a new boot, so a row lost with it (a queue entry, an expired row deleted, a
release) would have been dead anyway. A group whose calls are all :attr:`Call.light`
(a permit request that is expected to be queued, behind a waiter of this backend
object) runs with ``synchronous=NORMAL``: its commit writes the WAL without waiting
for the disk. Were a token issued in it after all (``issued`` moved), the group is
rolled back before its commit and run again with ``synchronous=FULL``: no answer is
given from the light run. Sixteen tasks on a semaphore of limit 4 then pay one synced
commit per round of releases, not two (a round of their queue entries in between).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MOST", "Call", "InGroup", "Savepoints", "run_group"]

#: The most calls in one group (the write lock is held for all of them).
MOST = 256


class Call:
    """A call waiting for the connection, then its outcome."""

    __slots__ = ("done", "error", "fn", "light", "result")

    def __init__(self, fn: Callable[[Any], Any], *, light: bool = False) -> None:
        self.fn = fn
        #: Whether its writes may commit without a sync unless it issues a token.
        self.light = light
        self.done = False
        self.result: Any = None
        self.error: Exception | None = None


class InGroup:
    """The connection as one call of a group sees it on the first run: its
    transaction is the group's (``BEGIN IMMEDIATE`` and ``COMMIT`` do nothing), and a
    ``rollback()`` marks the group ``failed`` (it is run again with savepoints)."""

    __slots__ = ("_conn", "failed", "in_transaction")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.in_transaction = False
        self.failed = False

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor | None:
        if sql == "BEGIN IMMEDIATE":
            self.in_transaction = True
            return None
        if sql == "COMMIT":
            self.in_transaction = False
            return None
        return self._conn.execute(sql, params)

    def rollback(self) -> None:
        self.in_transaction = False
        self.failed = True


class Savepoints:
    """The connection as one call of a group sees it: its transaction is a savepoint
    of the group's."""

    __slots__ = ("_conn", "in_transaction")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.in_transaction = False

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if sql == "BEGIN IMMEDIATE":
            self.in_transaction = True
            return self._conn.execute("SAVEPOINT aiolease_call")
        if sql == "COMMIT":
            self.in_transaction = False
            return self._conn.execute("RELEASE aiolease_call")
        return self._conn.execute(sql, params)

    def rollback(self) -> None:
        if self.in_transaction:
            self.in_transaction = False
            self._conn.execute("ROLLBACK TO aiolease_call")
            self._conn.execute("RELEASE aiolease_call")


def run_group(
    conn: sqlite3.Connection, calls: Sequence[Call], issued: Callable[[], int] | None = None
) -> None:
    """Run ``calls`` (in a worker thread): one alone as it is, several in one
    transaction. Each call's result or error is left in it. If every call is light
    and ``issued`` (the count of tokens issued on ``conn``) is given, the group first
    runs with ``synchronous=NORMAL``, and again with ``synchronous=FULL`` only if it
    issued a token.

    :raises sqlite3.Error: the group's own transaction failed (nothing of it is kept)
    """
    if issued is not None and all(call.light for call in calls):
        conn.execute("PRAGMA synchronous = NORMAL")
        try:
            if _run_light(conn, calls, issued):
                return
        finally:
            _sync_again(conn)
    if len(calls) == 1:
        one = calls[0]
        try:
            one.result = one.fn(conn)
        except Exception as exc:
            one.error = exc
        return
    try:
        _run_in_transaction(conn, calls)
        conn.execute("COMMIT")
    except BaseException:
        _undo(conn, calls)
        raise


def _run_in_transaction(conn: sqlite3.Connection, calls: Sequence[Call]) -> None:
    """Open the group's transaction and run ``calls`` in it (left open): each call's
    transaction the group's; if one fails, the transaction is rolled back and opened
    again, and the calls run with a savepoint each."""
    conn.execute("BEGIN IMMEDIATE")
    view = InGroup(conn)
    for call in calls:
        try:
            call.result = call.fn(view)
        except Exception:
            view.failed = True
        if view.failed:
            break
    else:
        return
    _undo(conn, calls)
    conn.execute("BEGIN IMMEDIATE")
    _run_each(conn, calls)


def _sync_again(conn: sqlite3.Connection) -> None:
    """Back to ``synchronous=FULL``; if that fails, the connection is closed: no later
    commit (a token's) may run without the sync."""
    try:
        conn.execute("PRAGMA synchronous = FULL")
    except BaseException:
        conn.close()
        raise


def _run_each(conn: sqlite3.Connection, calls: Sequence[Call]) -> None:
    for call in calls:
        view = Savepoints(conn)
        try:
            call.result = call.fn(view)
        except Exception as exc:
            view.rollback()
            call.error = exc


def _undo(conn: sqlite3.Connection, calls: Sequence[Call]) -> None:
    if conn.in_transaction:
        conn.rollback()
    for call in calls:
        call.result, call.error = None, None


def _run_light(conn: sqlite3.Connection, calls: Sequence[Call], issued: Callable[[], int]) -> bool:
    """Run ``calls`` as one transaction (``synchronous`` is ``NORMAL``); whether it was
    committed (``False``: it issued a token, and was rolled back, nothing of it kept)."""
    before = issued()
    try:
        _run_in_transaction(conn, calls)
        if issued() != before:
            _undo(conn, calls)
            return False
        conn.execute("COMMIT")
    except BaseException:
        _undo(conn, calls)
        raise
    return True
