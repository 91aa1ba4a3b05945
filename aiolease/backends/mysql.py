"""The MySQL / MariaDB backend (asyncmy): lease rows judged by the server's clock.

For MySQL 8 and MariaDB 10.6+::

    mysql://user:password@host:3306/dbname
    mariadb://user@host/dbname?table=leases&poll_interval=0.25&max_size=10

or wrap an ``asyncmy`` pool you already have (it is never closed by the backend)::

    backend = MySQLBackend(pool, table="leases")

**The table.** One row per name, created by :meth:`MySQLBackend.setup` or on first
use (``CREATE TABLE IF NOT EXISTS``, which the server's metadata lock makes safe
when many processes start at once). Names, owners and identities are
``VARBINARY``: compared byte for byte, so case, accents and trailing spaces count,
whatever the server's default collation::

    name VARBINARY(255) PRIMARY KEY, token BIGINT UNSIGNED, owner VARBINARY(255),
    identity VARBINARY(1024), metadata BLOB, ttl DOUBLE,
    acquired_at DATETIME(6), expires_at DATETIME(6)

**Server time.** Expiry is ``UTC_TIMESTAMP(6)``: the same statement-start clock as
``NOW(6)``, but free of the session time zone (``NOW()`` in a ``DATETIME`` would
jump an hour at a daylight-saving change, and differ between sessions).

**Acquire is one statement.** ``INSERT ... ON DUPLICATE KEY UPDATE`` decides
atomically under the row lock. MySQL has no ``WHERE`` on that update and evaluates
its assignments left to right, each seeing the columns assigned before it, so the
token is assigned first (from the untouched row), then the owner, and every later
column asks "is the owner now the caller?". The statement reports its outcome in
the OK packet: the token column is assigned through ``LAST_INSERT_ID(expr)``, so the
reply carries the granted token, or 0 when the name is held. Only a refusal is
followed by a second statement, a plain ``SELECT`` of the holder to report (the
decision is already made; MySQL has no ``RETURNING`` for this). Release is one
``UPDATE``, read the same way.

**Batched renewals.** All leases renewed through one backend object share one
``UPDATE`` per tick (see :class:`~aiolease.backends._sql.RenewBatcher`); its
affected-row count says when every lease of the batch was renewed, else one
``SELECT`` tells which are still the caller's and live.

**Hand-offs.** Waiters of one backend object queue oldest first
(:mod:`aiolease.backends._sql_turns`): a release through the backend grants the row
to the oldest in the release statement itself, and a release with nobody to hand
to wakes only the oldest. While a grant made here is live (see ``_Held``), other
callers of this backend are refused without a statement.

**Wake-ups.** There is no push: a waiter wakes when this backend object changes the
name, when the holder's remaining ttl runs out, and otherwise every
``poll_interval`` (a bounded poll that notices releases made elsewhere).

**Connections.** A backend made from a URL runs its statements on a lean pool of
its own (:mod:`aiolease.backends._sql_pool`), whose connections keep acquire,
release, hand-off and the holder read as server-side prepared statements where
asyncmy supports it (``stmt_cache_size``): parsed once per connection, not per call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from .._exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    NotOwnerError,
)
from .._validate import check_seconds
from ..abc import Backend, Capability, Grant, HolderInfo
from ._my_sql import Prepared, Sql
from ._sql import (
    Key,
    RenewBatcher,
    Wakeups,
    check_identifier,
    check_owner,
    encode_metadata,
    finished,
    holder,
    now,
    parse_count,
    parse_query,
    parse_seconds,
    parse_size,
    pool_size,
    wait_event,
)
from ._sql_pool import LeanPool, PoolStatistics
from ._sql_turns import Turn, Turns

__all__ = ["MySQLBackend", "MySQLStatistics"]

logger = logging.getLogger("aiolease.mysql")

#: How many times a refusal whose holder is gone by the time it is read is asked again.
_RACE_RETRIES = 8
#: Server error numbers that mean "try again later": lock wait timeout, deadlock,
#: statement time limit (MySQL, MariaDB).
_TIMEOUT_ERRNOS = frozenset({1205, 1213, 3024, 1969})
_NO_SUCH_TABLE = 1146

_URL_OPTIONS: dict[str, Callable[[str], Any]] = {
    "table": str,
    "poll_interval": parse_seconds,
    "renew_window": parse_seconds,
    "connect_timeout": parse_seconds,
    "min_size": parse_size,
    "max_size": parse_count,
}
_KEYWORD_ONLY = ("connect_options",)


def _errno(exc: BaseException) -> int | None:
    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _answered(exc: BaseException) -> bool:
    """Whether ``exc`` is an error the server sent (client-side errors are 2000 and up)."""
    from asyncmy import errors

    number = _errno(exc)
    return isinstance(exc, errors.Error) and number is not None and number < 2000


def map_error(exc: BaseException) -> BackendError:
    """The aiolease error for an asyncmy or socket error (most specific first)."""
    from asyncmy import errors

    number = _errno(exc)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or number in _TIMEOUT_ERRNOS:
        return BackendTimeout(f"MySQL did not answer in time: {exc!r}")
    if isinstance(exc, (OSError, errors.OperationalError, errors.InterfaceError)):
        return BackendUnavailable(f"MySQL unreachable: {exc!r}")
    return BackendError(f"MySQL error: {exc!r}")


@contextmanager
def _mapped() -> Iterator[None]:
    """Raise driver and socket errors as :class:`BackendError` ``from`` the original."""
    from asyncmy import errors

    try:
        yield
    except BackendError:
        raise
    except (OSError, asyncio.TimeoutError, errors.Error) as exc:
        raise map_error(exc) from exc
    except Exception as exc:
        if type(exc).__module__.startswith("asyncmy"):  # e.g. a packet it could not parse
            raise map_error(exc) from exc
        raise


#: Stands for the pool that :meth:`MySQLBackend.from_url` is about to open.
_OPENING: Any = object()


def _key(holder: HolderInfo | None) -> tuple[str, int] | None:
    return None if holder is None else (holder.owner, holder.token)


#: The share of a grant's ttl that a refusal answered from memory leaves unused, for
#: clock-rate drift between this host and the server.
_DRIFT = 0.001


@dataclass(slots=True)
class _Held:
    """A grant made through this backend, to refuse other callers without a statement.

    Until it is released through this backend, the row stays this owner's at least
    until ``sent_at + ttl`` (``sent_at``: when the newest statement that granted or
    renewed it was sent, before the server read its clock).
    """

    owner: str
    token: int
    identity: str
    meta: str
    ttl: float
    sent_at: float

    def remaining(self, at: float) -> float:
        return self.sent_at + self.ttl * (1 - _DRIFT) - at


#: What :meth:`MySQLBackend._execute` returns.
_ID, _ROWS, _COUNT = "id", "rows", "count"


async def _exchange(
    conn: Any, sql: Prepared | str, params: Any, want: str, then: Prepared | None
) -> Any:
    """Run ``sql`` (and ``then``) on ``conn``; what ``want`` asks for (see ``_execute``).

    A :class:`~aiolease.backends._my_sql.Prepared` statement takes its parameters from
    the mapping ``params``; a plain one (a batch, whose text differs with its size, so
    preparing it would cost a round trip per new size) goes as text.
    """
    async with conn.cursor() as cur:
        if isinstance(sql, Prepared):
            count = await cur.execute(sql.sql, [params[name] for name in sql.names])
        else:
            count = await cur.execute(cur.mogrify(sql, params))
        if want == _ID:
            result: Any = cur.lastrowid
        else:
            result = await cur.fetchall() if want == _ROWS else count
        if then is not None and not result:
            await cur.execute(then.sql, [params[name] for name in then.names])
            result = await cur.fetchall()
    if not conn.get_autocommit():
        await conn.commit()
    return result


#: Prepared statements kept per connection (of a backend made from a URL): acquire,
#: holder, release, hand-off.
_STATEMENT_CACHE = 8


def _statement_cache(asyncmy: Any) -> bool:
    """Whether this asyncmy prepares positional statements (``stmt_cache_size``)."""
    try:
        return "stmt_cache_size" in inspect.signature(asyncmy.connect).parameters
    except (TypeError, ValueError):  # a signature it does not expose: do without
        return False


def _usable(conn: Any) -> bool:
    """Whether an idle asyncmy connection is still open (the server may have closed it)."""
    return bool(conn.connected) and not getattr(conn, "_stream_broken", False)


def _micros(ttl: float) -> int:
    return max(round(ttl * 1_000_000), 1)


@dataclass(frozen=True, slots=True)
class MySQLStatistics:
    """What one :class:`MySQLBackend` did so far.

    :param renew_statements: renewal statements sent (each renews a whole batch)
    :param renewals_shared: renew calls answered from a statement sent for the batch
    :param hand_offs: releases that granted the name to a waiter in the same statement
    :param waiting: tasks blocked in ``wait_changed`` or ``wait_turn`` now
    :param pool: the connections of a backend made from a URL (``None``: the user's)
    """

    renew_statements: int
    renewals_shared: int
    hand_offs: int
    waiting: int
    pool: PoolStatistics | None = None


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
        {Capability.SERVER_TIME, Capability.DURABLE_TOKENS, Capability.MULTI_PROCESS}
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
        self.poll_interval = check_seconds("poll_interval", poll_interval)
        window = check_seconds("renew_window", renew_window, allow_zero=True)
        if pool is not _OPENING and not isinstance(pool, Pool):
            raise InvalidArgument(f"pool must be an asyncmy Pool, not {type(pool).__name__}")
        self._pool = pool
        #: Our own connections (a backend made from a URL), else ``None``: ``pool`` is the user's.
        self._lean: LeanPool[Any] | None = None
        self._sql = Sql(self._table)
        self._setup_lock = asyncio.Lock()
        self._wakeups = Wakeups()
        self._batcher = RenewBatcher(self._renew_batch, window=window)
        self._turns = Turns()
        self._held: dict[str, _Held] = {}
        #: Grants and releases made through this backend so far (any name): a refusal
        #: followed by none needs no read before its wait.
        self._changes = 0
        self._hand_offs = 0
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
            waiting=self._waiting,
            pool=None if self._lean is None else self._lean.statistics(),
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

        connect, ours = _parse_url(url)
        for key in options:
            if (key not in _URL_OPTIONS and key not in _KEYWORD_ONLY) or key in ours:
                raise InvalidArgument(f"MySQL option {key!r} is unknown or given twice")
        ours.update(options)
        if _statement_cache(asyncmy):
            connect["stmt_cache_size"] = _STATEMENT_CACHE
        connect.update(ours.pop("connect_options", None) or {})
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
            usable=_usable,
            max_size=max_size,
            min_size=min_size,
            close_timeout=connect["connect_timeout"],
            what=repr(backend),
        )
        with _mapped():
            try:
                await lean.fill()
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"bad MySQL URL or option: {exc}") from exc
        backend._pool = None
        backend._lean = lean
        return backend

    async def setup(self) -> None:
        """Create the table if it does not exist (idempotent; safe from many processes).

        :raises BackendError: e.g. the user may not create tables
        """
        async with self._setup_lock:
            with _mapped():
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
            await cur.execute(self._sql.create)
            await cur.execute("SET @@session.sql_notes = DEFAULT")

    # -- running statements ----------------------------------------------------------------

    async def _execute(
        self,
        sql: Prepared | str,
        params: Any,
        want: str = _ID,
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
        try:  # not ``_mapped()``: a context manager per statement costs more than this
            return await self._run(sql, params, want, then, renewal)
        except Exception as exc:
            if _errno(exc) != _NO_SUCH_TABLE or not _answered(exc):
                with _mapped():
                    raise
        with _mapped():
            await self.setup()  # first use: create the table, then ask again
            return await self._run(sql, params, want, then, renewal)

    async def _run(
        self, sql: Prepared | str, params: Any, want: str, then: Prepared | None, renewal: bool
    ) -> Any:
        lean = self._lean
        if lean is None:
            async with self._pool.acquire() as conn:
                try:
                    return await _exchange(conn, sql, params, want, then)
                except BaseException as exc:
                    if not _answered(exc):
                        # An interrupted exchange leaves the connection out of step with
                        # the server: close it, so that the pool never hands it out again.
                        conn.close()
                    raise
        conn = await lean.acquire(renewal)
        try:
            result = await _exchange(conn, sql, params, want, then)
        except BaseException as exc:
            if _answered(exc) and _errno(exc) != _NO_SUCH_TABLE:
                lean.release(conn, renewal)
            else:
                # Out of step with the server: never reused. (Also one that met no
                # table: asyncmy would not try to prepare those statements on it again.)
                lean.discard(conn, renewal)
            raise
        lean.release(conn, renewal)
        return result

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
            "us": _micros(ttl),
        }
        for _ in range(_RACE_RETRIES):
            changes, asked_at = self._changes, now()
            # Seen to its end even if the caller is cancelled (see ``finished``).
            result = await finished(self._execute(self._sql.acquire, params, then=self._sql.holder))
            if isinstance(result, int):
                self._turns.done(name, owner)
                self._changed(name)
                self._granted(name, _Held(owner, result, identity, meta, float(ttl), asked_at))
                return Grant(result, ttl)
            if result and result[0][0] != raw_owner:
                self._turns.refused(name, owner, float(ttl), identity, meta, now(), (0, changes))
                return self._holder(name, result[0])
            # The holder let go between the two statements: ask again.
        raise BackendTimeout(f"lease {name!r} kept changing under try_acquire; try again")

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
        return holder(name, held.owner, held.identity, held.token, held.meta, remaining)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        sent_at = None if token < 1 else await self._batcher.renew((name, owner, token), ttl)
        held = self._held.get(name)
        if held is not None and (held.owner, held.token) == (owner, token):
            if sent_at is None:
                del self._held[name]
            else:
                held.ttl, held.sent_at = float(ttl), max(held.sent_at, sent_at)
        if sent_at is None:
            raise NotOwnerError(name)
        return Grant(token, ttl, sent_at=sent_at)

    async def _renew_batch(self, items: Sequence[tuple[Key, float]]) -> frozenset[Key]:
        """Renew every lease of ``items`` in one statement; which ones were renewed.

        The statement's affected-row count tells when all were (the usual case: one
        statement); otherwise a read of which are still ours and live tells which.
        """
        triples = [v for (n, o, t), _ in items for v in (n.encode(), o.encode(), t)]
        ttls = {ttl for _, ttl in items}
        if len(ttls) == 1:
            ttl = float(items[0][1])
            params: list[Any] = [ttl, _micros(ttl), *triples]
            sql = self._sql.renew_many(len(items))
        else:
            params = [
                v
                for ((n, o, t), ttl) in items
                for v in (n.encode(), o.encode(), t, float(ttl), _micros(ttl))
            ]
            sql = self._sql.renew_mixed(len(items))
        if await self._execute(sql, params, _COUNT, renewal=True) == len(items):
            return frozenset(key for key, _ in items)
        rows = await self._execute(self._sql.live(len(items)), triples, _ROWS, renewal=True)
        return frozenset((n.decode(), o.decode(), int(t)) for n, o, t in rows)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        self._batcher.forget(name, owner, token)
        self._turns.done(name, owner)
        held = self._held.get(name)
        if held is not None and held.owner == owner:
            del self._held[name]  # before the statement: it may free the row
        turn = self._turns.next(name)
        if turn is not None:
            return await self._hand_off(name, owner, token, turn)
        params = {"name": name.encode(), "owner": owner.encode(), "token": token}
        freed = bool(await self._execute(self._sql.release, params))
        if freed:
            self._changed(name)
            self._turns.wake_one(name)
        return freed

    async def _hand_off(self, name: str, owner: str, token: int | None, turn: Turn) -> bool:
        """Release ``owner``'s grant to the oldest task waiting here, in one statement."""
        params = {
            "name": name.encode(),
            "owner": owner.encode(),
            "token": token,
            "next": turn.owner.encode(),
            "identity": turn.identity.encode(),
            "metadata": turn.metadata.encode(),
            "ttl": turn.ttl,
            "us": _micros(turn.ttl),
        }
        sent_at = now()
        turn.grant = (0, sent_at)  # claimed: no other release hands it a second grant
        try:
            granted = int(await self._execute(self._sql.hand_off, params))
        except BaseException:
            turn.grant = None
            turn.doubt = True  # it may hold the row now: it gives it back if it stops
            raise
        finally:
            turn.settled.set()
            turn.event.set()
        if not granted:
            turn.grant = None
            return False
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

    async def read(self, name: str) -> HolderInfo | None:
        rows = await self._execute(self._sql.holder, {"name": name.encode()}, _ROWS)
        return None if not rows else self._holder(name, rows[0])

    def _holder(self, name: str, row: Any) -> HolderInfo:
        owner, identity, token, meta, micros = row
        return holder(name, owner.decode(), identity.decode(), token, meta, micros / 1e6)

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Return when ``name``'s holder differs from ``seen`` (renewals do not count).

        Wakes at once for changes made through this backend object, when the
        holder's ttl runs out, and otherwise after at most :attr:`poll_interval`.
        """
        with self._wakeups.watching(name) as event:
            current = await self.read(name)
            if _key(current) != _key(seen):
                return
            await self._wait(event, current)

    async def _wait(self, event: asyncio.Event, current: HolderInfo | None) -> None:
        timeout = self.poll_interval
        if current is not None and current.remaining is not None:
            timeout = min(timeout, current.remaining)
        self._waiting += 1
        try:
            await wait_event(event, timeout)
        finally:
            self._waiting -= 1

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Wait, oldest first among this backend's waiters, for a hand-off or a change.

        Other waiters of this backend are not woken by the same change (wake-one),
        and a release through this backend hands the name to the oldest waiter.
        """
        await self._turns.wait(
            name,
            owner,
            lambda turn: self._wait_turn(name, seen, turn),
            lambda: self.wait_changed(name, seen),
            lambda token: self.release(name, owner, token),
        )

    async def _wait_turn(self, name: str, seen: HolderInfo, turn: Turn) -> None:
        current: HolderInfo | None = seen
        if turn.mark != (0, self._changes):  # something changed here since the refusal
            current = await self.read(name)
        if turn.grant is not None or _key(current) != _key(seen):
            return
        await self._wait(turn.event, current)

    async def aclose(self) -> None:
        """Close the pool if this backend opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wakeups.wake_all()
        self._turns.wake_all()
        if self._lean is not None:
            await self._lean.aclose()


def _parse_url(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a MySQL URL into asyncmy's connect arguments and our options.

    :raises InvalidArgument: not a mysql/mariadb URL, no database, or a bad option
    """
    parts = urlsplit(url)
    usage = "a MySQL URL is 'mysql://user:password@host:3306/database'"
    if parts.scheme.lower() not in ("mysql", "mariadb") or parts.fragment:
        raise InvalidArgument(f"{usage}, got {url!r}")
    database = unquote(parts.path[1:]) if parts.path.startswith("/") else ""
    if not database or "/" in database:
        raise InvalidArgument(f"{usage}: {url!r} names no database")
    try:
        port = parts.port or 3306
    except ValueError as exc:
        raise InvalidArgument(f"{usage}: {exc}") from None
    ours, _ = parse_query(parts.query, _URL_OPTIONS, what="MySQL", keep_unknown=False)
    connect: dict[str, Any] = {
        "host": parts.hostname or "127.0.0.1",
        "port": port,
        "user": unquote(parts.username) if parts.username else "root",
        "password": unquote(parts.password) if parts.password else "",
        "database": database,
        "autocommit": True,
        "charset": "utf8mb4",
    }
    return connect, ours
