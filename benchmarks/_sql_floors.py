"""The databases of ``bench_sql.py``: the raw lease-row and advisory floors of
PostgreSQL and MySQL/MariaDB (each on a table or connection of its own), the
benchmark's own PostgreSQL database, and tooz's coordinator for each."""

from __future__ import annotations

import asyncio
import uuid
import warnings
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from aiolease import open_backend
from aiolease.abc import Backend
from aiolease.backends._asyncio import timeout_after

TABLE = "aiolease_bench"
FLOOR_TABLE = "aiolease_bench_floor"
CHANNEL = "aiolease_bench_floor"
BENCH_DB = "aiolease_bench"
#: The ttl of hand-offs and uncontended cycles, and the floors' longest wait.
TTL = 10.0
#: The MySQL floor's poll (it has no push wake-up across processes).
MYSQL_POLL = 0.01


class Waker:
    """Wakes every waiting floor task (a new event per wake, so none is missed)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def fire(self, *_: object) -> None:
        self.event.set()
        self.event = asyncio.Event()


async def wait_event(event: asyncio.Event, timeout: float) -> None:
    """Not ``asyncio.wait_for``, which on Python 3.11 can swallow a cancel."""
    try:
        async with timeout_after(max(timeout, 0.0)):
            await event.wait()
    except asyncio.TimeoutError:
        pass


# -- the databases -------------------------------------------------------------------------


class Db:
    """One database: its floors, its server-side counter, and how others reach it."""

    name = ""
    poll = TTL

    def __init__(self, url: str) -> None:
        self.url = url
        self.waker = Waker()

    async def open(self, listen: bool = False) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def floor_acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """One statement: the token granted, or ``None``."""
        raise NotImplementedError

    async def floor_release(self, name: str, owner: str, token: int, notify: bool) -> bool:
        raise NotImplementedError

    async def floor_remaining(self, name: str, table: str = FLOOR_TABLE) -> float | None:
        """Seconds until the holder's row of ``table`` expires by the server's clock
        (``None``: free)."""
        raise NotImplementedError

    async def floor_renew_all(self, owner: str, ttl: float) -> int:
        """One statement renewing every live row of ``owner``; how many it renewed."""
        raise NotImplementedError

    async def floor_renew_names(self, names: list[str], ttl: float) -> int:
        """One statement renewing every live row of ``names`` (issue 18's floor: ``UPDATE
        ... WHERE name = ANY($1)``, no owner or token checked); how many it renewed."""
        raise NotImplementedError

    async def advisory(self) -> Advisory:
        raise NotImplementedError

    async def statements(self) -> int:
        """Statements the server ran so far (see the module docstring)."""
        raise NotImplementedError

    def aiolease_url(self) -> str:
        return f"{self.url}?table={TABLE}"

    def tooz_url(self) -> str:
        raise NotImplementedError

    async def floor_lock(self, name: str, owner: str, ttl: float) -> int:
        """Wait for ``name`` as the floor does: retry when woken, or at the expiry."""
        while True:
            event = self.waker.event
            token = await self.floor_acquire(name, owner, ttl)
            if token is not None:
                return token
            remaining = await self.floor_remaining(name)
            await wait_event(event, self.poll if remaining is None else min(remaining, self.poll))

    async def floor_unlock(self, name: str, owner: str, token: int) -> None:
        assert await self.floor_release(name, owner, token, notify=True)
        self.waker.fire()


class Advisory:
    """A session lock on a connection of its own (no ttl)."""

    async def try_lock(self, name: str) -> bool:
        raise NotImplementedError

    async def lock(self, name: str) -> None:
        raise NotImplementedError

    async def unlock(self, name: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


def _pg_key(name: str) -> int:
    return int.from_bytes(name.encode()[-8:].rjust(8, b"\0"), "big", signed=True)


class Postgres(Db):
    name = "PostgreSQL"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        t = f'"public"."{FLOOR_TABLE}"'
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {t} ("
            ' name text COLLATE "C" PRIMARY KEY, token bigint NOT NULL, owner text,'
            " identity text, metadata text, ttl float8, acquired_at timestamptz,"
            " expires_at timestamptz)"
        )
        self.acquire = (
            f"INSERT INTO {t} AS l (name, token, owner, ttl, acquired_at, expires_at)"
            " VALUES ($1, 1, $2, $3, clock_timestamp(),"
            " clock_timestamp() + make_interval(secs => $3))"
            " ON CONFLICT (name) DO UPDATE SET token = l.token + 1, owner = excluded.owner,"
            " ttl = excluded.ttl, acquired_at = excluded.acquired_at,"
            " expires_at = excluded.expires_at"
            " WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() RETURNING l.token"
        )
        where = "WHERE name = $1 AND owner = $2 AND token = $3"
        self.release = f"UPDATE {t} SET owner = NULL, expires_at = NULL {where}"
        self.release_notify = (
            f"WITH r AS (UPDATE {t} SET owner = NULL, expires_at = NULL {where}"
            f" RETURNING name) SELECT pg_notify('{CHANNEL}', name) IS NULL FROM r"
        )
        self.remaining = (
            "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8"
            ' FROM "public"."{table}" WHERE name = $1 AND owner IS NOT NULL'
        )
        self.renew_all = (
            f"UPDATE {t} SET expires_at = clock_timestamp() + make_interval(secs => $2)"
            " WHERE owner = $1 AND expires_at > clock_timestamp()"
        )
        self.renew_names = (
            f"UPDATE {t} SET expires_at = clock_timestamp() + make_interval(secs => $2)"
            " WHERE name = ANY($1) AND expires_at > clock_timestamp()"
        )
        self.pool: Any = None
        self.listener: Any = None

    async def open(self, listen: bool = False) -> None:
        import asyncpg

        self.pool = await asyncpg.create_pool(self.url, min_size=1, max_size=10, reset=_no_reset)
        await self.pool.execute(self.create)
        if listen:
            self.listener = await asyncpg.connect(self.url)
            await self.listener.add_listener(CHANNEL, self.waker.fire)

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()
        await self.pool.close()

    async def floor_acquire(self, name: str, owner: str, ttl: float) -> int | None:
        token = await self.pool.fetchval(self.acquire, name, owner, ttl)
        return None if token is None else int(token)

    async def floor_release(self, name: str, owner: str, token: int, notify: bool) -> bool:
        if notify:
            return bool(await self.pool.fetch(self.release_notify, name, owner, token))
        return bool(await self.pool.execute(self.release, name, owner, token) == "UPDATE 1")

    async def floor_remaining(self, name: str, table: str = FLOOR_TABLE) -> float | None:
        value = await self.pool.fetchval(self.remaining.format(table=table), name)
        return None if value is None else float(value)

    async def floor_renew_all(self, owner: str, ttl: float) -> int:
        status = await self.pool.execute(self.renew_all, owner, ttl)
        return int(status.split()[-1])

    async def floor_renew_names(self, names: list[str], ttl: float) -> int:
        status = await self.pool.execute(self.renew_names, names, ttl)
        return int(status.split()[-1])

    async def advisory(self) -> Advisory:
        import asyncpg

        return PgAdvisory(await asyncpg.connect(self.url))

    async def statements(self) -> int:
        # A statement of its own is a transaction of its own: the statistics snapshot
        # is fresh, and this reading adds 1 to the next (see ``held``).
        return int(
            await self.pool.fetchval(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database"
                " WHERE datname = current_database()"
            )
        )

    def tooz_url(self) -> str:
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(path="", query=f"dbname={parts.path[1:]}"))


async def _no_reset(_conn: Any) -> None:
    """The floor's pool, like aiolease's, skips asyncpg's reset round trip on release."""


