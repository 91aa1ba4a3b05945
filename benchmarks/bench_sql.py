"""PostgreSQL and MySQL/MariaDB: aiolease against raw floors and tooz, in one run.

Floors, on the same table shape as aiolease's (a table of their own):

* **raw lease-row floor**: one ``INSERT .. ON CONFLICT .. DO UPDATE .. WHERE expired
  .. RETURNING`` (MySQL: ``INSERT .. ON DUPLICATE KEY UPDATE`` read through
  ``LAST_INSERT_ID``) to acquire, one conditional ``UPDATE`` to release, on an asyncpg
  (asyncmy) pool. Its waiters wake on ``NOTIFY`` (PostgreSQL) or an in-process event
  plus a 10 ms poll (MySQL), and at the holder's expiry.
* **raw advisory floor**: ``pg_try_advisory_lock`` / ``GET_LOCK`` on a connection of its
  own; it has no ttl and is shown for reference.

tooz's ``pgsql`` / ``mysql`` drivers (synchronous, a new connection per acquire) run
in threads. Prints, as in issue 5's table, with ratios and a PASS/MISS column:

* **uncontended acquire+release**: median per cycle (contenders take turns, one
  cycle each), as a ratio to the lease-row floor and to the advisory floor;
* **hand-offs**: 8 tasks in one process, then 4 processes, on one key, holding it
  1 ms: hand-offs per second, the hand-off gap (from the releaser's release
  returning to the next holder's acquire returning) p50/p95, fairness max/min;
* **crash failover, ttl 2 s**: the holder process is ``SIGKILL``ed; the time from the
  server-side expiry of its row (``expires_at``, mapped onto this host's monotonic
  clock) to a waiter's acquire, and from the kill;
* **N leases held** (default 1,000, ttl 3 s, renewed every second): statements per
  renew tick counted server-side (PostgreSQL: ``pg_stat_database`` transactions of
  the benchmark's own database, which lag by up to a second; MySQL: global ``Com_*``
  counters, server-wide: run on a quiet server), CPU seconds per second, leases lost.

Usage: ``python benchmarks/bench_sql.py [--db postgres|mysql|both] [--url URL]
[--quick] [--skip tooz]``. PostgreSQL runs in a database of its own
(``aiolease_bench``, created if missing) so that its counters are the benchmark's.
Quote ratios from one run; absolute times depend on the machine. Needs
``pip install aiolease[bench]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from _common import add_figure_arguments, hold_in_tasks, run_threads, verdict

from aiolease import AsyncLock, open_backend
from aiolease.abc import Backend
from aiolease.backends._sql import timeout_after

TABLE = "aiolease_bench"
FLOOR_TABLE = "aiolease_bench_floor"
CHANNEL = "aiolease_bench_floor"
BENCH_DB = "aiolease_bench"
RUN = uuid.uuid4().hex[:8]
#: Hold time of each hand-off, and the ttl of hand-offs and uncontended cycles.
HOLD = 0.001
TTL = 10.0
#: Seconds for the processes of a figure to start and connect (shorter with --quick).
START_DELAY = [3.0]
#: Seconds the held leases settle before counting (shorter with --quick). PostgreSQL
#: reports an idle connection's counts up to 10 s late (PGSTAT_IDLE_INTERVAL): the
#: acquisitions must be in before the first reading.
SETTLE = [11.0]
#: The MySQL floor's poll (it has no push wake-up across processes).
MYSQL_POLL = 0.01
TARGET_RATIO = 1.10
TARGET_GAP = 0.0005
TARGET_FAIRNESS = 1.5
TARGET_FAILOVER = 0.020
#: Server-side statements per renew tick allowed (1, plus the counters' lag).
TARGET_PER_TICK = 1.2
FIGURES = ("uncontended", "handoffs", "failover", "held")
DEFAULT_URLS = {
    "postgres": os.environ.get(
        "AIOLEASE_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
    ),
    "mysql": os.environ.get("AIOLEASE_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
}

Record = tuple[float, float]  # (acquire returned, release returned), time.monotonic()


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
    backend: Backend = await stack.enter_async_context(open_backend(db.aiolease_url()))
    return backend


def statistics_of(backend: Backend) -> Any:
    stats = getattr(backend, "statistics", None)
    return None if stats is None else stats()


# -- uncontended -----------------------------------------------------------------------------


async def uncontended(db: Db, cycles: int, skip: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Median seconds per acquire+release by contender, and the lease-row floor's median
    measured alongside it. The contenders take turns, one cycle each in a random order,
    so that a busy moment of the machine (or of the server's disk: every grant and
    release is a commit) hits them all alike.

    tooz takes its turns with the floor in a second round of its own: each of its
    cycles opens a connection, so the server forks a process and tears it down, and
    that load spills into whatever cycle comes next (measured: +400 us on the next
    cycle of any contender). Its ratio is to the floor of its own round."""
    cycle: dict[str, Callable[[], Awaitable[object]]] = {}
    async with AsyncExitStack() as stack:
        await db.open()
        stack.push_async_callback(db.close)

        def floor(key: str, notify: bool) -> Callable[[], Awaitable[object]]:
            async def floor_cycle() -> None:
                owner = uuid.uuid4().hex
                token = await db.floor_acquire(key, owner, TTL)
                assert token is not None
                assert await db.floor_release(key, owner, token, notify)

            return floor_cycle

        cycle["raw lease-row floor"] = floor(f"uncontended-floor-{RUN}", False)
        if isinstance(db, Postgres):
            notify = floor(f"uncontended-notify-{RUN}", True)
            cycle["raw lease-row floor, NOTIFY on release"] = notify
        advisory = await db.advisory()
        stack.push_async_callback(advisory.close)

        async def advisory_cycle() -> None:
            assert await advisory.try_lock(f"uncontended-{RUN}")
            await advisory.unlock(f"uncontended-{RUN}")

        cycle["raw advisory floor (no ttl)"] = advisory_cycle
        backend = await opened_backend(stack, db)
        lock = AsyncLock(backend, f"uncontended-{RUN}", ttl=TTL)
        other = AsyncLock(backend, f"uncontended-with-{RUN}", ttl=TTL)

        async def nowait() -> None:
            lease = await lock.acquire_nowait()
            await lease.release()

        async def block() -> None:
            async with other:
                pass

        cycle["aiolease acquire_nowait+release"] = nowait
        cycle["aiolease async with"] = block
        found = await take_turns(cycle, cycles)
        floor_median = found["raw lease-row floor"]
        times = {label: (median, floor_median) for label, median in found.items()}
        if "tooz" not in skip:
            coordinator = tooz_coordinator(db)
            stack.callback(coordinator.stop)
            tooz_lock = coordinator.get_lock(f"uncontended-{RUN}".encode())

            async def tooz_cycle() -> None:  # blocking calls: the loop waits, as intended
                assert tooz_lock.acquire(blocking=False)
                tooz_lock.release()

            label = "tooz (new connection per acquire)"
            own = await take_turns(
                {"raw lease-row floor": cycle["raw lease-row floor"], label: tooz_cycle},
                max(cycles // 5, 20),
            )
            times[label] = (own[label], own["raw lease-row floor"])
    return times


async def take_turns(
    cycle: Mapping[str, Callable[[], Awaitable[object]]], cycles: int
) -> dict[str, float]:
    """Median seconds of each contender of ``cycle``, taking turns in a random order."""
    found: dict[str, list[float]] = {label: [] for label in cycle}
    for _ in range(min(cycles // 10, 50)):
        for one in cycle.values():
            await one()
    order = list(cycle.items())
    for _ in range(cycles):
        random.shuffle(order)  # no contender always follows the same one
        for label, one in order:
            start = time.perf_counter()
            await one()
            found[label].append(time.perf_counter() - start)
    return {label: statistics.median(samples) for label, samples in found.items()}


# -- hand-offs -------------------------------------------------------------------------------


async def run_tasks(
    make: Callable[[int], Callable[[], Awaitable[float]]],
    tasks: int,
    seconds: float,
    start_at: float | None = None,
) -> list[list[Record]]:
    """Run ``tasks`` loops of ``make(i)()`` (acquire, hold, release; returns when the
    acquire returned) for ``seconds`` from ``start_at``: each task's records."""
    records: list[list[Record]] = [[] for _ in range(tasks)]
    if start_at is not None:  # set up by then: connecting is not measured
        await asyncio.sleep(max(start_at - time.monotonic(), 0))
    end = time.monotonic() + seconds

    async def loop(i: int) -> None:
        once = make(i)
        while time.monotonic() < end:
            acquired = await once()
            records[i].append((acquired, time.monotonic()))

    runners = [asyncio.ensure_future(loop(i)) for i in range(tasks)]
    await asyncio.sleep(seconds)
    # A waiter is cancelled; the loop's check also ends one whose cancellation
    # asyncio.wait_for swallowed (it can, on Python 3.11, when its event fires).
    for runner in runners:
        runner.cancel()
    await asyncio.gather(*runners, return_exceptions=True)
    return records


async def handoffs(
    kind: str, db: Db, name: str, tasks: int, seconds: float, start_at: float | None = None
) -> list[list[Record]]:
    """Records per task of ``tasks`` tasks of contender ``kind`` on ``name``."""
    async with AsyncExitStack() as stack:
        if kind == "aiolease":
            lock = AsyncLock(await opened_backend(stack, db), name, ttl=TTL)

            def aiolease_once(i: int) -> Callable[[], Awaitable[float]]:
                async def once() -> float:
                    async with lock:
                        acquired = time.monotonic()
                        await asyncio.sleep(HOLD)
                    return acquired

                return once

            return await run_tasks(aiolease_once, tasks, seconds, start_at)
        if kind == "floor":
            await db.open(listen=True)
            stack.push_async_callback(db.close)

            def floor_once(i: int) -> Callable[[], Awaitable[float]]:
                async def once() -> float:
                    owner = uuid.uuid4().hex
                    token = await db.floor_lock(name, owner, TTL)
                    acquired = time.monotonic()
                    await asyncio.sleep(HOLD)
                    await db.floor_unlock(name, owner, token)
                    return acquired

                return once

            return await run_tasks(floor_once, tasks, seconds, start_at)
        if kind == "advisory":
            advisories = [await db.advisory() for _ in range(tasks)]
            for one in advisories:
                stack.push_async_callback(one.close)

            def advisory_once(i: int) -> Callable[[], Awaitable[float]]:
                async def once() -> float:
                    await advisories[i].lock(name)
                    acquired = time.monotonic()
                    await asyncio.sleep(HOLD)
                    await advisories[i].unlock(name)
                    return acquired

                return once

            return await run_tasks(advisory_once, tasks, seconds, start_at)
        if kind == "tooz":
            return await tooz_handoffs(db, name, tasks, seconds)
    raise ValueError(f"unknown contender {kind!r}")


async def tooz_handoffs(db: Db, name: str, threads: int, seconds: float) -> list[list[Record]]:
    """tooz is synchronous: one thread per contender, one coordinator each."""
    records: list[list[Record]] = [[] for _ in range(threads)]
    stop = threading.Event()

    def run(i: int) -> None:
        coordinator = tooz_coordinator(db)
        try:
            while not stop.is_set():
                lock = coordinator.get_lock(name.encode())
                assert lock.acquire(blocking=True)
                acquired = time.monotonic()
                time.sleep(HOLD)
                lock.release()
                records[i].append((acquired, time.monotonic()))
        finally:
            coordinator.stop()

    await run_threads(run, threads, stop, seconds)
    return records


async def handoffs_across_processes(
    kind: str, db: Db, processes: int, seconds: float
) -> list[list[Record]]:
    """Records per process, ``processes`` processes of one task each."""
    name = f"procs-{kind}-{uuid.uuid4().hex[:6]}"
    start_at = time.monotonic() + START_DELAY[0]  # every process connected by then
    command = [sys.executable, __file__, "--url", db.url, "--db", _kind(db)]
    command += ["--worker", kind, "--name", name]
    command += ["--start-at", repr(start_at), "--seconds", repr(seconds)]
    children = [
        await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
        for _ in range(processes)
    ]
    outputs = [await child.communicate() for child in children]
    return [[(a, r) for a, r in json.loads(out.strip().splitlines()[-1])] for out, _ in outputs]


def _kind(db: Db) -> str:
    return "postgres" if isinstance(db, Postgres) else "mysql"


async def worker(kind: str, db: Db, name: str, start_at: float, seconds: float) -> None:
    """One process of :func:`handoffs_across_processes`: prints its records."""
    (records,) = await handoffs(kind, db, name, 1, seconds, start_at)
    print(json.dumps(records), flush=True)


def gaps(records: Sequence[Sequence[Record]]) -> list[float]:
    """Hand-off gaps: each acquire's return minus the previous holder's release return."""
    ordered = sorted(record for task in records for record in task)
    return [b[0] - a[1] for a, b in zip(ordered, ordered[1:], strict=False)]


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(share * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def fairness(records: Sequence[Sequence[Record]]) -> float:
    counts = [len(task) for task in records]
    return max(counts) / max(min(counts), 1)


# -- crash failover --------------------------------------------------------------------------


async def hold_forever(kind: str, db: Db, name: str, ttl: float) -> None:
    """The holder process of a failover: acquire, say so, and wait to be killed."""
    async with AsyncExitStack() as stack:
        if kind == "aiolease":
            lock = AsyncLock(await opened_backend(stack, db), name, ttl=ttl)
            await stack.enter_async_context(lock)
        elif kind == "floor":
            await db.open()
            await db.floor_acquire(name, uuid.uuid4().hex, ttl)
        elif kind == "advisory":
            advisory = await db.advisory()  # kept: its connection holds the lock
            assert await advisory.try_lock(name)
        else:
            coordinator = tooz_coordinator(db)
            lock = coordinator.get_lock(name.encode())
            assert lock.acquire(blocking=False)
        print("held", flush=True)
        await asyncio.sleep(3600)


async def expiry_at(db: Db, name: str, table: str) -> float | None:
    """When the killed holder's row expires by the server's clock, on this host's
    ``time.monotonic()`` (the best of a few reads: the one with the shortest round
    trip); ``None`` if it holds no row (session locks)."""
    best: tuple[float, float] | None = None
    for _ in range(5):
        sent = time.monotonic()
        remaining = await db.floor_remaining(name, table)
        answered = time.monotonic()
        if remaining is None:
            return None
        if best is None or answered - sent < best[0]:
            best = (answered - sent, (sent + answered) / 2 + remaining)
    assert best is not None
    return best[1]


async def failover(kind: str, db: Db, ttl: float) -> tuple[float | None, float]:
    """One crash failover: (seconds from the server-side expiry of the holder's row to
    the waiter's acquire, or ``None`` for session locks; seconds from the kill)."""
    name = f"failover-{kind}-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, __file__, "--url", db.url, "--db", _kind(db)]
    command += ["--worker", f"hold-{kind}", "--name", name, "--ttl", repr(ttl)]
    holder = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
    assert holder.stdout is not None
    assert (await holder.stdout.readline()).strip() == b"held"
    async with AsyncExitStack() as stack:
        acquired = asyncio.ensure_future(wait_and_acquire(kind, db, name, ttl, stack))
        await asyncio.sleep(0.3)  # the waiter is waiting
        killed = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
        expiry = None
        if kind in ("aiolease", "floor"):
            # The row as the killed holder left it (aiolease's and the floor's rows
            # have the same shape; read through the floor's pool).
            probe = make_db(_kind(db), db.url)
            await probe.open()
            expiry = await expiry_at(probe, name, TABLE if kind == "aiolease" else FLOOR_TABLE)
            await probe.close()
        got = await acquired
    return (None if expiry is None else got - expiry), got - killed


async def wait_and_acquire(
    kind: str, db: Db, name: str, ttl: float, stack: AsyncExitStack
) -> float:
    """Wait for ``name`` as contender ``kind``; ``time.monotonic()`` once it is ours."""
    if kind == "aiolease":
        lease = await AsyncLock(await opened_backend(stack, db), name, ttl=ttl).acquire()
        got = time.monotonic()
        await lease.release()
        return got
    if kind == "floor":
        waiter = make_db(_kind(db), db.url)
        await waiter.open(listen=True)
        stack.push_async_callback(waiter.close)
        owner = uuid.uuid4().hex
        token = await waiter.floor_lock(name, owner, ttl)
        got = time.monotonic()
        await waiter.floor_unlock(name, owner, token)
        return got
    if kind == "advisory":
        advisory = await db.advisory()
        stack.push_async_callback(advisory.close)
        await advisory.lock(name)
        got = time.monotonic()
        await advisory.unlock(name)
        return got

    def blocking() -> float:
        coordinator = tooz_coordinator(db)
        try:
            lock = coordinator.get_lock(name.encode())
            assert lock.acquire(blocking=True)
            got = time.monotonic()
            lock.release()
            return got
        finally:
            coordinator.stop()

    return await asyncio.to_thread(blocking)


# -- many leases held ------------------------------------------------------------------------


async def held(
    kind: str, db: Db, count: int, seconds: float
) -> tuple[float, float | None, float, int]:
    """Hold ``count`` leases (ttl 3 s, renewed every second) for ``seconds``: (server
    statements per renew tick, renew statements per tick as the backend counted
    them, CPU seconds per second, leases lost)."""
    ttl = 3.0
    tick = ttl / 3
    counter = make_db(_kind(db), db.url)
    await counter.open()
    renewals: Callable[[], int | None] = lambda: None  # noqa: E731
    try:
        async with AsyncExitStack() as stack:
            check: Callable[[], int]
            if kind == "floor":
                await db.open()
                stack.push_async_callback(db.close)
                owner = uuid.uuid4().hex
                for i in range(count):
                    assert await db.floor_acquire(f"held-{RUN}-{i}", owner, ttl) is not None
                lost = [0]

                async def keepalive() -> None:
                    while True:
                        await asyncio.sleep(tick)
                        lost[0] = max(lost[0], count - await db.floor_renew_all(owner, ttl))

                task = asyncio.ensure_future(keepalive())
                stack.callback(task.cancel)
                check = lambda: lost[0]  # noqa: E731
            else:  # each held in a task of its own, as an application would
                backend = await opened_backend(stack, db)
                names = [f"held-{RUN}-{i}" for i in range(count)]
                leases = await hold_in_tasks(backend, names, ttl, stack)
                check = lambda: sum(lease.lost is not None for lease in leases)  # noqa: E731
                if statistics_of(backend) is not None:
                    renewals = lambda: statistics_of(backend).renew_statements  # noqa: E731
            await asyncio.sleep(SETTLE[0])  # settle: every renewal loop is running
            before = await counter.statements()
            renewed, cpu, wall = renewals(), time.process_time(), time.monotonic()
            await asyncio.sleep(seconds)
            after, after_renewed = await counter.statements(), renewals()
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            lost_now = check()
    finally:
        await counter.close()
    ticks = wall / tick
    if isinstance(db, Postgres):
        after -= 1  # the first reading's own transaction
    per_tick = (
        None if renewed is None or after_renewed is None else (after_renewed - renewed) / ticks
    )
    return (after - before) / ticks, per_tick, cpu / wall, lost_now


# -- the run -----------------------------------------------------------------------------------


async def print_uncontended(db: Db, args: argparse.Namespace) -> None:
    times = await uncontended(db, args.cycles, args.skip)
    advisory = times["raw advisory floor (no ttl)"][0]
    head = f"{'uncontended acquire+release':<40} {'median':>9} {'x floor':>8} {'x advis.':>8}"
    print(f"{head}  target <= {TARGET_RATIO:.2f} x floor")
    for label, (seconds, floor) in times.items():
        ratio = seconds / floor
        ok = ratio <= TARGET_RATIO if label.startswith("aiolease") else None
        print(
            f"  {label:<38} {seconds * 1e6:>6.0f} us {ratio:>8.2f} {seconds / advisory:>8.2f}"
            f"  {verdict(ok)}"
        )


async def print_handoffs(db: Db, args: argparse.Namespace, kinds: Sequence[str]) -> None:
    table = f"{'per s':>7} {'gap p50':>9} {'gap p95':>9} {'max/min':>8}"
    for title, across in (("8 tasks", False), ("4 processes", True)):
        print(f"\n{'hand-offs, ' + title + ', one key, 1 ms':<40} {table}  target p50 <= 0.5 ms,")
        print(f"{'':<40} {'':>37}  max/min <= {TARGET_FAIRNESS}")
        for contender in kinds:
            if across and contender == "tooz":
                continue
            if across:
                records = await handoffs_across_processes(contender, db, 4, args.seconds)
            else:
                name = f"handoff-{contender}-{RUN}"
                records = await handoffs(contender, db, name, 8, args.seconds)
            found, fair = gaps(records), fairness(records)
            p50 = percentile(found, 0.5)
            ok = p50 <= TARGET_GAP and fair <= TARGET_FAIRNESS if contender == "aiolease" else None
            print(
                f"  {contender:<38} {(len(found) + 1) / args.seconds:>7.0f}"
                f" {p50 * 1e3:>6.2f} ms {percentile(found, 0.95) * 1e3:>6.2f} ms"
                f" {fair:>8.2f}  {verdict(ok)}"
            )


async def print_failover(db: Db, args: argparse.Namespace, kinds: Sequence[str]) -> None:
    print(
        f"\n{'crash failover, ttl 2 s':<40} {'expiry->acquire':>16} {'kill->acquire':>14}"
        f"  target <= {TARGET_FAILOVER * 1e3:.0f} ms"
    )
    for contender in kinds:
        runs = [await failover(contender, db, 2.0) for _ in range(args.failovers)]
        total = statistics.median(r[1] for r in runs)
        after = [r[0] for r in runs if r[0] is not None]
        gap = f"{statistics.median(after) * 1e3:>13.1f} ms" if after else f"{'n/a (no ttl)':>16}"
        ok = statistics.median(after) <= TARGET_FAILOVER if contender == "aiolease" else None
        print(f"  {contender:<38} {gap} {total:>12.3f} s  {verdict(ok)}")


async def print_held(db: Db, args: argparse.Namespace) -> None:
    head = f"{args.held} leases held, ttl 3 s, tick 1 s"
    print(
        f"\n{head:<40} {'stmt/tick':>9} {'renew/tick':>10} {'CPU s/s':>8} {'lost':>5}"
        "  target 1 stmt/tick, 0 lost"
    )
    for contender in ("floor", "aiolease"):
        per_tick, renews, cpu, lost = await held(contender, db, args.held, args.held_seconds)
        ok = per_tick <= TARGET_PER_TICK and lost == 0 if contender == "aiolease" else None
        renew_text = "" if renews is None else f"{renews:.2f}"
        figures = f"{per_tick:>9.2f} {renew_text:>10} {cpu:>8.3f} {lost:>5}"
        print(f"  {contender:<38} {figures}  {verdict(ok)}")
    print("  (tooz: n/a, a session lock holds a connection each; no ttl to renew)")
    if SETTLE[0] < 11 and isinstance(db, Postgres):
        print("  (--quick: PostgreSQL's counts of the acquisitions may still arrive in the window)")


async def main_for(kind: str, url: str, args: argparse.Namespace) -> None:
    if kind == "postgres":
        url = await bench_database(url)
    db = make_db(kind, url)
    skip = args.skip
    print(f"\n== {db.name}: {url} (ratios from this run only)\n")
    kinds = ["floor", "advisory", "aiolease"] + ([] if "tooz" in skip else ["tooz"])
    if "uncontended" not in skip:
        await print_uncontended(db, args)
    if "handoffs" not in skip:
        await print_handoffs(db, args, kinds)
    if "failover" not in skip:
        await print_failover(db, args, kinds)
    if "held" not in skip:
        await print_held(db, args)


async def main(args: argparse.Namespace) -> None:
    kinds = ["postgres", "mysql"] if args.db == "both" else [args.db]
    if args.url is not None and len(kinds) > 1:
        raise SystemExit("--url names one database: give --db postgres or --db mysql too")
    for kind in kinds:
        await main_for(kind, args.url or DEFAULT_URLS[kind], args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=["postgres", "mysql", "both"], default="both")
    parser.add_argument("--url", help="the database (default: the test servers')")
    add_figure_arguments(parser)
    parser.add_argument(
        "--skip", action="append", default=[], choices=["tooz", *FIGURES], help="repeatable"
    )
    parser.add_argument("--quick", action="store_true", help="fewer cycles, shorter figures")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--ttl", type=float, default=2.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker_db = make_db(args.db, args.url)
        if args.worker.startswith("hold-"):
            kind = args.worker.removeprefix("hold-")
            asyncio.run(hold_forever(kind, worker_db, args.name, args.ttl))
        else:
            asyncio.run(worker(args.worker, worker_db, args.name, args.start_at, args.seconds))
    else:
        if args.quick:
            args.cycles, args.seconds, args.failovers = 100, 0.5, 1
            args.held, args.held_seconds = 200, 2.0
            START_DELAY[0], SETTLE[0] = 1.5, 1.0
        asyncio.run(main(args))
