"""The renewal scheduler: one task per backend renews every lease held through it.

Exact times come from trio's ``MockClock`` (virtual time, no waiting); the other
tests wait on events only.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest
from trio.testing import MockClock

import aiolease
from aiolease import (
    AsyncLock,
    BackendUnavailable,
    Capability,
    Lease,
    LeaseLostError,
    LossReason,
    open_backend,
)
from aiolease._renewer import Renewer, stop_own_service
from aiolease.abc import Backend, Grant, HolderInfo, Renewal, RenewResult
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.faults import FaultyBackend

pytestmark = pytest.mark.anyio

MOCK = pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
)


class Quiet(MemoryBackend):
    """The memory model without push wake-ups (so no takeover watch per lease), whose
    renewals of some names hang or fail, and which counts renewals and the renewer's
    tasks seen during them."""

    capabilities = frozenset({Capability.SERVER_TIME})

    def __init__(self) -> None:
        super().__init__()
        self.hang: set[str] = set()
        self.fail: set[str] = set()
        self.renewed: dict[str, int] = {}
        self.schedulers_seen: set[int] = set()
        self.renewed_event = anyio.Event()

    #: Renewals one by one, through :meth:`renew` below (the memory backend's own
    #: batch would bypass it): the core then renews each lease in a task of its own.
    renew_many = Backend.renew_many

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        self.schedulers_seen.add(_renewer_tasks())
        self.renewed[name] = self.renewed.get(name, 0) + 1
        self.renewed_event.set()
        self.renewed_event = anyio.Event()
        if name in self.hang:
            await anyio.sleep_forever()
        if name in self.fail:
            raise BackendUnavailable(f"renewal of {name} refused")
        return await super().renew(name, owner, token, ttl)


def _renewer_tasks() -> int:
    return sum(task.name == "aiolease renewer" for task in anyio.get_running_tasks())


async def _hold_all(
    stack: AsyncExitStack, backend: Any, names: list[str], ttl: float
) -> list[Lease]:
    return [await stack.enter_async_context(AsyncLock(backend, n, ttl=ttl)) for n in names]


@MOCK
async def test_many_leases_are_renewed_by_one_task(anyio_backend: object) -> None:
    backend, count = Quiet(), 50
    async with AsyncExitStack() as stack:
        leases = await _hold_all(stack, backend, [f"n{i}" for i in range(count)], ttl=3)
        assert _renewer_tasks() == 1
        await anyio.sleep(10)  # virtual: renewals at 1, 2, ..., 10 s
        assert all(lease.lost is None for lease in leases)
        assert all(lease.renewals >= 9 for lease in leases)
        stats = Renewer.of(backend).statistics()
    assert backend.schedulers_seen == {1}
    assert stats.leases == count and stats.hosts == 1
    # One wake-up per renew interval for all of them (a timer per lease: 500 and more).
    assert stats.wakeups <= 2 * 10 + 2, stats
    assert _renewer_tasks() == 0  # it ended with the last lease


async def test_the_renewer_moves_when_its_host_leaves(anyio_backend: str) -> None:
    backend = Quiet()
    lock = AsyncLock(backend, "first", ttl=0.6)
    first_in, first_out, first_left = anyio.Event(), anyio.Event(), anyio.Event()

    async def first() -> None:
        async with lock:  # the first block hosts the renewer
            # Its task runs by its first renewal (under asyncio it starts only then).
            while backend.renewed.get("first", 0) < 1:
                await backend.renewed_event.wait()
            first_in.set()
            await first_out.wait()
        first_left.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await first_in.wait()
            async with AsyncLock(backend, "second", ttl=0.6) as second:
                first_out.set()
                await first_left.wait()
                before = backend.renewed.get("second", 0)
                while backend.renewed.get("second", 0) < before + 2:
                    await backend.renewed_event.wait()
                assert second.lost is None
                # Under asyncio the scheduler of a backend made from its class runs in
                # a service of its own from the first block on: one task, which no
                # block's leaving moves (Renewer.serve_here). Under trio it moves.
                assert Renewer.of(backend).statistics().hosts == (
                    1 if anyio_backend == "asyncio" else 2
                )
    assert second.lost is LossReason.RELEASED


def test_a_backend_used_on_a_second_event_loop_is_served_there_again() -> None:
    """The service an asyncio loop gave a backend made from its class went with that
    loop (its task was cancelled when ``asyncio.run`` ended): a block on the next loop
    serves the backend there, and its lease is renewed (not left to expire with a
    dead task as its scheduler)."""
    backend = Quiet()

    async def hold_until_renewed(name: str) -> None:
        backend.renewed_event = anyio.Event()  # of this loop
        with anyio.fail_after(10):
            async with AsyncLock(backend, name, ttl=0.3) as lease:
                while backend.renewed.get(name, 0) < 2:
                    await backend.renewed_event.wait()
                assert lease.lost is None

    asyncio.run(hold_until_renewed("first"))
    asyncio.run(hold_until_renewed("second"))
    assert Renewer.of(backend).statistics().hosts == 2  # one task per loop


async def test_short_blocks_share_one_renewer_task_under_asyncio(anyio_backend: str) -> None:
    backend = Quiet()  # (no open_backend: under trio each block hosts the task)
    lock = AsyncLock(backend, "short", ttl=10)
    for _ in range(3):
        async with lock:
            await anyio.lowlevel.checkpoint()
    # Under asyncio the first block served the scheduler with a task of the loop's,
    # which the later blocks share (no task group per block); trio has no task that
    # outlives its nursery: a task per block.
    assert Renewer.of(backend).statistics().hosts == (1 if anyio_backend == "asyncio" else 3)
    await backend.aclose()  # stops that service
    assert not Renewer.of(backend).served


async def test_a_put_off_start_comes_sooner_for_a_lease_due_sooner(anyio_backend: str) -> None:
    backend = Quiet()
    with anyio.fail_after(10):
        async with AsyncLock(backend, "slow", ttl=30):  # its renewal is 10 s away
            async with AsyncLock(backend, "fast", ttl=0.3) as fast:  # renewed every 0.1 s
                while backend.renewed.get("fast", 0) < 3:
                    await backend.renewed_event.wait()
                assert fast.lost is None
    assert fast.lost is LossReason.RELEASED and "slow" not in backend.renewed


async def test_a_lease_whose_renewals_fail_is_lost_at_its_deadline_without_a_task_yet(
    anyio_backend: str,
) -> None:
    backend = Quiet()
    backend.fail.add("failing")
    with anyio.fail_after(10):
        with pytest.raises(LeaseLostError) as caught:
            async with AsyncLock(backend, "failing", ttl=0.3) as lease:
                await anyio.sleep_forever()  # cancelled when the lease is lost
    assert caught.value.reason is LossReason.UNREACHABLE and lease.lost is LossReason.UNREACHABLE


@MOCK
async def test_a_hanging_renewal_delays_no_other_deadline(anyio_backend: object) -> None:
    backend = Quiet()
    backend.hang.add("hangs")
    backend.fail.add("fails")
    ended: dict[str, tuple[float, LossReason]] = {}
    leases: dict[str, Lease] = {}
    start = anyio.current_time()

    async def hold(name: str) -> None:
        try:
            async with AsyncLock(backend, name, ttl=3) as lease:
                leases[name] = lease
                await anyio.sleep_forever()
        except LeaseLostError as exc:
            ended[name] = (round(anyio.current_time() - start, 6), exc.reason)

    async with anyio.create_task_group() as tg:
        for name in ("hangs", "fails", "fine"):
            tg.start_soon(hold, name)
        await anyio.sleep(60)
        assert leases["fine"].lost is None
        assert leases["fine"].renewals >= 59
        tg.cancel_scope.cancel()
    # Each ends exactly at its deadline (sent at 0, ttl 3, margin 0.3), whatever the
    # other's renewal does: one hangs (each attempt bounded by the renew interval).
    assert ended == {"hangs": (2.7, LossReason.UNREACHABLE), "fails": (2.7, LossReason.UNREACHABLE)}
    assert backend.renewed["hangs"] == 2  # at 1 s, then at 2 s after the first timed out
    assert backend.renewed["fails"] > 3  # retried with back-off until the deadline


@MOCK
async def test_a_backend_from_open_backend_runs_the_renewer_for_every_hold(
    anyio_backend: object,
) -> None:
    async with aiolease.open_backend("memory://") as backend:
        renewer = Renewer.of(backend)
        assert renewer.served and _renewer_tasks() == 1  # waiting, before any lease
        for i in range(5):  # one after the other: each hold starts no task of its own
            async with AsyncLock(backend, f"n{i}", ttl=3) as lease:
                await anyio.sleep(4)  # virtual: renewed at 1, 2, 3 s
                assert lease.renewals >= 3 and _renewer_tasks() == 1
        assert renewer.statistics().hosts == 1
    assert _renewer_tasks() == 0
    assert not renewer.served


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_backend_opened_by_one_task_may_be_closed_by_another(anyio_backend: str) -> None:
    """pytest-asyncio's fixtures and aiohttp's cleanup contexts open in one task and close
    in another: the scheduler's home must not be bound to the opening task."""
    stack = AsyncExitStack()
    backend = await asyncio.create_task(stack.enter_async_context(open_backend("memory://")))
    async with AsyncLock(backend, "n", ttl=1) as lease:
        await anyio.sleep(2.5)  # held past its ttl: renewed by open_backend's scheduler
        assert lease.lost is None and lease.renewals >= 3
    await asyncio.create_task(stack.aclose())
    assert not Renewer.of(backend).served


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_block_is_added_to_the_renewer_at_the_loops_next_step(anyio_backend: str) -> None:
    # Under asyncio, with a served scheduler: a body that ends before the loop's next
    # step costs the scheduler nothing; one that awaits is added while it waits, and
    # renewed as any other.
    async with aiolease.open_backend("memory://") as backend:
        renewer = Renewer.of(backend)
        async with AsyncLock(backend, "short", ttl=3):
            assert renewer.statistics().leases == 0
        await anyio.lowlevel.checkpoint()
        assert renewer.statistics().leases == 0 and renewer.statistics().entries == 0
        async with AsyncLock(backend, "long", ttl=0.3) as lease:
            await anyio.lowlevel.checkpoint()
            assert renewer.statistics().leases == 1
            await anyio.sleep(0.5)  # past its ttl: kept by renewals
            assert lease.lost is None and lease.renewals >= 1
        assert renewer.statistics().leases == 0


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_under_trio_asyncio_a_block_is_added_to_the_renewer_at_once(
    anyio_backend: str,
) -> None:
    # trio-asyncio's loop answers asyncio._get_running_loop() in trio's tasks too: the
    # block is still trio's, and adds its lease at once (a callback of that loop would
    # run the scheduler from asyncio's side).
    import trio_asyncio

    async with trio_asyncio.open_loop(), aiolease.open_backend("memory://") as backend:
        async with AsyncLock(backend, "n", ttl=3):
            assert Renewer.of(backend).statistics().leases == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_lease_not_yet_added_ends_when_the_service_stops(anyio_backend: str) -> None:
    backend = MemoryBackend()  # served by its first block, stopped by stop_own_service
    with pytest.raises(LeaseLostError) as info:
        async with AsyncLock(backend, "n", ttl=30) as lease:
            stop_own_service(backend)  # before the loop's next step
    assert info.value.reason is LossReason.SHUTDOWN and lease.lost is LossReason.SHUTDOWN
    await backend.aclose()


