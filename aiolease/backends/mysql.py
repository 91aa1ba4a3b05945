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
decision is already made; MySQL has no ``RETURNING`` for this). Renew and release
are one ``UPDATE`` each, read the same way.

**Wake-ups.** There is no push: a waiter wakes when this backend object changes the
name, when the holder's remaining ttl runs out, and otherwise every
``poll_interval`` (a bounded poll that notices releases made elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
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
from ._sql import (
    Wakeups,
    check_identifier,
    check_owner,
    encode_metadata,
    holder,
    parse_count,
    parse_query,
    parse_seconds,
    parse_size,
    pool_size,
    timeout_after,
    wait_event,
)

__all__ = ["MySQLBackend"]

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
    "connect_timeout": parse_seconds,
    "min_size": parse_size,
    "max_size": parse_count,
}
_KEYWORD_ONLY = ("connect_options",)

_NOW = "UTC_TIMESTAMP(6)"
_EXPIRY = f"{_NOW} + INTERVAL %(us)s MICROSECOND"
#: The row may be granted to the caller: free, expired, or the caller's.
_GRANTABLE = f"(owner IS NULL OR expires_at <= {_NOW} OR owner = %(owner)s)"
#: The caller already holds it, live: an idempotent retry.
_RETRY = f"(owner <=> %(owner)s AND expires_at > {_NOW})"
_MINE = "owner <=> %(owner)s"


class _Sql:
    """The statements for one table (the identifier validated and quoted)."""

    def __init__(self, table: str) -> None:
        t = f"`{table}`"
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {t} ("
            " name VARBINARY(255) NOT NULL PRIMARY KEY, token BIGINT UNSIGNED NOT NULL,"
            " owner VARBINARY(255) NULL, identity VARBINARY(1024) NULL, metadata BLOB NULL,"
            " ttl DOUBLE NULL, acquired_at DATETIME(6) NULL, expires_at DATETIME(6) NULL"
            ") ENGINE=InnoDB"
        )
        # Assignment order matters: token, acquired_at, identity and metadata read the
        # untouched row (a retry keeps them), owner is decided next, and the rest follow
        # the new owner.
        self.acquire = (
            f"INSERT INTO {t} (name, token, owner, identity, metadata, ttl, acquired_at,"
            " expires_at) VALUES (%(name)s, LAST_INSERT_ID(1), %(owner)s, %(identity)s,"
            f" %(metadata)s, %(ttl)s, {_NOW}, {_EXPIRY})"
            " ON DUPLICATE KEY UPDATE"
            f" token = IF({_GRANTABLE}, LAST_INSERT_ID(IF({_RETRY}, token, token + 1)),"
            " token + LAST_INSERT_ID(0)),"
            f" acquired_at = IF({_GRANTABLE} AND NOT {_RETRY}, {_NOW}, acquired_at),"
            f" identity = IF({_GRANTABLE} AND NOT {_RETRY}, %(identity)s, identity),"
            f" metadata = IF({_GRANTABLE} AND NOT {_RETRY}, %(metadata)s, metadata),"
            f" owner = IF({_GRANTABLE}, %(owner)s, owner),"
            f" ttl = IF({_MINE}, %(ttl)s, ttl),"
            f" expires_at = IF({_MINE}, {_EXPIRY}, expires_at)"
        )
        self.holder = (
            "SELECT owner, identity, token, metadata,"
            f" TIMESTAMPDIFF(MICROSECOND, {_NOW}, expires_at) FROM {t}"
            f" WHERE name = %(name)s AND owner IS NOT NULL AND expires_at > {_NOW}"
        )
        self.renew = (
            f"UPDATE {t} SET token = LAST_INSERT_ID(token), ttl = %(ttl)s,"
            f" expires_at = {_EXPIRY} WHERE name = %(name)s AND owner = %(owner)s"
            f" AND token = %(token)s AND expires_at > {_NOW}"
        )
        self.release = (
            f"UPDATE {t} SET token = LAST_INSERT_ID(token), owner = NULL, identity = NULL,"
            " metadata = NULL, expires_at = NULL WHERE name = %(name)s AND owner = %(owner)s"
            f" AND (%(token)s IS NULL OR token = %(token)s) AND expires_at > {_NOW}"
        )


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


def _micros(ttl: float) -> int:
    return max(round(ttl * 1_000_000), 1)


