"""The MySQL / MariaDB backend's permits (semaphores and read-write locks,
``docs/internals/semaphores.md``): :class:`Permits`, which
:class:`~aiolease.backends.mysql.MySQLBackend` owns and hands a permit's operations to.

An acquire is one round trip (the procedure that the backend's setup installs, see
:class:`~aiolease.backends.mysql._statements.PermitSql`), a release another. A
release wakes the waiters of the name in this process at once; waiters of other
processes look again after the poll interval (MySQL has no push). Renewals go in the
backend's renewal ticks, one statement per ttl beside the locks'.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ...abc import Grant, HolderInfo, PermitHolders
from .._asyncio import wait_event
from ..sql._permits import PermitRow, acquired, permit_holders, permit_row
from ..sql._renewals import Key, RenewBatcher
from ..sql._running import finished
from ..sql._values import check_owner, encode_metadata
from ..sql._wakeups import Wakeups
from ._statements import COUNT, MAX_RENEWALS, ROWS, PermitSql, micros

__all__ = ["Permits"]

#: Runs one statement as the backend runs its own: ``(sql, params, want, renewal=)``.
Execute = Callable[..., Awaitable[Any]]


def _text(value: object) -> object:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def permit_key(name: str) -> str:
    """The key that wakes the permit waiters of ``name``, apart from the lock's."""
    return "\x00permits:" + name


class Permits:
    """The permit operations of one MySQL / MariaDB backend.

    :param sql: the permit statements of the backend's table
    :param execute: runs a statement as the backend runs its own
    :param wakeups: the backend's in-process wake-ups
    :param batcher: the backend's renewal batches (a release leaves them)
    :param poll_interval: how long a wait lasts at most
    """

    def __init__(
        self,
        sql: PermitSql,
        execute: Execute,
        wakeups: Wakeups,
        batcher: RenewBatcher,
        poll_interval: Callable[[], float],
    ) -> None:
        self._sql = sql
        self._execute = execute
        self._wakeups = wakeups
        self._batcher = batcher
        self._poll_interval = poll_interval
        #: Tasks in :meth:`wait_turn` now.
        self.waiting = 0

    def _rows(self, name: str, rows: Sequence[Sequence[Any]]) -> list[PermitRow]:
        where = self._sql.where
        found = []
        for owner, weight, lim, granted, seq, token, identity, meta, left in rows:
            remaining = left / 1_000_000 if isinstance(left, int) else left
            found.append(
                permit_row(
                    where, name, owner, weight, lim, granted, seq, token, identity, meta, remaining
                )
            )
        return found

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
        """:meth:`~aiolease.abc.Backend.try_acquire_permit`: one round trip."""
        meta = encode_metadata(metadata) if metadata else "{}"
        ttl = float(ttl)
        params: dict[str, Any] = {
            "name": name.encode(),
            "owner": check_owner(owner),
            "weight": weight,
            "lim": limit,
            "identity": identity.encode(),
            "metadata": meta.encode(),
            "ttl": ttl,
            "us": micros(ttl),
        }
        # Seen to its end even if the caller is cancelled (see ``finished``).
        answer = await finished(self._execute(self._sql.acquire, params, ROWS))
        act, token = (_text(answer[0][0]), answer[0][1]) if answer else (None, None)
        rows = [] if token is not None else self._rows(name, [row[2:] for row in answer])
        return acquired(self._sql.where, name, owner, ttl, limit, act, token, rows)

    async def read(self, name: str) -> PermitHolders | None:
        """:meth:`~aiolease.abc.Backend.read_permits`."""
        rows = await self._execute(self._sql.read, {"name": name.encode()}, ROWS)
        return permit_holders(name, self._rows(name, rows))

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a permit or queue entry of ``name`` goes through this backend
        object, when ``seen`` expires, or after the poll interval (changes made
        elsewhere), never later than a third of ``ttl``."""
        timeout = min(self._poll_interval(), ttl / 3)
        if seen.remaining is not None:
            timeout = min(timeout, seen.remaining)
        self.waiting += 1
        try:
            with self._wakeups.watching(permit_key(name)) as event:
                await wait_event(event, timeout)
        finally:
            self.waiting -= 1

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Free ``owner``'s live permit (of ``token``), else drop its queue entry or
        expired permit: one statement, two for a waiter that leaves the queue."""
        self._batcher.forget(name, owner, token)
        params = {"name": name.encode(), "owner": check_owner(owner), "token": token}
        freed = bool(await self._execute(self._sql.free, params, COUNT))
        if freed or await self._execute(self._sql.drop, params, COUNT):
            self._wakeups.wake(permit_key(name))
        return freed

    async def renew(self, items: Sequence[tuple[Key, float]]) -> frozenset[Key]:
        """Renew the permits of ``items``: one statement per ttl (one, usually); which
        were renewed."""
        renewed: frozenset[Key] = frozenset()
        by_ttl: dict[float, list[Key]] = {}
        for key, ttl in items:
            by_ttl.setdefault(float(ttl), []).append(key)
        for ttl, keys in by_ttl.items():
            for start in range(0, len(keys), MAX_RENEWALS):
                chunk = keys[start : start + MAX_RENEWALS]
                triples = [v for n, o, t in chunk for v in (n.encode(), o.encode(), t)]
                sql = self._sql.renew(len(chunk))
                count = await self._execute(sql, [ttl, micros(ttl), *triples], COUNT, renewal=True)
                if count == len(chunk):
                    renewed |= frozenset(chunk)
                    continue
                live = self._sql.live(len(chunk))
                rows = await self._execute(live, triples, ROWS, renewal=True)
                renewed |= frozenset((n.decode(), o.decode(), int(t)) for n, o, t in rows)
        return renewed
