"""AsyncLock and Lease: the guarantees of DESIGN §1, on the memory backend with injected faults."""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable

import anyio
import pytest
from trio.testing import MockClock

import aiolease
from aiolease import (
    AsyncLock,
    Lease,
    LeaseExpiredError,
    LeaseHeldError,
    LeaseLostError,
    LossReason,
    _registry,
)
from aiolease.abc import HolderInfo
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.faults import FaultyBackend

pytestmark = pytest.mark.anyio

TTL = 0.6


@pytest.fixture
def inner() -> MemoryBackend:
    return MemoryBackend()


@pytest.fixture
def faulty(inner: MemoryBackend) -> FaultyBackend:
    return FaultyBackend(inner)


async def test_lost_at_local_deadline_before_server_expiry(
    inner: MemoryBackend, faulty: FaultyBackend
) -> None:
    seen_on_server: list[HolderInfo | None] = []
    lock = AsyncLock(faulty, "job", ttl=TTL)
    with pytest.raises(LeaseLostError) as info:
        async with lock as lease:
            faulty.hang("renew")
            try:
                await anyio.sleep_forever()
            finally:
                # Cancelled at the local deadline: the server must still hold our record.
                with anyio.CancelScope(shield=True):
                    seen_on_server.append(await inner.read("job"))
    # Renewals were sent and never answered: the backend could not be reached.
    assert info.value.reason is LossReason.UNREACHABLE
    assert lease.lost is LossReason.UNREACHABLE
    [holder] = seen_on_server
    assert holder is not None and holder.owner == lease.owner
    assert holder.remaining is not None and holder.remaining > 0


async def test_renewal_errors_until_deadline_mean_unreachable(faulty: FaultyBackend) -> None:
    lock = AsyncLock(faulty, "job", ttl=TTL)
    with pytest.raises(LeaseLostError) as info:
        async with lock:
            faulty.fail("renew")
            await anyio.sleep_forever()
    assert info.value.reason is LossReason.UNREACHABLE
    assert lock.statistics().renew_failures >= 1
    assert lock.statistics().losses == {LossReason.UNREACHABLE: 1}


async def test_transient_renewal_errors_are_retried(faulty: FaultyBackend) -> None:
    # A ttl of 2 s: the failed renewal is retried 50 ms later, well within the lease's
    # deadline even when a loaded CI machine stalls the loop for a few hundred ms
    # (with TTL, 0.6 s, the lease once expired before the retry ran).
    lock = AsyncLock(faulty, "job", ttl=2.0)
    async with lock as lease:
        faulty.fail("renew", times=1)
        while lock.statistics().renewals < 2:
            await faulty.wait_called("renew")
        assert lease.lost is None
    assert lock.statistics().renew_failures == 1
    assert lease.lost is LossReason.RELEASED


@pytest.mark.parametrize(
    "push", ["callback", "watch", "renewal"], ids=["callback", "watch", "renewal"]
)
async def test_stolen_lease_is_detected(
    inner: MemoryBackend, faulty: FaultyBackend, push: str
) -> None:
    if push == "watch":
        faulty.callbacks = False  # the takeover watch task: wait_taken, then a read
    if push == "renewal":
        inner.capabilities = frozenset()  # only renewals can tell
    thief = AsyncLock(inner, "job", ttl=TTL, identity="thief")
    after_cancel: list[str] = []
    with pytest.raises(LeaseLostError) as info:
        async with AsyncLock(faulty, "job", ttl=TTL) as lease:
            with anyio.CancelScope(shield=True):  # a push watch may cancel us at once
                inner.force_release("job")
                stolen = await thief.acquire_nowait()
            await anyio.sleep_forever()
            after_cancel.append("ran on")  # pragma: no cover - must not run
    assert info.value.reason is LossReason.STOLEN
    assert after_cancel == []
    assert stolen.token > lease.token
    holder = await inner.read("job")
    assert holder is not None and holder.owner == stolen.owner, (
        "the loser's release must not free it"
    )


async def test_body_exception_propagates_even_when_release_fails(faulty: FaultyBackend) -> None:
    faulty.fail("release")
    with pytest.raises(KeyError):
        async with AsyncLock(faulty, "job", ttl=TTL):
            raise KeyError("from the body")


async def test_release_is_bounded_when_the_backend_hangs(faulty: FaultyBackend) -> None:
    lock = AsyncLock(faulty, "job", ttl=TTL, release_timeout=0.1)
    with pytest.raises(KeyError):
        async with lock:
            faulty.hang("release")
            raise KeyError("from the body")
    assert faulty.calls["release"] == 1


