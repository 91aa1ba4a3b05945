"""The release bounds shared by one asyncio loop (aiolease._bounds)."""

from __future__ import annotations

import asyncio

import anyio
import anyio.lowlevel
import pytest

from aiolease import AsyncLock
from aiolease._bounds import Bounds
from aiolease.backends.memory import MemoryBackend

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # (trio keeps each scope's own deadline)


async def test_a_bound_cancels_its_scope_and_a_done_one_nothing() -> None:
    loop = asyncio.get_running_loop()
    bounds = Bounds.of(loop)
    assert bounds is not None and Bounds.of(loop) is bounds
    with anyio.CancelScope(shield=True) as cut:
        bounds.add(loop.time() + 0.05, cut)
        await anyio.sleep(5)
    assert cut.cancelled_caught
    with anyio.CancelScope(shield=True) as kept:
        entry = bounds.add(loop.time() + 0.05, kept)
        await anyio.lowlevel.checkpoint()
    bounds.done(entry)
    await anyio.sleep(0.1)  # past the bound: nothing left to cancel
    assert not kept.cancel_called


async def test_releases_leave_no_bounds_behind() -> None:
    """Many short blocks: their releases' bounds are swept as they end (one loop timer
    for them all; anyio's own deadline left a cancelled timer per release)."""
    loop = asyncio.get_running_loop()
    lock = AsyncLock(MemoryBackend(), "job", ttl=10)
    for _ in range(500):
        async with lock:
            pass
    bounds = Bounds.of(loop)
    assert bounds is not None and len(bounds._heap) <= 2 * bounds._live + 64
