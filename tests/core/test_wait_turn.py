"""The core's hooks for queueing backends: ``Backend.wait_turn`` and swallowed cancellations."""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import pytest
from trio.testing import MockClock

from aiolease import AsyncLock, AsyncSemaphore
from aiolease._bridge import adapt
from aiolease._checked import within_ttl
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.asyncio_only import AsyncioOnlyBackend

pytestmark = pytest.mark.anyio


class _Recording(MemoryBackend):
    """Records who waits how, and which owners tried to acquire."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[str] = []
        self.turns: list[tuple[str, str, float, HolderInfo]] = []
        self.waiting = anyio.Event()

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        self.attempts.append(owner)
        return await super().try_acquire(name, owner, ttl, identity, metadata)

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        self.turns.append((name, owner, ttl, seen))
        self.waiting.set()
        await super().wait_turn(name, owner, ttl, seen)


async def test_a_blocked_acquire_waits_for_its_turn_as_its_own_owner() -> None:
    backend = _Recording()
    holder = await AsyncLock(backend, "x", ttl=60).acquire_nowait()
    got: list[str] = []

    async def wait() -> None:
        lease = await AsyncLock(backend, "x", ttl=7).acquire()
        got.append(lease.owner)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await backend.waiting.wait()
        await holder.release()
    [(name, owner, ttl, seen)] = backend.turns
    assert (name, ttl) == ("x", 7.0)
    assert (seen.owner, seen.token) == (holder.owner, holder.token)
    assert backend.attempts[1:] == [owner, owner] and got == [owner]


async def test_the_default_wait_turn_is_wait_changed() -> None:
    backend = MemoryBackend()
    await backend.try_acquire("x", "a", 60, "a", {})
    seen = await backend.try_acquire("x", "b", 60, "b", {})
    assert isinstance(seen, HolderInfo)
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.wait_turn, "x", "b", 60.0, seen)
        await anyio.wait_all_tasks_blocked()
        await backend.release("x", "a", None)  # wait_changed's wake-up ends the wait


class _AsyncioTurns(AsyncioOnlyBackend):
    def __init__(self) -> None:
        super().__init__()
        self.turns: list[str] = []

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        self.turns.append(owner)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_bridge_forwards_wait_turn(anyio_backend: str) -> None:
    import trio_asyncio

    backend = _AsyncioTurns()
    seen = HolderInfo("x", "a", "a", 1)
    async with trio_asyncio.open_loop():
        await adapt(backend).wait_turn("x", "b", 1.0, seen)
    assert backend.turns == ["b"]


class _SwallowsCancellation(MemoryBackend):
    """Grants, then finishes the call even if cancelled meanwhile (as redis-py can)."""

    def __init__(self) -> None:
        super().__init__()
        self.granted = anyio.Event()
        self.cancelled = anyio.Event()

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        result = await super().try_acquire(name, owner, ttl, identity, metadata)
        self.granted.set()
        with anyio.CancelScope(shield=True):
            await self.cancelled.wait()  # the reply is still on its way when the cancel comes
        return result


async def test_a_grant_that_swallowed_the_cancellation_is_undone() -> None:
    backend = _SwallowsCancellation()
    returned = []
    async with anyio.create_task_group() as tg:

        async def acquire() -> None:
            returned.append(await AsyncLock(backend, "x", ttl=60).acquire())

        tg.start_soon(acquire)
        await backend.granted.wait()
        tg.cancel_scope.cancel()
        backend.cancelled.set()
    assert returned == []
    assert await backend.read("x") is None


class _Overrunning(MemoryBackend):
    """Its wait for a permit's turn never returns by itself (a contract breach), and it
    counts the requests: the core's own scope must still end each wait at the ttl."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        self.requests += 1
        return await super().try_acquire_permit(name, owner, ttl, identity, metadata, limit, weight)

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await anyio.sleep_forever()


@pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
)
async def test_a_wait_not_marked_as_bounded_is_cut_at_the_ttl(anyio_backend: object) -> None:
    """Only a wait marked ``returns_within_ttl`` is awaited without the core's scope:
    an override that is not marked (as this one, which breaks the contract) is cut at
    the ttl, and the request asked again (which keeps its place in the queue)."""
    backend = _Overrunning()
    assert within_ttl(MemoryBackend().wait_permit_turn)  # the memory model's own is
    assert not within_ttl(backend.wait_permit_turn)
    holder = await AsyncSemaphore(backend, "s", limit=1, ttl=60).acquire()
    sem = AsyncSemaphore(backend, "s", limit=1, ttl=5)
    started = anyio.current_time()
    with anyio.move_on_after(12):  # (mock time) two cuts at 5 s, then this
        await sem.acquire()
    assert backend.requests == 1 + 3  # the holder's, then one per ttl
    assert anyio.current_time() - started == 12
    await holder.release()
