"""The contenders of :mod:`bench_redis`: aiolease, the raw floor and the peers, behind
one interface, and what the benchmark counts on the client and the server."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection

from aiolease import AsyncLock, open_backend
from aiolease.backends.redis._keys import Keys
from aiolease.backends.redis._resp import _Connection

PREFIX = "aiolease-bench:"
RUN = uuid.uuid4().hex[:8]
#: Hold time of each hand-off.
HOLD = 0.001
#: Connections a peer's pool may open.
POOL = 64
PEERS = ("redis-py", "python-redis-lock", "pottery", "aioredlock")
#: The Redis backend's transports, as its ``transport`` option names them.
TRANSPORTS = ("lean", "redis-py")
#: How each contender waits and renews, printed with the results.
HOW = {
    "floor": "SET NX PX + Lua compare-and-delete; waits on BLPOP of a signal list",
    "aiolease": "one Lua script per op; waits on pub/sub; renewals batched per backend",
    "aiolease-fair": "fair=1: FIFO queue, release hands over; the message wakes the head",
    "redis-py": "asyncio Lock (thread_local=False); polls every 0.1 s; no auto-renewal"
    " (a task per lock calls reacquire() every ttl/3)",
    "python-redis-lock": "sync, threads; BLPOP signal; auto_renewal thread per lock"
    " (every expire*2/3)",
    "pottery": "AIORedlock; polls after random 0-0.2 s; no auto-renewal (a task per"
    " lock calls extend() every ttl/3, num_extensions raised)",
    "aioredlock": "3 tries 0.1-0.3 s apart, then LockError (retried); watchdog task"
    " per lock every 0.6*ttl",
}

UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
UNLOCK_SIGNAL = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('RPUSH', KEYS[2], 1)
redis.call('PEXPIRE', KEYS[2], 1000)
return 1
"""
RENEW_ALL = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('PEXPIRE', key, ARGV[2]); n = n + 1 end
end
return n
"""


# -- counting ------------------------------------------------------------------------------


class Sends:
    """Round trips counted in this process: socket writes of redis-py's connections
    (sync and asyncio) and of aiolease's lean connections, and aioredis's commands."""

    count = 0

    @classmethod
    def install(cls) -> None:
        lean_send = _Connection.send

        def counted_lean(self: _Connection, payload: bytes, count: int) -> Any:
            cls.count += 1
            return lean_send(self, payload, count)

        _Connection.send = counted_lean  # type: ignore[method-assign]
        async_send = redis.asyncio.connection.AbstractConnection.send_packed_command
        sync_send: Any = redis.connection.AbstractConnection.send_packed_command

        async def counted_async(self: Any, *args: Any, **kwargs: Any) -> None:
            cls.count += 1
            await async_send(self, *args, **kwargs)

        def counted_sync(self: Any, *args: Any, **kwargs: Any) -> None:
            cls.count += 1
            sync_send(self, *args, **kwargs)

        async_class: Any = redis.asyncio.connection.AbstractConnection
        async_class.send_packed_command = counted_async
        sync_class: Any = redis.connection.AbstractConnection
        sync_class.send_packed_command = counted_sync
        try:
            import aioredis.connection
        except ImportError:
            return
        execute: Any = aioredis.connection.RedisConnection.execute

        def counted_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
            cls.count += 1
            return execute(self, *args, **kwargs)

        aioredis.connection.RedisConnection.execute = counted_execute


_STATS: dict[str, redis.Redis] = {}


def server_reads(url: str) -> int:
    """Requests (socket reads) the server has processed so far, less this asking: all
    clients, so run on a quiet server. A request of more than 16 KiB takes several."""
    if url not in _STATS:
        _STATS[url] = redis.Redis.from_url(url)
        _STATS[url].ping()
    return int(_STATS[url].info("stats")["total_reads_processed"])


@contextmanager
def spawned_server() -> Iterator[str]:
    """A private redis-server (no persistence) on a free port, for the run."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--spawn-server needs redis-server on PATH")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--dir", tmp, "--maxclients", "4000"]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            for _ in range(200):
                try:
                    redis.Redis.from_url(url).ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            yield url
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(10)


# -- the contenders ------------------------------------------------------------------------
#
# Each contender kind gives: ``cycle`` (uncontended acquire+release), ``once`` (a
# blocking acquire, hold, release), a holder for failover, and the key it keeps.


def key_of(kind: str, name: str) -> str:
    """The Redis key that contender ``kind`` keeps the lock ``name`` in."""
    if kind.startswith("aiolease"):
        return Keys.of(PREFIX, name).lease.decode()
    return {
        "floor": f"bench-floor:{name}",
        "redis-py": f"bench-redispy:{name}",
        "python-redis-lock": f"lock:{name}",
        "pottery": f"redlock:{name}",
        "aioredlock": f"bench-aioredlock:{name}",
    }[kind]


