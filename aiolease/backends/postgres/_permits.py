"""The PostgreSQL backend's permits (semaphores and read-write locks,
``docs/internals/semaphores.md``): :class:`Permits`, which
:class:`~aiolease.backends.postgres.PostgresBackend` owns and hands a permit's
operations to.

An acquire is one statement (the function that the backend's setup installs, see
:class:`~aiolease.backends.postgres._statements.PermitSql`), a release another; a
release is announced (``NOTIFY`` ``'p:' + name``) and wakes the waiters of the name,
here at once and in other processes through their listener. Renewals go in the
backend's batches, beside the locks'.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ...abc import Grant, HolderInfo, PermitHolders
from .._asyncio import wait_event
from ..sql._permits import PermitRow, acquired, permit_holders, permit_row
from ..sql._renewals import RenewBatcher
from ..sql._running import finished
from ..sql._values import encode_metadata
from ..sql._wakeups import Wakeups
from ._listener import LISTEN_CHECK, Listener
from ._statements import PERMIT_COLUMNS, PermitSql, permit_key

__all__ = ["Permits"]

#: The most refused requests whose listener marks are remembered (a request that never
#: waits, as ``acquire_nowait``'s, leaves one): then all are forgotten.
_MAX_MARKS = 4096

#: Runs one statement (with the backend's pool, errors mapped, tables made on first use).
Fetch = Callable[..., Awaitable[list[Any]]]


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
        #: Refused requests: where the listener stood before their statement was sent.
        self._marks: dict[tuple[str, str], tuple[int, int] | None] = {}
        #: Tasks in :meth:`wait_turn` now.
        self.waiting = 0
        #: Acquire statements sent.
        self.statements = 0

    def _rows(self, name: str, rows: Sequence[Any]) -> list[PermitRow]:
        where = self._sql.where
        return [permit_row(where, name, *(row[c] for c in PERMIT_COLUMNS)) for row in rows]

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
        meta = encode_metadata(metadata) if metadata else "{}"
        ttl = float(ttl)
        mark = self._listener.mark()
        self.statements += 1
        # Seen to its end even if the caller is cancelled (see ``finished``).
        answer = await finished(
            self._fetch(self._sql.acquire, name, owner, weight, limit, identity, meta, ttl)
        )
        first = answer[0] if answer else None
        act, token = (None, None) if first is None else (first["act"], first["tok"])
        rows = [] if token is not None else self._rows(name, answer)
        outcome = acquired(self._sql.where, name, owner, ttl, limit, act, token, rows)
        if isinstance(outcome, Grant):
            self._marks.pop((name, owner), None)
        else:
            if len(self._marks) >= _MAX_MARKS:
                self._marks.clear()
            self._marks[(name, owner)] = mark
        return outcome

    async def read(self, name: str) -> PermitHolders | None:
        """:meth:`~aiolease.abc.Backend.read_permits`."""
        return permit_holders(name, self._rows(name, await self._fetch(self._sql.read, name)))

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a permit or queue entry of ``name`` goes (a ``NOTIFY``; or, while
        nothing listens, after the poll interval), when ``seen`` expires, and never
        later than a third of ``ttl`` (the retry keeps the caller's place)."""
        listening = await self._listener.ensure()
        key = permit_key(name)
        timeout = min(LISTEN_CHECK if listening else self._poll_interval(), ttl / 3)
        if seen.remaining is not None:
            timeout = min(timeout, max(seen.remaining, 0.001))
        self.waiting += 1
        try:
            with self._wakeups.watching(key) as event:
                # A permit that went after the refusal's statement was sent: at once.
                mark = self._marks.get((name, owner))
                if mark is not None and not self._listener.unchanged_since(key, mark):
                    return
                await wait_event(event, timeout)
        finally:
            self.waiting -= 1

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Delete ``owner``'s permit (of ``token``) or queue entry, and announce it."""
        self._batcher.forget(name, owner, token)
        self._marks.pop((name, owner), None)
        rows = await self._fetch(self._sql.release, name, owner, token, self._channel)
        if rows and rows[0]["deleted"]:
            self._wakeups.wake(permit_key(name))
        return bool(rows and rows[0]["freed"])
