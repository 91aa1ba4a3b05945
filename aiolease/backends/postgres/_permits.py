"""The PostgreSQL backend's permits (semaphores and read-write locks,
``docs/internals/semaphores.md``): :class:`Permits`, which
:class:`~aiolease.backends.postgres.PostgresBackend` owns and hands a permit's
operations to.

An acquire is one statement (the function that the backend's setup installs, see
:class:`~aiolease.backends.postgres._statements.PermitSql`), a release another (a
function too), which grants the queue entries that then fit. The acquires and releases
of a name that arrive while one of the name's is in flight go together in the next
statement (:class:`~aiolease.backends._combine.Combiner`: one transaction, in
order, instead of one each, all waiting on the name's row). A waiter of this backend
takes such a grant from the release's answer without a statement; one of another
backend is told by ``NOTIFY`` (``'q'``: the owners granted), through its listener, and
asks again (see :mod:`aiolease.backends.sql._handed`). Only the waiters granted wake.
Renewals go in the backend's batches, beside the locks'.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ...abc import Grant, HolderInfo, PermitHolders
from .._asyncio import Tasks, now, wait_event
from .._combine import Combiner
from ..sql._handed import Handed, turn_key
from ..sql._permits import CheckedRows, PermitRow, acquired, permit_holders
from ..sql._renewals import RenewBatcher
from ..sql._values import encode_metadata
from ..sql._wakeups import Wakeups
from ._listener import LISTEN_CHECK, Listener
from ._statements import PERMIT_COLUMNS, PermitSql

__all__ = ["Permits"]

#: The most names remembered as having requests queued (then all are forgotten).
_MAX_CONTENDED = 4096

#: Runs one statement (with the backend's pool, errors mapped, tables made on first use).
Fetch = Callable[..., Awaitable[list[Any]]]
#: An acquire: (owner, weight, limit, identity, metadata, ttl).
_Acquire = tuple[str, int, int, str, str, float]
#: A release: (owner, token or ``None``).
_Release = tuple[str, int | None]
#: What answered an operation: whether it was the plain ``DELETE``, and its rows.
_Answer = tuple[bool, list[Any]]

logger = logging.getLogger("aiolease.backends.postgres")


class Permits:
    """The permit operations of one PostgreSQL backend.

    :param sql: the permit statements of the backend's table
    :param fetch: runs a statement as the backend runs its own
    :param listener: the backend's listener (wake-ups, and marks)
    :param wakeups: the backend's in-process wake-ups
    :param batcher: the backend's renewal batches (a release leaves them)
    :param channel: the backend's ``NOTIFY`` channel
    :param poll_interval: how long a wait lasts at most while nothing listens
    """

    def __init__(
        self,
        sql: PermitSql,
        fetch: Fetch,
        listener: Listener,
        wakeups: Wakeups,
        batcher: RenewBatcher,
        channel: str,
        poll_interval: Callable[[], float],
    ) -> None:
        self._sql = sql
        self._fetch = fetch
        self._listener = listener
        self._wakeups = wakeups
        self._batcher = batcher
        self._channel = channel
        self._poll_interval = poll_interval
        #: The grants that releases made to queue entries, until their waiters take them.
        self._handed = Handed(wakeups.wake, now)
        self._checked = CheckedRows(sql.where)
        listener.permits_granted = self._handed.told
        listener.permits_released = self._handed.told_all
        #: Names with requests queued, as this backend last saw them (a refusal, or a
        #: release that left some): their releases take the name's row and grant.
        self._contended: set[str] = set()
        #: Tasks in :meth:`wait_turn` now.
        self.waiting = 0
        #: Acquires sent to the server (alone or with others in one statement).
        self.statements = 0
        self._tasks = Tasks(logger)
        self.combiner: Combiner[_Acquire | _Release, _Answer] = Combiner(
            self._send_one, self._send_many, self._tasks
        )

    async def aclose(self) -> None:
        """Stop sending the statements that gathered (their callers are told so)."""
        await self._tasks.aclose()

    async def _send_one(self, name: str, op: _Acquire | _Release) -> _Answer:
        """One operation of ``name``, by its own statement."""
        if len(op) == 6:
            return False, await self._fetch(self._sql.acquire, name, *op)
        owner, token = op
        if name not in self._contended:
            return True, await self._fetch(
                self._sql.release_plain, name, owner, token, self._channel
            )
        return False, await self._fetch(
            self._sql.release, name, owner, token, self._channel, self._handed.queued_here(name)
        )

    async def _send_many(self, name: str, ops: Sequence[_Acquire | _Release]) -> list[_Answer]:
        """Operations of ``name``, in order, by one statement (one transaction)."""
        acquires = [op if len(op) == 6 else None for op in ops]
        rows = await self._fetch(
            self._sql.batch,
            name,
            "".join("r" if a is None else "a" for a in acquires),
            [op[0] for op in ops],
            [None if a is not None else op[1] for op, a in zip(ops, acquires, strict=True)],
            [None if a is None else a[1] for a in acquires],
            [None if a is None else a[2] for a in acquires],
            [None if a is None else a[3] for a in acquires],
            [None if a is None else a[4] for a in acquires],
            [None if a is None else a[5] for a in acquires],
            self._channel,
            self._handed.queued_here(name),
        )
        answers: list[_Answer] = [(False, []) for _ in ops]
        for row in rows:
            answers[row["i"] - 1][1].append(row)
        return answers

    def _rows(self, name: str, rows: Sequence[Any]) -> list[PermitRow]:
        check = self._checked.row
        return [check(name, *(row[c] for c in PERMIT_COLUMNS)) for row in rows]

    async def try_acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        """:meth:`~aiolease.abc.Backend.try_acquire_permit`: one statement."""
        ttl = float(ttl)
        handed = self._handed.take(name, owner, ttl, limit)
        if handed is not None:  # granted by a release through this backend: no statement
            return handed
        meta = encode_metadata(metadata) if metadata else "{}"
        self._handed.asking(name, owner)
        self.statements += 1
        # Sent at once: seen to its end even if the caller is cancelled; gathered with
        # others: sent before whatever the caller sends next (see ``Combiner.run``).
        _, answer = await self.combiner.run(
            name,
            (owner, weight, limit, identity, meta, ttl),
            gather=self._handed.contended(name),
        )
        first = answer[0] if answer else None
        act, token = (None, None) if first is None else (first["act"], first["tok"])
        rows = [] if token is not None else self._rows(name, answer)
        outcome = acquired(self._sql.where, name, owner, ttl, limit, act, token, rows)
        if isinstance(outcome, Grant):
            self._handed.forget(name, owner)
        else:
            self._handed.refused(name, owner, limit)
            self._queued(name, True)
        return outcome

    def _queued(self, name: str, queued: bool) -> None:
        if not queued:
            self._contended.discard(name)
            return
        if len(self._contended) >= _MAX_CONTENDED:
            self._contended.clear()
        self._contended.add(name)

    async def read(self, name: str) -> PermitHolders | None:
        """:meth:`~aiolease.abc.Backend.read_permits`."""
        return permit_holders(name, self._rows(name, await self._fetch(self._sql.read, name)))

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a release grants the caller's queue entry (through this backend, or
        told by ``NOTIFY``; or, while nothing listens, after the poll interval), when
        ``seen`` expires, and never later than a third of ``ttl`` (the retry keeps the
        caller's place)."""
        listening = await self._listener.ensure()
        timeout = min(LISTEN_CHECK if listening else self._poll_interval(), ttl / 3)
        if seen.remaining is not None:
            timeout = min(timeout, max(seen.remaining, 0.001))
        self.waiting += 1
        try:
            with self._wakeups.watching(turn_key(name, owner)) as event:
                # Granted after the refusal's statement was sent: at once.
                if not self._handed.waiting(name, owner):
                    await wait_event(event, timeout)
        finally:
            self.waiting -= 1

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Delete ``owner``'s permit (of ``token``) or queue entry. Where this backend saw
        requests queue for the name (a refusal, or a release that left some), the
        release function, which also grants the queue entries that then fit (their
        waiters here take the grants from the answer); else one ``DELETE``, which tells
        every waiter of the name elsewhere to ask again (``'p:'``), if any."""
        self._batcher.forget(name, owner, token)
        self._handed.forget(name, owner)
        sent_at = now()
        # Its own notification may come before its answer: the waiters here take their
        # grants from the answer, not asking again for them.
        self._handed.releasing(name)
        try:
            plain, rows = await self.combiner.run(name, (owner, token), to_end=False)
            if plain:
                return bool(rows and rows[0]["freed"])
            row = rows[0] if rows else None
            if row is None:
                return False
            if row["deleted"]:  # (one that deleted nothing saw no queue: the mark stays)
                self._queued(name, bool(row["still_queued"]))
            if row["owners"]:
                self._handed.granted(name, row["owners"], row["tokens"], row["ttls"], sent_at)
            return bool(row["freed"])
        finally:
            self._handed.released(name)
