"""The MySQL / MariaDB backend's permits (semaphores and read-write locks,
``docs/internals/semaphores.md``): :class:`Permits`, which
:class:`~aiolease.backends.mysql.MySQLBackend` owns and hands a permit's operations to.

An acquire is one round trip (the procedure that the backend's setup installs, see
:class:`~aiolease.backends.mysql._statements.PermitSql`), a release another: one
``DELETE`` while nobody queued behind the permit, else a procedure that also grants
the queue entries that then fit. The acquires and releases of a name that arrive
while one of the name's is in flight go together in the next call (the batch
procedure: :class:`~aiolease.backends._combine.Combiner`, one transaction, in
order, its grants made once for the batch). A waiter here takes such a grant from the release's
answer without a statement, and only the waiters granted wake (see
:mod:`aiolease.backends.sql._handed`). Waiters of other processes wake by bells, as
lock waiters do (see :mod:`aiolease.backends.mysql._bell`), and ask again:
a request that waits holds the bell of its queue entry (named after its place,
``seq``) from its first wait until it leaves the queue or releases the permit it
became; a waiter waits on the bell of the row that blocks it (the one its refusal
reported), and the release of that row rings it. A row without a bell (a permit
granted without queueing, or a backend without bells: one on a pool of the user's)
is found free at once, and its waiters poll (every poll interval) as before.
Renewals go in the backend's renewal ticks, one statement per ttl beside the locks'.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ..._exceptions import BackendError
from ...abc import Grant, HolderInfo, PermitHolders
from .._asyncio import Tasks, now, wait_event
from .._combine import Combiner
from ..sql._handed import Handed, turn_key
from ..sql._permits import CheckedRows, PermitRow, acquired, permit_holders
from ..sql._renewals import Key, RenewBatcher
from ..sql._values import check_owner, encode_metadata
from ..sql._wakeups import Wakeups
from ._bell import Bells
from ._errors import answered
from ._statements import COUNT, MAX_RENEWALS, ROWS, SETS, PermitSql, batch_ops, micros

__all__ = ["Permits"]

#: The most requests whose places and blockers a backend remembers (one that neither
#: waits nor releases, as a crashed task's, leaves some): then all are forgotten.
_MAX_REMEMBERED = 4096

#: Runs one statement as the backend runs its own: ``(sql, params, want, renewal=)``.
Execute = Callable[..., Awaitable[Any]]
#: An acquire: (owner, weight, limit, identity, metadata, ttl).
_Acquire = tuple[str, int, int, str, str, float]
#: A release: (owner, token or ``None``).
_Release = tuple[str, int | None]
#: What answered an operation: whether it was the plain ``DELETE`` (no grant), and its
#: rows; or the error that its own statement raised.
_Answer = tuple[bool, list[Any]] | Exception

logger = logging.getLogger("aiolease.backends.mysql")


def _text(value: object) -> object:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def _answer(answer: _Answer) -> tuple[bool, list[Any]]:
    """An operation's answer; its own error raised."""
    if isinstance(answer, Exception):
        raise answer
    return answer


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
        #: The backend's bells (a backend made from a URL), else ``None``: waiters poll.
        self.bells: Bells | None = None
        #: The place (``seq``) of each refused request's queue entry, and of the row that
        #: blocked it (0: a permit that never queued, without a bell).
        self._places: dict[tuple[str, str], tuple[int, int]] = {}
        #: The requests whose bell the keeper holds, with their place.
        self._held: dict[tuple[str, str], int] = {}
        #: The places of rows that releases through this backend deleted (their requests
        #: held bells here): a waiter that such a row blocked waits for this backend's
        #: grants, as it does while the row is held (see :meth:`_ours`).
        self._gone: set[tuple[str, int]] = set()
        #: The place of the row whose bell a request's latest wait found let go: if the
        #: same row blocks it again, the bell was free (nobody rings it): it polls.
        self._rung: dict[tuple[str, str], int] = {}
        #: The grants that releases here made to queue entries, until their waiters take
        #: them.
        self._handed = Handed(wakeups.wake, now)
        #: The rows a refusal answers, checked once per stored value (the same queue
        #: entries come back with every refusal).
        self._checked = CheckedRows(sql.where)
        #: Whether the backend's connections may run the acquire ``CALL`` as a prepared
        #: statement (they ask for ``PS_MULTI_RESULTS``: a backend made from a URL).
        self.prepared = False
        #: Names with requests queued, as this backend last saw them (a refusal, or a
        #: release that left some): their releases go to the procedure at once.
        self._contended: set[str] = set()
        self._tasks = Tasks(logger)
        #: A name's acquires and releases that arrive while one of the name's is in
        #: flight go together in the next statement (the batch procedure).
        self.combiner: Combiner[_Acquire | _Release, _Answer] = Combiner(
            self._send_one, self._send_many, self._tasks
        )

    async def aclose(self) -> None:
        """Stop sending the operations that gathered (their callers are told so)."""
        await self._tasks.aclose()

    async def _send_one(self, name: str, op: _Acquire | _Release) -> _Answer:
        """One operation of ``name``, by its own statement(s): an acquire's procedure;
        a release's ``DELETE`` while nobody queued behind it since its grant, else (or
        if that deleted nothing) the release procedure."""
        if len(op) == 6:
            owner, weight, limit, identity, meta, ttl = op
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
            sql = self._sql.acquire_prepared if self.prepared else self._sql.acquire
            return False, await self._execute(sql, params, ROWS)
        owner, token = op
        params = {"name": name.encode(), "owner": check_owner(owner), "token": token}
        if name not in self._contended and token is not None:
            if await self._execute(self._sql.free, params, COUNT):
                return True, [(1,)]  # freed; nobody queued behind it since its grant
        return False, await self._execute(self._sql.release, params, ROWS)

    async def _send_many(self, name: str, ops: Sequence[_Acquire | _Release]) -> list[_Answer]:
        """Operations of ``name``, in order, in one transaction (the batch procedure):
        one answer each. If the server refuses the batch (rolled back whole: one
        operation may be at fault, as an identity too long), each goes alone, and
        answers its own error."""
        params = {"name": name.encode(), "ops": batch_ops(ops)}
        try:
            sets: list[list[Any]] = await self._execute(self._sql.batch, params, SETS)
        except BackendError as exc:
            if exc.__cause__ is None or not answered(exc.__cause__):
                raise  # (not known to be rolled back: as for one operation alone)
            return [await self._alone(name, op) for op in ops]
        acquires = sum(len(op) == 6 for op in ops)
        settled = sets[-1] if sets else []
        released = str(_text(settled[0][0])) if settled else ""
        if len(sets) != acquires + 1 or len(released) != 2 * (len(ops) - acquires):
            raise BackendError(
                f"the permit batch of {len(ops)} operations answered {len(sets)} result sets"
            )
        # A release answers as the release procedure does; the grants, made once for
        # the batch, go with its last release.
        queued = settled[0][1]
        grants = [row[2:] for row in settled if row[2] is not None]
        last = max(i for i, op in enumerate(ops) if len(op) != 6) if grants else -1
        answers: list[_Answer] = []
        results = iter(sets)
        for i, op in enumerate(ops):
            if len(op) == 6:
                answers.append((False, next(results)))
                continue
            freed, deleted = int(released[0]), int(released[1])
            released = released[2:]
            mine = grants if i == last else [(None, None, None)]
            answers.append((False, [(freed, deleted, queued, *grant) for grant in mine]))
        return answers

    async def _alone(self, name: str, op: _Acquire | _Release) -> _Answer:
        try:
            return await self._send_one(name, op)
        except Exception as exc:
            return exc

    def _rows(self, name: str, rows: Sequence[Sequence[Any]]) -> list[PermitRow]:
        check = self._checked.row
        found = []
        for owner, weight, lim, granted, seq, token, identity, meta, left in rows:
            remaining = left / 1_000_000 if isinstance(left, int) else left
            found.append(
                check(name, owner, weight, lim, granted, seq, token, identity, meta, remaining)
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
        ttl = float(ttl)
        handed = self._handed.take(name, owner, ttl, limit)
        if handed is not None:  # granted by a release through this backend: no statement
            self._forget_place(name, owner)
            return handed
        meta = encode_metadata(metadata) if metadata else "{}"
        # A request that cannot be encoded fails alone, never in a batch.
        check_owner(owner)
        identity.encode()
        meta.encode()
        # Sent at once: seen to its end even if the caller is cancelled; gathered with
        # others: sent before whatever the caller sends next (see ``Combiner.run``).
        _, answer = _answer(
            await self.combiner.run(
                name,
                (owner, weight, limit, identity, meta, ttl),
                gather=self._handed.contended(name),
            )
        )
        act, token = (_text(answer[0][0]), answer[0][1]) if answer else (None, None)
        rows = [] if token is not None else self._rows(name, [row[2:] for row in answer])
        outcome = acquired(self._sql.where, name, owner, ttl, limit, act, token, rows)
        if isinstance(outcome, Grant):
            self._handed.forget(name, owner)
            self._forget_place(name, owner)
            return outcome
        self._handed.refused(name, owner, limit)
        self._queued(name, True)
        # The rows are read after the caller's entry was written: its place is among them.
        mine = next((row.seq for row in rows if row.owner == owner), 0)
        ahead = next((row.seq for row in rows if row.owner == outcome.owner), 0)
        if len(self._places) >= _MAX_REMEMBERED:
            self._places.clear()
            self._rung.clear()
        self._places[(name, owner)] = (mine, ahead)
        return outcome

    def _queued(self, name: str, queued: bool) -> None:
        if not queued:
            self._contended.discard(name)
            return
        if len(self._contended) >= _MAX_REMEMBERED:
            self._contended.clear()
        self._contended.add(name)

    def _forget_place(self, name: str, owner: str) -> None:
        self._places.pop((name, owner), None)
        self._rung.pop((name, owner), None)

    async def read(self, name: str) -> PermitHolders | None:
        """:meth:`~aiolease.abc.Backend.read_permits`."""
        rows = await self._execute(self._sql.read, {"name": name.encode()}, ROWS)
        return permit_holders(name, self._rows(name, rows))

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a release through this backend object grants the caller's queue
        entry, when the row that blocks the caller goes (its bell rings), when ``seen``
        expires, or after the poll interval, never later than a third of ``ttl``."""
        timeout = min(self._poll_interval(), ttl / 3)
        if seen.remaining is not None:
            timeout = min(timeout, seen.remaining)
        request = (name, owner)
        mine, ahead = self._places.get(request, (0, 0))
        bells = self.bells
        if bells is not None and mine and request not in self._held:
            # The bell that the caller's successors wait on, held until it leaves the
            # queue or releases its permit.
            if await bells.hold(permit_key(name), mine):
                self._held[request] = mine
        self.waiting += 1
        try:
            with self._wakeups.watching(turn_key(name, owner)) as event:
                if self._handed.waiting(name, owner):
                    return  # granted after the refusal's statement was sent
                if (
                    bells is None
                    or not ahead
                    or self._rung.get(request) == ahead
                    or self._ours(name, ahead)  # a release here grants, and sets ``event``
                ):
                    await wait_event(event, timeout)
                    return
                rang = await bells.wait(
                    permit_key(name), ahead, timeout, event, self._sql.ring, {}, owner
                )
                if rang is None:  # no wait could be sent: poll
                    await wait_event(event, timeout)
                elif rang[0] == 1:
                    self._rung[request] = ahead
        except BaseException:
            if bells is not None:
                await bells.abandon(owner)  # no session left blocked
            raise
        finally:
            self.waiting -= 1

    def _ours(self, name: str, place: int) -> bool:
        """Whether the row at ``place`` of ``name`` is a request of this backend's, held
        or released here: either way its release, through this backend, hands its
        grants to the waiters here (:class:`Handed`), and wakes those it grants. A
        waiter whose blocker was released while its own bell was being taken (after its
        refusal) would otherwise find that bell free, and ask again, refused as before
        if the release granted another (a statement, and a bell wait, per such race)."""
        if (name, place) in self._gone:
            return True
        return any(n == name and seq == place for (n, _), seq in self._held.items())

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Free ``owner``'s live permit (of ``token``), else drop its queue entry or
        expired permit: one statement while nobody queued behind it since its grant,
        else (or if that deleted nothing) the procedure, which also grants the queue
        entries that then fit; then let go of its bell, if it held one (which rings the
        waiters behind it). A request given up (``token`` ``None``: the core's acquire
        loop, cancelled or timed out wherever it was) also ends its bell wait still in
        flight, if any (one cut short by a wake-up stays in flight until its own timeout)."""
        if token is None and self.bells is not None:
            await self.bells.abandon(owner)  # no session left blocked
        self._batcher.forget(name, owner, token)
        self._forget_place(name, owner)
        self._handed.forget(name, owner)
        check_owner(owner)
        sent_at = now()
        plain, rows = _answer(await self.combiner.run(name, (owner, token), to_end=False))
        first = rows[0] if rows else None
        freed = bool(first and first[0])
        if not plain:
            self._queued(name, bool(first and first[2]))
            grants = [row[3:] for row in rows if row[3] is not None]
            if grants:
                owners = [str(_text(row[0])) for row in grants]
                tokens = [int(row[1]) for row in grants]
                ttls = [float(row[2]) for row in grants]
                self._handed.granted(name, owners, tokens, ttls, sent_at)
        place = self._held.pop((name, owner), None)
        if place is not None:
            if len(self._gone) >= _MAX_REMEMBERED:
                self._gone.clear()
            self._gone.add((name, place))
        if place is not None and self.bells is not None:
            await self.bells.drop(permit_key(name), place)
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
