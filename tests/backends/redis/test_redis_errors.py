"""The Redis backend's errors on a real server: foreign data under its keys, bad URLs
and options, an unreachable server, a user's client, and connections killed under it.

Every test works under its own key prefix on the shared test server and deletes
its keys afterwards (never FLUSHDB: other suites use the same server).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio

import aiolease
from aiolease import (
    AsyncLock,
    BackendError,
    BackendUnavailable,
    InvalidArgument,
    LeaseHeldError,
)
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.redis import ForeignDataError, RedisBackend, parse_url
from aiolease.backends.redis._keys import Keys
from tests.backends.redis.support import (
    Opener,
    asyncio_loop,
    connections,
    new_name,
    subscribe,
    sync_client,
)
from tests.support import on_asyncio, raises

pytestmark = pytest.mark.anyio

LONG = 30.0


# -- errors ---------------------------------------------------------------------------------


FOREIGN_VALUES: list[tuple[str, Callable[[redis.Redis, Keys], object]]] = [
    ("lease is a string", lambda c, k: c.set(k.lease, "hello")),
    ("lease hash of others", lambda c, k: c.hset(k.lease, mapping={"user": "x"})),
    (
        "lease without expiry",
        lambda c, k: c.hset(
            k.lease, mapping={"owner": "o", "identity": "i", "token": "1", "metadata": "{}"}
        ),
    ),
    ("token not a number", lambda c, k: c.set(k.token, "abc")),
    ("token is a list", lambda c, k: c.rpush(k.token, "1")),
    ("queue is a string", lambda c, k: c.set(k.queue, "x")),
    ("waiters is a string", lambda c, k: (c.zadd(k.queue, {"w": 1}), c.set(k.waiters, "x"))),
    ("token is negative", lambda c, k: c.set(k.token, "-3")),
]


@contextmanager
def foreign_value(
    url: str, prefix: str, write: Callable[[redis.Redis, Keys], object]
) -> Iterator[tuple[redis.Redis, str, Keys]]:
    """A new name with ``write`` done to its keys: a client, the name, its keys."""
    name = new_name()
    keys = Keys.of(prefix, name)
    with sync_client(url) as client:
        write(client, keys)
        yield client, name, keys


@pytest.mark.parametrize(
    "write", [w for _, w in FOREIGN_VALUES], ids=[i for i, _ in FOREIGN_VALUES]
)
async def test_foreign_values_are_reported_and_kept(
    anyio_backend: str,
    open_redis: Opener,
    redis_url: str,
    prefix: str,
    write: Callable[[redis.Redis, Keys], object],
) -> None:
    with foreign_value(redis_url, prefix, write) as (client, name, keys):
        before = [client.dump(key) for key in keys.all]
        async with open_redis(fair=True) as backend:
            with pytest.raises(ForeignDataError, match="left it unchanged") as info:
                await backend.try_acquire(name, "me", LONG, "me", {})
            assert isinstance(info.value, BackendError) and info.value.name == name
            with pytest.raises(ForeignDataError):
                await AsyncLock(backend, name, ttl=LONG).acquire_nowait()
        assert [client.dump(key) for key in keys.all] == before


@pytest.mark.parametrize(
    "write",
    [lambda c, k: c.set(k.watched, "mine"), lambda c, k: c.rpush(k.watched, "1")],
    ids=["a string of others", "a list"],
)
async def test_a_foreign_watch_mark_is_reported_and_kept(
    anyio_backend: str,
    open_redis: Opener,
    redis_url: str,
    prefix: str,
    write: Callable[[redis.Redis, Keys], object],
) -> None:
    with foreign_value(redis_url, prefix, write) as (client, name, keys):
        before = client.dump(keys.watched)
        async with open_redis() as backend:
            with pytest.raises(ForeignDataError, match="not an aiolease watch mark"):
                await subscribe(backend, name)
        assert client.dump(keys.watched) == before and client.pttl(keys.watched) == -1


async def test_foreign_lease_fails_read_and_release(
    anyio_backend: str, open_redis: Opener, redis_url: str, prefix: str
) -> None:
    name = new_name()
    with sync_client(redis_url) as client:
        client.set(Keys.of(prefix, name).lease, "hello")
    async with open_redis() as backend:
        with pytest.raises(ForeignDataError):
            await backend.read(name)
        with pytest.raises(ForeignDataError):
            await backend.release(name, "me", None)


BAD_URLS = [
    "redis://127.0.0.1:99999/0",
    "redis://127.0.0.1:6379/notadb",
    "redis://127.0.0.1:6379/0?prefix=a{b}",
    "redis://127.0.0.1:6379/0?prefix=",
    "redis://127.0.0.1:6379/0?prefix=with%20space",
    "redis://127.0.0.1:6379/0?fair=maybe",
    "redis://127.0.0.1:6379/0?bogus=1",
    "redis://127.0.0.1:6379/0?fair=1&fair=0",
    "redis://127.0.0.1:6379/0?socket_timeout=soon",
    "redis://127.0.0.1:6379/0#fragment",
    "unix://",
    # A TLS option on a plain URL: redis-py's connection refused it with a raw
    # TypeError at the first command.
    "redis://127.0.0.1:6379/0?ssl_cert_reqs=none",
]


@pytest.mark.parametrize("url", BAD_URLS)
async def test_bad_urls_are_invalid_arguments(anyio_backend: str, url: str) -> None:
    with raises(InvalidArgument):
        async with aiolease.open_backend(url):
            pass


@pytest.mark.parametrize(
    "options",
    [{"prefix": 3}, {"prefix": "x" * 200}, {"fair": "perhaps"}, {"timeout": 0}, {"db": 1}],
    ids=["prefix-type", "prefix-long", "fair", "timeout", "unknown"],
)
async def test_bad_options_are_invalid_arguments(
    anyio_backend: str, redis_url: str, options: dict[str, Any]
) -> None:
    with raises(InvalidArgument):
        async with aiolease.open_backend(redis_url, **options):
            pass


def test_url_options_are_split_from_redis_py_ones() -> None:
    url, ours = parse_url("rediss://u:p@h:1/2?prefix=app:&fair=yes&socket_timeout=2")
    assert ours == {"prefix": "app:", "fair": "yes"}
    assert url == "rediss://u:p@h:1/2?socket_timeout=2"
    assert parse_url("unix:///run/redis.sock?db=3") == ("unix:///run/redis.sock?db=3", {})


async def test_option_given_twice_is_invalid(anyio_backend: str, redis_url: str) -> None:
    with raises(InvalidArgument, match="twice"):
        async with aiolease.open_backend(f"{redis_url}?prefix=a:", prefix="b:"):
            pass


async def test_not_a_client_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="redis.asyncio.Redis"):
        RedisBackend(object())  # type: ignore[arg-type]


async def test_unreachable_server_is_unavailable(anyio_backend: str) -> None:
    with raises(BackendUnavailable):
        async with aiolease.open_backend("redis://127.0.0.1:1/0", timeout=1):
            pass


async def test_a_users_client_is_never_closed(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    backend = RedisBackend(client, prefix=prefix, fair=True)
    name = new_name()
    async with asyncio_loop():
        try:
            async with AsyncLock(backend, name, ttl=LONG):
                with pytest.raises(LeaseHeldError):
                    await AsyncLock(backend, name, ttl=LONG).acquire_nowait()
            await on_asyncio(backend.aclose)
            assert backend.client is client and backend.fair
            assert await on_asyncio(client.ping)
            with pytest.raises(BackendUnavailable, match="closed"):
                await on_asyncio(lambda: backend.read(name))
        finally:
            await on_asyncio(client.aclose)


# -- connections that fail under the backend ------------------------------------------------


def kill_connections(url: str, client_name: str) -> int:
    """``CLIENT KILL`` every connection called ``client_name``, as a server restart would
    (but only this test's, not other suites'); how many there were."""
    ids = connections(url, client_name)
    with sync_client(url) as admin:
        for client_id in ids:
            try:
                admin.client_kill_filter(_id=client_id)
            except redis.ResponseError:
                pass  # it closed meanwhile
    return len(ids)


async def test_watchers_outlive_their_connections_being_killed(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """Watchers come and go while the server keeps killing the backend's connections: each
    ``wait_changed`` returns or raises a BackendError (never a redis-py error), one
    pub/sub connection serves them all, and afterwards a release still wakes every watcher.

    Before the pub/sub connection had a single owner, a watcher (un)subscribing while
    the reader reconnected wrote to a connection closed under it (AttributeError) or
    read it alongside the reader (RuntimeError).
    """
    client_name = f"aiolease-kill-{uuid.uuid4().hex[:8]}"
    url = f"{redis_url}?client_name={client_name}"
    async with aiolease.open_backend(url, prefix=prefix) as backend:
        names = [new_name() for _ in range(6)]
        seen: dict[str, HolderInfo | None] = {}
        for name in names:
            assert isinstance(await backend.try_acquire(name, "holder", LONG, "h", {}), Grant)
            seen[name] = await backend.read(name)
        rng = random.Random(42)
        failed = 0

        async def churn(name: str) -> None:
            nonlocal failed
            while True:
                with anyio.move_on_after(rng.uniform(0.002, 0.03)):
                    try:
                        await backend.wait_changed(name, seen[name])
                    except BackendError:
                        failed += 1

        killed = 0
        with anyio.fail_after(LONG):
            async with anyio.create_task_group() as tg:
                for name in names * 2:
                    tg.start_soon(churn, name)
                while killed < 20:
                    found = await anyio.to_thread.run_sync(kill_connections, redis_url, client_name)
                    if not found:  # the backend waits before it connects again
                        await anyio.sleep(0.01)
                    killed += found
                tg.cancel_scope.cancel()
        # Whether a wait saw a kill as a BackendError (``failed``) depends on timing: the
        # lean pub/sub connection reconnects under its waiters without failing them.
        # What must hold: nothing but BackendError escaped, and the wake-ups below.

        # Pooled connections killed while idle fail one command each (BackendUnavailable),
        # which the core would retry: so do these calls.
        async def wait_for_release(name: str) -> None:
            while True:
                with suppress(BackendUnavailable):
                    return await backend.wait_changed(name, seen[name])

        async def release(name: str) -> bool:
            for _ in range(10):
                with suppress(BackendUnavailable):
                    return await backend.release(name, "holder", None)
            return await backend.release(name, "holder", None)

        with anyio.fail_after(LONG / 2):  # the holders' ttl: only a wake-up ends the waits
            async with anyio.create_task_group() as tg:
                for name in names:
                    tg.start_soon(wait_for_release, name)
                for name in names:
                    assert await release(name)
        subscribers = await anyio.to_thread.run_sync(connections, redis_url, client_name, "pubsub")
        assert len(subscribers) <= 1, subscribers
