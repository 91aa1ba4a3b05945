"""The Redis backend on a real server: the contract, fairness, wake-ups, batched
renewals, cancellation. (Its errors are in test_redis_errors.py; its transports,
pub/sub messages and riders in test_redis_lean.py, test_redis_messages.py and
test_redis_riders.py.)

Every test works under its own key prefix on the shared test server and deletes
its keys afterwards (never FLUSHDB: other suites use the same server).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio

import aiolease
from aiolease import (
    AsyncLock,
    Capability,
    Lease,
    LeaseLostError,
    LossReason,
    UnsupportedCapability,
)
from aiolease._bridge import adapt
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.redis import RedisBackend
from aiolease.backends.redis._keys import Keys
from aiolease.backends.redis._scripts import RENEW
from aiolease.testing import CHECKS, Check
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.proxy import FaultProxy
from tests.backends.model import agrees_with_the_model
from tests.backends.redis.support import (
    Opener,
    Tap,
    asyncio_loop,
    inner,
    new_name,
    requests,
    subscribe,
    sync_client,
)
from tests.support import on_asyncio, raises

pytestmark = pytest.mark.anyio

LONG = 30.0


# -- the contract ---------------------------------------------------------------------------


# Once per loop, each loop with one of the two modes (docs/testing.md, "Keeping the
# suite short"): every check meets both loops and both modes.
@pytest.mark.parametrize(("anyio_backend", "fair"), [("asyncio", False), ("trio", True)])
@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(
    anyio_backend: str, open_redis: Opener, check: Check, fair: bool
) -> None:
    await check(lambda: open_redis(fair=fair))


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_agrees_with_the_model(redis_url: str, prefix: str, loop: str) -> None:
    # The model has no queue: plain mode (a fair release hands the name to a waiter).
    # A permit's release grants the queue entries that then fit.
    def opener() -> Any:
        return aiolease.open_backend(redis_url, prefix=prefix, fair=False)

    agrees_with_the_model(opener, loop, 30, 50, grants_on_release=True)


async def test_capabilities(anyio_backend: str, open_redis: Opener) -> None:
    base = {
        Capability.PUSH_WAKEUP,
        Capability.SERVER_TIME,
        Capability.MULTI_PROCESS,
        Capability.PROCLAIM,
        Capability.SEMAPHORE,
        Capability.FAIR_PERMITS,  # permits queue in both modes
        Capability.PERMIT_RETRY_KEEPS_ENTRY,
    }
    async with open_redis(fair=False) as plain, open_redis() as fair:
        assert plain.capabilities == base
        assert fair.capabilities == base | {Capability.FAIR_QUEUE}  # the default
    assert (
        Capability.DURABLE_TOKENS not in RedisBackend(redis.asyncio.Redis()).capabilities
    )  # not asked
    with raises(UnsupportedCapability, match="fair_queue"):
        async with open_redis(fair=False, require=[Capability.FAIR_QUEUE]):
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
    async with open_redis(fair=False) as backend:
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
        # Nobody watches the name: the thief's grant is not published, and the next
        # renewal reports the takeover.
        assert info.value.reason is LossReason.STOLEN
        assert tap.calls["wait_taken"] == 1
        await adapt(tap.inner).release(name, "thief", None)


async def test_a_held_lease_costs_no_subscription_and_no_task(
    anyio_backend: str, open_redis: Opener, redis_url: str
) -> None:
    """Holding leases nobody else watches starts no watch task and subscribes to no
    channel (a grant is not published then: the renewals report a takeover)."""
    async with open_redis() as backend:
        names = [new_name() for _ in range(3)]
        channels = [inner(backend)._keys(name).channel for name in names]
        tasks = len(anyio.get_running_tasks())
        async with AsyncExitStack() as stack:
            for name in names:
                await stack.enter_async_context(AsyncLock(backend, name, ttl=LONG))
            assert len(anyio.get_running_tasks()) == tasks
            with sync_client(redis_url) as admin:
                assert all(count == 0 for _, count in admin.pubsub_numsub(*channels))


@contextmanager
def _publishes(url: str, prefix: str) -> Iterator[Callable[[], int]]:
    """Counts PUBLISHes (scripts' included) on the channels of ``prefix``: every channel
    the backend publishes on starts with its key prefix (``_keys.py``), and no other
    client of the shared server publishes there, so the count is this test's alone.

    The returned callable flushes the subscription (a marker published last, on this
    connection's order) and returns how many messages came before it.
    """
    marker = f"{prefix}count-end"
    with sync_client(url) as admin, admin.pubsub() as sub:
        sub.psubscribe(f"{prefix}*")
        assert sub.get_message(timeout=5)["type"] == "psubscribe"

        def count() -> int:
            admin.publish(marker, "")
            seen = 0
            while (message := sub.get_message(timeout=5)) is not None:
                if message["channel"] == marker.encode():
                    return seen
                seen += 1
            raise AssertionError("the marker never came back")

        yield count


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_a_cycle_nobody_waits_for_does_no_work_for_waiters(
    anyio_backend: str, open_redis: Opener, redis_url: str, prefix: str, fair: bool
) -> None:
    """No PUBLISH, and one request each for acquire and release (no leading PING)."""
    with _publishes(redis_url, prefix) as published:
        async with open_redis(fair=fair) as backend:
            sent = requests(backend)
            for _ in range(3):
                async with AsyncLock(backend, new_name(), ttl=LONG):
                    pass
            assert published() == 0
            assert sent["PING"] == 0 and sent["requests"] == 6, sent


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
    # A ttl of 3 s (ticks 1 s apart): with 0.9 s, 40 leases bridged to asyncio under
    # trio were lost (renewals late) on a loaded CI machine. What is checked is the
    # number of round trips per tick, not how fast they come.
    count, ticks, ttl = 40, 3, 3.0
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


# Seconds of slow round trips: once (the loops take turns between Redis and MySQL).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_renewals_slower_than_a_third_of_the_ttl_still_confirm(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    host, port = redis_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    async with FaultProxy(host, int(port)) as proxy:
        async with aiolease.open_backend(proxy.url_for(redis_url), prefix=prefix) as backend:
            # Round trips of about 2.4 s: longer than ttl / 3 (2 s), which a batch is
            # allowed to be old when a renewal joins it, shorter than the renew interval.
            faulty = FaultyBackend(backend)
            lock = AsyncLock(faulty, "slow", ttl=6.0, renew_interval=2.9, margin=0.05)
            with redis.Redis.from_url(redis_url) as admin:
                # A server that never ran it (a fresh one, or after SCRIPT FLUSH) would
                # answer the first renewal NOSCRIPT: two more slow round trips.
                admin.script_load(RENEW.source)
            async with lock as lease:
                await proxy.delay(1.2)
                with anyio.fail_after(30):
                    for _ in range(3):  # the third renewal starts when the second has ended
                        await faulty.wait_called("renew")
                assert lock.statistics().renewals >= 2
                assert lease.lost is None
                await proxy.pass_through()


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
