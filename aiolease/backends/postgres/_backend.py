"""PostgresBackend: the contract of :mod:`aiolease.abc` on PostgreSQL (see the package)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..._checked import derived
from ..._exceptions import (
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    LossReason,
    NotOwnerError,
)
from ..._permits import PermitHolders, is_permit_owner
from ..._records import state_of
from ..._urls import scrub
from ..._validate import check_seconds
from ...abc import Backend, Capability, Grant, HolderInfo, Renewal, RenewResult
from .._asyncio import now, wait_event
from .._takers import Takers, no_watch
from ..sql._options import pool_size
from ..sql._permits import by_kind
from ..sql._pool import LeanPool
from ..sql._renewals import Key, RenewBatcher, renew_held, renew_many_held
from ..sql._rows import HOLDER_COLUMNS, row_holder
from ..sql._running import finished
from ..sql._sweeps import Sweeps
from ..sql._values import check_identifier, check_owner, encode_metadata
from ..sql._wakeups import Wakeups
from ._errors import mapped
from ._listener import LISTEN_CHECK, Held, Listener
from ._permits import Permits
from ._queue import Queue
from ._statements import (
    PermitSql,
    Sql,
    advisory_key,
    default_channel,
    grants_channel,
    literals_of,
)
from ._stats import PostgresStatistics
from ._url import KEYWORD_ONLY, URL_OPTIONS, parse_pooler, parse_url

__all__ = ["PostgresBackend", "PostgresStatistics"]

#: How many times a refusal whose holder the statement could not see is asked again.
_RACE_RETRIES = 8
#: The SQLSTATEs of a statement on a table, a column (the mark of a table made before
#: the queue) or a function (the permits' acquire, of a table made before it) that
#: does not exist (yet).
_UNDEFINED = ("42P01", "42703", "42883")
#: A waiter asks again (refreshing its row, which lasts its ttl) this share of its ttl
#: after its latest refused ask, so that it keeps its place.
_REFRESH_SHARE = 1 / 3
#: A hand-off is taken without a statement only if the ask it saw was sent less than
#: this share of the ttl ago (else the waiter asks again, and gets a full ttl).
_FRESH_SHARE = 0.5
#: The most owners remembered as possibly having a waiter row left (see ``_rowed``).
_MAX_ROWED = 4096
#: A wait for a holder to appear marks the row watched for this many seconds (then
#: grants of the free name, and releases nobody queued for, are announced) ...
WATCH_FOR = 60.0
#: ... and marks it again once less than this is left of what it knows of the mark: more
#: than the longest a listening wait lasts (LISTEN_CHECK) after its read.
_WATCH_AGAIN = 3 * LISTEN_CHECK
#: The most names remembered as watched (see ``_watched``).
_MAX_WATCHED = 4096


#: Stands for the pool that :meth:`PostgresBackend.from_url` is about to open.
_OPENING: Any = object()


#: What every instance guarantees (listening adds :attr:`Capability.PUSH_WAKEUP`).
CAPABILITIES = frozenset(
    {
        Capability.FAIR_QUEUE,
        Capability.SERVER_TIME,
        Capability.DURABLE_TOKENS,
        Capability.MULTI_PROCESS,
        Capability.PROCLAIM,
        Capability.SEMAPHORE,
        Capability.FAIR_PERMITS,
        Capability.PERMIT_RETRY_KEEPS_ENTRY,
    }
)
#: :data:`CAPABILITIES` of a backend that listens.
_LISTENING = CAPABILITIES | {Capability.PUSH_WAKEUP}


class PostgresBackend(Backend):
    """Leases as rows of a PostgreSQL table, on asyncpg.

    :param db: an ``asyncpg.Pool`` or ``asyncpg.Connection`` (yours: never closed here;
        a connection is used by one operation at a time)
    :param table: the table of leases (created on first use)
    :param schema: the schema of the table (must exist)
    :param listen: receive NOTIFY for push wake-ups (else poll every ``poll_interval``)
    :param listen_url: where the listening connection goes (default: from the pool,
        or the given connection itself)
    :param poll_interval: how often a waiter looks again while nothing is listening
    :param renew_window: seconds a renewal waits for others to share its statement
    :param command_timeout: seconds before a statement is abandoned as a
        :class:`BackendTimeout` (default: no limit; the core bounds its own calls)
    :param connect_timeout: seconds to open a connection
    :param channel: the NOTIFY channel (default: derived from schema and table)
    :param connect_options: keyword arguments for ``asyncpg.connect`` of the listener
    :raises InvalidArgument: a bad identifier, number, or ``db``
    """

    requires_asyncio = True

    def __init__(
        self,
        db: Any,
        *,
        table: str = "aiolease_leases",
        schema: str = "public",
        listen: bool = True,
        listen_url: str | None = None,
        poll_interval: float = 0.5,
        renew_window: float = 0.0,
        command_timeout: float | None = None,
        connect_timeout: float = 10.0,
        channel: str | None = None,
        connect_options: Mapping[str, Any] | None = None,
    ) -> None:
        import asyncpg

        self._table = check_identifier("table", table)
        self._schema = check_identifier("schema", schema)
        if channel is None:
            channel = default_channel(self._schema, self._table)
        self._channel = check_identifier("channel", channel)
        self._grants_channel = grants_channel(self._channel)
        self.poll_interval = check_seconds("poll_interval", poll_interval)
        window = check_seconds("renew_window", renew_window, allow_zero=True)
        self._timeout = (
            None if command_timeout is None else check_seconds("command_timeout", command_timeout)
        )
        self._connect_timeout = check_seconds("connect_timeout", connect_timeout)
        if db is not _OPENING and not isinstance(db, (asyncpg.Pool, asyncpg.Connection)):
            raise InvalidArgument(
                f"db must be an asyncpg Pool or Connection, not {type(db).__name__}"
            )
        self._db = db
        self._conn_lock = asyncio.Lock() if isinstance(db, asyncpg.Connection) else None
        #: Our own connections (a backend made from a URL), else ``None``: ``db`` is the user's.
        self._pool: LeanPool[Any] | None = None
        self._answered = asyncpg.PostgresError
        self._gate: asyncio.Semaphore | bool | None = None
        self._listens = bool(listen)
        self._sql = Sql(self._schema, self._table)
        self._permit_sql = PermitSql(self._schema, self._table)
        self._where = f'"{self._schema}"."{self._table}"'  # as errors name the table
        self._batcher = RenewBatcher(self._renew_batch, window=window)
        self._wakeups = Wakeups()
        self._queue = Queue()
        self._sweeps = Sweeps()
        #: Owners granted from a hand-off, whose waiter row an ask that crossed the
        #: hand-off may have written again: their release deletes it.
        self._rowed: set[tuple[str, str]] = set()
        self._acquire_statements = 0
        self._handoffs_taken = 0
        self._takers = Takers()
        self._held: dict[str, Held] = {}
        #: Until when (at least) the rows a wait for a holder marked watched stay marked.
        self._watched: dict[str, float] = {}
        self._setup_lock = asyncio.Lock()
        self._waiting = 0
        self._closed = False
        self._listener = Listener(
            db,
            self._conn_lock,
            channel=self._channel,
            grants_channel=self._grants_channel,
            enabled=bool(listen),
            url=listen_url,
            connect_timeout=self._connect_timeout,
            connect_options=dict(connect_options or {}),
            poll_interval=self.poll_interval,
            closed=lambda: self._closed,
            wakeups=self._wakeups,
            queue=self._queue,
            takers=self._takers,
            what=repr(self),
        )
        self._permits = Permits(
            self._permit_sql,
            self._fetch,
            self._listener,
            self._wakeups,
            self._batcher,
            self._channel,
            lambda: self.poll_interval,
        )

    def __repr__(self) -> str:
        return f"<PostgresBackend {self._schema}.{self._table}>"

    @property
    def table(self) -> str:
        """The table the leases live in."""
        return self._table

    @property
    def schema(self) -> str:
        """The schema of :attr:`table`."""
        return self._schema

    @property
    def channel(self) -> str:
        """The NOTIFY channel that releases and takeovers are announced on."""
        return self._channel

    def statistics(self) -> PostgresStatistics:
        """Counters of renew statements and the state of the listener."""
        return PostgresStatistics(
            renew_statements=self._batcher.statements,
            renewals_shared=self._batcher.shared,
            listening=self._listener.up,
            listener_connects=self._listener.connects,
            waiting=self._waiting + self._permits.waiting,
            pool=None if self._pool is None else self._pool.statistics(),
            acquire_statements=self._acquire_statements + self._permits.statements,
            handoffs_taken=self._handoffs_taken,
            permit_statements_combined=self._permits.combiner.combined,
        )

    @property
    def capabilities(self) -> frozenset[Capability]:
        """:data:`CAPABILITIES`, and :attr:`Capability.PUSH_WAKEUP` unless ``listen=false``."""
        return _LISTENING if self._listens else CAPABILITIES  # (read on every acquire)

    # -- opening -------------------------------------------------------------------------

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> PostgresBackend:
        """Open a pool for a ``postgresql://`` (or ``postgres://``) URL.

        Options come from the URL query or keyword arguments (not both): ``table``,
        ``schema``, ``channel``, ``listen``, ``listen_url``, ``poll_interval``, ``renew_window``,
        ``command_timeout``, ``connect_timeout``, ``min_size``, ``max_size``,
        ``statement_cache_size``, ``pooler``; ``connect_options`` (a mapping, keyword only)
        goes to asyncpg. Other query parameters go to asyncpg as they are.

        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: the server cannot be reached
        """
        dsn, ours = parse_url(url)
        for key in options:
            if (key not in URL_OPTIONS and key not in KEYWORD_ONLY) or key in ours:
                raise InvalidArgument(f"PostgreSQL option {key!r} is unknown or given twice")
        ours.update(options)
        return await cls._open(dsn, ours)

    @classmethod
    async def _open(cls, dsn: str, options: dict[str, Any]) -> PostgresBackend:
        import asyncpg

        min_size, max_size = pool_size(options.pop("min_size", 1), options.pop("max_size", 10))
        pooled = parse_pooler(options.pop("pooler", "none")) == "transaction"
        connect = dict(options.get("connect_options") or {})
        if "statement_cache_size" in options:
            connect["statement_cache_size"] = options.pop("statement_cache_size")
        elif pooled:
            # A named statement prepared on one server connection is unknown on the next.
            connect.setdefault("statement_cache_size", 0)
        if pooled and options.get("listen_url") is None:
            # LISTEN through a transaction pooler is accepted and then hears nothing.
            if options.get("listen"):
                raise InvalidArgument(
                    "listen=true through a transaction pooler needs listen_url (a direct"
                    " or session-mode connection); LISTEN through the pooler hears nothing"
                )
            options["listen"] = False
        options["connect_options"] = connect
        backend = cls(_OPENING, **options)  # every option is checked before connecting
        timeout = backend._connect_timeout

        async def open_connection() -> Any:
            return await asyncpg.connect(dsn, timeout=timeout, **connect)

        pool: LeanPool[Any] = LeanPool(
            open_connection,
            close=lambda conn: conn.close(timeout=timeout),
            terminate=lambda conn: conn.terminate(),
            usable=lambda conn: not conn.is_closed(),
            max_size=max_size,
            min_size=min_size,
            close_timeout=timeout,
            what=repr(backend),
        )
        with mapped():
            try:
                await pool.fill()
            # Not chained: asyncpg's message may quote the DSN's parts, the password's too.
            except ValueError as exc:  # asyncpg's ClientConfigurationError is one too
                raise InvalidArgument(scrub(f"bad PostgreSQL URL or option: {exc}", dsn)) from None
            except TypeError as exc:  # an unknown keyword in connect_options
                raise InvalidArgument(scrub(f"bad PostgreSQL option: {exc}", dsn)) from None
        backend._db = None
        backend._pool = pool
        backend._listener.own_connections(dsn)
        if min_size:
            # Listen from the start (as the pool connects ahead of use), so that held
            # leases are watched by callback (``on_taken``) from the first one on. A
            # listener that cannot connect is retried by the next wait, as ever.
            try:
                await backend._listener.ensure()
            except BaseException:  # cancelled: leave no connection open
                backend._closed = True
                pool.terminate()
                raise
        return backend

    async def setup(self) -> None:
        """Create the table and its waiters table if they do not exist (idempotent; safe
        from many processes).

        :raises BackendError: e.g. the schema does not exist or the role may not create
        """
        async with self._setup_lock:
            with mapped():
                if self._pool is not None:
                    async with self._pool.connection(reusable=self._reusable) as conn:
                        await self._create(conn)
                elif self._conn_lock is not None:
                    async with self._conn_lock:
                        await self._create(self._db)
                else:
                    async with self._db.acquire() as conn:
                        await self._create(conn)

    async def _create(self, conn: Any) -> None:
        async with conn.transaction():
            # Concurrent CREATE TABLE IF NOT EXISTS can fail on the catalog's unique
            # index; a transaction-scoped lock serialises it (and suits poolers).
            key = advisory_key(self._schema, self._table)
            await conn.execute("SELECT pg_advisory_xact_lock($1::int8)", key)
            await conn.execute(self._sql.create)
            # A table made before the marks has not got them: added once (``ADD COLUMN
            # IF NOT EXISTS`` would take the table's exclusive lock on every setup).
            if not await conn.fetchval(self._sql.has_marks, f'"{self._schema}"."{self._table}"'):
                await conn.execute(self._sql.add_marks)
            await conn.execute(self._sql.create_waiters)
            await conn.execute(self._sql.create_waiters_index)
            await conn.execute(self._permit_sql.create)
            await conn.execute(self._permit_sql.create_names)
            for routine, create in (
                (self._permit_sql.routine, self._permit_sql.create_acquire),
                (self._permit_sql.release_routine, self._permit_sql.create_release),
                (self._permit_sql.batch_routine, self._permit_sql.create_batch),
            ):
                if not await conn.fetchval(self._permit_sql.has_acquire, routine):
                    await conn.execute(create)

    # -- running statements ----------------------------------------------------------------

    def _reusable(self, exc: BaseException) -> bool:
        """Whether a connection is in step after ``exc``: the server answered with an error."""
        return isinstance(exc, self._answered)

    async def _fetch(self, sql: str, *args: Any, renewal: bool = False) -> list[Any]:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        try:  # not ``mapped()``: a context manager per statement costs more than this
            if self._pool is not None:
                return await self._run_pooled(self._pool, sql, args, renewal)
            return await self._gated(sql, args, renewal)
        except Exception as exc:
            if getattr(exc, "sqlstate", None) not in _UNDEFINED:
                with mapped():
                    raise
        with mapped():
            await self.setup()  # first use: create the table (or the mark), then ask again
            if self._pool is not None:
                return await self._run_pooled(self._pool, sql, args, renewal)
            return await self._gated(sql, args, renewal)

    async def _run_pooled(
        self, pool: LeanPool[Any], sql: str, args: tuple[Any, ...], renewal: bool
    ) -> list[Any]:
        """Run ``sql`` on a connection of our own pool (its renewal reserve is built in)."""
        conn = await pool.acquire(renewal)
        try:
            rows: list[Any] = await conn.fetch(sql, *args, timeout=self._timeout)
        except BaseException as exc:
            if isinstance(exc, self._answered):
                pool.release(conn, renewal)  # the server answered: the connection is fine
            else:
                # An interrupted statement leaves the connection in doubt: closed at
                # once, never reused, and never waiting on asyncpg's cancel request.
                pool.discard(conn, renewal)
            raise
        pool.release(conn, renewal)
        return rows

    async def _gated(self, sql: str, args: tuple[Any, ...], renewal: bool) -> list[Any]:
        gate = None if renewal else self._pool_gate()
        if gate is None:
            return await self._run(sql, args)
        async with gate:
            return await self._run(sql, args)

    def _pool_gate(self) -> asyncio.Semaphore | None:
        """Other statements use at most all but one of the pool's connections, so the
        renewal statement (one in flight at a time) never queues behind a burst of
        acquires until the leases it renews expire."""
        if self._gate is None:
            size = 1 if self._conn_lock is not None else int(self._db.get_max_size())
            self._gate = asyncio.Semaphore(size - 1) if size >= 2 else False
        return self._gate if isinstance(self._gate, asyncio.Semaphore) else None

    async def _run(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        if self._conn_lock is not None:
            async with self._conn_lock:
                rows: list[Any] = await self._db.fetch(sql, *args, timeout=self._timeout)
                return rows
        import asyncpg

        conn = await self._db.acquire()
        try:
            rows = await conn.fetch(sql, *args, timeout=self._timeout)
        except asyncpg.PostgresError:
            # The server answered with an error: the connection is idle and fine.
            await self._db.release(conn, timeout=self._connect_timeout)
            raise
        except BaseException:
            # An interrupted statement leaves the connection in doubt. Closing it at
            # once never waits on asyncpg's cancel request, which hangs as long as the
            # network does (the pool drops a closed connection by itself).
            conn.terminate()
            raise
        await self._db.release(conn, timeout=self._connect_timeout)
        return rows

    # -- the contract ------------------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        check_owner(owner)
        meta = encode_metadata(metadata) if metadata else "{}"
        handed = self._queue.take(name, owner, float(ttl) * _FRESH_SHARE)
        if handed is not None:  # handed over while it waited: confirmed by the notification
            await asyncio.sleep(0)  # a checkpoint; a cancel here leaves it to the caller's release
            token, sent_at, granted_ttl = handed
            self._queue.done(name, owner)
            self._handoffs_taken += 1
            if len(self._rowed) >= _MAX_ROWED:
                self._rowed.clear()  # leases never released (a stale row lapses by itself)
            self._rowed.add((name, owner))
            self._held[name] = Held(owner, token, identity, meta, granted_ttl, sent_at, None)
            return Grant(token, min(float(ttl), granted_ttl), sent_at=sent_at)
        asker = self._queue.get(name, owner)
        # Not queued: first the statement that touches the lease table only, which
        # grants a row not marked as having waiters. A refusal (a holder, or a mark)
        # goes on to the queue-aware statement, which queues the caller.
        fast = asker is None or asker.refused_at is None
        args = (name, owner, identity, meta, float(ttl), self._channel, self._grants_channel)
        seen: HolderInfo | None = None  # the holder that the latest read showed
        for _ in range(_RACE_RETRIES + fast):
            asked_at, mark = now(), self._listener.mark()
            if fast:
                sql, ask = self._sql.acquire_fast, 0
            else:
                sql, ask = self._sql.acquire, self._queue.sending(name, owner, float(ttl), asked_at)
            self._acquire_statements += 1
            # Seen to its end even if the caller is cancelled (see ``finished``).
            rows = await finished(self._fetch(sql, *args, *(() if fast else (ask,))))
            row = rows[0] if rows else None
            if row is not None and row["granted"]:
                self._queue.done(name, owner)
                self._wakeups.wake(name)
                token = int(row["token"])
                self._remember(name, Held(owner, token, identity, meta, float(ttl), asked_at, mark))
                if not row["fresh"]:  # a retry: the row kept its identity and metadata
                    self._held[name].mark = None  # known again from the next read
                return Grant(token, ttl)
            if fast:  # refused by a holder or a mark (or a newer row): queue
                fast = False
            elif row is not None and row["owner"] not in (None, owner) and row["remaining"] > 0:
                self._queue.refused(name, owner, ask)
                return row_holder(self._where, name, *(row[c] for c in HOLDER_COLUMNS))
            elif row is None:
                # Neither granted nor refused: a row this statement's snapshot does not
                # show yet, or one held with no expiry (foreign: the read raises).
                seen = await self._read(name, self._sql.read, name)
            # Refused by a row this statement's snapshot does not show yet: ask again.
        if seen is not None and seen.owner != owner and (seen.remaining or 0) > 0:
            # The name changed hands under every statement (a storm of grants and
            # releases): it is held, as the latest read showed. A refusal, so that the
            # caller waits for a change as for any other, rather than failing.
            return seen
        raise BackendTimeout(f"lease {name!r} kept changing under try_acquire; try again")

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
        """One statement: the acquire function (see :class:`PermitSql`)."""
        return await self._permits.try_acquire(name, owner, ttl, identity, metadata, limit, weight)

    async def read_permits(self, name: str) -> PermitHolders | None:
        return await self._permits.read(name)

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await self._permits.wait_turn(name, owner, ttl, seen)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        return await renew_held(self._batcher, self._held, name, owner, token, ttl)

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        """Every lease the core's scheduler finds due, in one statement."""
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        return await renew_many_held(self._batcher, self._renew_failed, self._held, renewals)

    async def _renew_batch(self, items: Sequence[tuple[Key, float]]) -> frozenset[Key]:
        """Renew every lease of ``items`` in one statement; which ones were renewed."""
        failed = await self._renew_failed([(n, o, t, ttl) for (n, o, t), ttl in items])
        return frozenset(key for key, _ in items if key not in failed)

    async def _renew_failed(self, renewals: Sequence[Renewal]) -> set[Key]:
        """Renew every lease of ``renewals`` in one statement (one more for the permits
        among them); those it did not renew (the statements answer only them). What
        is sent is made once per list of the core's (:func:`derived`)."""
        locks, permits = derived(renewals, "kinds", by_kind)
        failed: set[Key] = set()
        for kind, sql, batch in (
            ("postgres", self._sql.renew, locks),
            ("postgres-permits", self._permit_sql.renew, permits),
        ):
            if not batch:
                continue
            literals = derived(renewals, kind, literals_of(batch))
            rows = await self._fetch(sql, *literals, renewal=True)
            failed |= {(row["name"], row["owner"], int(row["token"])) for row in rows}
        return failed

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Free ``owner``'s grant of ``name`` (handing it to the oldest live waiter, if
        any), and drop ``owner``'s waiter row (a caller that stops waiting releases).
        A permit's owner: delete its permit or queue entry, and ``NOTIFY`` it."""
        if is_permit_owner(owner):
            return await self._permits.release(name, owner, token)
        self._batcher.forget(name, owner, token)
        # It may have a waiter row if it sent a queue-aware ask (one whose refusal it
        # never saw, too: a caller cancelled while the statement ran to its end), or
        # if this is the core's compensating release (no token), which must never
        # leave a row that a later release hands the name to.
        queued = self._queue.get(name, owner) is not None or token is None
        self._queue.done(name, owner)
        held = self._held.get(name)
        mine = held is not None and held.owner == owner
        if mine:
            del self._held[name]
        if not queued and (name, owner) not in self._rowed:
            # No waiter row of its own to delete or to look for (the uncontended path):
            # the lease table only, unless the row is marked as having waiters. Nobody
            # queued for it (a waiter marks the row), so the release of a grant made here
            # concerns only observers: it goes to the grants channel if one watches the
            # row, and the holders' listeners are not woken by every release. A release
            # in the name of a grant made elsewhere goes to the channel, where its
            # holder's watch hears it.
            channel = self._grants_channel if mine else self._channel
            rows = await self._fetch(self._sql.release_fast, name, owner, token, channel, mine)
            if rows:
                self._wakeups.wake(name)
                return True
            # Marked as having waiters (or not ``owner``'s): hand it on, if it is ours.
            row = await self._release(name, owner, token, self._sql.release_held)
            if row is None:
                return False
        else:
            self._rowed.discard((name, owner))
            row = await self._release(name, owner, token)
        if row["token"] is None and queued and owner not in (row["gone"] or ()):
            # Its waiter row was gone: a hand-off to ``owner`` may have deleted it after
            # this statement's snapshot was taken, so that the statement could not see
            # the grant. Look again, and give it back.
            row = await self._release(name, owner, None)
        freed = row["token"] is not None
        for _ in range(_RACE_RETRIES):
            handed_to = row["handed_to"]
            if handed_to is None or handed_to in (row["gone"] or ()):
                break
            # The waiter it went to deleted its row meanwhile (it stopped waiting, and
            # its own release came too early to see the grant): give it back for it.
            row = await self._release(name, handed_to, int(row["token"]))
        return freed

    async def _release(
        self, name: str, owner: str, token: int | None, sql: str | None = None
    ) -> Any:
        rows = await self._fetch(sql or self._sql.release, name, owner, token, self._channel)
        row = rows[0] if rows else None
        if row is not None and row["token"] is not None:
            self._wakeups.wake(name)
            if row["handed_to"] is not None:  # a waiter here learns it before the NOTIFY
                lasts = None if row["lasts"] is None else row["lasts"] / 1000
                self._queue.handed(name, row["handed_to"], int(row["token"]), row["ask"], lasts)
        return row

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        """Replace the metadata of ``owner``'s grant, and announce it (``NOTIFY``, as
        ``'m'``: every listener's watchers look again; no holder is taken by it)."""
        check_owner(owner)
        meta = encode_metadata(metadata) if metadata else "{}"
        rows = await self._fetch(self._sql.update_metadata, name, owner, token, meta, self._channel)
        if not rows:
            raise NotOwnerError(name)
        held = self._held.get(name)
        if held is not None and (held.owner, held.token) == (owner, token):
            held.meta = meta  # what read() answers from here
        self._wakeups.wake(name)

    async def read(self, name: str) -> HolderInfo | None:
        """The holder of ``name``. For a live grant made through this backend, answered
        without a statement while the listener proves the row unchanged (see ``Held``)."""
        held = self._held.get(name)
        if held is not None and self._listener.unchanged_since(name, held.mark, held.owner):
            remaining = held.sent_at + held.ttl - now()
            if remaining > 0:
                await asyncio.sleep(0)
                return row_holder(
                    self._where, name, held.owner, held.identity, held.token, held.meta, remaining
                )
        return await self._read(name, self._sql.read, name)

    async def _read(self, name: str, sql: str, *args: Any) -> HolderInfo | None:
        mark = self._listener.mark()
        rows = await self._fetch(sql, *args)
        if not rows:
            return None
        row = rows[0]
        held = self._held.get(name)
        if held is not None and (held.owner, held.token) == (row["owner"], row["token"]):
            held.identity, held.meta = row["identity"], row["metadata"]
            held.mark = mark  # seen unchanged: answer from here again
        return row_holder(self._where, name, *(row[c] for c in HOLDER_COLUMNS))

    async def _watched_read(self, name: str) -> HolderInfo | None:
        """:meth:`read`, having marked the row watched (see ``WATCH_FOR``) unless it is
        known to be for long enough still: then its grants and releases are announced."""
        sent_at = now()
        if self._watched.get(name, 0.0) - sent_at > _WATCH_AGAIN:
            return await self.read(name)
        current = await self._read(name, self._sql.watch, name, WATCH_FOR)
        if len(self._watched) >= _MAX_WATCHED:
            self._watched.clear()
        self._watched[name] = sent_at + WATCH_FOR  # the server's mark lasts at least that
        return current

    def _remember(self, name: str, held: Held) -> None:
        self._held[name] = held  # without a mark, the next read that finds it ours sets one

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None] | None:
        """Call ``taken(STOLEN)`` when a notification shows ``name``'s ``token`` released
        by somebody else, or a newer token granted: no task and no read per lease.

        Only while the listener is up (else ``None``: the core's watch task waits in
        :meth:`wait_taken`, which connects it). Notifications carry their token, so a
        late one from before the grant ends nothing (see
        :class:`~aiolease.backends._takers.Takers`). A takeover whose notification is
        missed (the listener was down) ends nothing here: the holder's next renewal
        finds the row gone, within one renew interval.
        """
        if is_permit_owner(owner):
            # Nobody but its holder ends a permit before its expiry, which its renewal
            # finds: no watch (a read per change of the lock of the name would be waste).
            return no_watch
        if not self._listener.up or self._closed:
            return None
        return self._takers.add(name, owner, token, taken)

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Return when ``name``'s holder differs from ``seen`` (renewals do not count).

        Wakes on NOTIFY of a release or takeover, when the holder's ttl runs out, and,
        while no listener is up, every :attr:`poll_interval`. The notification of the
        very grant it read (which the listener may deliver after the read) is no change.
        """
        # Listen, and watch, before reading: a change after the read then wakes us. (A
        # listener that connects wakes every watcher, as notifications were missed.)
        # Grants of a free name, and releases nobody queued for, are announced only to
        # listeners that ask for them (see ``release``), and only for a row that a wait
        # marked watched (``_watched_read``).
        listening = await self._listener.for_grants()
        self._waiting += 1
        try:
            with self._wakeups.watching(name) as event:
                mark = self._listener.mark()
                current = await (self._watched_read(name) if listening else self.read(name))
                if state_of(current) != state_of(seen):
                    return
                timeout = LISTEN_CHECK if listening else self.poll_interval
                if current is not None and current.remaining is not None:
                    timeout = min(timeout, current.remaining)
                deadline = now() + timeout
                woken = await wait_event(event, timeout)
            while woken and current is not None:
                if not self._listener.unchanged_since(name, mark, current.owner):
                    return
                with self._wakeups.watching(name) as event:  # the holder's own grant: wait on
                    woken = await wait_event(event, deadline - now())
        finally:
            self._waiting -= 1

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Wait, in the name's queue in the database, until the lease is handed to
        ``owner``, the name is released with nobody to hand it to, the holder's ttl
        runs out (or, once the name is handed to another waiter, that grant's: a
        waiter that died while queued holds ``owner`` up for no longer than what was
        left of its row), or ``owner``'s waiter row is due for a refresh (a third of
        ``ttl`` after its latest refused ask: its next ask keeps its place).

        While nothing listens, looks every :attr:`poll_interval` (a read) whether the
        name is ``owner``'s or free. A wait that ends by an exception leaves the
        compensating release to the core, which also drops the waiter row.
        """
        asker = self._queue.get(name, owner)
        if asker is None or asker.refused_at is None:  # not refused here: no row of ours
            await self.wait_changed(name, seen)
            return
        if self._sweeps.due():  # expired rows of dead waiters, of any name
            await self._fetch(self._sql.sweep)
        deadline = asker.refused_at + ttl * _REFRESH_SHARE
        if seen.remaining is not None:
            deadline = min(deadline, now() + seen.remaining)
        event = asker.event
        self._waiting += 1
        try:
            while asker.handed is None:
                listening = await self._listener.ensure()  # a reconnect sets the event
                left = min(deadline, asker.until) - now()
                if left <= 0:
                    return
                step = min(left, LISTEN_CHECK if listening else self.poll_interval)
                if await wait_event(event, step):
                    if asker.woken or asker.handed is not None or event is not asker.event:
                        return
                    event.clear()  # re-timed by a hand-off to another waiter: wait on
                    continue
                if not listening and now() < deadline:
                    current = await self.read(name)
                    if current is None or current.owner == owner:
                        return
        finally:
            self._waiting -= 1

    async def aclose(self) -> None:
        """Stop listening and close the pool if this backend opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wakeups.wake_all()
        self._queue.wake_all()
        try:
            await self._permits.aclose()
            await self._listener.aclose()
        finally:
            if self._pool is not None:
                await self._pool.aclose()