async def test_closing_the_backend_ends_the_leases_held_through_it(anyio_backend: str) -> None:
    entered, lost = anyio.Event(), anyio.Event()
    reasons: list[LossReason] = []

    async def holder(backend: Backend) -> None:
        with pytest.raises(LeaseLostError) as info:
            async with AsyncLock(backend, "held", ttl=30) as lease:
                entered.set()
                await anyio.sleep_forever()  # cancelled by the shutdown
        reasons.append(info.value.reason)
        assert lease.lost is LossReason.SHUTDOWN
        lost.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async with aiolease.open_backend("memory://") as backend:
                tg.start_soon(holder, backend)
                await entered.wait()
            await lost.wait()
    assert reasons == [LossReason.SHUTDOWN]


@MOCK
async def test_next_renewal_counts_from_the_backends_earlier_send_time(
    anyio_backend: object,
) -> None:
    class Early(Quiet):
        async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
            grant = await super().renew(name, owner, token, ttl)
            return Grant(grant.token, grant.ttl, anyio.current_time() - 0.5)

    backend = Early()
    times: list[float] = []
    async with AsyncLock(backend, "n", ttl=3) as lease:
        while len(times) < 3:
            await backend.renewed_event.wait()
            times.append(anyio.current_time())
        assert lease.lost is None
    # Confirmed as sent 0.5 s before each call: the next one comes 1 s after that.
    assert [round(b - a, 6) for a, b in zip(times, times[1:], strict=False)] == [0.5, 0.5]


