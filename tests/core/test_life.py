"""Leases and the life of their backend: what closing it does to the leases still held
through it, the scheduler's bookkeeping after a release, and non-reentrant blocks.

Against every real server, under asyncio and trio.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import anyio
import pytest
from trio.testing import MockClock

import aiolease
from aiolease import (
    AsyncLock,
    Elector,
    Lease,
    LeaseHeldError,
    LeaseLostError,
    LossReason,
    ReentrantAcquireError,
)
from aiolease._life import Tenancy, other_blocks_open
from aiolease._renewer import Renewer
from aiolease.abc import Backend
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.proxy import FaultProxy
from aiolease.testing.servers import server

pytestmark = pytest.mark.anyio

#: The backends, by the ``aiolease_server`` name of their server (memory and SQLite
#: need none).
BACKENDS = ["memory", "sqlite", "redis", "redis-redlock", "postgres", "mariadb", "etcd"]


@pytest.fixture(params=BACKENDS)
def url(
    request: pytest.FixtureRequest, aiolease_server: Callable[[str], str], tmp_path: Path
) -> str:
    """The URL of one backend's real server."""
    kind = str(request.param)
    if kind == "memory":
        return "memory://"
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'leases.db'}"
    return aiolease_server(kind)


def unique(prefix: str) -> str:
    """A name no other run uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def reopen(url: str, closed: Backend) -> AbstractAsyncContextManager[Backend]:
    """Another backend on the same server as ``closed`` (the memory backend keeps its
    records in the object, which goes on working after it is closed)."""
    if url.startswith("memory:"):
        return _same(closed)
    return aiolease.open_backend(url)


@asynccontextmanager
async def _same(backend: Backend) -> AsyncIterator[Backend]:
    yield backend


async def hold_until_lost(backend: Backend, name: str, entered: anyio.Event) -> LossReason:
    """Hold ``name`` in a block until the lease is lost; why it was."""
    with pytest.raises(LeaseLostError) as info:
        async with AsyncLock(backend, name, ttl=60):
            entered.set()
            await anyio.sleep_forever()
    return info.value.reason


# -- closing the backend ---------------------------------------------------------------


@pytest.mark.parametrize("closing", ["block", "aclose"])
async def test_closing_releases_the_leases_still_held(
    anyio_backend: str, url: str, closing: str
) -> None:
    """Closing ends every lease held through the backend, the block's and the one from
    ``acquire_nowait()`` alike (``SHUTDOWN``), and frees their names on the server: the
    next holder gets them at once, not after their 60 s ttl. Whether the block of
    ``open_backend`` ends or ``aclose()`` is called."""
    in_block, nowait_name = unique("block"), unique("nowait")
    entered = anyio.Event()
    reasons: list[LossReason] = []

    async def holder(backend: Backend) -> None:
        reasons.append(await hold_until_lost(backend, in_block, entered))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            async with aiolease.open_backend(url) as backend:
                tg.start_soon(holder, backend)
                await entered.wait()
                nowait = await AsyncLock(backend, nowait_name, ttl=60).acquire_nowait()
                if closing == "aclose":
                    await backend.aclose()
                    assert nowait.lost is LossReason.SHUTDOWN
            assert nowait.lost is LossReason.SHUTDOWN
        assert reasons == [LossReason.SHUTDOWN]
        async with reopen(url, backend) as fresh:
            for name in (in_block, nowait_name):
                lease = await AsyncLock(fresh, name, ttl=60).acquire_nowait()
                assert await lease.release()


async def test_release_after_close_returns_false(anyio_backend: str, url: str) -> None:
    """An explicit release of a lease whose backend was closed reports ``False`` under
    both loops (under trio it raised ``UnsupportedCapability``: the bridge's loop was
    gone)."""
    with anyio.fail_after(60):
        async with aiolease.open_backend(url) as backend:
            lease = await AsyncLock(backend, unique("released-late"), ttl=60).acquire()
        assert await lease.release() is False
        assert await lease.release() is False  # idempotent
        assert lease.lost is LossReason.SHUTDOWN  # ended by the close, not the release


@pytest.mark.parametrize("fault", ["hang", "fail"])
async def test_closing_on_a_dead_server_is_bounded_and_does_not_raise(
    anyio_backend: str, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A release that hangs or fails does not keep ``aclose`` waiting past the release
    timeout, nor make it raise; the lease still ends, and the failure is logged once."""
    backend = FaultyBackend(MemoryBackend())
    lease = await AsyncLock(backend, "n", ttl=60, release_timeout=0.2).acquire()
    if fault == "hang":
        backend.hang("release")
    else:
        backend.fail("release")
    with caplog.at_level(logging.WARNING, logger="aiolease"), anyio.fail_after(10):
        await backend.aclose()
    assert lease.lost is LossReason.SHUTDOWN
    assert backend.calls["release"] == 1
    closing = [r for r in caplog.records if r.getMessage().startswith("closing ")]
    assert len(closing) == 1 and "1 of 1 leases" in closing[0].getMessage()
    assert (await backend.inner.read("n")) is not None  # left to expire on its own