class Floor:
    """SET NX PX, Lua compare-and-delete; a signal list for push hand-offs."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self.unlock = client.register_script(UNLOCK)
        self.unlock_signal = client.register_script(UNLOCK_SIGNAL)

    async def cycle(self, key: str) -> None:
        token = uuid.uuid4().hex
        assert await self.client.set(key, token, nx=True, px=10_000)
        await self.unlock(keys=[key], args=[token])

    async def acquire(self, key: str, ttl: float) -> str:
        token = uuid.uuid4().hex
        while not await self.client.set(key, token, nx=True, px=int(ttl * 1000)):
            pttl = await self.client.pttl(key)
            await self.client.blpop([key + ":signal"], max(pttl, 1) / 1000 + 0.002)
        return token

    async def release(self, key: str, token: str) -> None:
        await self.unlock_signal(keys=[key, key + ":signal"], args=[token])


class Contender:
    """One library's way to take and give back a lock, driven as its users would."""

    def __init__(
        self, kind: str, url: str, stack: AsyncExitStack, *, transport: str = "auto"
    ) -> None:
        self.kind, self.url, self.stack = kind, url, stack
        #: aiolease's transport (see aiolease.backends.redis._transport).
        self.transport = transport

    async def start(self) -> None:
        kind, url, stack = self.kind, self.url, self.stack
        # A bounded pool that waits for a free connection, as a service holding 1,000
        # locks would configure it (redis-py 8's default pool raises past 100, and
        # opening one per lock at once starves the loop until the locks expire).
        pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=POOL)
        self.client = redis.asyncio.Redis(connection_pool=pool)
        stack.push_async_callback(pool.disconnect)
        stack.push_async_callback(self.client.aclose)
        if kind.startswith("aiolease"):
            fair = kind == "aiolease-fair"
            self.backend = await stack.enter_async_context(
                open_backend(url, prefix=PREFIX, fair=fair, transport=self.transport)
            )
        elif kind == "floor":
            self.floor = Floor(self.client)
        elif kind == "python-redis-lock":
            sync_pool = redis.BlockingConnectionPool.from_url(url, max_connections=POOL)
            self.sync = redis.Redis(connection_pool=sync_pool)
            stack.callback(sync_pool.disconnect)
            stack.callback(self.sync.close)
        elif kind == "aioredlock":
            from aioredlock import Aioredlock

            kwargs = self.client.connection_pool.connection_kwargs
            self.manager = Aioredlock([{"host": kwargs["host"], "port": kwargs["port"]}])
            stack.push_async_callback(self.manager.destroy)

    def key(self, name: str) -> str:
        return key_of(self.kind, name)

    async def acquire(self, name: str, ttl: float, blocking: bool = True) -> Any:
        """Acquire ``name`` (waiting, unless not ``blocking``): a handle for release."""
        kind = self.kind
        if kind.startswith("aiolease"):
            lock = AsyncLock(self.backend, name, ttl=ttl)
            return await (lock.acquire() if blocking else lock.acquire_nowait())
        if kind == "floor":
            if not blocking:
                token = uuid.uuid4().hex
                assert await self.client.set(self.key(name), token, nx=True, px=int(ttl * 1000))
                return token
            return await self.floor.acquire(self.key(name), ttl)
        if kind == "redis-py":
            rlock = self.client.lock(self.key(name), timeout=ttl, thread_local=False)
            assert await rlock.acquire(blocking=blocking)
            return rlock
        if kind == "python-redis-lock":
            import redis_lock

            plock = redis_lock.Lock(self.sync, name, expire=max(int(ttl), 1))
            if blocking:
                assert await asyncio.to_thread(plock.acquire)
            else:
                assert plock.acquire(blocking=False)  # sync: the loop waits, as intended
            return plock
        if kind == "pottery":
            from pottery import AIORedlock

            alock = AIORedlock(key=name, masters={self.client}, auto_release_time=ttl)
            assert await alock.acquire(blocking=blocking)
            return alock
        if kind == "aioredlock":
            from aioredlock import LockError

            while True:
                try:
                    return await self.manager.lock(self.key(name), lock_timeout=ttl)
                except LockError:
                    if not blocking:
                        raise
        raise ValueError(f"unknown contender {kind!r}")

    async def release(self, name: str, handle: Any) -> None:
        kind = self.kind
        if kind.startswith("aiolease"):
            await handle.release()
        elif kind == "floor":
            await self.floor.release(self.key(name), handle)
        elif kind == "python-redis-lock":
            handle.release()
        elif kind == "aioredlock":
            await self.manager.unlock(handle)
        else:
            await handle.release()

    async def once(self, name: str) -> None:
        """One blocking acquire, a 1 ms hold, a release (``async with`` for aiolease)."""
        if self.kind.startswith("aiolease"):
            async with AsyncLock(self.backend, name, ttl=10):
                await asyncio.sleep(HOLD)
            return
        handle = await self.acquire(name, 10)
        await asyncio.sleep(HOLD)
        await self.release(name, handle)