class Clock:
    """A session clock the test moves by hand."""

    def __init__(self, expires: float) -> None:
        self.expires = expires
        self.error: BaseException | None = None


class Held(Quiet):
    """A session backend that keeps held grants itself (``hold``)."""

    capabilities = frozenset({Capability.SERVER_TIME, Capability.SESSION})

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.ended: dict[str, Any] = {}

    def hold(self, name: str, owner: str, token: int, ended: Any) -> Clock:
        self.ended[name] = ended
        return self.clock

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        result = await super().try_acquire(name, owner, ttl, identity, metadata)
        if isinstance(result, Grant):  # a grant on the session: good until it expires
            return Grant(result.token, ttl, self.clock.expires - ttl)
        return result


@MOCK
async def test_session_leases_follow_their_session_and_are_never_renewed(
    anyio_backend: object,
) -> None:
    clock = Clock(anyio.current_time() + 3)
    backend = Held(clock)
    with pytest.raises(LeaseLostError):  # when the blocks are left, after the loss
        async with AsyncExitStack() as stack:
            leases = await _hold_all(stack, backend, [f"n{i}" for i in range(20)], ttl=3)
            for _ in range(10):  # the session's keepalives, every second
                await anyio.sleep(1)
                clock.expires = anyio.current_time() + 3
            assert all(lease.lost is None for lease in leases)
            assert leases[0].deadline == clock.expires - leases[0].timing.margin
            stats = Renewer.of(backend).statistics()
            assert stats.renewals == 0 and backend.renewed == {}
            assert stats.wakeups <= 10  # one deadline for the whole session, never per lease
            with pytest.raises(LeaseLostError) as info:
                async with AsyncLock(backend, "last", ttl=3) as lease:
                    clock.error = BackendUnavailable("keepalive refused")
                    await anyio.sleep_forever()  # the keepalives stopped: ends at the deadline
            assert info.value.reason is LossReason.UNREACHABLE
            assert anyio.current_time() == clock.expires - lease.timing.margin
            assert all(lease.lost is LossReason.UNREACHABLE for lease in leases)
    assert backend.renewed == {}


