"""``Backend.wait_lost``: a session backend ends held leases at once, with its reason.

A backend that carries many leases on one session (etcd, ZooKeeper) learns of the
loss of the session, or of its own closing, before any renewal would: the core
ends every lease on it as soon as the backend says so, with the reason it gives.

Also: a cancellation that arrives while the protected block is being entered still
releases the lease (under trio the guards' task group re-raised it first).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from aiolease import AsyncLock, Capability, Elector, Lease, LeaseLostError, LossReason
from aiolease._bridge import call_asyncio, running_trio
from aiolease._holding import Counters, HealthPolicy, Holding
from aiolease.abc import Backend, HolderInfo
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.asyncio_only import AsyncioOnlyBackend

pytestmark = pytest.mark.anyio


class SessionMemory(MemoryBackend):
    """The memory model, plus a session whose loss the test decides."""

    capabilities = MemoryBackend.capabilities | {Capability.SESSION}

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0
        self._reason: LossReason | None = None
        self._lost = anyio.Event()

    def lose(self, reason: LossReason) -> None:
        self._reason = reason
        self._lost.set()

    async def wait_lost(self, name: str, owner: str, token: int) -> LossReason:
        self.waiting += 1
        await self._lost.wait()
        assert self._reason is not None
        return self._reason


class SessionAsyncioOnly(AsyncioOnlyBackend):
    """The asyncio-only model with a session (its waits are asyncio's)."""

    capabilities = AsyncioOnlyBackend.capabilities | {Capability.SESSION}

    def __init__(self) -> None:
        super().__init__()
        self._reason: LossReason | None = None
        self._lost = asyncio.Event()

    async def lose(self, reason: LossReason) -> None:
        self._reason = reason
        self._lost.set()

    async def wait_lost(self, name: str, owner: str, token: int) -> LossReason:
        await self._lost.wait()
        assert self._reason is not None
        return self._reason


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """A trio-asyncio loop under trio; nothing under asyncio."""
    if running_trio():
        import trio_asyncio

        async with trio_asyncio.open_loop():
            yield
    else:
        yield


@pytest.mark.parametrize("reason", [LossReason.STOLEN, LossReason.SHUTDOWN, LossReason.EXPIRED])
async def test_a_lost_session_ends_the_lease_with_its_reason(
    anyio_backend: str, reason: LossReason
) -> None:
    backend = SessionMemory()
    with anyio.fail_after(10), pytest.raises(LeaseLostError) as info:
        async with AsyncLock(backend, "n", ttl=30) as lease:
            backend.lose(reason)
            await anyio.sleep_forever()  # cancelled by the loss, long before the ttl
    assert info.value.reason is reason
    assert lease.lost is reason
    assert await backend.read("n") is None  # released on the way out


async def test_the_default_never_reports_a_loss(anyio_backend: str) -> None:
    class Plain(MemoryBackend):
        capabilities = MemoryBackend.capabilities | {Capability.SESSION}

    async with AsyncLock(Plain(), "n", ttl=30) as lease:
        await anyio.wait_all_tasks_blocked()
        assert lease.lost is None
    assert lease.lost is LossReason.RELEASED


async def test_only_session_backends_are_asked(anyio_backend: str) -> None:
    class NoSession(SessionMemory):
        capabilities = MemoryBackend.capabilities

    backend = NoSession()
    async with AsyncLock(backend, "n", ttl=30):
        await anyio.wait_all_tasks_blocked()
        backend.lose(LossReason.STOLEN)
        await anyio.wait_all_tasks_blocked()
    assert backend.waiting == 0


class CountingReads(SessionMemory):
    """Counts ``read`` calls (the core's takeover watch makes none until something is
    pushed) and takeover subscriptions (:meth:`Backend.on_taken`, one per watched lease)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.subscriptions = 0

    async def read(self, name: str) -> HolderInfo | None:
        self.reads += 1
        return await super().read(name)

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None]:
        self.subscriptions += 1
        return super().on_taken(name, owner, token, taken)


class _Clock:
    """A session that never expires (the test ends the grant by hand)."""

    expires = float("inf")
    error: BaseException | None = None


class KeepingReads(CountingReads):
    """:class:`CountingReads` that keeps held grants itself (:meth:`Backend.hold`) and
    reports their loss, takeovers included, through ``ended``."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: list[Callable[[LossReason], object]] = []

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> _Clock:
        self.ended.append(ended)
        return _Clock()

    def lose(self, reason: LossReason) -> None:
        for ended in self.ended:
            ended(reason)


@pytest.mark.parametrize("keeps", [True, False], ids=["hold", "renewed"])
async def test_a_backend_that_keeps_its_grants_gets_no_takeover_watch(
    anyio_backend: str, keeps: bool
) -> None:
    """A backend whose :meth:`Backend.hold` keeps the grant reports every end of it,
    takeovers included: the core neither subscribes (:meth:`Backend.on_taken`) nor
    watches the session (:meth:`Backend.wait_lost`) for it."""
    backend = KeepingReads() if keeps else CountingReads()
    assert Capability.PUSH_WAKEUP in backend.capabilities
    with anyio.fail_after(10), pytest.raises(LeaseLostError) as info:
        async with AsyncLock(backend, "n", ttl=30):
            await anyio.wait_all_tasks_blocked()
            assert backend.reads == 0
            assert backend.subscriptions == (0 if keeps else 1)
            assert backend.waiting == (0 if keeps else 1)
            backend.lose(LossReason.STOLEN)
            await anyio.sleep_forever()
    assert info.value.reason is LossReason.STOLEN


async def test_a_lease_released_first_ignores_a_later_loss(anyio_backend: str) -> None:
    backend = SessionMemory()
    async with AsyncLock(backend, "n", ttl=30) as lease:
        await anyio.wait_all_tasks_blocked()
        assert backend.waiting == 1
    backend.lose(LossReason.STOLEN)
    assert lease.lost is LossReason.RELEASED


async def test_an_elector_hears_the_reason(anyio_backend: str) -> None:
    backend = SessionMemory()
    defeats: list[LossReason] = []

    async def work(lease: Lease) -> None:
        backend.lose(LossReason.SHUTDOWN)
        await anyio.sleep_forever()

    elector = Elector(backend, "e", ttl=30, on_defeated=defeats.append)
    with pytest.raises(LeaseLostError) as info:
        async with elector.leadership() as lease:
            await work(lease)
    assert info.value.reason is LossReason.SHUTDOWN
    assert defeats == [LossReason.SHUTDOWN]
    assert elector.statistics().losses == {LossReason.SHUTDOWN: 1}


async def test_the_loss_crosses_the_bridge(anyio_backend: str) -> None:
    backend: Backend = SessionAsyncioOnly()
    async with asyncio_loop():
        with pytest.raises(LeaseLostError) as info:
            async with AsyncLock(backend, "n", ttl=30):
                assert isinstance(backend, SessionAsyncioOnly)
                if running_trio():
                    await call_asyncio(backend.lose, LossReason.STOLEN)
                else:
                    await backend.lose(LossReason.STOLEN)
                await anyio.sleep_forever()
    assert info.value.reason is LossReason.STOLEN


async def test_a_cancelled_entry_into_the_block_releases(anyio_backend: str) -> None:
    backend = MemoryBackend()
    lease = await AsyncLock(backend, "n", ttl=30).acquire()
    # A health probe to run: the block enters a task group, where a cancel can land.
    health = HealthPolicy(lambda: True, interval=10, failures=1, timeout=1)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await Holding(lease, Counters(), health).__aenter__()
    assert scope.cancelled_caught
    assert await backend.read("n") is None