async def test_a_hung_release_at_a_blocks_end_is_shielded_then_bounded(
    faulty: FaultyBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A block whose lease ended in time is released in its body's own scope (issue
    18): an outer cancellation while the release hangs does not cut it short; its
    bound (``release_timeout``) does, the block then ends without an exception of its
    own, and the outer cancellation goes on."""
    lock = AsyncLock(faulty, "job", ttl=TTL, release_timeout=0.2)
    faulty.hang("release")
    ended: list[float] = []
    # Watched from here: under trio the block can reach its release before the task
    # below first runs (a wait_called() there then waited for a second release: a hang).
    releasing = faulty.called("release")

    async def cancel_while_releasing(outer: anyio.CancelScope) -> None:
        await releasing.wait()
        outer.cancel()

    with anyio.CancelScope() as outer:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_while_releasing, outer)
            started = anyio.current_time()
            async with lock as lease:
                pass
            ended.append(anyio.current_time() - started)
            await anyio.sleep_forever()
    assert outer.cancelled_caught
    assert ended and ended[0] >= 0.2
    assert lease.lost is LossReason.RELEASED
    assert "timed out after 0.2s" in caplog.text


async def test_outer_cancellation_is_not_swallowed(inner: MemoryBackend) -> None:
    with anyio.CancelScope() as scope:
        async with AsyncLock(inner, "job", ttl=TTL):
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert await inner.read("job") is None


async def test_outer_cancellation_wins_over_loss(faulty: FaultyBackend) -> None:
    with anyio.CancelScope() as scope:
        async with AsyncLock(faulty, "job", ttl=TTL) as lease:
            faulty.hang("renew")
            try:
                await anyio.sleep_forever()
            finally:
                scope.cancel()
    assert scope.cancelled_caught
    assert lease.lost is LossReason.UNREACHABLE


async def test_cancelled_acquire_leaves_nothing_held(
    inner: MemoryBackend, faulty: FaultyBackend
) -> None:
    faulty.slow_reply("try_acquire", 10)
    lock = AsyncLock(faulty, "job", ttl=5)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lock.acquire)
        await inner.wait_changed("job", None)  # the grant reached the server
        assert faulty.calls["try_acquire"] == 1
        tg.cancel_scope.cancel()
    assert await inner.read("job") is None
    assert faulty.calls["release"] == 1


class HandsOffWhileWaiting(MemoryBackend):
    """Grants the name to a waiter inside ``wait_turn``, as hand-off backends do."""

    def __init__(self) -> None:
        super().__init__()
        self.handed = anyio.Event()

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await self.release(name, seen.owner, None)  # the holder lets go, and the name
        await self.try_acquire(name, owner, ttl, "waiter", {})  # goes to the waiter
        self.handed.set()
        await anyio.sleep_forever()


async def test_cancelled_wait_gives_back_a_hand_off() -> None:
    backend = HandsOffWhileWaiting()
    await AsyncLock(backend, "job", ttl=5).acquire()
    async with anyio.create_task_group() as tg:
        tg.start_soon(AsyncLock(backend, "job", ttl=5).acquire)
        await backend.handed.wait()
        assert await backend.read("job") is not None
        tg.cancel_scope.cancel()
    assert await backend.read("job") is None


async def test_lost_reply_leaves_nothing_held(inner: MemoryBackend, faulty: FaultyBackend) -> None:
    faulty.lose_reply("try_acquire")
    with pytest.raises(aiolease.BackendTimeout):
        await AsyncLock(faulty, "job", ttl=5).acquire_nowait()
    assert await inner.read("job") is None


async def test_acquire_timeout_and_cancel_scopes(inner: MemoryBackend) -> None:
    holder = await AsyncLock(inner, "job", ttl=5, identity="first").acquire()
    lock = AsyncLock(inner, "job", ttl=5)
    with pytest.raises(TimeoutError):
        await lock.acquire(timeout=0.05)
    with anyio.move_on_after(0.05) as scope:
        await lock.acquire()
    assert scope.cancelled_caught
    current = await inner.read("job")
    assert current is not None and current.owner == holder.owner


async def test_timeout_zero_is_one_try(inner: MemoryBackend) -> None:
    lock = AsyncLock(inner, "job", ttl=5, identity="first")
    lease = await lock.acquire(timeout=0)  # free: granted, not cancelled before it is sent
    assert (await inner.read("job")) is not None
    second = AsyncLock(inner, "job", ttl=5, identity="second")
    # One try, exactly as acquire_nowait(): LeaseHeldError naming the holder.
    one_try: list[Callable[[], Awaitable[Lease]]] = [
        functools.partial(second.acquire, timeout=0),
        second.acquire_nowait,
    ]
    for attempt in one_try:
        with pytest.raises(LeaseHeldError) as info:
            await attempt()
        assert info.value.holder is not None
        assert (info.value.holder.identity, info.value.holder.token) == ("first", lease.token)
    with pytest.raises(LeaseHeldError):
        async with second.hold(timeout=0):
            pytest.fail("entered a held lock")
    async with AsyncLock(inner, "other", ttl=5).hold(timeout=0) as held:
        assert held.token >= 1
    assert await lease.release()
    current = await inner.read("job")
    assert current is None


async def test_acquire_nowait_reports_the_holder(inner: MemoryBackend) -> None:
    first = await AsyncLock(inner, "job", ttl=5, identity="first", metadata={"k": "v"}).acquire()
    with pytest.raises(LeaseHeldError) as info:
        await AsyncLock(inner, "job", ttl=5).acquire_nowait()
    assert info.value.holder is not None
    assert (info.value.holder.identity, info.value.holder.token) == ("first", first.token)
    assert dict(info.value.holder.metadata) == {"k": "v"}


async def test_blocking_acquire_wakes_on_release(
    inner: MemoryBackend, faulty: FaultyBackend
) -> None:
    first = await AsyncLock(inner, "job", ttl=30).acquire()
    got: list[int] = []

    async def wait_for_it() -> None:
        got.append((await AsyncLock(faulty, "job", ttl=30).acquire(timeout=5)).token)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_it)
        await faulty.wait_called("wait_turn")
        assert await first.release() is True
    assert got == [first.token + 1]


async def test_release_of_a_lost_lease_returns_false(inner: MemoryBackend) -> None:
    lease = await AsyncLock(inner, "job", ttl=TTL).acquire()
    inner.force_release("job")
    other = await AsyncLock(inner, "job", ttl=TTL).acquire_nowait()
    with pytest.raises(LeaseLostError) as info:
        await lease.renew()
    assert info.value.reason is LossReason.STOLEN
    assert await lease.release() is False
    assert await lease.release() is False
    assert (await inner.read("job")) is not None
    assert await other.release() is True
    assert await other.release() is False


async def test_manual_lease_expires_by_its_deadline(inner: MemoryBackend) -> None:
    lease = await AsyncLock(inner, "job", ttl=0.2).acquire()
    assert await lease.wait_lost() is LossReason.EXPIRED
    assert lease.remaining == 0.0
    with pytest.raises(LeaseExpiredError):
        await lease.renew()


async def test_tokens_strictly_increase_and_one_lock_serves_many_tasks(
    inner: MemoryBackend,
) -> None:
    lock = AsyncLock(inner, "job", ttl=TTL)
    intervals: list[tuple[float, float, int]] = []

    async def worker() -> None:
        for _ in range(3):
            async with lock as lease:
                start = anyio.current_time()
                await anyio.sleep(0.001)
                intervals.append((start, anyio.current_time(), lease.token))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(worker)
    intervals.sort()
    assert len(intervals) == 12
    for (_, end, token), (start, _, next_token) in zip(intervals, intervals[1:], strict=False):
        assert end <= start and token < next_token
    assert lock.statistics().acquisitions == 12 and lock.statistics().held == 0


async def test_release_inside_the_body_ends_it_quietly(inner: MemoryBackend) -> None:
    reached: list[str] = []
    async with AsyncLock(inner, "job", ttl=TTL) as lease:
        assert await lease.release() is True
        await anyio.sleep_forever()
        reached.append("after")  # pragma: no cover
    assert reached == [] and lease.lost is LossReason.RELEASED
    assert await inner.read("job") is None


async def test_timing_defaults_and_deadline_from_send_time(faulty: FaultyBackend) -> None:
    lock = AsyncLock(faulty, "job", ttl=1.0)
    assert math.isclose(lock.timing.renew_interval, 1 / 3)
    assert math.isclose(lock.timing.margin, 0.1)
    faulty.slow_reply("try_acquire", 0.2)
    before = anyio.current_time()
    lease = await lock.acquire()
    # The deadline counts from the send, not from the (late) reply.
    assert lease.deadline <= before + 1.0 - 0.1 + 0.05
    assert lease.deadline < anyio.current_time() + 0.9 - 0.1
    await lease.release()


def test_lease_has_no_public_constructor() -> None:
    with pytest.raises(TypeError):
        aiolease.Lease()  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": ""}, "empty"),
        ({"name": "x" * 256}, "256 bytes"),
        ({"name": "é" * 128}, "256 bytes"),
        ({"name": "a\x00b"}, "NUL"),
        ({"name": 5}, "str"),
        ({"ttl": 0}, "ttl"),
        ({"ttl": -1}, "ttl"),
        ({"ttl": math.nan}, "ttl"),
        ({"ttl": True}, "ttl"),
        ({"ttl": 1, "renew_interval": 0.95}, "renew_interval"),
        ({"ttl": 1, "margin": 1}, "margin"),
        ({"identity": ""}, "identity"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"metadata": {"k": "v" * 5000}}, "metadata"),
    ],
)
async def test_bad_arguments_are_rejected_and_change_nothing(
    inner: MemoryBackend, kwargs: dict[str, object], match: str
) -> None:
    held = await AsyncLock(inner, "held", ttl=30).acquire()
    before = await inner.read("held")
    args: dict[str, object] = {"name": "fresh", "ttl": 5, **kwargs}
    name = args.pop("name")
    with pytest.raises(aiolease.InvalidArgument, match=match):
        AsyncLock(inner, name, **args)  # type: ignore[arg-type]
    with pytest.raises(aiolease.InvalidArgument, match=match):
        aiolease.Elector(inner, name, **args)  # type: ignore[arg-type]
    after = await inner.read("held")
    assert before is not None and after is not None and held.lost is None
    assert (after.owner, after.token) == (before.owner, before.token)
    assert await inner.read("fresh") is None


def test_a_remembered_timing_is_not_given_for_arguments_that_only_equal_it(
    inner: MemoryBackend,
) -> None:
    """Locks made with the same timing share its validation; ``True`` equals ``1`` but
    is no number of seconds, and an unhashable value is still checked."""
    assert AsyncLock(inner, "n", ttl=1).timing == AsyncLock(inner, "n", ttl=1.0).timing
    with pytest.raises(aiolease.InvalidArgument, match="ttl"):
        AsyncLock(inner, "n", ttl=True)
    with pytest.raises(aiolease.InvalidArgument, match="ttl"):
        AsyncLock(inner, "n", ttl=[1])  # type: ignore[arg-type]


async def test_bad_urls_are_typed_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    # A backend whose driver is not installed names the extra to install.
    monkeypatch.setitem(_registry.BUILTIN, "fake", "aiolease_no_such_driver:Backend")
    monkeypatch.setitem(_registry.EXTRAS, "fake", "fakedriver")
    with pytest.raises(aiolease.BackendNotFound, match="aiolease\\[fakedriver\\]"):
        async with aiolease.open_backend("fake://127.0.0.1:1/0"):
            pass  # pragma: no cover
    with pytest.raises(aiolease.BackendNotFound, match="known schemes"):
        async with aiolease.open_backend("nosuch://x"):
            pass  # pragma: no cover
    with pytest.raises(aiolease.InvalidArgument, match="no scheme"):
        async with aiolease.open_backend("just-a-path"):
            pass  # pragma: no cover
    with pytest.raises(aiolease.InvalidArgument):
        async with aiolease.open_backend("memory://host/path"):
            pass  # pragma: no cover
    with pytest.raises(aiolease.UnsupportedCapability, match="fair_queue"):
        async with aiolease.open_backend("memory://", require=[aiolease.Capability.FAIR_QUEUE]):
            pass  # pragma: no cover


async def test_open_backend_memory() -> None:
    async with aiolease.open_backend("memory://") as backend:
        async with AsyncLock(backend, "x", ttl=1) as lease:
            assert lease.token == 1


@pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
)
async def test_hour_long_ttl_under_trio_mock_clock(
    anyio_backend: object, inner: MemoryBackend, faulty: FaultyBackend
) -> None:
    """With trio's MockClock, hours of lease time pass instantly and exactly."""
    start = anyio.current_time()
    lock = AsyncLock(faulty, "job", ttl=3600, margin=60)
    with pytest.raises(LeaseLostError, match="unreachable"):
        async with lock as lease:
            while lease.renewals < 5:
                await faulty.wait_called("renew")
            faulty.hang("renew")
            await anyio.sleep_forever()
    # Renewals an interval apart, then the last confirmed send + ttl - margin.
    assert lease.renewals >= 5
    assert anyio.current_time() - start == lease.renewals * 1200 + 3600 - 60
    holder = await inner.read("job")
    assert holder is None, "released after the loss"