async def test_a_session_backend_ends_a_held_lease_at_once(anyio_backend: str) -> None:
    backend = Held(Clock(anyio.current_time() + 30))
    with anyio.fail_after(10), pytest.raises(LeaseLostError) as info:
        async with AsyncLock(backend, "n", ttl=30):
            backend.ended["n"](LossReason.STOLEN)
            await anyio.sleep_forever()
    assert info.value.reason is LossReason.STOLEN
    assert await backend.read("n") is None


# -- an outer cancellation at the moment of the loss ---------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_task_cancel_at_the_loss_is_not_swallowed(anyio_backend: str) -> None:
    backend = Held(Clock(anyio.current_time() + 30))
    entered = anyio.Event()

    async def holder() -> None:
        async with AsyncLock(backend, "n", ttl=30):
            entered.set()
            await anyio.sleep_forever()

    task = asyncio.ensure_future(holder())
    await entered.wait()
    backend.ended["n"](LossReason.STOLEN)  # the loss cancels the block...
    task.cancel()  # ...and so does the application, at the same moment
    # Python 3.10 counts no cancellations (no Task.cancelling()): asyncio folds this
    # Task.cancel() into the scope's own, and nothing can tell them apart. The block
    # then raises the loss: the task still ends by an exception, never returns.
    ended = asyncio.CancelledError if sys.version_info >= (3, 11) else LeaseLostError
    with anyio.fail_after(10), pytest.raises(ended):
        await task
    assert await backend.read("n") is None


async def test_an_outer_scope_cancelled_at_the_loss_is_not_swallowed(anyio_backend: str) -> None:
    backend = Held(Clock(anyio.current_time() + 30))
    with anyio.fail_after(10):
        with anyio.CancelScope() as outer:
            async with AsyncLock(backend, "n", ttl=30) as lease:
                backend.ended["n"](LossReason.STOLEN)
                outer.cancel()
                await anyio.sleep_forever()
    assert outer.cancelled_caught
    assert lease.lost is LossReason.STOLEN
    assert await backend.read("n") is None


