"""MySQLBackend: the contract of :mod:`aiolease.abc` on MySQL and MariaDB (see the package)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..._checked import HeldRenewals, derived
from ..._exceptions import (
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    NotOwnerError,
)
from ..._permits import PermitHolders, is_permit_owner
from ..._records import identity_of, state_of
from ..._validate import check_seconds
from ...abc import Backend, Capability, Grant, HolderInfo, Renewal, RenewResult
from .._asyncio import now, wait_event
from ..sql._options import pool_size
from ..sql._permits import (
    by_kind,
)
from ..sql._pool import LeanPool
from ..sql._renewals import Held, Key, RenewBatcher, renew_held, renew_many_held
from ..sql._rows import row_holder
from ..sql._running import finished
from ..sql._values import check_identifier, check_owner, encode_metadata
from ..sql._wakeups import Wakeups
from ._bell import Bells
from ._errors import answered, errno, mapped
from ._exchange import PS_MULTI_RESULTS, STATEMENT_CACHE, exchange, statement_cache, usable
from ._permits import Permits
from ._queue import REFRESH, Queue
from ._statements import (
    COUNT,
    EXPIRED,
    ID,
    MAX_RENEWALS,
    ROWS,
    WAITERS_SUFFIX,
    PermitSql,
    Prepared,
    Rendered,
    Sql,
    micros,
)
from ._stats import MySQLStatistics
from ._turns import Turn, Turns
from ._url import KEYWORD_ONLY, URL_OPTIONS, parse_url

__all__ = ["MySQLBackend", "MySQLStatistics"]

T = TypeVar("T")

logger = logging.getLogger("aiolease.backends.mysql")

#: How many times a refusal whose holder is gone by the time it is read is asked again.
_RACE_RETRIES = 8
_NO_SUCH_TABLE = 1146
#: Errors that :meth:`MySQLBackend.setup` cures: no such table, no such column (a
#: table made by an older version, without ``queued``), no such procedure (the
#: permits' acquire, of tables made by an older version).
_SET_UP = frozenset({_NO_SUCH_TABLE, 1054, 1305})
#: The procedure exists already (another process made it first).
_PROCEDURE_EXISTS = 1304
#: The user may not create the procedure (no ``CREATE ROUTINE``): setup goes on
#: without it, so that locks work; a permit acquire then fails (1305).
_DENIED = frozenset({1044, 1142, 1227, 1370})
_DUPLICATE_COLUMN = 1060
#: A statement chosen as a deadlock's victim (rolled back: asked again, at most
#: ``_DEADLOCK_RETRIES`` times). The waiters table is read by the statements that
#: write the lease row, and written by others, so InnoDB may pick one now and then.
#: Each retry waits a random pause of up to ``_DEADLOCK_PAUSE`` seconds, doubled each
#: time: asked again at once, the statements that met kept meeting (five in a row
#: were seen with six tasks on one name), and a pause lets one of them finish first.
_DEADLOCK = 1213
_DEADLOCK_RETRIES = 8
_DEADLOCK_PAUSE = 0.001
#: MySQL's longest table name.
_MAX_IDENTIFIER = 64


#: Stands for the pool that :meth:`MySQLBackend.from_url` is about to open.
_OPENING: Any = object()


#: The share of a grant's ttl that a refusal answered from memory leaves unused, for
#: clock-rate drift between this host and the server.
_DRIFT = 0.001


@dataclass(slots=True)
class _Held(Held):
    """A grant made through this backend, to refuse other callers without a statement.

    Until it is released through this backend, the row stays this owner's at least
    until ``sent_at + ttl`` (``sent_at``: when the newest statement that granted or
    renewed it was sent, before the server read its clock).
    """

    def remaining(self, at: float) -> float:
        """Seconds it surely has left at ``at`` (clock-rate drift allowed for)."""
        return self.sent_at + self.ttl * (1 - _DRIFT) - at


def _granted_to(turn: Turn) -> bool:
    """Whether a hand-off here granted ``turn`` the name (not just claimed it)."""
    return turn.grant is not None and bool(turn.grant[0])


class MySQLBackend(Backend):
    """Leases as rows of a MySQL or MariaDB table, on asyncmy.

    :param pool: an ``asyncmy`` pool (yours: never closed here); statements are
        committed even if the pool is not in autocommit mode
    :param table: the table of leases, in the connection's database (created on first use)
    :param poll_interval: the longest a waiter sleeps before looking again
    :param renew_window: seconds a renewal waits for others to share its statement
    :raises InvalidArgument: a bad table name or number, or ``pool``
    """

    capabilities = frozenset(
        {
            Capability.SERVER_TIME,
            Capability.DURABLE_TOKENS,
            Capability.MULTI_PROCESS,
            Capability.FAIR_QUEUE,
            Capability.PROCLAIM,
            Capability.SEMAPHORE,
            Capability.FAIR_PERMITS,
            Capability.PERMIT_RETRY_KEEPS_ENTRY,
        }
    )
    requires_asyncio = True

    def __init__(
        self,
        pool: Any,
        *,
        table: str = "aiolease_leases",
        poll_interval: float = 0.25,
        renew_window: float = 0.0,
    ) -> None:
        from asyncmy.pool import Pool

        self._table = check_identifier("table", table)
        if len(table) + len(WAITERS_SUFFIX) > _MAX_IDENTIFIER:
            raise InvalidArgument(
                f"table must be at most {_MAX_IDENTIFIER - len(WAITERS_SUFFIX)} characters"
                f" (its waiters table adds {WAITERS_SUFFIX!r}), got {table!r}"
            )
        self.poll_interval = check_seconds("poll_interval", poll_interval)
        window = check_seconds("renew_window", renew_window, allow_zero=True)
        if pool is not _OPENING and not isinstance(pool, Pool):
            raise InvalidArgument(f"pool must be an asyncmy Pool, not {type(pool).__name__}")
        self._pool = pool
        #: Our own connections (a backend made from a URL), else ``None``: ``pool`` is the user's.
        self._lean: LeanPool[Any] | None = None
        self._sql = Sql(self._table)
        self._permit_sql = PermitSql(self._table)
        self._setup_lock = asyncio.Lock()
        self._wakeups = Wakeups()
        self._batcher = RenewBatcher(self._renew_batch, window=window)
        self._turns = Turns()
        self._queue = Queue(self._sql, self._execute, self._ask, self._turns)
        self._held: dict[str, _Held] = {}
        self._permits = Permits(
            self._permit_sql,
            self._execute,
            self._wakeups,
            self._batcher,
            lambda: self.poll_interval,
        )
        #: Grants and releases made through this backend so far (any name): a refusal
        #: followed by none needs no read before its wait.
        self._changes = 0
        self._hand_offs = 0
        self._deadlocks = 0
        self._waiting = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"<MySQLBackend {self._table}>"

    @property
    def table(self) -> str:
        """The table the leases live in."""
        return self._table

    def statistics(self) -> MySQLStatistics:
        """Counters of renew statements, hand-offs and waiters."""
        return MySQLStatistics(
            renew_statements=self._batcher.statements,
            renewals_shared=self._batcher.shared,
            hand_offs=self._hand_offs,
            waiting=self._waiting + self._permits.waiting,
            pool=None if self._lean is None else self._lean.statistics(),
            polls=self._queue.polls,
            queue_writes=self._queue.writes,
            deadlocks=self._deadlocks,
            permit_statements_combined=self._permits.combiner.combined,
            **self._queue.bell_statistics(),
        )

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> MySQLBackend:
        """Open a pool for ``mysql://user:password@host:port/database`` (or ``mariadb://``).

        Options come from the URL query or keyword arguments (not both): ``table``,
        ``poll_interval``, ``renew_window``, ``connect_timeout``, ``min_size``,
        ``max_size``; ``connect_options`` (a mapping, keyword only) goes to
        ``asyncmy.connect``.

        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: the server cannot be reached
        """
        import asyncmy

        connect, ours = parse_url(url)
        for key in options:
            if (key not in URL_OPTIONS and key not in KEYWORD_ONLY) or key in ours:
                raise InvalidArgument(f"MySQL option {key!r} is unknown or given twice")
        ours.update(options)
        prepared = statement_cache(asyncmy)
        if prepared:
            connect["stmt_cache_size"] = STATEMENT_CACHE
        connect.update(ours.pop("connect_options", None) or {})
        if prepared:
            # A prepared ``CALL`` may answer a result set (the permits' acquire).
            connect["client_flag"] = int(connect.get("client_flag", 0)) | PS_MULTI_RESULTS
        connect["connect_timeout"] = check_seconds(
            "connect_timeout", ours.pop("connect_timeout", 10.0)
        )
        min_size, max_size = pool_size(ours.pop("min_size", 1), ours.pop("max_size", 10))
        backend = cls(_OPENING, **ours)  # every option is checked before connecting

        async def open_connection() -> Any:
            return await asyncmy.connect(**connect)

        lean: LeanPool[Any] = LeanPool(
            open_connection,
            close=lambda conn: conn.ensure_closed(),
            terminate=lambda conn: conn.close(),
            usable=usable,
            max_size=max_size,
            min_size=min_size,
            close_timeout=connect["connect_timeout"],
            what=repr(backend),
        )
        with mapped():
            try:
                await lean.fill()
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"bad MySQL URL or option: {exc}") from exc
        backend._pool = None
        backend._lean = lean
        backend._queue.bells = Bells(open_connection, f"{connect['database']}.{backend.table}")
        backend._permits.bells = backend._queue.bells  # one keeper, one cap on waits
        backend._permits.prepared = prepared and bool(connect.get("stmt_cache_size"))
        return backend

    async def setup(self) -> None:
        """Create the table and its waiters table if they do not exist (idempotent; safe
        from many processes).

        :raises BackendError: e.g. the user may not create tables
        """
        async with self._setup_lock:
            with mapped():
                if self._lean is not None:
                    # Interrupted or refused (with notes still off): never reused.
                    async with self._lean.connection(reusable=lambda _: False) as conn:
                        await self._create(conn)
                    return
                async with self._pool.acquire() as conn:
                    try:
                        await self._create(conn)
                    except BaseException:
                        # Interrupted (or refused, with notes still off): a connection
                        # the pool must not hand out again. A cancel stays a cancel.
                        conn.close()
                        raise

    async def _create(self, conn: Any) -> None:
        async with conn.cursor() as cur:
            # A concurrent creator leaves a "table exists" note: not worth a warning.
            await cur.execute("SET @@session.sql_notes = 0")
            for create in (*self._sql.create, *self._permit_sql.create):
                await cur.execute(create)
            await cur.execute(self._sql.has_queued)
            if not (await cur.fetchall())[0][0]:  # made by an older version
                try:
                    await cur.execute(self._sql.add_queued)
                except Exception as exc:
                    if errno(exc) != _DUPLICATE_COLUMN:  # (another process was first)
                        raise
            await cur.execute(self._permit_sql.has_waited)
            if not (await cur.fetchall())[0][0]:  # made by an older version
                try:
                    await cur.execute(self._permit_sql.add_waited)
                except Exception as exc:
                    if errno(exc) != _DUPLICATE_COLUMN:  # (another process was first)
                        raise
            permits = self._permit_sql
            for create in (permits.create_acquire, permits.create_release, *permits.create_batch):
                try:
                    await cur.execute(create)
                except Exception as exc:
                    if errno(exc) in _DENIED:
                        logger.warning(
                            "%r may not create its permits' procedures (CREATE ROUTINE):"
                            " locks work, semaphores and read-write locks fail until a user"
                            " who may runs setup()",
                            self,
                        )
                        break
                    if errno(exc) != _PROCEDURE_EXISTS:
                        raise
            await cur.execute("SET @@session.sql_notes = DEFAULT")

    # -- running statements ----------------------------------------------------------------

    async def _execute(
        self,
        sql: Prepared | Rendered | str,
        params: Any,
        want: str = ID,
        then: Prepared | None = None,
        renewal: bool = False,
    ) -> Any:
        """Run ``sql``, creating the table on first use.

        :param want: what to return: the insert id, the rows, or the affected row count
        :param then: a query to run next, for its rows, if ``sql`` left insert id 0
        :param renewal: for the renewal statement (may use the pool's reserved connection)
        """
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        for retry in range(_DEADLOCK_RETRIES, -1, -1):
            try:  # not ``mapped()``: a context manager per statement costs more than this
                return await self._run(sql, params, want, then, renewal)
            except Exception as exc:
                number = errno(exc) if answered(exc) else None
                if number == _DEADLOCK and retry:
                    # The server rolled it back: it had no effect.
                    self._deadlocks += 1
                    pause = _DEADLOCK_PAUSE * 2 ** (_DEADLOCK_RETRIES - retry)
                    await asyncio.sleep(random.uniform(0, pause))
                    continue
                if number not in _SET_UP:
                    with mapped():
                        raise
                break
        with mapped():
            await self.setup()  # first use (or an older table): set up, then ask again
            return await self._run(sql, params, want, then, renewal)

    async def _run(
        self,
        sql: Prepared | Rendered | str,
        params: Any,
        want: str,
        then: Prepared | None,
        renewal: bool,
    ) -> Any:
        lean = self._lean
        if lean is None:
            async with self._pool.acquire() as conn:
                try:
                    return await exchange(conn, sql, params, want, then)
                except BaseException as exc:
                    if not answered(exc):
                        # An interrupted exchange leaves the connection out of step with
                        # the server: close it, so that the pool never hands it out again.
                        conn.close()
                    raise
        conn = await lean.acquire(renewal)
        try:
            result = await exchange(conn, sql, params, want, then)
        except BaseException as exc:
            if answered(exc) and errno(exc) not in _SET_UP:
                lean.release(conn, renewal)
            else:
                # Out of step with the server: never reused. (Also one that met no
                # table: asyncmy would not try to prepare those statements on it again.)
                lean.discard(conn, renewal)
            raise
        lean.release(conn, renewal)
        return result

    # -- permits (docs/internals/semaphores.md: see ``_permits``) -------------------------

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
        """One round trip: the acquire procedure (see :class:`PermitSql`)."""
        return await self._permits.try_acquire(name, owner, ttl, identity, metadata, limit, weight)

    async def read_permits(self, name: str) -> PermitHolders | None:
        return await self._permits.read(name)

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await self._permits.wait_turn(name, owner, ttl, seen)

    # -- the contract ------------------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        raw_owner = check_owner(owner)
        meta = encode_metadata(metadata) if metadata else "{}"
        if self._turns.handed(name, owner):
            await asyncio.sleep(0)  # a checkpoint; a cancel here leaves it to the caller's release
            handed = self._turns.take(name, owner)
            if handed is not None and handed.grant is not None:  # a release here handed it
                token, sent_at = handed.grant
                return Grant(token, handed.ttl, sent_at=sent_at)
        held = self._held.get(name)
        if held is not None and held.owner != owner:
            refusal = await self._refuse(name, owner, ttl, identity, meta, held)
            if refusal is not None:
                return refusal
        params = {
            "name": name.encode(),
            "owner": raw_owner,
            "identity": identity.encode(),
            "metadata": meta.encode(),
            "ttl": float(ttl),
            "us": micros(ttl),
        }
        for _ in range(_RACE_RETRIES):
            changes, asked_at = self._changes, now()
            # Seen to its end even if the caller is cancelled (see ``finished``).
            result = await finished(self._ask(params, self._sql.holder))
            if isinstance(result, int):
                self._turns.done(name, owner)
                self._changed(name)
                self._granted(name, _Held(owner, result, identity, meta, float(ttl), asked_at))
                return Grant(result, ttl)
            if not result:  # free, but kept for the oldest waiter (or let go meanwhile)
                result = await self._execute(self._sql.reserved, params, ROWS)
            if result and result[0][0] != raw_owner:
                self._turns.refused(name, owner, float(ttl), identity, meta, now(), (0, changes))
                return self._holder(name, result[0])
            # The holder let go between the statements: ask again.
        raise BackendTimeout(f"lease {name!r} kept changing under try_acquire; try again")

    async def _ask(self, params: Mapping[str, Any], then: Prepared | None = None) -> Any:
        """The acquire statement; for a row that expired under another owner, then the
        take-over statement, which gives it to the oldest live waiter."""
        result = await self._execute(self._sql.acquire, params, then=then)
        if result == EXPIRED:
            result = await self._execute(self._sql.take_over, params, then=then)
        return result

    def _granted(self, name: str, held: _Held) -> None:
        known = self._held.get(name)
        if known is not None and (known.owner, known.token) == (held.owner, held.token):
            # A retry: the row kept the identity and metadata of the first grant.
            held.identity, held.meta = known.identity, known.meta
        self._held[name] = held

    async def _refuse(
        self, name: str, owner: str, ttl: float, identity: str, meta: str, held: _Held
    ) -> HolderInfo | None:
        """Refuse ``owner`` without a statement while a grant made here is live
        (``None``: it may have run out, ask the server)."""
        at = now()
        remaining = held.remaining(at)
        if remaining <= 0:
            if self._held.get(name) is held:
                del self._held[name]
            return None
        await asyncio.sleep(0)  # a checkpoint, as a statement would be
        self._turns.refused(name, owner, float(ttl), identity, meta, at, (0, self._changes))
        where = f"`{self._table}`"
        return row_holder(where, name, held.owner, held.identity, held.token, held.meta, remaining)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        return await renew_held(self._batcher, self._held, name, owner, token, ttl)

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        """Every lease the core's scheduler finds due, in one statement."""
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        return await renew_many_held(self._batcher, self._renew_failed, self._held, renewals)

    async def _renew_failed(self, renewals: Sequence[Renewal]) -> set[Key]:
        """Renew every lease of ``renewals`` (:meth:`_renew_batch`); those it did not renew.

        The core's list (a cohort's, renewed again tick after tick) is rendered into
        the statement's text once (:class:`Rendered`, :func:`derived`). Permits go in
        statements of their own (:meth:`Permits.renew`)."""
        locks, permits = derived(renewals, "kinds", by_kind)
        if permits:
            failed = await self._renew_failed(locks) if locks else set()
            items = [((n, o, t), ttl) for n, o, t, ttl in permits]
            renewed = await self._permits.renew(items)
            return failed | {key for key, _ in items if key not in renewed}
        if type(renewals) is HeldRenewals and len(renewals) <= MAX_RENEWALS:
            update, triples = derived(renewals, "mysql", self._rendered_renewal)
            if await self._execute(update, None, COUNT, renewal=True) == len(renewals):
                return set()
            live = self._sql.live(len(renewals))
            rows = await self._execute(live, triples, ROWS, renewal=True)
            live_keys = {(n.decode(), o.decode(), int(t)) for n, o, t in rows}
            return {(n, o, t) for n, o, t, _ in renewals if (n, o, t) not in live_keys}
        items = [((n, o, t), ttl) for n, o, t, ttl in renewals]
        renewed = await self._renew_batch(items)
        if len(renewed) == len(items):
            return set()
        return {key for key, _ in items if key not in renewed}

    async def _renew_batch(self, items: Sequence[tuple[Key, float]]) -> frozenset[Key]:
        """Renew every lease of ``items`` in one statement; which ones were renewed.

        The statement's affected-row count tells when all were (the usual case: one
        statement); otherwise a read of which are still ours and live tells which.
        More than :data:`MAX_RENEWALS` go in statements of that many. Permits go in a
        statement of their own (:meth:`Permits.renew`).
        """
        permits = [item for item in items if is_permit_owner(item[0][1])]
        if permits:
            renewed_permits = await self._permits.renew(permits)
            locks = [item for item in items if not is_permit_owner(item[0][1])]
            return renewed_permits | (await self._renew_batch(locks) if locks else frozenset())
        if len(items) > MAX_RENEWALS:
            renewed: frozenset[Key] = frozenset()
            for start in range(0, len(items), MAX_RENEWALS):
                renewed |= await self._renew_batch(items[start : start + MAX_RENEWALS])
            return renewed
        sql, params, triples = self._renewal(items)
        if await self._execute(sql, params, COUNT, renewal=True) == len(items):
            return frozenset(key for key, _ in items)
        rows = await self._execute(self._sql.live(len(items)), triples, ROWS, renewal=True)
        return frozenset((n.decode(), o.decode(), int(t)) for n, o, t in rows)

    def _rendered_renewal(self, renewals: Sequence[Renewal]) -> tuple[Rendered, list[Any]]:
        """The renew statement of ``renewals``, to render once; the read's parameters."""
        sql, params, triples = self._renewal([((n, o, t), ttl) for n, o, t, ttl in renewals])
        return Rendered(sql, params), triples

    def _renewal(self, items: Sequence[tuple[Key, float]]) -> tuple[str, list[Any], list[Any]]:
        """The statement that renews ``items`` (at most :data:`MAX_RENEWALS`), its
        parameters, and those of the read of which are live (the triples)."""
        triples = [v for (n, o, t), _ in items for v in (n.encode(), o.encode(), t)]
        ttls = {ttl for _, ttl in items}
        if len(ttls) == 1:
            ttl = float(items[0][1])
            params: list[Any] = [ttl, micros(ttl), *triples]
            sql = self._sql.renew_many(len(items))
        else:
            params = [
                v
                for ((n, o, t), ttl) in items
                for v in (n.encode(), o.encode(), t, float(ttl), micros(ttl))
            ]
            sql = self._sql.renew_mixed(len(items))
        return sql, params, triples

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        if is_permit_owner(owner):
            return await self._permits.release(name, owner, token)
        self._batcher.forget(name, owner, token)
        self._turns.done(name, owner)
        held = self._held.get(name)
        if held is not None and held.owner == owner:
            del self._held[name]  # before the statement: it may free the row
        # Out of the queue first (a waiter that got the name keeps its entry until
        # then), so that no release after this one hands it the row again.
        place = await self._queue.leave(name, owner)
        try:
            turn = self._queue.poller(name)
            if turn is not None:
                freed = await self._hand_off(name, owner, token, turn)
            else:
                freed = await self._free(name, owner, token, queued=place is not None)
        finally:
            if place is not None:  # the row is handed on: wake the next in line
                await self._queue.ring(name, place)
        self._queue.wake_poller(name)
        return freed

    async def _free(self, name: str, owner: str, token: int | None, queued: bool = True) -> bool:
        """Release ``owner``'s grant: to the oldest live waiter in the waiters table (any
        process) if there is one, else free the row. Whether it was ``owner``'s.

        :param queued: whether waiters are likely (the cheap statement, which frees the
            row unless it is marked as having waiters, is skipped)
        """
        params = {"name": name.encode(), "owner": owner.encode(), "token": token}
        after = 0 if queued else int(await self._execute(self._sql.release, params))
        if not after:  # waiters may be queued (or not ours): hand it to the oldest, if any
            after = int(await self._execute(self._sql.release_queued, params))
        if not after:
            return False
        self._changed(name)
        if token is not None and after == token + 1:
            self._hand_offs += 1  # the oldest waiter finds out by its poll
        else:
            self._turns.wake_one(name)
        return True

    async def _hand_off(self, name: str, owner: str, token: int | None, turn: Turn) -> bool:
        """Release ``owner``'s grant to the oldest task waiting here, in one statement, if
        no older waiter elsewhere is ahead of it (else to that one: :meth:`_free`)."""
        params = {
            "name": name.encode(),
            "owner": owner.encode(),
            "token": token,
            "next": turn.owner.encode(),
            "identity": turn.identity.encode(),
            "metadata": turn.metadata.encode(),
            "ttl": turn.ttl,
            "us": micros(turn.ttl),
        }
        sent_at = now()
        claim = (0, sent_at)
        turn.grant = claim  # claimed: no other release hands it a second grant
        try:
            granted = int(await self._execute(self._sql.hand_off, params))
        except BaseException:
            if turn.grant == claim:  # (not a grant its own poll found meanwhile)
                turn.grant = None
            turn.doubt = True  # it may hold the row now: it gives it back if it stops
            raise
        finally:
            turn.settled.set()
            turn.event.set()
        if not granted:
            if turn.grant == claim:
                turn.grant = None
            return await self._free(name, owner, token)
        turn.grant = (granted, sent_at)
        self._held[name] = _Held(
            turn.owner, granted, turn.identity, turn.metadata, turn.ttl, sent_at
        )
        self._hand_offs += 1
        self._changed(name)
        if turn.cancelled:  # it stopped waiting meanwhile: give its grant back
            await self.release(name, turn.owner, granted)
        return True

    def _changed(self, name: str) -> None:
        self._changes += 1
        self._wakeups.wake(name)

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        meta = encode_metadata(metadata) if metadata else "{}"
        params = {
            "name": name.encode(),
            "owner": check_owner(owner),
            "token": token,
            "metadata": meta.encode(),
        }
        if await self._execute(self._sql.update_metadata, params, ID) != token:
            raise NotOwnerError(name)
        held = self._held.get(name)
        if held is not None and (held.owner, held.token) == (owner, token):
            held.meta = meta  # refusals answered from here report it
        self._changed(name)

    async def read(self, name: str) -> HolderInfo | None:
        rows = await self._execute(self._sql.holder, {"name": name.encode()}, ROWS)
        return None if not rows else self._holder(name, rows[0])

    def _holder(self, name: str, row: Any) -> HolderInfo:
        """The holder a row reports (``owner, identity, token, metadata, microseconds left``).

        :raises ForeignDataError: the row holds what aiolease did not write
        """
        owner, identity, token, meta, micros = row
        return row_holder(f"`{self._table}`", name, owner, identity, token, meta, micros, unit=1e-6)

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Return when ``name``'s holder differs from ``seen`` (renewals do not count).

        Wakes at once for changes made through this backend object, when the
        holder's ttl runs out, and otherwise after at most :attr:`poll_interval`.
        """
        with self._wakeups.watching(name) as event:
            current = await self.read(name)
            if state_of(current) != state_of(seen):
                return
            await self._wait(event, current)

    async def _wait(
        self, event: asyncio.Event, current: HolderInfo | None, most: float | None = None
    ) -> None:
        timeout = self.poll_interval if most is None else min(self.poll_interval, most)
        if current is not None and current.remaining is not None:
            timeout = min(timeout, current.remaining)
        self._waiting += 1
        try:
            await wait_event(event, timeout)
        finally:
            self._waiting -= 1

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Wait in the waiters table, oldest first across processes, for a hand-off.

        The first wait joins the queue (and one every quarter ttl refreshes the entry).
        Among this backend's waiters only the oldest polls the server, with the acquire
        statement itself (which finds a hand-off to it, or a free row that is its turn);
        the others wait for a change made here, or ``poll_interval``.
        """
        await self._turns.wait(
            name,
            owner,
            lambda turn: self._wait_turn(name, owner, ttl, seen, turn),
            lambda: self.wait_changed(name, seen),
            lambda token: self.release(name, owner, token),
        )

    async def _wait_turn(
        self, name: str, owner: str, ttl: float, seen: HolderInfo, turn: Turn
    ) -> None:
        place = await self._queue.join(name, owner, ttl, turn)
        current: HolderInfo | None = seen
        if turn.mark != (0, self._changes):  # something changed here since the refusal
            current = await self.read(name)
        if turn.grant is not None or identity_of(current) != identity_of(seen):
            return
        if self._queue.poller(name) is not turn:  # one older in the queue polls for both
            await self._wait(turn.event, current, ttl * REFRESH)
            return
        start = now()
        expiry = None
        if current is not None and current.remaining is not None:
            expiry = start + current.remaining
        self._waiting += 1
        try:
            polled = await self._queue.poll(
                name, owner, ttl, turn, place, expiry, self.poll_interval
            )
        finally:
            self._waiting -= 1
        if polled is None:
            return
        # A hand-off from elsewhere, or its turn at a free row. The poll reset the row's
        # expiry (sent before the server read its clock): its send time is ``sent_at``.
        token, sent_at = polled
        if not _granted_to(turn):  # (a hand-off here may be in flight, and will fail)
            turn.grant = polled
        turn.settled.set()
        turn.event.set()
        self._granted(name, _Held(owner, token, turn.identity, turn.metadata, float(ttl), sent_at))
        self._changed(name)
        self._queue.wake_poller(name)  # the next oldest here polls now

    async def aclose(self) -> None:
        """Close the pool if this backend opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wakeups.wake_all()
        self._turns.wake_all()
        await self._permits.aclose()
        await self._queue.aclose()
        if self._lean is not None:
            await self._lean.aclose()
