"""``aiolease._clock``'s timers, under asyncio and trio: an :class:`Alarm` wakes its
task at its time or when set, whichever comes first; :class:`fail_after` raises
:class:`TimeoutError` only when its own deadline cut the block short."""

from __future__ import annotations

import math

import anyio
import pytest

from aiolease._clock import Alarm, current_time, fail_after

pytestmark = pytest.mark.anyio


async def test_an_alarm_wakes_its_task_at_its_time() -> None:
    at = current_time() + 0.05
    await Alarm().wait_until(at)
    assert current_time() >= at


async def test_an_alarm_set_wakes_its_task_before_its_time() -> None:
    alarm = Alarm()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(alarm.wait_until, math.inf)
            await anyio.wait_all_tasks_blocked()
            alarm.set()
        alarm.set()  # (again: nothing happens)
        await alarm.wait_until(math.inf)  # set before: returns at once


async def test_an_alarm_waiting_is_cancelled_by_its_scope() -> None:
    with anyio.move_on_after(0.05) as scope:
        await Alarm().wait_until(math.inf)
    assert scope.cancelled_caught


async def test_fail_after_raises_timeout_error_at_its_deadline() -> None:
    with pytest.raises(TimeoutError):
        with fail_after(0.05):
            await anyio.sleep_forever()


async def test_fail_after_lets_an_outer_cancel_through_as_a_cancel() -> None:
    with anyio.move_on_after(0.05) as outer:
        with fail_after(30):
            await anyio.sleep_forever()
    assert outer.cancelled_caught


async def test_fail_after_returns_what_its_block_returns_in_time() -> None:
    with fail_after(30) as scope:
        await anyio.lowlevel.checkpoint()
    assert not scope.cancelled_caught
