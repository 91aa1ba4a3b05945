"""A storm of cancelled acquires leaves nothing held (guarantee 6), on every backend
with a real server, plain and fair, under asyncio and trio.

One task takes and releases a name in a loop (holds of 0-20 ms) while many others
each enter ``async with lock:`` under a random timeout of 0-50 ms, a few at a time.
Most of them are cancelled while they are refused, queued, or being handed the name.
Afterwards nobody may hold the name (a fresh backend reads it free and takes it at
once), and no live queue entry may be left: every contender has stopped, so any
entry left would be a cancelled owner's, which a later release could hand the name
to. The queues are read behind the backends' back.

The same storm runs on a read-write lock on every backend that serves permits:
readers and writers cancelled at random points leave no live permit and no live
queue entry (``read_permits`` answers ``None``).
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import anyio
import pytest
import redis

import aiolease
from aiolease import AsyncLock, AsyncReadWriteLock
from aiolease.abc import Backend
from aiolease.backends.redis._keys import Keys
from tests.backends.etcd.support import Gateway, unique_prefix
from tests.backends.mongo.support import raw as mongo_raw
from tests.backends.mysql.support import raw as my_raw
from tests.backends.postgres.support import no_tls
from tests.backends.postgres.support import raw as pg_raw
from tests.backends.redis.support import delete_under, new_prefix
from tests.backends.zookeeper.support import Outside
from tests.backends.zookeeper.support import unique_prefix as zk_prefix
from tests.support import unique, with_query

pytestmark = pytest.mark.anyio

#: The storm: this many contenders, at most ``AT_ONCE`` of them asking at a time, each
#: giving up after a random 0-``PATIENCE`` seconds; the lease's ttl.
CONTENDERS = 300
AT_ONCE = 10
PATIENCE = 0.05
TTL = 5.0

#: The live queue entries of a name (owner ids), read behind the backend's back.
Entries = Callable[[str], Awaitable[list[str]]]


async def no_queue(name: str) -> list[str]:
    """A backend without a queue has no entries."""
    await anyio.lowlevel.checkpoint()
    return []


@dataclass
class Target:
    """A backend to storm: how to open it, and how to read its queue."""

    url: str
    entries: Entries = no_queue
    #: Whether another backend object sees the same leases (not so in memory).
    shared: bool = True


def postgres(request: pytest.FixtureRequest, url: str) -> Target:
    schema = request.getfixturevalue("pg_schema")
    table = unique("storm")
    url = no_tls(url)

    async def entries(name: str) -> list[str]:
        rows = await pg_raw(
            url,
            f'SELECT owner FROM "{schema}"."{table}_waiters"'
            " WHERE name = $1 AND expires_at > clock_timestamp()",
            name,
        )
        return [row["owner"] for row in rows]

    return Target(with_query(url, schema=schema, table=table), entries)


def mysql(request: pytest.FixtureRequest, url: str) -> Target:
    database = request.getfixturevalue("my_database")
    table = unique("storm")

    async def entries(name: str) -> list[str]:
        rows = await my_raw(
            url,
            f"SELECT owner FROM `{database}`.`{table}_waiters`"
            " WHERE name = %s AND expires_at > UTC_TIMESTAMP(6)",
            name.encode(),
        )
        return [bytes(row[0]).decode() for row in rows]

    in_database = urlunsplit(urlsplit(url)._replace(path=f"/{database}"))
    return Target(with_query(in_database, table=table), entries)


def redis_target(request: pytest.FixtureRequest, url: str, fair: bool) -> Target:
    prefix = new_prefix("storm")
    request.addfinalizer(lambda: delete_under(prefix, [redis.Redis.from_url(url)]))

    def live(name: str) -> list[str]:
        keys = Keys.of(prefix, name)
        with redis.Redis.from_url(url) as client:
            seconds, micros = client.time()
            now_ms = seconds * 1000 + micros // 1000
            queued = {owner.decode() for owner in client.zrange(keys.queue, 0, -1)}
            waiters = client.hgetall(keys.waiters)
        return sorted(
            owner.decode()
            for owner, raw in waiters.items()
            if owner.decode() in queued and json.loads(raw)["e"] > now_ms
        )

    async def entries(name: str) -> list[str]:
        return await anyio.to_thread.run_sync(live, name)

    return Target(with_query(url, prefix=prefix, fair=int(fair)), entries)


def etcd_target(url: str, fair: bool) -> Target:
    prefix = unique_prefix()
    gateway = Gateway(url)

    async def entries(name: str) -> list[str]:
        # Every contender has stopped and the holder released: no key of the name
        # (an attempt's, queued or holding) may be left.
        return [kv["key"] for kv in await gateway.keys(f"{prefix}{name}/")]

    return Target(with_query(url, prefix=prefix, fair=int(fair)), entries)


def mongo_target(request: pytest.FixtureRequest, url: str, fair: bool) -> Target:
    collection = unique("storm")

    def drop() -> None:
        with mongo_raw(url) as client:
            client.aiolease.drop_collection(collection)

    request.addfinalizer(drop)

    def live(name: str) -> list[str]:
        # The queue entries of the lease document that are live on the server's clock.
        with mongo_raw(url) as client:
            found = client.aiolease[collection].aggregate(
                [
                    {"$match": {"_id": name}},
                    {"$unwind": "$queue"},
                    {"$match": {"$expr": {"$gt": ["$queue.expires", "$$NOW"]}}},
                    {"$project": {"owner": "$queue.owner"}},
                ]
            )
            return [str(doc["owner"]) for doc in found]

    async def entries(name: str) -> list[str]:
        return await anyio.to_thread.run_sync(live, name)

    return Target(with_query(url, collection=collection, fair=int(fair)), entries)


def zookeeper_target(url: str) -> Target:
    prefix = zk_prefix()

    async def entries(name: str) -> list[str]:
        # Every contender has stopped and the holder released: no contender node of
        # the name (queued or holding) may be left.
        async with Outside(url) as outside:
            return await outside.tree(f"/{prefix}")

    return Target(with_query(url, prefix=prefix), entries)


KINDS = [
    "memory",
    "sqlite",
    "postgres",
    "mysql",
    "redis",
    "redis-fair",
    "etcd",
    "etcd-fair",
    "mongo",
    "mongo-fair",
    "zookeeper",
]


@pytest.fixture(params=KINDS)
def target(
    request: pytest.FixtureRequest,
    aiolease_server: Callable[[str], str],
    tmp_path: Path,
) -> Target:
    return make_target(str(request.param), request, aiolease_server, tmp_path)


def make_target(
    kind: str,
    request: pytest.FixtureRequest,
    aiolease_server: Callable[[str], str],
    tmp_path: Path,
) -> Target:
    """The target of ``kind`` (one of :data:`KINDS`), on its test server."""
    if kind == "memory":
        return Target("memory://", shared=False)
    if kind == "sqlite":
        return Target(f"sqlite:///{tmp_path / 'leases.db'}")
    if kind == "postgres":
        return postgres(request, aiolease_server("postgres"))
    if kind == "mysql":
        return mysql(request, aiolease_server("mariadb"))
    if kind.startswith("mongo"):
        return mongo_target(request, aiolease_server("mongo"), fair=kind.endswith("fair"))
    if kind.startswith("redis"):
        return redis_target(request, aiolease_server("redis"), fair=kind.endswith("fair"))
    if kind == "zookeeper":
        return zookeeper_target(aiolease_server("zookeeper"))
    return etcd_target(aiolease_server("etcd"), fair=kind.endswith("fair"))


async def storm(
    enter: Callable[[bool], AbstractAsyncContextManager[object]], writes: float
) -> None:
    """The holder's loop against ``CONTENDERS`` impatient ``async with enter(write):``,
    a ``writes`` share of them writers (the holder alternates, unless all write): a
    writer is never inside with anyone, so with ``writes=1`` never two at once."""
    readers = writers = 0
    done = anyio.Event()
    at_once = anyio.Semaphore(AT_ONCE)

    async def inside(write: bool, seconds: float) -> None:
        nonlocal readers, writers
        if write:
            writers += 1
        else:
            readers += 1
        try:
            assert writers <= 1 and not (writers and readers), (
                f"{writers} writers, {readers} readers"
            )
            await anyio.sleep(seconds)
        finally:
            if write:
                writers -= 1
            else:
                readers -= 1

    async def holder() -> None:
        write = True
        while not done.is_set():
            async with enter(write):
                await inside(write, random.uniform(0, 0.02))
            write = writes >= 1 or not write

    async def contender() -> None:
        write = random.random() < writes
        async with at_once:
            with anyio.move_on_after(random.uniform(0, PATIENCE)):
                async with enter(write):
                    await inside(write, 0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        async with anyio.create_task_group() as contenders:
            for _ in range(CONTENDERS):
                contenders.start_soon(contender)
        done.set()


@asynccontextmanager
async def checker(target: Target, backend: Backend) -> AsyncIterator[Backend]:
    """A fresh backend on the same server (the storm's own, where nothing else sees it)."""
    if not target.shared:
        yield backend
        return
    async with aiolease.open_backend(target.url) as fresh:
        yield fresh


async def test_a_storm_of_cancelled_acquires_leaves_nothing_held(target: Target) -> None:
    name = unique("storm")
    async with aiolease.open_backend(target.url) as backend:
        with anyio.fail_after(90):  # a hang guard: the storm takes a few seconds
            lock = AsyncLock(backend, name, ttl=TTL)
            await storm(lambda _write: lock, writes=1.0)
        # Looked at while the storm's backend is still open: closing it could clear
        # what a leak left (an etcd session's keys).
        async with checker(target, backend) as fresh:
            assert await fresh.read(name) is None
            assert await target.entries(name) == []
            lease = await AsyncLock(fresh, name, ttl=TTL).acquire_nowait()
            assert await lease.release()


# -- permits: a read-write lock under the same storm ----------------------------------------

#: The backends that serve permits (Capability.SEMAPHORE); their targets as above.
PERMIT_KINDS = ["memory", "sqlite", "postgres", "mysql", "redis", "etcd", "mongo", "zookeeper"]


@pytest.fixture
def permit_target(
    request: pytest.FixtureRequest, aiolease_server: Callable[[str], str], tmp_path: Path
) -> Target:
    return make_target(str(request.param), request, aiolease_server, tmp_path)


@pytest.mark.parametrize("permit_target", PERMIT_KINDS, indirect=True)
async def test_a_storm_of_cancelled_permit_acquires_leaves_nothing_held(
    permit_target: Target,
) -> None:
    """The read-write lock's readers and writers, cancelled while refused, queued or being
    granted: afterwards the name has no live permit and no live queue entry (a writer,
    which needs the whole limit, is granted at once)."""
    name = unique("storm")
    async with aiolease.open_backend(permit_target.url) as backend:
        with anyio.fail_after(90):  # a hang guard: the storm takes a few seconds
            rw = AsyncReadWriteLock(backend, name, ttl=TTL)
            await storm(lambda write: rw.write() if write else rw.read(), writes=0.3)
        async with checker(permit_target, backend) as fresh:
            assert await fresh.read_permits(name) is None
            lease = await AsyncReadWriteLock(fresh, name, ttl=TTL).write().acquire_nowait()
            assert await lease.release()
