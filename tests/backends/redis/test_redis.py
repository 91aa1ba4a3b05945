"""The Redis backend on a real server: the contract, fairness, wake-ups, batching, cancellation.

Every test works under its own key prefix on the shared test server and deletes
its keys afterwards (never FLUSHDB: other suites use the same server).
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, TypeVar

import anyio
import pytest
import redis
import redis.asyncio

import aiolease
from aiolease import (
    AsyncLock,
    BackendError,
    BackendUnavailable,
    Capability,
    InvalidArgument,
    Lease,
    LeaseHeldError,
    LeaseLostError,
    LossReason,
    UnsupportedCapability,
)
from aiolease._bridge import adapt, call_asyncio, running_trio
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.redis import ForeignDataError, RedisBackend, parse_url
from aiolease.backends.redis._keys import Keys
from aiolease.backends.redis._scripts import RENEW
from aiolease.testing import CHECKS, Check
from tests.backends.model import agrees_with_the_model
from tests.backends.redis.support import Opener, Tap, inner, new_name, subscribe

pytestmark = pytest.mark.anyio

T = TypeVar("T")
LONG = 30.0


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """Under trio, a trio-asyncio loop for a redis.asyncio client the test makes itself."""
    if running_trio():
        import trio_asyncio

        async with trio_asyncio.open_loop():
            yield
    else:
        yield


async def on_asyncio(fn: Callable[[], Awaitable[T]]) -> T:
    """Await an asyncio-only coroutine function from either loop."""
    return await call_asyncio(fn) if running_trio() else await fn()


@contextmanager
def raises(kind: type[BaseException], match: str | None = None) -> Iterator[None]:
    """``pytest.raises`` that also accepts ``kind`` alone in (nested) exception groups.

    Under trio, ``open_backend`` runs inside a trio-asyncio loop whose nursery wraps
    what the block raises in exception groups.
    """
    try:
        yield
    except BaseException as exc:
        leaf: BaseException = exc
        while len(getattr(leaf, "exceptions", ())) == 1:
            leaf = leaf.exceptions[0]  # type: ignore[attr-defined]
        if isinstance(leaf, kind) and (match is None or re.search(match, str(leaf))):
            return
        raise
    pytest.fail(f"did not raise {kind.__name__}")


def sync_client(url: str) -> redis.Redis:
    """A blocking client to set up and inspect keys (a few loopback round trips)."""
    return redis.Redis.from_url(url)


# -- the contract ---------------------------------------------------------------------------


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(
    anyio_backend: str, open_redis: Opener, check: Check, fair: bool
) -> None:
    await check(lambda: open_redis(fair=fair))


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_agrees_with_the_model(redis_url: str, prefix: str, loop: str) -> None:
    agrees_with_the_model(lambda: aiolease.open_backend(redis_url, prefix=prefix), loop, 30, 50)


async def test_capabilities(anyio_backend: str, open_redis: Opener) -> None:
    base = {Capability.PUSH_WAKEUP, Capability.SERVER_TIME, Capability.MULTI_PROCESS}
    async with open_redis() as plain, open_redis(fair=True) as fair:
        assert plain.capabilities == base
        assert fair.capabilities == base | {Capability.FAIR_QUEUE}
    assert Capability.DURABLE_TOKENS not in RedisBackend.capabilities
    with raises(UnsupportedCapability, match="fair_queue"):
        async with open_redis(require=[Capability.FAIR_QUEUE]):
            pass
    async with open_redis(fair="1", require=[Capability.FAIR_QUEUE]):
        pass


async def test_keys_share_one_hash_tag(anyio_backend: str, open_redis: Opener) -> None:
    name = "a{b}c%7D/ü"
    keys = Keys.of("p:", name)
    for key in (*keys.all, keys.channel):
        assert key.startswith("p:{a%7Bb%7Dc%257D/ü}:".encode())
    async with open_redis() as backend:
        async with AsyncLock(backend, name, ttl=LONG) as lease:
            holder = await backend.read(name)
            assert holder is not None and holder.name == name and holder.token == lease.token


# -- fairness -------------------------------------------------------------------------------


async def test_fair_mode_serves_waiters_in_arrival_order(
    anyio_backend: str, open_redis: Opener
) -> None:
    async with open_redis(fair=True) as backend:
        tap = Tap(inner(backend))
        name = new_name()
        first = await AsyncLock(tap, name, ttl=LONG).acquire_nowait()
        order: list[int] = []
        tokens: list[int] = []

        async def wait_in_line(i: int) -> None:
            async with AsyncLock(tap, name, ttl=LONG, identity=f"waiter-{i}") as lease:
                order.append(i)
                tokens.append(lease.token)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(wait_in_line, i)
                    await tap.wait_for(tap.refusals(i + 1))
                await first.release()
        assert order == list(range(6))
        assert tokens == sorted(tokens) and tokens[0] > first.token
        assert await backend.read(name) is None


async def test_a_dead_waiter_does_not_stall_the_queue(
    anyio_backend: str, open_redis: Opener
) -> None:
    dead_ttl = 1.0
    async with open_redis(fair=True) as backend:
        tap = Tap(inner(backend))
        name = new_name()
        # Subscribed: the live waiter waits for its turn from its first attempt, which
        # only the announcement of the hand-off to the dead waiter can cut short.
        await subscribe(backend, name)
        holder = await AsyncLock(tap, name, ttl=LONG).acquire_nowait()
        # The dead waiter queues up once, and never comes back (its process died).
        dead = await adapt(tap).try_acquire(name, "dead-waiter", dead_ttl, "dead", {})
        assert isinstance(dead, HolderInfo)
        got: list[Lease] = []

        async def live_waiter() -> None:
            got.append(await AsyncLock(tap, name, ttl=LONG, identity="live").acquire())

        # Bounded by the dead waiter's ttl (plus slack), not by the live one's (30 s).
        with anyio.fail_after(dead_ttl + 3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(live_waiter)
                await tap.wait_for(tap.refusals(2))
                await holder.release()
                handed = await backend.read(name)
                assert handed is not None and handed.owner == "dead-waiter"
        assert handed is not None and got[0].token > handed.token
        await got[0].release()


async def test_plain_mode_does_not_queue(anyio_backend: str, open_redis: Opener) -> None:
    async with open_redis() as backend:
        name = new_name()
        lease = await AsyncLock(backend, name, ttl=LONG).acquire_nowait()
        refusal = await backend.try_acquire(name, "other", LONG, "other", {})
        assert isinstance(refusal, HolderInfo)
        await lease.release()
        assert await backend.read(name) is None  # nobody was handed the lease


# -- wake-ups -------------------------------------------------------------------------------


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_release_wakes_a_waiter(anyio_backend: str, open_redis: Opener, fair: bool) -> None:
    async with open_redis(fair=fair) as backend:
        tap = Tap(inner(backend))
        name = new_name()
        await subscribe(backend, name)
        holder = await AsyncLock(tap, name, ttl=LONG).acquire_nowait()
        got: list[Lease] = []
        with anyio.fail_after(5):  # far below the holder's ttl
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: _append(got, AsyncLock(tap, name, ttl=LONG).acquire()))
                op = "wait_turn"
                await tap.wait_for(lambda: tap.calls[op] == 1)
                await holder.release()
        assert got[0].token > holder.token
        assert tap.calls["try_acquire"] == 3  # holder, refused waiter, granted waiter
        await got[0].release()


async def test_a_held_lease_is_watched_by_pushes_not_reads(
    anyio_backend: str, open_redis: Opener
) -> None:
    async with open_redis() as backend:
        redis_backend = inner(backend)
        reads: list[str] = []
        read = redis_backend.read

        async def counted_read(name: str) -> HolderInfo | None:  # also the backend's own
            reads.append(name)
            return await read(name)

        redis_backend.read = counted_read  # type: ignore[method-assign]
        tap = Tap(redis_backend)
        name = new_name()
        with pytest.raises(LeaseLostError) as info:
            async with AsyncLock(tap, name, ttl=0.6) as lease:
                await tap.wait_for(lambda: tap.calls["renew"] >= 4)  # more than a ttl
                assert reads == [] and tap.calls["wait_changed"] == 0
                with anyio.CancelScope(shield=True):
                    await adapt(tap.inner).release(name, lease.owner, None)
                    await adapt(tap.inner).try_acquire(name, "thief", LONG, "thief", {})
                await anyio.sleep_forever()
        assert info.value.reason is LossReason.STOLEN
        assert tap.calls["wait_taken"] == 1 and reads
        await adapt(tap.inner).release(name, "thief", None)


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_holder_expiry_wakes_a_waiter(
    anyio_backend: str, open_redis: Opener, fair: bool
) -> None:
    async with open_redis(fair=fair) as backend:
        tap = Tap(inner(backend))
        name = new_name()
        await subscribe(backend, name)
        crashed = await adapt(tap).try_acquire(name, "crashed", 0.5, "crashed", {})
        assert isinstance(crashed, Grant)
        with anyio.fail_after(5):
            lease = await AsyncLock(tap, name, ttl=LONG).acquire()
        assert lease.token > crashed.token
        # Woken by the holder's ttl, not by polling: one refusal, then the grant.
        assert tap.calls["try_acquire"] == 3
        await lease.release()


async def _append(into: list[Lease], acquiring: Any) -> None:
    into.append(await acquiring)


# -- batched renewals -----------------------------------------------------------------------


class _Counting(redis.asyncio.Connection):
    renew_round_trips = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        chunks = [command] if isinstance(command, (bytes, str)) else list(command)
        if any(
            RENEW.sha.encode() in bytes(c if isinstance(c, bytes) else c.encode()) for c in chunks
        ):
            type(self).renew_round_trips += 1
        await super().send_packed_command(command, check_health)


async def test_renewals_of_many_leases_share_one_round_trip(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    count, ticks, ttl = 40, 3, 0.9
    pool = redis.asyncio.ConnectionPool.from_url(redis_url, connection_class=_Counting)
    client = redis.asyncio.Redis(connection_pool=pool)
    backend = RedisBackend(client, prefix=prefix)
    tap = Tap(backend)
    held = anyio.Event()
    leases: list[Lease] = []

    async def hold(i: int) -> None:
        async with AsyncLock(tap, f"many/{i}", ttl=ttl) as lease:
            leases.append(lease)
            await held.wait()

    async with asyncio_loop():
        try:
            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(hold, i)
                # The first renewal of each lease joins whichever batch comes next; from
                # the second on, they all ride on one batch per tick.
                await tap.wait_for(lambda: len(leases) == count and tap.calls["renew"] >= count)
                before = _Counting.renew_round_trips
                renewals = tap.calls["renew"]
                await tap.wait_for(lambda: tap.calls["renew"] >= renewals + count * ticks)
                sent = _Counting.renew_round_trips - before
                held.set()
        finally:
            await on_asyncio(backend.aclose)
            await on_asyncio(client.aclose)
            await on_asyncio(pool.disconnect)
    assert all(lease.lost is aiolease.LossReason.RELEASED for lease in leases)
    assert backend.statistics().renewals >= count * ticks
    # One round trip per tick, with a little slack for stragglers at the window's edges.
    assert sent <= ticks + 2, f"{sent} round trips renewed {count} leases {ticks} times"


async def test_a_renewal_is_never_answered_from_an_older_round_trip(
    anyio_backend: str, open_redis: Opener
) -> None:
    async with open_redis() as backend:
        name = new_name()
        granted = await backend.try_acquire(name, "me", LONG, "me", {})
        assert isinstance(granted, Grant)
        first = await backend.renew(name, "me", granted.token, LONG)
        second = await backend.renew(name, "me", granted.token, LONG)
        assert first.sent_at is not None and second.sent_at is not None
        assert second.sent_at > first.sent_at
        await backend.release(name, "me", None)
        with pytest.raises(aiolease.NotOwnerError):
            await backend.renew(name, "me", granted.token, LONG)


# -- cancellation ---------------------------------------------------------------------------


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_cancelled_acquires_leave_nothing_held(
    anyio_backend: str, open_redis: Opener, redis_url: str, prefix: str, fair: bool
) -> None:
    rng = random.Random(4)
    async with open_redis(fair=fair) as backend:
        name = new_name()
        lock = AsyncLock(backend, name, ttl=LONG)
        blocker = AsyncLock(backend, name, ttl=LONG, identity="blocker")
        cancelled = returned = 0
        for i in range(300):
            holder = await blocker.acquire_nowait() if i % 2 else None
            with anyio.move_on_after(rng.uniform(0, 0.004)) as scope:
                lease = await lock.acquire()
            if scope.cancelled_caught:
                cancelled += 1
            else:
                returned += 1
                await lease.release()
            if holder is not None:
                await holder.release()
            assert await backend.read(name) is None, f"iteration {i} left the name held"
        assert cancelled > 100
        lease = await lock.acquire_nowait()  # free at once: nothing queued either
        await lease.release()
    keys = Keys.of(prefix, name)
    with sync_client(redis_url) as client:
        assert client.exists(keys.lease, keys.queue, keys.waiters) == 0


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


def connections(url: str, client_name: str, kind: str | None = None) -> list[str]:
    """The ids of the server's connections called ``client_name`` (of type ``kind``)."""
    with sync_client(url) as admin:
        return [c["id"] for c in admin.client_list(_type=kind) if c.get("name") == client_name]


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
