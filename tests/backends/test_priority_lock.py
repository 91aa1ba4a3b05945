"""The backends' priority mutex (``aiolease.backends._priority``), under asyncio and
trio: urgent callers go first, FIFO within each class, and a cancelled waiter neither
keeps its place nor loses the lock for the others."""

from __future__ import annotations

import anyio
import pytest

from aiolease.backends._priority import PriorityLock

pytestmark = pytest.mark.anyio


async def test_urgent_callers_go_first_then_the_others_in_arrival_order() -> None:
    lock, order = PriorityLock(), []
    release = anyio.Event()

    async def holder() -> None:
        async with lock.hold():
            await release.wait()

    async def caller(label: str, urgent: bool) -> None:
        async with lock.hold(urgent=urgent):
            order.append(label)

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await anyio.wait_all_tasks_blocked()
        for label, urgent in [("a", False), ("U1", True), ("b", False), ("U2", True)]:
            tg.start_soon(caller, label, urgent)
            await anyio.wait_all_tasks_blocked()
        assert lock.waiting == 4
        release.set()
    assert order == ["U1", "U2", "a", "b"]
    assert lock.waiting == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_the_lock_goes_on() -> None:
    lock, order = PriorityLock(), []
    release = anyio.Event()

    async def holder() -> None:
        async with lock.hold():
            await release.wait()

    async def caller(label: str) -> None:
        async with lock.hold(urgent=True):
            order.append(label)

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await anyio.wait_all_tasks_blocked()
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(caller, "cancelled")
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
        tg.start_soon(caller, "next")
        await anyio.wait_all_tasks_blocked()
        assert lock.waiting == 1
        release.set()
    assert order == ["next"]
    async with lock.hold():  # free again
        pass
