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
import math
import sys
from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

__all__ = ["retrieve", "run_to_end", "timeout_after"]

T = TypeVar("T")


async def run_to_end(awaitable: Awaitable[T], grace: float) -> T:
    """Await ``awaitable`` in a task of its own; if the caller is cancelled meanwhile,
    wait up to ``grace`` more seconds for it to end, then re-raise the caller's
    cancellation. anyio re-delivers the cancellation on every loop turn meanwhile; it
    is held back. A task still running after ``grace`` is cancelled, and its end
    awaited (at once, in practice), before the cancellation is re-raised.

    :raises asyncio.CancelledError: the caller's own (anyio tells its scopes' apart)
    """
    task = asyncio.ensure_future(awaitable)
    loop = asyncio.get_running_loop()
    cancelled: asyncio.CancelledError | None = None
    give_up = math.inf
    while not task.done() and loop.time() < give_up:
        try:
            if cancelled is None:
                await asyncio.shield(task)
            else:
                await asyncio.wait({task}, timeout=give_up - loop.time())
        except asyncio.CancelledError as exc:
            if cancelled is None:
                cancelled, give_up = exc, loop.time() + grace
    if cancelled is None:
        return task.result()
    task.cancel()
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            pass
    task.add_done_callback(retrieve)
    raise cancelled


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