@MOCK
async def test_a_renewal_interrupted_by_the_move_is_done_again(anyio_backend: object) -> None:
    """The host's block ends just as the other lease's renewal is due (both at 1 s of
    virtual time): the renewal, started or not, is made again by the moved task."""
    backend = Quiet()
    locks = AsyncLock(backend, "host", ttl=3), AsyncLock(backend, "other", ttl=3)
    hosting = anyio.Event()

    async def host() -> None:
        async with locks[0]:
            hosting.set()
            await anyio.sleep(1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(host)
        await hosting.wait()
        async with locks[1] as other:
            await anyio.sleep(10)
            assert other.lost is None
            assert other.renewals >= 9
    assert Renewer.of(backend).statistics().hosts >= 2


async def test_the_fault_wrapper_forwards_hold_unless_told_not_to(anyio_backend: str) -> None:
    inner = Held(Clock(anyio.current_time() + 30))
    faulty = FaultyBackend(inner)
    async with AsyncLock(faulty, "kept", ttl=30):
        assert faulty.calls["hold"] == 1 and "kept" in inner.ended
    faulty.sessions = False  # renewals go through the wrapper, where faults apply
    async with AsyncLock(faulty, "renewed", ttl=30):
        assert "renewed" not in inner.ended


# -- backends that renew many leases in one call ---------------------------------------------


class Many(Quiet):
    """Renews through ``renew_many``: records each call's names; a name in ``fail``
    fails alone, ``fail_call`` fails whole calls (it overrides ``renew_many``, so
    :attr:`Backend.renews_many` is set)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []
        self.fail_call = 0

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        self.calls.append([name for name, *_ in renewals])
        if self.fail_call:
            self.fail_call -= 1
            raise BackendUnavailable("the whole call failed")
        return await super().renew_many(renewals)


@MOCK
async def test_leases_granted_apart_are_renewed_in_one_call_per_interval(
    anyio_backend: object,
) -> None:
    backend, count = Many(), 30
    async with AsyncExitStack() as stack:
        leases = []
        for i in range(count):  # granted over 1.5 s: due at 30 different times
            leases.append(await stack.enter_async_context(AsyncLock(backend, f"n{i}", ttl=3)))
            await anyio.sleep(0.05)
        backend.calls.clear()
        await anyio.sleep(10)  # virtual: every lease due about 10 times
        assert all(lease.lost is None and lease.renewals >= 9 for lease in leases)
        assert _renewer_tasks() == 1
    # Early renewals align them: about one call per renew interval, not one per lease.
    assert len(backend.calls) <= 12, [len(c) for c in backend.calls]
    assert max(len(c) for c in backend.calls) == count
    assert sum(backend.renewed.values()) >= 9 * count  # through renew_many's default


@MOCK
async def test_one_lease_refused_in_a_call_ends_alone(anyio_backend: object) -> None:
    backend = Many()
    with pytest.raises(LeaseLostError) as info:
        async with AsyncLock(backend, "kept", ttl=3) as kept:
            async with AsyncLock(backend, "taken", ttl=3) as taken:
                assert await backend.release("taken", taken.owner, None)  # behind its back
                await anyio.sleep(10)
    assert info.value.reason is LossReason.STOLEN
    assert kept.lost is LossReason.RELEASED and kept.renewals >= 1


@MOCK
async def test_a_failed_call_is_retried_for_every_lease_in_it(anyio_backend: object) -> None:
    backend = Many()
    locks = [AsyncLock(backend, f"n{i}", ttl=3) for i in range(5)]
    async with AsyncExitStack() as stack:
        leases = [await stack.enter_async_context(lock) for lock in locks]
        backend.fail_call = 2
        await anyio.sleep(3)
        assert all(lease.lost is None and lease.renewals >= 2 for lease in leases)
    assert all(lock.statistics().renew_failures == 2 for lock in locks)


class AsAsked(Quiet):
    """Renews through the memory backend's own ``renew_many`` (a :class:`RenewedAsAsked`
    answer), recording each call's renewals."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Sequence[Renewal]] = []

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        self.calls.append(renewals)
        return await MemoryBackend.renew_many(self, renewals)


@MOCK
async def test_a_compact_answer_ends_the_refused_lease_alone(anyio_backend: object) -> None:
    backend = AsAsked()
    with pytest.raises(LeaseLostError) as info:
        await _hold_two_timings(backend)
    assert info.value.reason is LossReason.STOLEN
    assert isinstance(await MemoryBackend.renew_many(backend, []), aiolease.abc.RenewedAsAsked)