class PgAdvisory(Advisory):
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def try_lock(self, name: str) -> bool:
        return bool(await self.conn.fetchval("SELECT pg_try_advisory_lock($1)", _pg_key(name)))

    async def lock(self, name: str) -> None:
        await self.conn.execute("SELECT pg_advisory_lock($1)", _pg_key(name))

    async def unlock(self, name: str) -> None:
        assert await self.conn.fetchval("SELECT pg_advisory_unlock($1)", _pg_key(name))

    async def close(self) -> None:
        await self.conn.close()


async def bench_database(url: str) -> str:
    """``url`` pointed at the benchmark's own database (created if missing)."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", BENCH_DB):
            try:
                await conn.execute(f'CREATE DATABASE "{BENCH_DB}"')
            except asyncpg.DuplicateDatabaseError:
                pass
    finally:
        await conn.close()
    return urlunsplit(urlsplit(url)._replace(path=f"/{BENCH_DB}"))


_MY_NOW = "UTC_TIMESTAMP(6)"
_MY_FREE = f"(owner IS NULL OR expires_at <= {_MY_NOW})"


class MySQL(Db):
    name = "MySQL/MariaDB"
    poll = MYSQL_POLL

    def __init__(self, url: str) -> None:
        super().__init__(url)
        t = f"`{FLOOR_TABLE}`"
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {t} ("
            " name VARBINARY(255) NOT NULL PRIMARY KEY, token BIGINT UNSIGNED NOT NULL,"
            " owner VARBINARY(255) NULL, identity VARBINARY(1024) NULL, metadata BLOB NULL,"
            " ttl DOUBLE NULL, acquired_at DATETIME(6) NULL, expires_at DATETIME(6) NULL"
            ") ENGINE=InnoDB"
        )
        expiry = f"{_MY_NOW} + INTERVAL %(us)s MICROSECOND"
        # The token is assigned first, from the untouched row; LAST_INSERT_ID carries it
        # (or 0: refused) back in the OK packet.
        self.acquire = (
            f"INSERT INTO {t} (name, token, owner, ttl, acquired_at, expires_at)"
            f" VALUES (%(name)s, LAST_INSERT_ID(1), %(owner)s, %(ttl)s, {_MY_NOW}, {expiry})"
            f" ON DUPLICATE KEY UPDATE token = IF({_MY_FREE}, LAST_INSERT_ID(token + 1),"
            " token + LAST_INSERT_ID(0)),"
            f" owner = IF({_MY_FREE}, %(owner)s, owner),"
            " ttl = IF(owner = %(owner)s, %(ttl)s, ttl),"
            f" expires_at = IF(owner = %(owner)s, {expiry}, expires_at)"
        )
        self.release = (
            f"UPDATE {t} SET owner = NULL, expires_at = NULL"
            " WHERE name = %(name)s AND owner = %(owner)s AND token = %(token)s"
        )
        self.remaining = (
            f"SELECT TIMESTAMPDIFF(MICROSECOND, {_MY_NOW}, expires_at) FROM `{{table}}`"
            " WHERE name = %(name)s AND owner IS NOT NULL"
        )
        self.renew_all = (
            f"UPDATE {t} SET expires_at = {expiry}"
            f" WHERE owner = %(owner)s AND expires_at > {_MY_NOW}"
        )
        self.renew_names = (
            f"UPDATE {t} SET expires_at = {expiry}"
            f" WHERE name IN ({{names}}) AND expires_at > {_MY_NOW}"
        )
        #: The names statement rendered (escaped) once per count of names: the list
        #: only grows, so each text is rendered once, as a careful raw client would.
        self._rendered: dict[int, str] = {}
        self.pool: Any = None

    def connect_args(self) -> dict[str, Any]:
        parts = urlsplit(self.url)
        return {
            "host": parts.hostname or "127.0.0.1",
            "port": parts.port or 3306,
            "user": parts.username or "root",
            "password": parts.password or "",
            "db": parts.path[1:],
            "autocommit": True,
        }

    async def open(self, listen: bool = False) -> None:
        import asyncmy

        self.pool = await asyncmy.create_pool(minsize=1, maxsize=10, **self.connect_args())
        await self._run("SET @@session.sql_notes = 0", {})  # no "table exists" notes
        await self._run(self.create, {})

    async def close(self) -> None:
        self.pool.close()
        await self.pool.wait_closed()

    async def _run(self, sql: str, params: Any, what: str = "rowcount") -> Any:
        async with self.pool.acquire() as conn, conn.cursor() as cur:
            count = await cur.execute(sql, params)
            if what == "rows":
                return await cur.fetchall()
            return cur.lastrowid if what == "id" else count

    async def floor_acquire(self, name: str, owner: str, ttl: float) -> int | None:
        params = {"name": name, "owner": owner, "ttl": ttl, "us": round(ttl * 1e6)}
        token = await self._run(self.acquire, params, "id")
        return int(token) or None

    async def floor_release(self, name: str, owner: str, token: int, notify: bool) -> bool:
        params = {"name": name, "owner": owner, "token": token}
        return bool(await self._run(self.release, params) == 1)

    async def floor_remaining(self, name: str, table: str = FLOOR_TABLE) -> float | None:
        rows = await self._run(self.remaining.format(table=table), {"name": name}, "rows")
        return None if not rows or rows[0][0] is None else float(rows[0][0]) / 1e6

    async def floor_renew_all(self, owner: str, ttl: float) -> int:
        params = {"owner": owner, "us": round(ttl * 1e6)}
        return int(await self._run(self.renew_all, params))

    async def floor_renew_names(self, names: list[str], ttl: float) -> int:
        count = len(names)
        if not count:
            return 0
        text = self._rendered.get(count)
        async with self.pool.acquire() as conn, conn.cursor() as cur:
            if text is None:
                self._rendered.clear()
                inner = ", ".join(["%s"] * count)
                sql = self.renew_names.replace("{names}", inner).replace("%(us)s", "%s")
                args = [round(ttl * 1e6), *names]  # the expiry's, then the names
                text = self._rendered[count] = cur.mogrify(sql, args)
            return int(await cur.execute(text))

    async def advisory(self) -> Advisory:
        import asyncmy

        return MyAdvisory(await asyncmy.connect(**self.connect_args()))

    async def statements(self) -> int:
        rows = await self._run(
            "SHOW GLOBAL STATUS WHERE Variable_name IN"
            " ('Com_select', 'Com_insert', 'Com_update', 'Com_delete')",
            {},
            "rows",
        )
        return sum(int(value) for _, value in rows)

    def tooz_url(self) -> str:
        return self.url


class MyAdvisory(Advisory):
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def _value(self, sql: str, *args: object) -> Any:
        async with self.conn.cursor() as cur:
            await cur.execute(sql, args)
            return (await cur.fetchone())[0]

    async def try_lock(self, name: str) -> bool:
        return bool(await self._value("SELECT GET_LOCK(%s, 0)", name))

    async def lock(self, name: str) -> None:
        assert await self._value("SELECT GET_LOCK(%s, 3600)", name) == 1

    async def unlock(self, name: str) -> None:
        assert await self._value("SELECT RELEASE_LOCK(%s)", name) == 1

    async def close(self) -> None:
        await self.conn.ensure_closed()


def make_db(kind: str, url: str) -> Db:
    return Postgres(url) if kind == "postgres" else MySQL(url)


def tooz_coordinator(db: Db) -> Any:
    from tooz import coordination

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tooz's PostgreSQL driver is deprecated
        coordinator = coordination.get_coordinator(db.tooz_url(), uuid.uuid4().hex.encode())
    coordinator.start()
    return coordinator


async def opened_backend(stack: AsyncExitStack, db: Db) -> Backend:
    """An aiolease backend on ``db``'s server, open until ``stack`` closes."""
    backend: Backend = await stack.enter_async_context(open_backend(db.aiolease_url()))
    return backend


def kind_of(db: Db) -> str:
    """``--db``'s name for ``db``: ``postgres`` or ``mysql``."""
    return "postgres" if isinstance(db, Postgres) else "mysql"
