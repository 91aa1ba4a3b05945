"""Waits that never drop a cancellation (asyncio only): run an awaitable to its end
although its caller is cancelled, and time limits that run in the caller's task.

A backend's request that may change the server (an acquire, a revoke) must not be
interrupted halfway when its caller is cancelled: the server may still carry it
out, after whatever the caller does next. :func:`run_to_end` runs it in a task of
its own and, once the caller is cancelled, waits a while longer for it before
re-raising the caller's cancellation. Asyncio primitives only, like the backends
that use it (they run on trio-asyncio's loop under trio).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

__all__ = ["retrieve", "run_to_end", "timeout_after"]

T = TypeVar("T")


async def run_to_end(awaitable: Awaitable[T], grace: float) -> T:
    """Await ``awaitable`` in a task of its own; if the caller is cancelled meanwhile,
    wait up to ``grace`` more seconds for it to end, then re-raise the caller's
    cancellation. A task still running after ``grace`` is cancelled, and its end
    awaited (at once, in practice), before the cancellation is re-raised.

    The caller awaits the task itself, whose ``cancel()`` only starts the grace
    period (see :class:`_ToTheEnd`): a cancellation of the caller, anyio's included
    (re-delivered on every loop turn meanwhile), stays pending in the caller's task
    until the task has ended, and is raised then, with its own message (anyio tells
    its scopes' apart by it). Awaiting the task directly costs one event-loop pass
    less than awaiting it through ``asyncio.shield``.

    :raises asyncio.CancelledError: the caller's own
    """
    coro = awaitable if asyncio.iscoroutine(awaitable) else _coroutine(awaitable)
    task = _ToTheEnd(coro, loop=asyncio.get_running_loop())
    task.grace = grace
    task.add_done_callback(retrieve)  # a caller cancelled meanwhile never sees its outcome
    try:
        result: T = await task
    finally:
        task.stop_timer()
    return result


class _ToTheEnd(asyncio.Task[Any]):
    """A task that a ``cancel()`` (its awaiter's cancellation reaching it, too) does not
    cancel at once: it runs on for :attr:`grace` more seconds, then is cancelled.

    ``cancel()`` returns ``False``, so a cancelled awaiter keeps waiting for it (its
    own cancellation pending), and raises that cancellation once it has ended.
    """

    grace = 0.0
    _timer: asyncio.TimerHandle | None = None

    def cancel(self, msg: Any | None = None) -> bool:
        if not self.done() and self._timer is None:
            self._timer = self.get_loop().call_later(self.grace, self._give_up, msg)
        return False

    def _give_up(self, msg: Any | None) -> None:
        super().cancel(msg)

    def stop_timer(self) -> None:
        """The task has ended, or nobody waits for it any more."""
        if self._timer is not None:
            self._timer.cancel()


async def _coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


def retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a task's outcome seen (nobody awaits it any more)."""
    if not task.cancelled():
        task.exception()


def timeout_after(seconds: float | None) -> AbstractAsyncContextManager[object]:
    """Raise :exc:`asyncio.TimeoutError` out of the block after ``seconds`` (``None``: never).

    Not ``asyncio.wait_for``: up to Python 3.11 it returns the result of an await that
    completes in the step a cancel arrives in, and drops the cancel, so a cancelled
    caller ran on (and could go on to take a lease). This runs the block in the
    caller's own task, where a cancel is always raised: ``asyncio.timeout`` on 3.11+.
    """
    if sys.version_info >= (3, 11):
        return asyncio.timeout(seconds)
    return _Timeout(seconds)  # pragma: no cover - Python 3.10


class _Timeout:  # pragma: no cover - Python 3.10, which lacks asyncio.timeout
    """``asyncio.timeout`` for Python 3.10. Without ``Task.uncancel``, a cancel that
    arrives in the very step the timer fires is taken for the timeout."""

    def __init__(self, seconds: float | None) -> None:
        self._seconds = seconds
        self._fired = False
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> _Timeout:
        task = asyncio.current_task()
        if self._seconds is not None and task is not None:
            self._handle = asyncio.get_running_loop().call_later(self._seconds, self._fire, task)
        return self

    def _fire(self, task: asyncio.Task[Any]) -> None:
        self._fired = True
        task.cancel()

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._fired and kind is asyncio.CancelledError:
            raise asyncio.TimeoutError
