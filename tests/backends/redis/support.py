"""What the Redis and Redlock tests share: key prefixes of their own, deleted afterwards,
a look at the server's keys and connections, and ways to see what a backend does."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest
import redis

from aiolease import AsyncLock
from aiolease._bridge import running_trio
from aiolease.abc import Backend, Capability, Grant, HolderInfo
from aiolease.backends.redis import RedisBackend
from tests import support

__all__ = [
    "Opener",
    "Tap",
    "asyncio_loop",
    "asyncio_only",
    "connections",
    "delete_under",
    "in_database",
    "inner",
    "new_name",
    "new_prefix",
    "noting_waits",
    "prefix_fixture",
    "requests",
    "subscribe",
    "sync_client",
    "take_once",
]

#: Runs a test under asyncio only (for what the trio bridge keeps out of reach).
asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])

#: Opens a backend with the given options (the ``open_redis`` and ``open_redlock`` fixtures).
Opener = Callable[..., AbstractAsyncContextManager[Backend]]


def new_prefix(label: str) -> str:
    """A key prefix no other test uses: ``aiolease-<label>-<random>:``."""
    return f"aiolease-{label}-{uuid.uuid4().hex[:12]}:"


def delete_under(prefix: str, clients: Iterable[redis.Redis]) -> None:
    """Delete every key under ``prefix`` through each of ``clients``, closing them."""
    for client in clients:
        with client:
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                client.delete(*keys)


def in_database(url: str, db: int) -> str:
    """``url`` with its database replaced by ``db``."""
    return urlsplit(url)._replace(path=f"/{db}").geturl()


def prefix_fixture(label: str, *, dbs: Sequence[int | None] = (None,)) -> Any:
    """A ``prefix`` fixture for a test module: a key prefix of the test alone
    (:func:`new_prefix`), whose keys are deleted afterwards from each database of
    ``dbs`` on the ``redis_url`` server (``None``: the URL's own)."""

    @pytest.fixture
    def prefix(redis_url: str) -> Iterator[str]:
        made = new_prefix(label)
        yield made
        # The database goes in the URL: from_url() lets the URL's override a db= argument.
        urls = (redis_url if db is None else in_database(redis_url, db) for db in dbs)
        delete_under(made, (redis.Redis.from_url(url) for url in urls))

    return prefix


def inner(backend: Backend) -> RedisBackend:
    """The :class:`RedisBackend` behind ``backend`` (a bridge under trio)."""
    return support.inner(backend, RedisBackend)


class Tap(Backend):
    """Forwards every call to ``inner`` and tells the test what happened.

    Under trio its methods run on the asyncio side of the bridge, so it only *sets*
    events, which the waiting test created on its own side.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.requires_asyncio = inner.requires_asyncio  # type: ignore[misc]
        self.calls: Counter[str] = Counter()
        self.refused: list[str] = []
        self._waiting: list[anyio.Event] = []

    @property
    def capabilities(self) -> frozenset[Capability]:
        """``inner``'s."""
        return self.inner.capabilities

    def _note(self, op: str) -> None:
        self.calls[op] += 1
        for event in self._waiting:
            event.set()

    def refusals(self, count: int) -> Callable[[], bool]:
        """A condition: ``count`` different owners were refused (queued, in fair mode)."""
        return lambda: len(self.refused) >= count

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds, re-checking after each call."""
        while not condition():
            event = anyio.Event()
            self._waiting.append(event)
            try:
                await event.wait()
            finally:
                self._waiting.remove(event)

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Tap:
        raise NotImplementedError

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        result = await self.inner.try_acquire(name, owner, ttl, identity, metadata)
        if isinstance(result, HolderInfo) and owner not in self.refused:
            self.refused.append(owner)
        self._note("try_acquire")
        return result

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        grant = await self.inner.renew(name, owner, token, ttl)
        self._note("renew")
        return grant

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        freed = await self.inner.release(name, owner, token)
        self._note("release")
        return freed

    async def read(self, name: str) -> HolderInfo | None:
        holder = await self.inner.read(name)
        self._note("read")
        return holder

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        self._note("wait_changed")
        await self.inner.wait_changed(name, seen)

    async def wait_taken(self, name: str, held: HolderInfo) -> None:
        self._note("wait_taken")
        await self.inner.wait_taken(name, held)

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        self._note("wait_turn")
        await self.inner.wait_turn(name, owner, ttl, seen)


def new_name() -> str:
    return f"job/{uuid.uuid4().hex[:8]}"


async def subscribe(backend: Backend, name: str) -> None:
    """Have the backend subscribe ``name``'s channel (it lingers after the call), as
    the holders' takeover watches keep it: a fair waiter then needs no extra attempt.
    It also marks the name watched: releases then announce their hand-offs on it."""
    await backend.wait_changed(name, HolderInfo(name, "nobody", "", 1, {}))


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """Under trio, a trio-asyncio loop for a redis.asyncio client the test makes itself."""
    if running_trio():
        import trio_asyncio

        async with trio_asyncio.open_loop():
            yield
    else:
        yield


def sync_client(url: str) -> redis.Redis:
    """A blocking client to set up and inspect keys (a few loopback round trips)."""
    return redis.Redis.from_url(url)


def connections(url: str, client_name: str, kind: str | None = None) -> list[str]:
    """The ids of the server's connections called ``client_name`` (of type ``kind``)."""
    with sync_client(url) as admin:
        return [c["id"] for c in admin.client_list(_type=kind) if c.get("name") == client_name]


def requests(backend: Backend) -> Counter[str]:
    """Count the commands the RedisBackend behind ``backend`` sends through its transport
    (not its pub/sub connection), by command, and the requests (``"requests"``: each
    one write of one or more commands)."""
    wire = inner(backend)._wire
    calls: Counter[str] = Counter()
    call, batch, batch_now = wire.call, wire.batch, wire.batch_now

    def note(commands: Any) -> None:
        calls["requests"] += 1
        for command in commands:
            calls[str(command[0]).split()[0]] += 1

    async def counted_call(*args: Any) -> Any:
        note([args])
        return await call(*args)

    async def counted_batch(commands: Any, **options: Any) -> Any:
        note(commands)
        return await batch(commands, **options)

    def counted_batch_now(commands: Any) -> Any:
        note(commands)
        return batch_now(commands)

    wire.call = counted_call  # type: ignore[method-assign]
    wire.batch = counted_batch  # type: ignore[method-assign]
    wire.batch_now = counted_batch_now  # type: ignore[method-assign]
    return calls


async def take_once(backend: Backend, name: str, got: list[Any]) -> None:
    """Acquire ``name`` (waiting as long as it takes, with a 30 s ttl), note the token,
    release."""
    lease = await AsyncLock(backend, name, ttl=30.0).acquire()
    got.append(lease.token)
    await lease.release()


def noting_waits(found: RedisBackend) -> anyio.Event:
    """An event set when a waiter of ``found`` starts waiting for its turn."""
    waiting = anyio.Event()
    wait_turn = found.wait_turn

    async def noted_wait_turn(name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        waiting.set()
        await wait_turn(name, owner, ttl, seen)

    found.wait_turn = noted_wait_turn  # type: ignore[method-assign]
    return waiting
