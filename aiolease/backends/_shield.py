"""Run an awaitable to its end although its caller is cancelled (asyncio only).

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
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["retrieve", "run_to_end"]

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