async def _hold_two_timings(backend: AsAsked) -> None:
    async with AsyncExitStack() as stack:
        # Two timings in one batch: each lease's deadline follows its own ttl.
        short = await _hold_all(stack, backend, [f"s{i}" for i in range(3)], ttl=3)
        long = await _hold_all(stack, backend, [f"l{i}" for i in range(3)], ttl=6)
        taken = short[1]
        backend.force_release(taken.name)  # behind its back
        await anyio.sleep(10)
        assert taken.lost is LossReason.STOLEN
        assert [lease.lost for lease in short + long if lease is not taken] == [None] * 5
        assert all(lease.renewals >= 4 for lease in short + long if lease is not taken)
        now = anyio.current_time()
        assert all(now + 2 - 0.3 <= lease.deadline <= now + 3 for lease in short[::2])
        assert all(now + 4 - 0.6 <= lease.deadline <= now + 6 for lease in long)


@MOCK
async def test_a_cohort_is_renewed_with_the_same_renewals_until_one_ends(
    anyio_backend: object,
) -> None:
    backend = AsAsked()
    async with AsyncExitStack() as stack:
        leases = await _hold_all(stack, backend, [f"n{i}" for i in range(4)], ttl=3)
        await anyio.sleep(5)
        steady = backend.calls[-3:]
        assert all(call is steady[0] for call in steady)  # one list, tick after tick
        assert [r[0] for r in steady[0]] == [lease.name for lease in leases]
        await leases[2].release()
        await anyio.sleep(3)
        after = backend.calls[-1]
        assert after is not steady[0]
        assert [r[0] for r in after] == [leases[i].name for i in (0, 1, 3)]
        assert all(lease.lost is None for i, lease in enumerate(leases) if i != 2)