async def test_closing_on_a_cut_off_redis_is_bounded_and_does_not_raise(
    anyio_backend: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The same against a real server whose connection goes silent: the close gives up
    on the release after its timeout, raises nothing, and the lease ends anyway."""
    host, port = server("redis").addresses[0]
    name = unique("cut-off")
    async with FaultProxy(host, port) as proxy:
        with caplog.at_level(logging.WARNING, logger="aiolease"), anyio.fail_after(30):
            async with aiolease.open_backend(proxy.url_for(redis_url)) as backend:
                lock = AsyncLock(backend, name, ttl=30, release_timeout=0.5)
                lease = await lock.acquire_nowait()
                await proxy.blackhole()
        assert lease.lost is LossReason.SHUTDOWN
        assert any(r.getMessage().startswith("closing ") for r in caplog.records)
        async with aiolease.open_backend(redis_url) as direct:
            holder = await direct.read(name)  # not released: it expires on its own
            assert holder is not None and holder.owner == lease.owner
            assert await direct.release(name, lease.owner, lease.token)


async def test_closing_releases_through_every_backend_class(anyio_backend: str) -> None:
    """The release comes from the core, for any backend (its subclass's ``aclose`` is
    wrapped), also one whose ``aclose`` does nothing of its own."""

    class Closing(MemoryBackend):
        closed = 0

        async def aclose(self) -> None:
            self.closed += 1

    backend = Closing()
    lease = await AsyncLock(backend, "n", ttl=60).acquire_nowait()
    async with backend:
        pass
    assert backend.closed == 1
    assert lease.lost is LossReason.SHUTDOWN
    assert await backend.read("n") is None


@pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
)
async def test_dropped_leases_are_not_kept_for_the_close(anyio_backend: object) -> None:
    """Leases from ``acquire()`` that their callers dropped without a release are
    forgotten once past their deadline (the close has nothing left to end), so a
    backend that is never closed does not keep them all."""
    backend = MemoryBackend()
    lock = AsyncLock(backend, "n", ttl=1)
    for _ in range(500):
        await lock.acquire()
        await anyio.sleep(1)  # virtual time: the lease lapses
    assert len(Tenancy.of(backend).leases) <= 64


# -- the scheduler forgets released leases -----------------------------------------------


async def test_released_leases_leave_no_entry_in_the_scheduler(
    anyio_backend: str, url: str
) -> None:
    """A lease released long before its renewal time is dropped from the scheduler at
    once (it stayed, with the lease, until that time: a grant-release loop grew it)."""
    with anyio.fail_after(60):
        async with aiolease.open_backend(url) as backend:
            renewer = Renewer.of(backend)
            kept = AsyncLock(backend, unique("kept"), ttl=60)
            cycled = AsyncLock(backend, unique("cycled"), ttl=60)
            async with kept:
                for _ in range(20):
                    async with cycled:
                        pass
                stats = renewer.statistics()
                assert stats.leases == 1
                assert stats.entries <= 4  # one lease (and its session): fewer stale
            assert renewer.statistics().entries == 0


async def test_dropping_released_entries_does_not_wake_the_scheduler(anyio_backend: str) -> None:
    """Short holds in a row wake the scheduler about once per renew interval, not once
    per hold, although their entries are dropped as they end."""
    async with aiolease.open_backend("memory://") as backend:
        renewer = Renewer.of(backend)
        lock = AsyncLock(backend, "n", ttl=60)
        async with lock:
            pass
        await anyio.lowlevel.checkpoint()  # the scheduler sleeps now, until a renewal
        before = renewer.statistics().wakeups
        for _ in range(200):
            async with lock:
                pass
        assert renewer.statistics().wakeups - before <= 2
        assert renewer.statistics().entries == 0


# -- non-reentrant blocks ------------------------------------------------------------------


async def test_entering_a_held_name_again_in_the_same_task_raises_at_once(
    anyio_backend: str, url: str
) -> None:
    """Inside ``async with lock``, waiting again for the same name through the same
    backend in the same task would wait for itself until the lease is lost: it raises
    ``ReentrantAcquireError`` before anything is sent. A single try still reports the
    holder; the held lease is untouched."""
    name = unique("reentry")
    with anyio.fail_after(60):
        async with aiolease.open_backend(url) as backend:
            lock = AsyncLock(backend, name, ttl=60)
            async with lock as lease:
                with pytest.raises(ReentrantAcquireError) as info:
                    async with lock:
                        pass
                assert info.value.name == name
                assert isinstance(info.value, RuntimeError)
                with pytest.raises(ReentrantAcquireError):
                    async with AsyncLock(backend, name, ttl=5).hold(timeout=30):
                        pass
                with pytest.raises(ReentrantAcquireError):
                    await lock.acquire(timeout=30)
                with pytest.raises(ReentrantAcquireError):
                    async with Elector(backend, name, ttl=5).leadership():
                        pass
                with pytest.raises(LeaseHeldError):
                    await lock.acquire_nowait()
                assert lease.lost is None
                holder = await backend.read(name)
                assert holder is not None and holder.token == lease.token
            async with lock as again:  # once left, the task may enter again
                assert again.token > lease.token


async def test_a_term_is_not_reentrant_either(anyio_backend: str) -> None:
    async with aiolease.open_backend("memory://") as backend:
        async with Elector(backend, "leader", ttl=5).leadership():
            with pytest.raises(ReentrantAcquireError), anyio.fail_after(10):
                async with AsyncLock(backend, "leader", ttl=5):
                    pass


async def test_other_tasks_and_handed_off_leases_still_wait(anyio_backend: str, url: str) -> None:
    """Only the task that holds the name in a block is refused: another task waits for
    it as before, and a lease from ``acquire()`` may be released by another task while
    the one that acquired it waits for the name again."""
    name = unique("others")
    tokens: list[int] = []
    with anyio.fail_after(60):
        async with aiolease.open_backend(url) as backend:
            lock = AsyncLock(backend, name, ttl=60)

            async def waiter() -> None:
                async with lock as lease:
                    tokens.append(lease.token)

            async with anyio.create_task_group() as tg:
                async with lock as first:
                    tg.start_soon(waiter)
            assert tokens and tokens[0] > first.token

            handed = await lock.acquire()

            async def release(lease: Lease) -> None:
                assert await lease.release()

            async with anyio.create_task_group() as tg:
                tg.start_soon(release, handed)
                again = await lock.acquire(timeout=30)
            assert again.token > handed.token
            assert await again.release()


async def test_open_blocks_are_counted_however_they_end(anyio_backend: str) -> None:
    """The count that decides whether an exit yields before its release (so that blocks
    ending together are each judged when they end) comes back to zero."""
    backend = MemoryBackend()
    lock = AsyncLock(backend, "counted", ttl=10)
    assert not other_blocks_open()
    async with lock:
        assert other_blocks_open()
        async with AsyncLock(backend, "inner", ttl=10):
            assert other_blocks_open()
    with anyio.move_on_after(0):  # cancelled in the body
        async with lock:
            await anyio.sleep_forever()
    with pytest.raises(LeaseLostError):
        async with lock as lease:
            lease._end(LossReason.STOLEN)  # as a takeover watch would
            await anyio.sleep_forever()
    with pytest.raises(RuntimeError):
        async with lock:
            raise RuntimeError("the body failed")
    assert not other_blocks_open()
