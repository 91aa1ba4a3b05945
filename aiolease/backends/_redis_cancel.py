"""Waiting on asyncio without losing a cancellation.

Two traps swallow a ``Task.cancel()`` on Python 3.11 with redis-py:

* redis-py's asyncio client (8.1 measured) sometimes lets a cancellation that
  arrives while it awaits a reply go unanswered: the command completes and the call
  returns normally;
* ``asyncio.wait_for`` returns the result, and drops the cancellation, when the
  awaited thing finishes at the moment it is cancelled (fixed in Python 3.12).

The first was measured a third of the time on a ``BLPOP`` cancelled early on a
client with a ``socket_timeout`` (redis-py sends through ``asyncio.wait_for``).
anyio re-delivers the cancellation of a cancelled scope at the next checkpoint, but
a plain ``task.cancel()`` (trio-asyncio forwarding a trio cancellation, say) comes
once. So the backend awaits redis-py through :func:`guarded`, and waits with
:func:`wait_event`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["cancel_requests", "guarded", "wait_event", "wait_for_or_none"]

T = TypeVar("T")

#: Loop iterations given to anyio to re-deliver a swallowed cancellation itself.
_REDELIVERY_TURNS = 3


def cancel_requests() -> int:
    """How many cancellations of the current task were requested and not withdrawn.

    Always 0 on Python 3.10, which does not count them.
    """
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return 0 if cancelling is None else int(cancelling())


async def guarded(awaitable: Awaitable[T]) -> T:
    """Await a redis-py call; if the task was asked to cancel meanwhile but the call
    returned anyway, raise the cancellation.

    :raises asyncio.CancelledError: a cancellation was requested during the call
    """
    before = cancel_requests()
    result = await awaitable
    if cancel_requests() > before:
        # Let anyio re-deliver its own (its cancel scopes recognise only theirs) ...
        for _ in range(_REDELIVERY_TURNS):
            await asyncio.sleep(0)
        # ... or deliver it here.
        raise asyncio.CancelledError("cancelled while Redis answered")
    return result


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set (``True``) or ``timeout`` seconds pass (``False``)."""
    if timeout is None:
        await event.wait()
        return True
    if sys.version_info >= (3, 11):
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return False
        return True
    # Python 3.10: not asyncio.wait_for, which returns if the event is set in the step
    # a cancel arrives in, and drops the cancel (a trio cancellation comes only once).
    waiter = asyncio.ensure_future(event.wait())  # pragma: no cover - Python 3.10
    try:  # pragma: no cover
        done, _ = await asyncio.wait([waiter], timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)  # pragma: no cover


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: asyncio does not log it as lost


async def wait_for_or_none(awaitable: Awaitable[T], timeout: float) -> T | None:
    """Await ``awaitable`` for at most ``timeout`` seconds; ``None`` if the time ran out
    (it is then cancelled)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait([task], timeout=timeout)
    except BaseException:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        return None
    return task.result()
