"""The one asyncio toolkit of the backends: waits that never drop a cancellation.

Backends run their drivers on asyncio (on trio-asyncio's loop under trio). There
anyio's asyncio backend may hold a ``get_running_loop`` that trio-asyncio has not
patched (it depends on import order), so backends use asyncio's own primitives,
looked up at call time, never anyio's; and every such helper lives here, once:

* :func:`now`: the loop's clock, which is the core's ``anyio.current_time()`` on both
  loops (asyncio's loop clock, or trio's clock on a trio-asyncio loop).
* :func:`run_to_end`: a request that may change the server (an acquire, a revoke)
  must not be interrupted halfway when its caller is cancelled: the server may still
  carry it out, after whatever the caller does next. It runs in a task of its own
  and, once the caller is cancelled, is waited for a while longer before the
  caller's cancellation is re-raised.
* :func:`timeout_after`, :func:`wait_event`, :func:`wait_until`, :func:`wait_any`,
  :func:`wait_for_or_none`: time limits that run in the caller's task, where a
  cancel is always raised. Not ``asyncio.wait_for``: up to Python 3.11 it returns
  the result of an await that completes in the step a cancel arrives in, and drops
  the cancel (trio-asyncio forwards a trio cancellation once).
* :func:`guarded`: redis-py's asyncio client (8.1 measured) sometimes lets a
  cancellation that arrives while it awaits a reply go unanswered: the command
  completes and the call returns normally. Awaiting a driver call through
  :func:`guarded` raises the cancellation anyway.
* :func:`retrieve`: marks the outcome of a task nobody awaits any more as seen.
* :class:`Tasks`: the background tasks of one backend object, whose failures are
  logged, cancelled and awaited when the backend closes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections.abc import Awaitable, Coroutine, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

__all__ = [
    "Tasks",
    "cancel_requests",
    "guarded",
    "now",
    "retrieve",
    "run_to_end",
    "timeout_after",
    "wait_any",
    "wait_event",
    "wait_for_or_none",
    "wait_until",
]

T = TypeVar("T")

#: Loop iterations given to anyio to re-deliver a swallowed cancellation itself.
_REDELIVERY_TURNS = 3


def now() -> float:
    """The running loop's clock: the caller's ``anyio.current_time()``, also under
    trio-asyncio."""
    return asyncio.get_running_loop().time()


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


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds (``None``: no limit); whether it was set.

    A checkpoint; a cancel is always raised, also one that comes in the step the
    event is set in.
    """
    if timeout is not None and timeout <= 0:
        await asyncio.sleep(0)
        return event.is_set()
    try:
        async with timeout_after(timeout):
            await event.wait()
    except asyncio.TimeoutError:
        return False
    return True


async def wait_until(event: asyncio.Event, deadline: float) -> bool:
    """Wait until ``event`` is set or the loop's clock (:func:`now`) reaches ``deadline``
    (``math.inf``: no limit); whether it was set. A checkpoint, as :func:`wait_event`."""
    if event.is_set():
        await asyncio.sleep(0)
        return True
    return await wait_event(event, None if math.isinf(deadline) else deadline - now())


async def wait_any(
    futures: Iterable[asyncio.Future[Any]], event: asyncio.Event, timeout: float
) -> None:
    """Wait until one of ``futures`` is done, ``event`` is set, or ``timeout`` seconds pass.

    Leaves the futures running. A cancel is always raised (``asyncio.wait`` never
    swallows one).
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({*futures, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


async def wait_for_or_none(awaitable: Awaitable[T], timeout: float) -> T | None:
    """Await ``awaitable`` for at most ``timeout`` seconds; ``None`` if the time ran out
    (it is then cancelled)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait([task], timeout=timeout)
    except BaseException:
        task.cancel()
        task.add_done_callback(retrieve)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(retrieve)
        return None
    return task.result()


def cancel_requests() -> int:
    """How many cancellations of the current task were requested and not withdrawn.

    Always 0 on Python 3.10, which does not count them.
    """
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return 0 if cancelling is None else int(cancelling())


async def guarded(awaitable: Awaitable[T]) -> T:
    """Await a driver call; if the task was asked to cancel meanwhile but the call
    returned anyway (redis-py does, see the module), raise the cancellation.

    :raises asyncio.CancelledError: a cancellation was requested during the call
    """
    before = cancel_requests()
    result = await awaitable
    if cancel_requests() > before:
        # Let anyio re-deliver its own (its cancel scopes recognise only theirs) ...
        for _ in range(_REDELIVERY_TURNS):
            await asyncio.sleep(0)
        # ... or deliver it here.
        raise asyncio.CancelledError("cancelled while the server answered")
    return result


class Tasks:
    """Background tasks owned by one backend object, cancelled and awaited by :meth:`aclose`.

    :param logger: where a task's failure is logged (never lost)
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` in the background (once closed: close it, never run it)."""
        if self.closed:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._logger.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def aclose(self) -> None:
        """Cancel every task and wait until all have ended. Idempotent."""
        self.closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