MOCK = pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
)


@MOCK
@pytest.mark.parametrize("callbacks", [True, False], ids=["on_taken", "wait_taken"])
async def test_a_held_lease_on_a_push_backend_reads_nothing(
    anyio_backend: object, faulty: FaultyBackend, callbacks: bool
) -> None:
    """No read at the start (the grant tells who holds it) and none on a timer: only
    renewals, one per renew interval, confirm ownership while nothing is pushed."""
    faulty.callbacks = callbacks
    async with AsyncLock(faulty, "job", ttl=3) as lease:
        await anyio.sleep(30)  # virtual: ten ttls
        assert lease.lost is None
    assert faulty.calls["read"] == 0
    assert faulty.calls["wait_changed"] == 0
    assert faulty.calls["on_taken"] == (1 if callbacks else 0)
    assert faulty.calls["wait_taken"] == (0 if callbacks else 1)
    renewals = faulty.calls["renew"] + faulty.calls["renew_many"]  # a batch of one, here
    assert 29 <= renewals <= 31  # every ttl / 3


@pytest.mark.parametrize("callbacks", [True, False], ids=["on_taken", "wait_taken"])
async def test_the_takeover_watch_ignores_renewals_and_sees_a_takeover(
    inner: MemoryBackend, faulty: FaultyBackend, callbacks: bool
) -> None:
    faulty.callbacks = callbacks
    with pytest.raises(LeaseLostError) as info:
        async with AsyncLock(faulty, "job", ttl=TTL) as lease:
            await lease.renew()
            await inner.renew("job", lease.owner, lease.token, TTL)
            assert faulty.calls["read"] == 0 and lease.lost is None
            with anyio.CancelScope(shield=True):
                inner.force_release("job")
                await inner.try_acquire("job", "thief", TTL, "thief", {})
            await anyio.sleep_forever()
    assert info.value.reason is LossReason.STOLEN
    assert faulty.calls["read"] == (0 if callbacks else 1)