class Stalls(AsAsked):
    """:class:`AsAsked`, whose calls hang once ``stall`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.stall = False

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        if self.stall:
            self.calls.append(renewals)
            await anyio.sleep_forever()
        return await super().renew_many(renewals)


@MOCK
async def test_a_steady_cohort_is_confirmed_without_a_write_per_lease(
    anyio_backend: object,
) -> None:
    backend = AsAsked()
    locks = [AsyncLock(backend, f"n{i}", ttl=3) for i in range(4)]
    async with AsyncExitStack() as stack:
        leases = [await stack.enter_async_context(lock) for lock in locks]
        await anyio.sleep(3.5)  # settled: renewed together, in one call per tick
        own = [(lease._deadline, lease._renewals) for lease in leases]
        seen = [(lease.deadline, lease.renewals) for lease in leases]
        calls = len(backend.calls)
        await anyio.sleep(3)
        assert len(backend.calls) == calls + 3
        # Three ticks confirmed them all: what each lease reads moved on ...
        now = anyio.current_time()
        for lease, (deadline, renewals) in zip(leases, seen, strict=True):
            assert lease.lost is None and lease.renewals == renewals + 3
            assert deadline + 3 - 1e-9 <= lease.deadline <= now + 3 - 0.3
        # ... while the leases themselves were not written to: the cohort's shared
        # state was (docs/internals/renewal.md, "What a tick costs").
        assert [(lease._deadline, lease._renewals) for lease in leases] == own
        assert [lock.statistics().renewals for lock in locks] == [
            lease.renewals for lease in leases
        ]
        await leases[1].release()  # leaves the cohort with what it had counted
        ended = leases[1].renewals, leases[1].deadline
        await anyio.sleep(3)
        assert (leases[1].renewals, leases[1].deadline) == ended
        assert locks[1].statistics().renewals == ended[0]
        assert all(leases[i].lost is None for i in (0, 2, 3))
        assert [locks[i].statistics().renewals for i in (0, 2, 3)] == [
            leases[i].renewals for i in (0, 2, 3)
        ]
        assert min(leases[i].renewals for i in (0, 2, 3)) >= ended[0] + 2


@MOCK
async def test_a_lease_due_with_a_steady_cohort_joins_its_ride(anyio_backend: object) -> None:
    backend = AsAsked()
    locks = [AsyncLock(backend, f"n{i}", ttl=3) for i in range(5)]
    async with AsyncExitStack() as stack:
        leases = [await stack.enter_async_context(lock) for lock in locks[:4]]
        await anyio.sleep(3.5)  # a steady cohort: one ride for the four
        ride = leases[0]._ride
        assert ride is not None and all(lease._ride is ride for lease in leases)
        own = [(lease._deadline, lease._renewals) for lease in leases]
        leases.append(await stack.enter_async_context(locks[4]))
        await anyio.sleep(3)
        # The newcomer joined the cohort's ride; the cohort's members were not made
        # anew (the same ride, their own fields never written: the join cost only the
        # newcomer), and every count reads as it would have alone.
        assert all(lease._ride is ride for lease in leases)
        assert [(lease._deadline, lease._renewals) for lease in leases[:4]] == own
        assert [r[0] for r in backend.calls[-1]] == [lease.name for lease in leases]
        joined = sum(leases[4].name in {r[0] for r in call} for call in backend.calls)
        assert leases[4].renewals == joined >= 2
        assert [lock.statistics().renewals for lock in locks] == [
            lease.renewals for lease in leases
        ]
        now = anyio.current_time()
        assert all(lease.lost is None and lease.deadline > now + 1.5 for lease in leases)
        await leases[4].release()  # leaves the ride with what it counted there
        ended = leases[4].renewals
        await anyio.sleep(3)
        assert leases[4].renewals == locks[4].statistics().renewals == ended
        assert [lock.statistics().renewals for lock in locks[:4]] == [
            lease.renewals for lease in leases[:4]
        ]
        assert all(lease.lost is None for lease in leases[:4])


@MOCK
async def test_a_lease_refused_as_it_joins_a_cohort_ends_alone(anyio_backend: object) -> None:
    backend = AsAsked()
    locks = [AsyncLock(backend, f"n{i}", ttl=3) for i in range(4)]
    async with AsyncExitStack() as stack:
        leases = [await stack.enter_async_context(lock) for lock in locks[:3]]
        await anyio.sleep(3.5)  # a steady cohort
        calls = len(backend.calls)
        with pytest.raises(LeaseLostError) as info:
            async with locks[3] as newcomer:
                backend.force_release(newcomer.name)  # before its first renewal
                await anyio.sleep(3)
        assert info.value.reason is LossReason.STOLEN
        # Refused in the call it shared with the cohort: it alone ended; the others
        # stay held, renewed in every call since, and counted right.
        assert {r[0] for r in backend.calls[-1]} == {"n0", "n1", "n2", "n3"}
        before = [lease.renewals for lease in leases]
        await anyio.sleep(3.5)  # three ticks
        assert all(lease.lost is None for lease in leases)
        assert [lease.renewals for lease in leases] == [n + 3 for n in before]
        assert all("n3" not in {r[0] for r in call} for call in backend.calls[-3:])
    assert len(backend.calls) > calls
    assert [lock.statistics().renewals for lock in locks] == [
        lease.renewals for lease in [*leases, newcomer]
    ]


@MOCK
async def test_a_steady_cohort_unanswered_is_lost_at_its_last_confirmed_deadline(
    anyio_backend: object,
) -> None:
    backend = Stalls()
    ended: dict[str, tuple[float, LossReason]] = {}
    deadlines: dict[str, float] = {}

    async def hold(name: str) -> None:
        try:
            async with AsyncLock(backend, name, ttl=3) as lease:
                await anyio.sleep(4.5)  # settled into a steady cohort
                backend.stall = True
                deadlines[name] = lease.deadline
                await anyio.sleep_forever()
        except LeaseLostError as exc:
            ended[name] = (anyio.current_time(), exc.reason)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(hold, f"n{i}")
    assert set(ended) == {"n0", "n1", "n2"}
    for name, (at, reason) in ended.items():
        # Ended at the deadline the last answer gave, not later (nor earlier):
        # UNREACHABLE, since a renewal was sent and never answered.
        assert at == pytest.approx(deadlines[name]) and reason is LossReason.UNREACHABLE


class SlowRelease(MemoryBackend):
    """A memory backend whose release takes 3 s of the (mock) clock before its first
    await, as thousands of releases at once take of a loaded process's time."""

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        import trio

        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, MockClock)
        clock.jump(3)
        return await super().release(name, owner, token)


