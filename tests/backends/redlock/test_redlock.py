"""The Redlock backend on three real Redis servers (``redis-redlock``: 6381-6383).

The contract and the model over asyncio and trio; instances cut off through fault
proxies (one of three: everything still works; two of three: a typed error and no
key left behind); the validity arithmetic; a storm of cancelled acquires; and the
safety harness (none, sigstop, and blackhole through :class:`RespRouter`).

Every test works under its own key prefix and deletes its keys afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import random
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

import aiolease
from aiolease import (
    AsyncLock,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    Capability,
    InvalidArgument,
    UnsupportedCapability,
)
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.redlock import RedlockBackend
from aiolease.testing import CHECKS, Check
from aiolease.testing.proxy import FaultProxy
from aiolease.testing.safety import Fault, assert_safe
from tests.backends.model import agrees_with_the_model
from tests.backends.redis.support import Opener
from tests.backends.redlock.support import (
    RespRouter,
    Stubborn,
    instance_clients,
    lease_keys,
)
from tests.backends.safety import CUT_OFF_FRESH, short_run
from tests.support import on_asyncio

pytestmark = pytest.mark.anyio

LONG = 30.0


@asynccontextmanager
async def through_proxies(
    endpoints: list[tuple[str, int]], prefix: str, **options: Any
) -> AsyncIterator[tuple[Backend, list[FaultProxy]]]:
    """A Redlock whose every instance is reached through a FaultProxy of its own."""
    async with (
        FaultProxy(*endpoints[0]) as a,
        FaultProxy(*endpoints[1]) as b,
        FaultProxy(*endpoints[2]) as c,
    ):
        proxies = [a, b, c]
        hosts = ",".join(p.address for p in proxies)
        url = f"redis+redlock://{hosts}"
        # A cut-off instance costs each operation this long: keep it short here.
        options = {"request_timeout": 0.1, **options}
        async with aiolease.open_backend(url, prefix=prefix, **options) as backend:
            try:
                yield backend, proxies
            finally:
                for proxy in proxies:
                    await proxy.pass_through()  # what was held is delivered, then cleaned up


def inner(backend: Backend) -> RedlockBackend:
    found = getattr(backend, "inner", backend)
    assert isinstance(found, RedlockBackend)
    return found


def new_name() -> str:
    return f"job/{uuid.uuid4().hex[:8]}"


def no_leases(endpoints: list[tuple[str, int]], prefix: str) -> None:
    left = {i: keys for i, keys in lease_keys(endpoints, prefix).items() if keys}
    assert not left, f"lease keys left behind: {left}"


# -- the contract ---------------------------------------------------------------------------


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(anyio_backend: str, open_redlock: Opener, check: Check) -> None:
    await check(open_redlock)


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_agrees_with_the_model(redlock_url: str, prefix: str, loop: str) -> None:
    # Reads wait up to request_timeout for a majority (0.5 s by default): on a loaded
    # 2-core CI machine none of three instances answered one in time (a BackendTimeout,
    # not a disagreement). The model checks what the backend decides, not how fast.
    agrees_with_the_model(
        lambda: aiolease.open_backend(redlock_url, prefix=prefix, request_timeout=2),
        loop,
        10,
        30,
    )


async def test_capabilities_are_honest(anyio_backend: str, open_redlock: Opener) -> None:
    async with open_redlock() as backend:
        assert backend.capabilities == {
            Capability.PUSH_WAKEUP,
            Capability.SERVER_TIME,
            Capability.MULTI_PROCESS,
            Capability.PROCLAIM,
        }
        assert inner(backend).quorum == 2
    for missing in (Capability.DURABLE_TOKENS, Capability.FAIR_QUEUE):
        with pytest.raises(UnsupportedCapability):
            async with open_redlock(require=[missing]):
                pass


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis+redlock://",
        "redis+redlock://127.0.0.1:6381,127.0.0.1:6381",
        "redis+redlock://127.0.0.1:6381,127.0.0.1",
        "redis+redlock://127.0.0.1:99999",
        "redis+redlock://127.0.0.1:6381/x",
        "redis+redlock://127.0.0.1:6381?nope=1",
        "redis+redlock://127.0.0.1:6381?prefix=a&prefix=b",
        "redis+redlock://127.0.0.1:6381?fair=1",
        "redis+redlock://127.0.0.1:6381?fair=maybe",
        "redis+redlock://127.0.0.1:6381?request_timeout=0",
        "redis+redlock://127.0.0.1:6381?request_timeout=soon",
        "redis+redlock://127.0.0.1:6381?drift_factor=0.7",
        "redis+redlock://127.0.0.1:6381?drift_floor=-1",
        "redis+redlock://127.0.0.1:6381?prefix=a{b}",
    ],
)
async def test_bad_urls_are_refused(anyio_backend: str, url: str) -> None:
    with pytest.raises(InvalidArgument):
        async with aiolease.open_backend(url):
            pass


async def test_bad_clients_are_refused(
    anyio_backend: str, endpoints: list[tuple[str, int]]
) -> None:
    async def check() -> None:
        (h1, p1), (h2, p2) = endpoints[:2]
        a, b = redis.asyncio.Redis(host=h1, port=p1), redis.asyncio.Redis(host=h2, port=p2)
        again = redis.asyncio.Redis(host=h1, port=p1)
        other_db = redis.asyncio.Redis(host=h1, port=p1, db=1)
        try:
            for clients in ([], [a, again], [a, "b"], "ab", None):
                with pytest.raises(InvalidArgument):
                    RedlockBackend(clients)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="fair"):
                RedlockBackend([a, b], fair=True)
            assert RedlockBackend([a, b], fair=False).quorum == 2
            assert RedlockBackend([a, other_db]).quorum == 2  # another database
        finally:
            for client in (a, b, again, other_db):
                await client.aclose()

    await on_asyncio(check)


async def test_clients_of_the_user_are_not_closed(
    anyio_backend: str, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    async def check() -> None:
        async with instance_clients(endpoints) as clients:
            async with RedlockBackend(clients, prefix=prefix) as backend:
                name = new_name()
                granted = await backend.try_acquire(name, "me", LONG, "i", {})
                assert isinstance(granted, Grant)
                assert await backend.release(name, "me", granted.token)
            for client in clients:
                assert await client.ping()

    await on_asyncio(check)


async def test_a_minority_down_at_open_is_tolerated(
    anyio_backend: str, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    live = ",".join(f"{h}:{p}" for h, p in endpoints[:2])
    async with aiolease.open_backend(f"redis+redlock://{live},127.0.0.1:1", prefix=prefix) as b:
        async with AsyncLock(b, new_name(), ttl=LONG) as lease:
            assert lease.token >= 1
    with pytest.raises(BackendUnavailable):
        async with aiolease.open_backend(
            f"redis+redlock://{live.split(',')[0]},127.0.0.1:1,127.0.0.1:2", prefix=prefix
        ):
            pass


# -- tokens ---------------------------------------------------------------------------------


async def test_tokens_carry_forward_from_an_instance_that_ran_ahead(
    anyio_backend: str, open_redlock: Opener, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    """One instance's counter is far ahead: the grant takes the quorum's highest, renew
    and release raise every counter to it, so the next grant is higher still everywhere."""
    import redis as sync_redis

    name = new_name()
    async with open_redlock() as backend:
        first = await backend.try_acquire(name, "a", LONG, "a", {})
        assert isinstance(first, Grant)
        assert await backend.release(name, "a", first.token)
        host, port = endpoints[2]
        with sync_redis.Redis(host=host, port=port) as client:
            counter = next(iter(client.scan_iter(match=f"{prefix}*:token")))
            client.set(counter, 100)
        second = await backend.try_acquire(name, "b", LONG, "b", {})
        assert isinstance(second, Grant) and second.token >= first.token + 1
        # Instances disagree until the first renewal carries the grant's token to all.
        holder = await backend.read(name)
        assert holder is not None and holder.owner == "b" and holder.token <= second.token
        assert await backend.renew(name, "b", second.token, LONG)
        holder = await backend.read(name)
        assert holder is not None and holder.token == second.token
        assert await backend.release(name, "b", second.token)
        third = await backend.try_acquire(name, "c", LONG, "c", {})
        assert isinstance(third, Grant) and third.token > second.token
        assert await backend.release(name, "c", third.token)


async def test_foreign_data_is_refused_and_left_alone(
    anyio_backend: str, open_redlock: Opener, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    import redis as sync_redis

    from aiolease.backends.redis import ForeignDataError

    name = new_name()
    host, port = endpoints[1]
    key = f"{prefix}{{{name}}}:lease"
    with sync_redis.Redis(host=host, port=port) as client:
        client.set(key, "not ours")
    async with open_redlock() as backend:
        with pytest.raises(ForeignDataError):
            await backend.try_acquire(name, "me", LONG, "me", {})
    with sync_redis.Redis(host=host, port=port) as client:
        assert client.get(key) == b"not ours"
    assert lease_keys(endpoints, prefix) == {0: [], 1: [key.encode()], 2: []}


class Counting(RedlockBackend):
    """Counts acquire attempts."""

    attempts = 0

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        self.attempts += 1
        return await super().try_acquire(name, owner, ttl, identity, metadata)


async def test_a_split_vote_waits_for_a_change_not_a_poll(
    anyio_backend: str, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    """x holds instance 0 (briefly), y instance 1, nobody a majority: a waiter is
    refused, and tries again when x's key expires (a few attempts, not a poll loop)."""

    async def check() -> None:
        async with instance_clients(endpoints) as clients:
            one_a = RedlockBackend(clients[:1], prefix=prefix)
            one_b = RedlockBackend(clients[1:2], prefix=prefix)
            name = new_name()
            assert isinstance(await one_a.try_acquire(name, "x", 0.3, "x", {}), Grant)
            assert isinstance(await one_b.try_acquire(name, "y", LONG, "y", {}), Grant)
            async with Counting(clients, prefix=prefix) as full:
                refused = await full.try_acquire(name, "z", LONG, "z", {})
                assert isinstance(refused, HolderInfo) and refused.owner in ("x", "y")
                assert await full.read(name) is None  # nobody holds a majority
                full.attempts = 0
                lease = await AsyncLock(full, name, ttl=LONG).acquire()
                holder = await full.read(name)
                assert holder is not None and holder.owner == lease.owner
                assert full.attempts <= 4, full.attempts
                assert await lease.release()
            assert await one_b.release(name, "y", None)

    await on_asyncio(check)