async def test_memory_on_taken_reports_release_and_takeover_only(inner: MemoryBackend) -> None:
    taken: list[LossReason] = []
    grant = await inner.try_acquire("job", "me", 5, "me", {})
    assert not isinstance(grant, HolderInfo)
    stop = inner.on_taken("job", "me", grant.token, taken.append)
    await inner.renew("job", "me", grant.token, 5)
    assert isinstance(await inner.try_acquire("job", "other", 5, "other", {}), HolderInfo)
    assert taken == []
    inner.force_release("job")
    assert taken == [LossReason.STOLEN]
    stop()  # after the report: harmless
    # Already gone when subscribing: reported at once. Unsubscribed: never.
    inner.on_taken("job", "me", grant.token, taken.append)
    assert taken == [LossReason.STOLEN] * 2
    grant = await inner.try_acquire("job", "me", 5, "me", {})
    assert not isinstance(grant, HolderInfo)
    inner.on_taken("job", "me", grant.token, taken.append)()
    inner.force_release("job")
    assert taken == [LossReason.STOLEN] * 2


async def test_locks_nest_in_one_task_and_exits_pair_per_task(inner: MemoryBackend) -> None:
    lock, other = AsyncLock(inner, "a", ttl=TTL), AsyncLock(inner, "b", ttl=TTL)
    async with lock as outer:
        async with other as middle:
            async with AsyncLock(inner, "c", ttl=TTL) as inner_lease:
                pass
            assert inner_lease.lost is LossReason.RELEASED and middle.lost is None
        assert middle.lost is LossReason.RELEASED and outer.lost is None
        with pytest.raises(RuntimeError, match="without __aenter__"):
            await other.__aexit__(None, None, None)
    assert outer.lost is LossReason.RELEASED
    assert lock.statistics().held == 0