class MySQLBackend(Backend):
    """Leases as rows of a MySQL or MariaDB table, on asyncmy.

    :param pool: an ``asyncmy`` pool (yours: never closed here); statements are
        committed even if the pool is not in autocommit mode
    :param table: the table of leases, in the connection's database (created on first use)
    :param poll_interval: the longest a waiter sleeps before looking again
    :raises InvalidArgument: a bad table name or number, or ``pool``
    """

    capabilities = frozenset(
        {Capability.SERVER_TIME, Capability.DURABLE_TOKENS, Capability.MULTI_PROCESS}
    )
    requires_asyncio = True

    def __init__(
        self, pool: Any, *, table: str = "aiolease_leases", poll_interval: float = 0.25
    ) -> None:
        from asyncmy.pool import Pool

        self._table = check_identifier("table", table)
        self.poll_interval = check_seconds("poll_interval", poll_interval)
        if pool is not _OPENING and not isinstance(pool, Pool):
            raise InvalidArgument(f"pool must be an asyncmy Pool, not {type(pool).__name__}")
        self._pool = pool
        self._owns_pool = False
        self._sql = _Sql(self._table)
        self._setup_lock = asyncio.Lock()
        self._wakeups = Wakeups()
        self._closed = False

    def __repr__(self) -> str:
        return f"<MySQLBackend {self._table}>"

    @property
    def table(self) -> str:
        """The table the leases live in."""
        return self._table

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> MySQLBackend:
        """Open a pool for ``mysql://user:password@host:port/database`` (or ``mariadb://``).

        Options come from the URL query or keyword arguments (not both): ``table``,
        ``poll_interval``, ``connect_timeout``, ``min_size``, ``max_size``;
        ``connect_options`` (a mapping, keyword only) goes to ``asyncmy.create_pool``.

        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: the server cannot be reached
        """
        import asyncmy

        connect, ours = _parse_url(url)
        for key in options:
            if (key not in _URL_OPTIONS and key not in _KEYWORD_ONLY) or key in ours:
                raise InvalidArgument(f"MySQL option {key!r} is unknown or given twice")
        ours.update(options)
        connect.update(ours.pop("connect_options", None) or {})
        connect["connect_timeout"] = check_seconds(
            "connect_timeout", ours.pop("connect_timeout", 10.0)
        )
        min_size, max_size = pool_size(ours.pop("min_size", 1), ours.pop("max_size", 10))
        backend = cls(_OPENING, **ours)  # every option is checked before connecting
        with _mapped():
            try:
                backend._pool = await asyncmy.create_pool(
                    minsize=min_size, maxsize=max_size, **connect
                )
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"bad MySQL URL or option: {exc}") from exc
        backend._owns_pool = True
        return backend

    async def setup(self) -> None:
        """Create the table if it does not exist (idempotent; safe from many processes).

        :raises BackendError: e.g. the user may not create tables
        """
        async with self._setup_lock:
            with _mapped():
                async with self._pool.acquire() as conn, conn.cursor() as cur:
                    # A concurrent creator leaves a "table exists" note: not worth a warning.
                    await cur.execute("SET @@session.sql_notes = 0")
                    try:
                        await cur.execute(self._sql.create)
                    finally:
                        await cur.execute("SET @@session.sql_notes = DEFAULT")

    # -- running statements ----------------------------------------------------------------

    async def _execute(
        self, sql: str, params: Mapping[str, Any], *, rows: bool = False, then: str | None = None
    ) -> Any:
        """Run ``sql``, creating the table on first use.

        :param rows: return the rows, not the insert id
        :param then: a query to run next, for its rows, if ``sql`` left insert id 0
        :returns: the insert id, or rows
        """
        from asyncmy import errors

        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        with _mapped():
            try:
                return await self._run(sql, params, rows, then)
            except errors.ProgrammingError as exc:
                if _errno(exc) != _NO_SUCH_TABLE:
                    raise
            await self.setup()  # first use: create the table, then ask again
            return await self._run(sql, params, rows, then)

    async def _run(self, sql: str, params: Mapping[str, Any], rows: bool, then: str | None) -> Any:
        async with self._pool.acquire() as conn:
            try:
                async with conn.cursor() as cur:
                    await cur.execute(sql, params)
                    result: Any = await cur.fetchall() if rows else cur.lastrowid
                    if then is not None and not result:
                        await cur.execute(then, params)
                        result = await cur.fetchall()
                if not conn.get_autocommit():
                    await conn.commit()
            except BaseException as exc:
                if not _answered(exc):
                    # An interrupted exchange leaves the connection out of step with
                    # the server: close it, so that the pool never hands it out again.
                    conn.close()
                raise
            return result

    # -- the contract ------------------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        params = {
            "name": name.encode(),
            "owner": check_owner(owner),
            "identity": identity.encode(),
            "metadata": encode_metadata(metadata).encode(),
            "ttl": float(ttl),
            "us": _micros(ttl),
        }
        for _ in range(_RACE_RETRIES):
            result = await self._execute(self._sql.acquire, params, then=self._sql.holder)
            if isinstance(result, int):
                self._wakeups.wake(name)
                return Grant(result, ttl)
            if result and result[0][0] != params["owner"]:
                return self._holder(name, result[0])
            # The holder let go between the two statements: ask again.
        raise BackendTimeout(f"lease {name!r} kept changing under try_acquire; try again")

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        params = {
            "name": name.encode(),
            "owner": owner.encode(),
            "token": token,
            "ttl": float(ttl),
            "us": _micros(ttl),
        }
        # The reply's insert id is the renewed row's token, or 0 when none matched.
        if token < 1 or await self._execute(self._sql.renew, params) != token:
            raise NotOwnerError(name)
        return Grant(token, ttl)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        params = {"name": name.encode(), "owner": owner.encode(), "token": token}
        freed = bool(await self._execute(self._sql.release, params))
        if freed:
            self._wakeups.wake(name)
        return freed

    async def read(self, name: str) -> HolderInfo | None:
        rows = await self._execute(self._sql.holder, {"name": name.encode()}, rows=True)
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
            timeout = self.poll_interval
            if current is not None and current.remaining is not None:
                timeout = min(timeout, current.remaining)
            await wait_event(event, timeout)

    async def aclose(self) -> None:
        """Close the pool if this backend opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wakeups.wake_all()
        if self._owns_pool:
            self._pool.close()
            try:
                async with timeout_after(10):
                    await self._pool.wait_closed()
            except BaseException:  # timed out or cancelled: close it the hard way
                self._pool.terminate()
                raise


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