# -- instances cut off ----------------------------------------------------------------------


async def test_one_instance_blackholed_changes_nothing(
    anyio_backend: str, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    async with through_proxies(endpoints, prefix) as (backend, proxies):
        await proxies[1].blackhole()
        name = new_name()
        granted = await backend.try_acquire(name, "me", LONG, "host-a", {"k": "v"})
        assert isinstance(granted, Grant)
        renewed = await backend.renew(name, "me", granted.token, LONG)
        assert renewed.token == granted.token
        holder = await backend.read(name)
        assert holder is not None and holder.owner == "me" and holder.metadata == {"k": "v"}
        refused = await backend.try_acquire(name, "other", LONG, "host-b", {})
        assert isinstance(refused, HolderInfo) and refused.owner == "me"
        assert await backend.release(name, "me", granted.token)
        assert await backend.read(name) is None
        async with AsyncLock(backend, name, ttl=LONG) as lease:
            assert lease.token > granted.token
    no_leases(endpoints, prefix)


@pytest.mark.parametrize("mode", ["blackhole", "reset"])
async def test_two_instances_cut_off_is_a_typed_error(
    anyio_backend: str, endpoints: list[tuple[str, int]], prefix: str, mode: str
) -> None:
    async with through_proxies(endpoints, prefix) as (backend, proxies):
        for proxy in proxies[1:]:
            await proxy.set_mode(mode)
        name = new_name()
        with pytest.raises((BackendTimeout, BackendUnavailable)):
            await backend.try_acquire(name, "me", LONG, "host-a", {})
        # The reachable instance granted it, and was told to let it go before the error.
        assert lease_keys(endpoints[:1], prefix)[0] == []
        with pytest.raises(BackendError):
            await AsyncLock(backend, name, ttl=LONG).acquire_nowait()
        with pytest.raises(BackendError):
            await backend.read(name)
        assert lease_keys(endpoints[:1], prefix)[0] == []
    # What the cut-off instances received late was undone as it arrived.
    no_leases(endpoints, prefix)


async def test_a_late_grant_after_release_is_undone(
    anyio_backend: str, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    """An instance answers after the lease was granted by the others and released:
    its late grant is released when it arrives."""
    async with through_proxies(endpoints, prefix) as (backend, proxies):
        await proxies[2].blackhole()
        name = new_name()
        granted = await backend.try_acquire(name, "me", LONG, "me", {})
        assert isinstance(granted, Grant)
        assert await backend.release(name, "me", granted.token)
        await proxies[2].pass_through()
    no_leases(endpoints, prefix)


# -- validity -------------------------------------------------------------------------------


async def test_the_grant_counts_from_the_send_and_leaves_out_the_drift(
    anyio_backend: str, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    delay, ttl = 0.05, 10.0
    async with through_proxies(endpoints, prefix, request_timeout=2) as (backend, proxies):
        for proxy in proxies:
            await proxy.delay(delay)
        before = anyio.current_time()
        granted = await backend.try_acquire(new_name(), "me", ttl, "me", {})
        after = anyio.current_time()
        assert isinstance(granted, Grant)
        assert granted.ttl == pytest.approx(ttl - (ttl * 0.01 + 0.002))
        assert inner(backend).drift(ttl) == pytest.approx(ttl * 0.01 + 0.002)
        # Counted from before the first request went out, not from the replies.
        assert granted.sent_at is not None and before <= granted.sent_at <= after - 2 * delay


async def test_no_validity_left_means_no_grant(
    anyio_backend: str, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    """A majority granted, but ``ttl - elapsed - drift <= 0``: released everywhere."""
    options = {"request_timeout": 2, "drift_factor": 0.45, "drift_floor": 0.5}
    async with through_proxies(endpoints, prefix, **options) as (backend, proxies):
        for proxy in proxies:
            await proxy.delay(0.03)  # elapsed >= 0.06 s; drift 0.95 s of a 1 s ttl
        with pytest.raises(BackendTimeout):
            await backend.try_acquire(new_name(), "me", 1.0, "me", {})
        for proxy in proxies:
            await proxy.pass_through()
    no_leases(endpoints, prefix)


# -- cancellation ---------------------------------------------------------------------------


async def test_a_storm_of_cancelled_acquires_leaves_nothing(
    anyio_backend: str, open_redlock: Opener, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    rng = random.Random(4)
    cancelled = granted = 0
    names = [new_name() for _ in range(2)]

    async def contender(backend: Backend, rounds: int) -> None:
        nonlocal cancelled, granted
        for _ in range(rounds):
            lock = AsyncLock(backend, rng.choice(names), ttl=LONG)
            with anyio.move_on_after(rng.uniform(0, 0.025)) as scope:
                lease = await lock.acquire()
                granted += 1
                await lease.release()
            cancelled += scope.cancelled_caught

    async with open_redlock() as backend:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(contender, backend, 30)
    print(f"cancellation storm: {cancelled} cancelled, {granted} granted")
    assert cancelled >= 30, (cancelled, granted)
    no_leases(endpoints, prefix)


async def test_closing_ends_the_requests_left_behind(
    anyio_backend: str, endpoints: list[tuple[str, int]], prefix: str
) -> None:
    """A request the caller stopped waiting for (an instance hangs) is still under way
    at aclose(), and its driver ignores the cancellation: closing waits for its end, so
    none is left to end later with a raw redis-py error (trio-asyncio raises those of
    the tasks still running out of its loop as it closes), nor with one nobody retrieved
    (the loop's exception handler would hear of it)."""
    async with FaultProxy(*endpoints[2]) as cut:
        await cut.blackhole()

        async def check() -> None:
            loop = asyncio.get_running_loop()
            lost: list[dict[str, Any]] = []
            handler = loop.get_exception_handler()
            loop.set_exception_handler(lambda _, context: lost.append(context))
            before = asyncio.all_tasks()
            places = [*endpoints[:2], (cut.host, cut.port)]
            clients = [
                Stubborn(host=h, port=p, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
                for h, p in places
            ]
            try:
                backend = RedlockBackend(clients, prefix=prefix, request_timeout=0.1)
                # Decided by the two that answer: the third's request is cancelled (and
                # runs on until its socket timeout).
                assert await backend.read(new_name()) is None
                await backend.aclose()
                proxy = "aiolease.testing.proxy"  # its tasks share the loop under asyncio
                new = asyncio.all_tasks() - before
                left = [t for t in new if not t.done() and not t.get_name().startswith(proxy)]
                assert not left, f"still running after aclose(): {left}"
                gc.collect()
                assert not lost, lost
            finally:
                loop.set_exception_handler(handler)
                for client in clients:
                    await client.aclose()

        await on_asyncio(check)
        await cut.pass_through()


# -- safety ---------------------------------------------------------------------------------

DURATION = {Fault.SIGSTOP: 2.5, Fault.BLACKHOLE: 2.5}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("anyio_backend", "fault"),
    [
        # Each run starts four worker processes: each fault runs once, the loops taking
        # turns (docs/testing.md). Every run checks that no bodies overlap outside a pause.
        ("asyncio", Fault.SIGSTOP),
        ("trio", Fault.BLACKHOLE),
    ],
)
async def test_redlock_is_safe(
    anyio_backend: str,
    redlock_url: str,
    endpoints: list[tuple[str, int]],
    tmp_path: Path,
    fault: Fault,
) -> None:
    if fault is not Fault.BLACKHOLE:
        report = await short_run(redlock_url, fault, anyio_backend, tmp_path, DURATION)
    else:
        # Each worker's one proxy leads to a router that joins it to all three
        # instances: the blackhole cuts the holder off from every one of them.
        # The proxies and the router run in this process: a pause of its loop delays
        # every request, and a request may take at most a fifth of the ttl. A ttl of 1 s
        # leaves 200 ms; the blackhole outlasts it.
        options: dict[str, Any] = {
            **CUT_OFF_FRESH,
            "ttl": 1.0,
            "margin": 0.3,
            "fault_length": 1.5,
            "duration": 4.0,
        }
        async with RespRouter(endpoints) as router:
            report = await short_run(
                router.url(),
                fault,
                anyio_backend,
                tmp_path,
                DURATION,
                backend_factory="tests.backends.redlock.support:RoutedRedlock",
                **options,
            )
            assert min(router.routed) >= 1, router.routed
    print(report.line(), report.errors)
    assert_safe(report)
    assert report.acquisitions >= 2, report.line()
    if fault is Fault.SIGSTOP:
        assert report.losses >= 1 and report.stale_rejected >= 1, report.line()
    if fault is Fault.BLACKHOLE:
        assert report.losses >= 1, report.line()