class _ReleasesNow(MemoryBackend):
    """Sends its release at once (Backend.release_now), noting what the core does when."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool]:
        self.calls.append("release_now")
        return self._finish(name, owner, token)

    async def _finish(self, name: str, owner: str, token: int) -> bool:
        self.calls.append("awaited")
        return await super().release(name, owner, token)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        self.calls.append("release")
        return await super().release(name, owner, token)


async def test_a_block_sends_a_release_now_before_its_bookkeeping_and_awaits_it() -> None:
    backend = _ReleasesNow()
    async with AsyncLock(backend, "now", ttl=TTL) as lease:
        lease._on_end(lambda reason: backend.calls.append(f"ended {reason.value}"))
    assert backend.calls == ["release_now", "ended released", "awaited"]
    assert await backend.read("now") is None
    await (await AsyncLock(backend, "now", ttl=TTL).acquire()).release()
    assert backend.calls[-1] == "release"  # Lease.release() asks release() as before


async def test_a_release_now_that_raises_falls_back_to_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(MemoryBackend):
        def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool]:
            raise RuntimeError("a bug")

    backend = Broken()
    async with AsyncLock(backend, "broken", ttl=TTL):
        pass
    assert await backend.read("broken") is None
    assert "release_now of lease 'broken' failed" in caplog.text
