"""The one-round-trip calls: ``Lease.ensure_held``, ``AsyncLock.holder``,
``Elector.leader`` and ``Elector.proclaim`` (every backend runs the contract's side
of proclaim in the conformance checks ``update_metadata*``)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from aiolease import (
    AsyncLock,
    BackendUnavailable,
    Elector,
    InvalidArgument,
    LeaderInfo,
    LeaseHeldError,
    LeaseLostError,
    LossReason,
    NotOwnerError,
    UnsupportedCapability,
)
from aiolease.abc import Capability, Grant
from aiolease.backends.memory import MemoryBackend
from aiolease.backends.sqlite import SQLiteBackend
from aiolease.testing.faults import FaultyBackend

pytestmark = pytest.mark.anyio


@pytest.fixture
def inner() -> MemoryBackend:
    return MemoryBackend()


# -- Lease.ensure_held --------------------------------------------------------------------


async def test_ensure_held_returns_while_ours_and_does_not_renew(inner: MemoryBackend) -> None:
    faulty = FaultyBackend(inner)
    lease = await AsyncLock(faulty, "job", ttl=30).acquire()
    before = await inner.read("job")
    await lease.ensure_held()
    after = await inner.read("job")
    assert before is not None and after is not None
    assert faulty.calls["read"] == 1 and faulty.calls["renew"] == 0
    assert after.remaining is not None and before.remaining is not None
    assert after.remaining <= before.remaining  # a read, not a renewal
    assert lease.lost is None and lease.renewals == 0
    assert await lease.release()


async def test_ensure_held_ends_a_lease_taken_by_another(inner: MemoryBackend) -> None:
    lease = await AsyncLock(inner, "job", ttl=30).acquire()  # no watch: only the read sees
    inner.force_release("job")
    other = await AsyncLock(inner, "job", ttl=30, identity="other").acquire()
    with pytest.raises(LeaseLostError) as info:
        await lease.ensure_held()
    assert info.value.reason is LossReason.STOLEN and lease.lost is LossReason.STOLEN
    assert not await lease.release()  # the other holder keeps it
    assert (await inner.read("job")) is not None and other.lost is None
    await other.release()


async def test_ensure_held_ends_a_lease_nobody_holds(inner: MemoryBackend) -> None:
    lease = await AsyncLock(inner, "job", ttl=30).acquire()
    inner.force_release("job")
    with pytest.raises(LeaseLostError) as info:
        await lease.ensure_held()
    assert info.value.reason is LossReason.STOLEN


async def test_ensure_held_cancels_the_protected_block(tmp_path: Path) -> None:
    # SQLite has no push wake-ups: no takeover watch runs, and the renewals (every
    # 10 s here) are far off, so only ensure_held() can find the takeover.
    async with SQLiteBackend(str(tmp_path / "leases.db")) as backend:
        reached = False
        with pytest.raises(LeaseLostError) as info:
            async with AsyncLock(backend, "job", ttl=30) as lease:
                assert await backend.release("job", lease.owner, None)  # an operator's
                await AsyncLock(backend, "job", ttl=30, identity="other").acquire_nowait()
                try:
                    await lease.ensure_held()
                finally:
                    reached = True
                pytest.fail("ensure_held() returned for a lease taken by another")
        assert reached and info.value.reason is LossReason.STOLEN


async def test_ensure_held_of_an_ended_lease_raises_without_a_read(inner: MemoryBackend) -> None:
    faulty = FaultyBackend(inner)
    lease = await AsyncLock(faulty, "job", ttl=30).acquire()
    await lease.release()
    faulty.fail("read")  # a read would raise BackendUnavailable instead
    with pytest.raises(LeaseLostError) as info:
        await lease.ensure_held()
    assert info.value.reason is LossReason.RELEASED


async def test_ensure_held_read_failure_keeps_the_lease(inner: MemoryBackend) -> None:
    faulty = FaultyBackend(inner)
    lease = await AsyncLock(faulty, "job", ttl=30).acquire()
    faulty.fail("read", times=1)
    with pytest.raises(BackendUnavailable):
        await lease.ensure_held()
    assert lease.lost is None
    await lease.ensure_held()
    await lease.release()


# -- AsyncLock.holder and Elector.leader ---------------------------------------------------


async def test_lock_holder_reports_who_holds(inner: MemoryBackend) -> None:
    lock = AsyncLock(inner, "job", ttl=30, identity="host-a", metadata={"k": "v"})
    assert await lock.holder() is None
    async with lock as lease:
        holder = await AsyncLock(inner, "job", ttl=5).holder()
        assert holder is not None
        assert (holder.identity, holder.token, dict(holder.metadata)) == (
            "host-a",
            lease.token,
            {"k": "v"},
        )
        assert holder.owner == lease.owner
        assert holder.remaining is not None and 0 < holder.remaining <= 30
    assert await lock.holder() is None


async def test_elector_leader_reports_the_term(inner: MemoryBackend) -> None:
    elector = Elector(inner, "sched", ttl=30, identity="host-a", metadata={"url": "a"})
    observer = Elector(inner, "sched", ttl=30, identity="observer")
    assert await observer.leader() is None
    async with elector.leadership() as lease:
        leader = await observer.leader()
        assert leader == LeaderInfo("host-a", lease.token, {"url": "a"})
        assert leader is not None and leader.remaining is not None
        assert 0 < leader.remaining <= 30
    assert await observer.leader() is None


# -- Elector.proclaim --------------------------------------------------------------------


async def test_proclaim_updates_what_observers_see(inner: MemoryBackend) -> None:
    elector = Elector(inner, "sched", ttl=30, identity="host-a", metadata={"url": "a"})
    observer = Elector(inner, "sched", ttl=30, identity="observer")
    seen = []
    send, receive = anyio.create_memory_object_stream[LeaderInfo | None](10)

    async def observe() -> None:
        async with send:
            async for leader in observer.observe():
                await send.send(leader)

    async with receive, elector.leadership() as lease, anyio.create_task_group() as tg:
        tg.start_soon(observe)
        seen.append(await receive.receive())
        await elector.proclaim({"url": "b"})
        seen.append(await receive.receive())
        tg.cancel_scope.cancel()
        assert lease.metadata == {"url": "b"} and lease.lost is None
        assert await elector.leader() == LeaderInfo("host-a", lease.token, {"url": "b"})
    assert seen == [
        LeaderInfo("host-a", lease.token, {"url": "a"}),
        LeaderInfo("host-a", lease.token, {"url": "b"}),
    ]
    async with elector.leadership() as second:  # the next term publishes it too
        assert second.token > lease.token
        assert await observer.leader() == LeaderInfo("host-a", second.token, {"url": "b"})


async def test_proclaim_when_not_leading_raises_not_owner(inner: MemoryBackend) -> None:
    elector = Elector(inner, "sched", ttl=30)
    with pytest.raises(NotOwnerError):
        await elector.proclaim({"url": "b"})
    with pytest.raises(InvalidArgument):
        await elector.proclaim({"url": 1})  # type: ignore[dict-item]
    assert await inner.read("sched") is None


async def test_proclaim_of_a_taken_term_ends_it(tmp_path: Path) -> None:
    # SQLite: no takeover watch runs and the renewals are far off, so only the
    # proclaim's own write can hear that the term is gone.
    async with SQLiteBackend(str(tmp_path / "leases.db")) as backend:
        faulty = FaultyBackend(backend)
        elector = Elector(faulty, "sched", ttl=30, metadata={"url": "a"})
        with pytest.raises(LeaseLostError) as info:
            async with elector.leadership() as lease:
                assert await backend.release("sched", lease.owner, None)  # an operator's
                assert isinstance(await backend.try_acquire("sched", "thief", 30, "t", {}), Grant)
                with pytest.raises(NotOwnerError):
                    await elector.proclaim({"url": "b"})
                assert faulty.calls["update_metadata"] == 1  # the server said so
                assert lease.lost is LossReason.STOLEN
                await anyio.sleep_forever()  # cancelled: the term ended
        assert info.value.reason is LossReason.STOLEN
        holder = await backend.read("sched")
        assert holder is not None and holder.owner == "thief" and dict(holder.metadata) == {}


async def test_a_held_name_is_refused_with_the_proclaimed_metadata(inner: MemoryBackend) -> None:
    elector = Elector(inner, "sched", ttl=30, metadata={"url": "a"})
    async with elector.leadership():
        await elector.proclaim({"url": "b"})
        with pytest.raises(LeaseHeldError) as info:
            await AsyncLock(inner, "sched", ttl=5).acquire_nowait()
        assert info.value.holder is not None and dict(info.value.holder.metadata) == {"url": "b"}


class _NoProclaim(MemoryBackend):
    """The reference, declared without PROCLAIM (as Kafka is)."""

    capabilities = MemoryBackend.capabilities - {Capability.PROCLAIM}


async def test_proclaim_needs_the_capability() -> None:
    backend = _NoProclaim()
    elector = Elector(backend, "sched", ttl=30, metadata={"url": "a"})
    async with elector.leadership() as lease:
        with pytest.raises(UnsupportedCapability):
            await elector.proclaim({"url": "b"})
        holder = await backend.read("sched")
        assert holder is not None and dict(holder.metadata) == {"url": "a"}
        assert lease.lost is None and lease.metadata == {"url": "a"}
