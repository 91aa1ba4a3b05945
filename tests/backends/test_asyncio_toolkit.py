"""The backends' one asyncio toolkit (``aiolease.backends._asyncio``), tested once.

Each test body is asyncio code, as in a backend; it runs on asyncio itself and, under
trio, on a trio-asyncio loop (``on_asyncio``), as the core bridges an asyncio-only
backend. What each helper promises: a cancel of the caller is never dropped, also
one that comes in the very step the awaited thing completes.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import math
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from aiolease.backends._asyncio import (
    Tasks,
    cancel_requests,
    guarded,
    now,
    retrieve,
    run_to_end,
    timeout_after,
    wait_any,
    wait_event,
    wait_for_or_none,
    wait_until,
)
from tests.support import eventually, on_asyncio, suspended_in

pytestmark = pytest.mark.anyio


async def started(coro: Awaitable[Any], where: str) -> asyncio.Task[Any]:
    """``coro`` in a task of its own, once it is suspended inside ``where``."""
    task = asyncio.ensure_future(coro)
    await eventually(lambda: suspended_in(task, where), f"a task blocked in {where}")
    return task


async def cancelled(task: asyncio.Future[Any]) -> bool:
    """Whether awaiting ``task`` raises a cancellation."""
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


async def test_now_is_the_callers_clock() -> None:
    before = anyio.current_time()
    seen = await on_asyncio(lambda: asyncio.sleep(0, now()))
    assert before <= seen <= anyio.current_time()


# -- run_to_end -----------------------------------------------------------------------------


class Work:
    """Work that blocks until released, and notes that it ended."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.ended: list[str] = []

    async def __call__(self, label: str) -> str:
        try:
            await self.release.wait()
        finally:
            self.ended.append(label)
        return label


async def test_run_to_end_returns_the_result_or_raises_the_error() -> None:
    async def failing() -> None:
        raise LookupError("from the work")

    async def body() -> None:
        assert await run_to_end(asyncio.sleep(0, "done"), 60) == "done"
        with pytest.raises(LookupError, match="from the work"):
            await run_to_end(failing(), 60)
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.set_result, 7)
        assert await run_to_end(future, 60) == 7  # any awaitable, not only coroutines

    await on_asyncio(body)


async def test_run_to_end_finishes_the_work_then_raises_the_callers_cancel() -> None:
    async def body() -> None:
        work = Work()
        caller = await started(run_to_end(work("within grace"), 60), "run_to_end")
        caller.cancel()
        for _ in range(3):  # loop turns in which a cancel passed on would end the work
            await asyncio.sleep(0)
        assert not caller.done() and work.ended == []
        work.release.set()
        assert await cancelled(caller)
        assert work.ended == ["within grace"]

    await on_asyncio(body)


async def test_run_to_end_gives_up_on_the_work_after_the_grace() -> None:
    async def body() -> None:
        work = Work()
        caller = await started(run_to_end(work("past grace"), 0.01), "run_to_end")
        caller.cancel()
        assert await cancelled(caller)
        assert work.ended == ["past grace"] and not work.release.is_set()

    await on_asyncio(body)


# -- timeout_after --------------------------------------------------------------------------


async def test_timeout_after_times_out_or_never() -> None:
    async def body() -> None:
        with pytest.raises(asyncio.TimeoutError):
            async with timeout_after(0.01):
                await asyncio.Event().wait()
        async with timeout_after(None):  # no limit
            await asyncio.sleep(0)
        async with timeout_after(60):
            await asyncio.sleep(0)

    await on_asyncio(body)


async def test_timeout_after_raises_a_cancel_that_comes_with_the_result() -> None:
    async def limited(future: asyncio.Future[int]) -> int:
        async with timeout_after(60):
            return await future

    async def body() -> None:
        future = asyncio.get_running_loop().create_future()
        task = await started(limited(future), "limited")
        future.set_result(1)
        task.cancel()  # in the same step: the result must not win
        assert await cancelled(task)

    await on_asyncio(body)


# -- wait_event and wait_until ----------------------------------------------------------------


async def test_wait_event_says_whether_the_event_was_set() -> None:
    async def body() -> None:
        event = asyncio.Event()
        assert not await wait_event(event, 0.01)
        assert not await wait_event(event, 0)  # no time: a checkpoint, and a look
        asyncio.get_running_loop().call_soon(event.set)
        assert await wait_event(event, 60)
        assert await wait_event(event, None)
        assert await wait_event(event, -1)

    await on_asyncio(body)


async def test_wait_until_says_whether_the_event_was_set_by_the_deadline() -> None:
    async def body() -> None:
        event = asyncio.Event()
        assert not await wait_until(event, now() + 0.01)
        assert not await wait_until(event, now() - 1)
        asyncio.get_running_loop().call_soon(event.set)
        assert await wait_until(event, math.inf)  # no limit
        assert await wait_until(event, now() - 1)  # set already: no matter the deadline

    await on_asyncio(body)


WAITS: dict[str, Callable[[asyncio.Event], Awaitable[bool]]] = {
    "wait_event": lambda event: wait_event(event, 60),
    "wait_until": lambda event: wait_until(event, now() + 60),
}


@pytest.mark.parametrize("helper", list(WAITS))
async def test_a_cancel_in_the_step_the_event_is_set_is_raised(helper: str) -> None:
    async def body() -> None:
        event = asyncio.Event()
        task = await started(WAITS[helper](event), "wait_event")
        event.set()
        task.cancel()  # in the same step: the wake-up must not win
        assert await cancelled(task)

    await on_asyncio(body)