@MOCK
async def test_bodies_that_end_together_are_judged_when_they_end(anyio_backend: object) -> None:
    backend = SlowRelease()
    done = anyio.Event()
    outcomes: dict[str, str] = {}

    async def hold(name: str) -> None:
        try:
            async with AsyncLock(backend, name, ttl=3):
                await done.wait()
            outcomes[name] = "ended"
        except LeaseLostError as exc:
            outcomes[name] = exc.reason.value

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(hold, f"n{i}")
        await anyio.sleep(1.5)
        done.set()  # every body ends now, well before its deadline
    # None is reported lost because the others' releases (3 s each) came first.
    assert outcomes == {"n0": "ended", "n1": "ended", "n2": "ended"}


def test_a_compact_answer_reads_as_the_list_it_stands_for() -> None:
    renewals = [("a", "o1", 3, 2.0), ("b", "o2", 5, 4.0), ("c", "o3", 7, 6.0)]
    refused = aiolease.NotOwnerError("b")
    answer = aiolease.abc.RenewedAsAsked(renewals, 12.5, {1: refused})
    expected = [Grant(3, 2.0, sent_at=12.5), refused, Grant(7, 6.0, sent_at=12.5)]
    assert len(answer) == 3 and list(answer) == expected
    assert answer[-1] == expected[-1] and answer[-2] is refused
    assert answer[1:] == expected[1:] and answer[::-1] == expected[::-1]
    with pytest.raises(IndexError):
        answer[3]
    assert list(aiolease.abc.RenewedAsAsked(renewals)) == [
        Grant(3, 2.0),
        Grant(5, 4.0),
        Grant(7, 6.0),
    ]


def _mock_clock() -> MockClock:
    import trio

    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, MockClock)
    return clock


class SlowSends(MemoryBackend):
    """A memory backend that writes each release at once (``release_now``), the write
    taking 0.2 s of the (mock) clock: as a socket write per release takes of a loaded
    process's time when thousands of blocks end at once."""

    def __init__(self) -> None:
        super().__init__()
        self.sends = 0

    def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool] | None:
        self.sends += 1
        _mock_clock().jump(0.2)
        return self.release(name, owner, token)


@MOCK
async def test_bodies_ending_together_are_judged_before_the_releases_are_sent(
    anyio_backend: object,
) -> None:
    backend = SlowSends()
    done, all_ended = anyio.Event(), anyio.Event()
    ending, kept = 30, 3  # 30 sends: 6 s, more than a deadline's 1.7 s ahead
    outcomes: dict[str, str] = {}
    held: list[Lease] = []

    async def hold(name: str) -> None:
        try:
            async with AsyncLock(backend, name, ttl=3):
                await done.wait()
            outcomes[name] = "ended"
        except LeaseLostError as exc:
            outcomes[name] = exc.reason.value
        if len(outcomes) == ending:
            all_ended.set()

    async with AsyncExitStack() as stack:
        held = await _hold_all(stack, backend, [f"kept{i}" for i in range(kept)], ttl=3)
        async with anyio.create_task_group() as tg:
            for i in range(ending):
                tg.start_soon(hold, f"n{i}")
            await anyio.sleep(10)  # steady: renewed at 1, 2, ..., 10 s
            done.set()  # every body ends now, well before its deadline
            await all_ended.wait()
        # None is reported lost because the others' sends came first, and the leases
        # still held were renewed between the sends (6 s of them in all).
        assert outcomes == {f"n{i}": "ended" for i in range(ending)}
        assert [lease.lost for lease in held] == [None] * kept
    assert backend.sends == ending + kept
    for i in range(ending):
        assert await backend.read(f"n{i}") is None  # every release went through


@MOCK
async def test_a_body_that_ran_past_its_deadline_is_lost_when_others_end_with_it(
    anyio_backend: object,
) -> None:
    backend = SlowSends()
    done = anyio.Event()
    outcomes: dict[str, str] = {}

    async def hold(name: str, late: bool) -> None:
        try:
            async with AsyncLock(backend, name, ttl=3):
                await done.wait()
                if late:
                    _mock_clock().jump(5)  # runs past its deadline, no renewal meanwhile
            outcomes[name] = "ended"
        except LeaseLostError as exc:
            outcomes[name] = exc.reason.value

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(hold, f"n{i}", i == 2)
        await anyio.sleep(1.5)
        done.set()
    # Judged when it ended, past its deadline: lost, whether its release was sent at
    # once or joined the others' batch. (Those that ended after it, in the same step,
    # ended past their deadlines too.)
    assert outcomes["n2"] == LossReason.EXPIRED.value
    assert len(outcomes) == 5
