"""AsyncSemaphore and AsyncReadWriteLock through the core: arguments, the acquire
variants, cancel-on-loss, one renewal batch with locks, and the wrappers.

The backend rules (limit, tokens, FIFO, expiry) are the conformance suite's permit
checks (``aiolease/testing/_permit_checks.py``), run on memory and SQLite.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

import aiolease
from aiolease import (
    AsyncLock,
    AsyncReadWriteLock,
    AsyncSemaphore,
    InvalidArgument,
    LeaseHeldError,
    LeaseLostError,
    LimitMismatchError,
    LossReason,
)
from aiolease._permits import RW_LIMIT
from aiolease.abc import Grant, HolderInfo, Renewal, RenewResult, is_permit_owner, permit_owner
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.faults import FaultyBackend
from tests.testing.remote_support import remote

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2", None, 10**6 + 1])
def test_a_bad_limit_is_refused(limit: object) -> None:
    with pytest.raises(InvalidArgument, match="limit"):
        AsyncSemaphore(MemoryBackend(), "s", limit=limit, ttl=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"name": ""}, {"ttl": 0}, {"ttl": "1"}, {"identity": ""}, {"metadata": {"k": 1}}],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"name": "s", "ttl": 1, **kwargs}
    with pytest.raises(InvalidArgument):
        AsyncSemaphore(MemoryBackend(), limit=2, **args)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        AsyncReadWriteLock(MemoryBackend(), **args)  # type: ignore[arg-type]


def test_not_a_backend_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="backend"):
        AsyncSemaphore(object(), "s", limit=2, ttl=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("limit", "weight"), [(2, 0), (2, 3), (2, True), (0, 1), (True, 1), ("2", 1), (2**31, 1)]
)
async def test_the_contract_checks_limit_and_weight(limit: int, weight: int) -> None:
    backend = MemoryBackend()
    with pytest.raises(InvalidArgument):
        await backend.try_acquire_permit("n", "permit:o", 1.0, "id", {}, limit, weight)
    assert await backend.read_permits("n") is None


async def test_acquire_variants_when_full() -> None:
    backend = MemoryBackend()
    sem = AsyncSemaphore(backend, "s", limit=1, ttl=10)
    held = await sem.acquire_nowait()
    with pytest.raises(LeaseHeldError) as info:
        await sem.acquire_nowait()
    assert info.value.holder is not None and info.value.holder.token == held.token
    with pytest.raises(LeaseHeldError):  # one try, as for a lock
        await sem.acquire(timeout=0)
    with pytest.raises(LeaseHeldError):
        async with sem.hold(timeout=0):
            pytest.fail("a full semaphore let a block in")
    with pytest.raises(TimeoutError):
        async with sem.hold(timeout=0.05):
            pytest.fail("a full semaphore let a block in")
    permits = await backend.read_permits("s")
    assert permits is not None and permits.waiting == 0, "a given-up wait left its queue entry"
    assert await held.release()
    async with sem.hold(timeout=1) as permit:
        assert permit.token > held.token
        assert sem.statistics().held == 1
    stats = sem.statistics()
    assert (stats.name, stats.limit, stats.held, stats.acquisitions) == ("s", 1, 0, 2)


async def test_limit_mismatch_is_typed() -> None:
    backend = MemoryBackend()
    async with AsyncSemaphore(backend, "s", limit=2, ttl=10):
        with pytest.raises(LimitMismatchError) as info:
            await AsyncSemaphore(backend, "s", limit=3, ttl=10).acquire()
        assert (info.value.limit, info.value.held_limit) == (3, 2)
        assert "permits of 's' are held with limit 2, not 3" in str(info.value)
        with pytest.raises(LimitMismatchError) as info:
            await AsyncReadWriteLock(backend, "s", ttl=10).read().acquire()
        # Said as what it is, not as the read-write lock's limit (2**31 - 1).
        assert "'s' is a semaphore of limit 2, not a read-write lock" in str(info.value)
        assert str(RW_LIMIT) not in str(info.value)
    async with AsyncReadWriteLock(backend, "rw", ttl=10).write():
        with pytest.raises(LimitMismatchError) as info:
            await AsyncSemaphore(backend, "rw", limit=4, ttl=10).acquire()
        assert "'rw' is a read-write lock, not a semaphore of limit 4" in str(info.value)
        assert str(RW_LIMIT) not in str(info.value)


async def test_a_lost_permit_cancels_its_block() -> None:
    backend = MemoryBackend()
    sem = AsyncSemaphore(backend, "s", limit=2, ttl=10)
    with pytest.raises(LeaseLostError) as info:
        async with sem:
            backend.force_release_permits("s")
            await anyio.sleep_forever()
    assert info.value.reason is LossReason.STOLEN
    assert sem.statistics().losses == {LossReason.STOLEN: 1}


async def test_a_task_may_hold_several_permits_and_the_lock_of_the_name() -> None:
    backend = MemoryBackend()
    sem = AsyncSemaphore(backend, "s", limit=2, ttl=10)
    async with sem as first, sem as second, AsyncLock(backend, "s", ttl=10):
        assert first.token < second.token
        assert sem.statistics().held == 2
        with pytest.raises(LeaseHeldError):
            await sem.acquire(timeout=0)


async def test_readers_share_and_a_writer_waits_for_them() -> None:
    backend = MemoryBackend()
    rw = AsyncReadWriteLock(backend, "rw", ttl=10)
    order: list[str] = []
    tokens: list[int] = []

    async def write() -> None:
        async with rw.write() as writing:
            order.append("write")
            tokens.append(writing.token)
            assert rw.statistics().writing == 1

    async with anyio.create_task_group() as tg:
        async with rw.read() as first, rw.read() as second:
            tokens += [first.token, second.token]
            assert rw.statistics().reading == 2
            tg.start_soon(write)
            await anyio.wait_all_tasks_blocked()
            permits = await backend.read_permits("rw")
            assert permits is not None and (len(permits.holders), permits.waiting) == (2, 1)
            order.append("readers leave")
    assert order == ["readers leave", "write"]
    assert tokens == sorted(tokens)
    stats = rw.statistics()
    assert (stats.reading, stats.writing, stats.acquisitions) == (0, 0, 3)


class _Batches(MemoryBackend):
    """Records which renewals come in one call."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[bool]] = []
        self.three = anyio.Event()

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        self.batches.append(sorted(is_permit_owner(owner) for _, owner, _, _ in renewals))
        if len(self.batches) >= 3:
            self.three.set()
        return await super().renew_many(renewals)