# -- wait_any ---------------------------------------------------------------------------------


async def test_wait_any_returns_on_a_future_the_event_or_the_timeout() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        other: asyncio.Future[int] = loop.create_future()
        event = asyncio.Event()
        loop.call_soon(future.set_result, 1)
        await wait_any([future, other], event, 60)
        assert future.done() and not other.done()  # the others keep running
        loop.call_soon(event.set)
        await wait_any([other], event, 60)
        assert not other.done()
        started_at = now()
        await wait_any([other], asyncio.Event(), 0.01)
        assert now() >= started_at and not other.done()
        other.cancel()

    await on_asyncio(body)


async def test_wait_any_raises_a_cancel_and_leaves_the_futures() -> None:
    async def body() -> None:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        event = asyncio.Event()
        task = await started(wait_any([future], event, 60), "wait_any")
        event.set()
        task.cancel()
        assert await cancelled(task)
        assert not future.done()
        future.cancel()

    await on_asyncio(body)


# -- wait_for_or_none -------------------------------------------------------------------------


async def test_wait_for_or_none_gives_the_result_or_none_and_cancels_the_late() -> None:
    async def body() -> None:
        assert await wait_for_or_none(asyncio.sleep(0, "soon"), 60) == "soon"
        work = Work()
        assert await wait_for_or_none(work("late"), 0.01) is None
        await eventually(lambda: work.ended == ["late"], "the late work cancelled")

    await on_asyncio(body)


async def test_wait_for_or_none_cancels_its_work_with_the_caller() -> None:
    async def body() -> None:
        work = Work()
        task = await started(wait_for_or_none(work("cancelled"), 60), "wait_for_or_none")
        task.cancel()
        assert await cancelled(task)
        await eventually(lambda: work.ended == ["cancelled"], "the work cancelled too")

    await on_asyncio(body)


# -- guarded and cancel_requests --------------------------------------------------------------


async def swallowing(reply: asyncio.Future[str]) -> str:
    """A driver call that lets a cancellation that comes while it awaits its reply go
    unanswered, and returns normally (as redis-py's sometimes does)."""
    try:
        return await reply
    except asyncio.CancelledError:
        return "answered anyway"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 counts no cancel requests")
async def test_guarded_raises_a_cancellation_the_call_swallowed() -> None:
    async def body() -> None:
        reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        unguarded = await started(swallowing(reply), "swallowing")
        unguarded.cancel()
        assert await unguarded == "answered anyway"  # the driver's bug, shown
        reply = asyncio.get_running_loop().create_future()
        task = await started(guarded(swallowing(reply)), "swallowing")
        task.cancel()
        assert await cancelled(task)

    await on_asyncio(body)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 counts no cancel requests")
async def test_guarded_passes_a_result_and_counts_requests() -> None:
    async def body() -> None:
        assert cancel_requests() == 0
        assert await guarded(asyncio.sleep(0, "reply")) == "reply"

    await on_asyncio(body)


# -- retrieve ---------------------------------------------------------------------------------


async def test_retrieve_marks_an_outcome_seen() -> None:
    async def body() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        before = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        try:
            failed: asyncio.Future[None] = loop.create_future()
            failed.set_exception(LookupError("nobody awaits this"))
            retrieve(failed)
            gone: asyncio.Future[None] = loop.create_future()
            gone.cancel()
            retrieve(gone)  # a cancelled one has nothing to retrieve, and raises nothing
            done: asyncio.Future[int] = loop.create_future()
            done.set_result(1)
            retrieve(done)
            del failed, gone, done
            gc.collect()
            unseen: asyncio.Future[None] = loop.create_future()
            unseen.set_exception(LookupError("never retrieved"))
            del unseen
            gc.collect()  # the control: an outcome nobody saw is reported
        finally:
            loop.set_exception_handler(before)
        return reported

    reported = await on_asyncio(body)
    assert [str(context.get("exception")) for context in reported] == ["never retrieved"]


# -- Tasks ------------------------------------------------------------------------------------


async def test_tasks_log_failures_and_are_cancelled_and_awaited_by_aclose(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("aiolease.test-tasks")

    async def body() -> tuple[list[str], int, int]:
        tasks = Tasks(logger)
        seen: list[str] = []
        failed = asyncio.Event()

        async def fail() -> None:
            failed.set()
            raise LookupError("lost in the background")

        async def forever() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                await asyncio.sleep(0)  # still awaited by aclose, once cancelled
                seen.append("forever ended")

        tasks.spawn(fail(), "failing")
        tasks.spawn(forever(), "forever")
        await failed.wait()
        await asyncio.sleep(0)
        running = len(tasks)
        await tasks.aclose()
        late = forever()
        tasks.spawn(late, "after close")  # closed, never run: no "never awaited" warning
        assert inspect.getcoroutinestate(late) == inspect.CORO_CLOSED
        await tasks.aclose()  # idempotent
        return seen, running, len(tasks)

    with caplog.at_level(logging.ERROR, "aiolease.test-tasks"):
        seen, running, left = await on_asyncio(body)
    assert (seen, running, left) == (["forever ended"], 1, 0)
    [record] = caplog.records
    assert "failing" in record.getMessage() and record.exc_info is not None