async def test_permits_and_locks_renew_in_one_batch() -> None:
    backend = _Batches()
    sem = AsyncSemaphore(backend, "s", limit=3, ttl=0.3)
    rw = AsyncReadWriteLock(backend, "rw", ttl=0.3)
    async with AsyncLock(backend, "l", ttl=0.3), sem, sem, rw.write():
        await backend.three.wait()
    assert [False, True, True, True] in backend.batches
    assert sem.statistics().renewals >= 2 and not sem.statistics().losses


@pytest.mark.parametrize("wrap", ["faulty", "remote"])
async def test_through_wrappers(wrap: str) -> None:
    inner = MemoryBackend()
    if wrap == "faulty":
        await _use(FaultyBackend(inner))
        return
    async with remote(inner) as client:
        assert aiolease.Capability.SEMAPHORE in client.capabilities
        await _use(client)


async def _use(backend: aiolease.Backend) -> None:
    sem = AsyncSemaphore(backend, "s", limit=1, ttl=10)
    async with sem as permit:
        with pytest.raises(LeaseHeldError):
            await sem.acquire_nowait()
        with pytest.raises(LimitMismatchError):
            await AsyncSemaphore(backend, "s", limit=2, ttl=10).acquire_nowait()
        permits = await backend.read_permits("s")
        assert permits is not None and [h.token for h in permits.holders] == [permit.token]
    assert await backend.read_permits("s") is None


async def test_a_memory_release_wakes_only_the_waiters_whose_turn_came() -> None:
    # Every change of a name's permits woke every waiter of the name, and each asked
    # again (16 tasks on a semaphore of 4 asked 3.2 times per acquisition, not once).
    name, holder = "sem", permit_owner()
    first, second, third = (permit_owner() for _ in range(3))
    async with MemoryBackend() as backend:
        held = await backend.try_acquire_permit(name, holder, 60, "h", {}, 2, 2)
        assert isinstance(held, Grant)
        refusals = {}
        for owner in (first, second, third):
            refused = await backend.try_acquire_permit(name, owner, 60, "w", {}, 2, 1)
            assert isinstance(refused, HolderInfo)
            refusals[owner] = refused
        woken: list[str] = []
        turn = {owner: anyio.Event() for owner in (first, second, third)}

        async def wait(owner: str) -> None:
            await backend.wait_permit_turn(name, owner, 60, refusals[owner])
            woken.append(owner)
            turn[owner].set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for owner in (first, second, third):
                    tg.start_soon(wait, owner)
                await anyio.wait_all_tasks_blocked()
                assert await backend.release(name, holder, held.token)  # two fit now
                await turn[first].wait()
                await turn[second].wait()
                await anyio.wait_all_tasks_blocked()
                assert sorted(woken) == sorted([first, second])
                # The first gives up its place (a cancelled acquire's undo): the third
                # now fits, and only it wakes.
                assert await backend.release(name, first, None) is False
                await turn[third].wait()
                assert sorted(woken) == sorted([first, second, third])
        for owner in (second, third):
            granted = await backend.try_acquire_permit(name, owner, 60, "w", {}, 2, 1)
            assert isinstance(granted, Grant)
        assert await backend.read_permits(name) is not None
