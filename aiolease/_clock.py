"""The core's clock: ``anyio.current_time()``, read with one look-up instead of three.

``anyio.current_time()`` finds the running async library (sniffio), then anyio's
backend class for it, then asks that backend. On the hot path (every acquire,
release, renewal and deadline check) this asks for the running asyncio loop first
and reads its clock, which is what anyio's asyncio backend returns too (also on a
trio-asyncio loop, whose clock is trio's, ``MockClock`` included). With no asyncio
loop running, the only other library anyio runs on is trio: this asks trio itself
(``trio.current_time()``, what anyio's trio backend returns), and anyio only when
that fails (outside any event loop: anyio's error is raised).

``asyncio._get_running_loop`` is looked up on every call: trio-asyncio replaces it
with one that also knows trio's tasks (whose loop is not the thread's).

Cancel scopes, checkpoints and events are made the same way: in an asyncio task with
anyio's asyncio classes, elsewhere (trio's tasks) with anyio's trio classes, each
learned from the first one anyio made there.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Awaitable, Callable
from typing import cast

import anyio

__all__ = [
    "Alarm",
    "cancel_scope",
    "checkpoint",
    "current_time",
    "event",
    "fail_after",
    "in_asyncio_task",
    "move_on_after",
]

#: ``trio.current_time`` and ``trio.lowlevel.checkpoint``, once trio was seen running.
_trio_time: list[Callable[[], float]] = []
_trio_checkpoint: list[Callable[[], Awaitable[None]]] = []


def current_time() -> float:
    """``anyio.current_time()``: the running event loop's monotonic clock, in seconds."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop.time()
    if _trio_time:
        try:
            return _trio_time[0]()
        except RuntimeError:  # not in trio.run(): anyio raises its own error below
            pass
    now = anyio.current_time()
    _learn_trio()
    return now


def _learn_trio() -> None:
    """Remember trio's functions once anyio found it running (no asyncio loop runs)."""
    trio = sys.modules.get("trio")
    if not _trio_time and trio is not None:
        _trio_time.append(cast(Callable[[], float], trio.current_time))
        _trio_checkpoint.append(cast(Callable[[], Awaitable[None]], trio.lowlevel.checkpoint))


def in_asyncio_task() -> bool:
    """Whether an asyncio task runs (not a trio task, trio-asyncio's included)."""
    loop = asyncio._get_running_loop()
    return loop is not None and asyncio.current_task(loop) is not None


#: The classes of anyio's cancel scopes, learned from the first one made in an asyncio
#: task (``[0]``) and in a trio task (``[1]``): ``anyio.CancelScope()`` finds its
#: backend's class by sniffio on every call (as costly as the scope itself).
_scope_classes: list[type[anyio.CancelScope] | None] = [None, None]


def cancel_scope(*, deadline: float = math.inf, shield: bool = False) -> anyio.CancelScope:
    """``anyio.CancelScope(deadline=deadline, shield=shield)``, made without asking sniffio
    (in an asyncio task, as :func:`current_time` and ``aiolease._life.current_task``
    tell one: a running asyncio loop, and an asyncio task on it; trio's tasks,
    trio-asyncio's included, have none)."""
    which = 0 if in_asyncio_task() else 1
    made = _scope_classes[which]
    if made is not None:
        return made(deadline=deadline, shield=shield)
    scope = anyio.CancelScope(deadline=deadline, shield=shield)
    _scope_classes[which] = type(scope)
    return scope


#: The classes of anyio's events, learned as :data:`_scope_classes` are.
_event_classes: list[type[anyio.Event] | None] = [None, None]


def event() -> anyio.Event:
    """``anyio.Event()``, made without asking sniffio (as :func:`cancel_scope` makes a
    scope)."""
    which = 0 if in_asyncio_task() else 1
    made = _event_classes[which]
    if made is not None:
        return made()
    new = anyio.Event()
    _event_classes[which] = type(new)
    return new


def move_on_after(delay: float) -> anyio.CancelScope:
    """``anyio.move_on_after(delay)``: a scope whose deadline is ``delay`` seconds from
    now, made as :func:`cancel_scope` makes one."""
    return cancel_scope(deadline=current_time() + delay)


async def checkpoint() -> None:
    """``anyio.lowlevel.checkpoint()``, without asking sniffio: in an asyncio task,
    anyio's is ``asyncio.sleep(0)`` (a cancellation of the task's scopes is delivered
    at that await, as at any other); in a trio task, ``trio.lowlevel.checkpoint()``."""
    if in_asyncio_task():
        await asyncio.sleep(0)
    elif _trio_checkpoint:
        await _trio_checkpoint[0]()
    else:
        await anyio.lowlevel.checkpoint()
        _learn_trio()


class fail_after:  # noqa: N801 (used as anyio's function of that name is)
    """``anyio.fail_after(delay)``, made as :func:`cancel_scope` makes a scope: raises
    :class:`TimeoutError` when the deadline cut the block short."""

    __slots__ = ("_scope",)

    def __init__(self, delay: float) -> None:
        self._scope = cancel_scope(deadline=current_time() + delay)

    def __enter__(self) -> anyio.CancelScope:
        return self._scope.__enter__()

    def __exit__(self, *exc_info: object) -> bool:
        scope = self._scope
        suppressed = bool(scope.__exit__(*exc_info))  # type: ignore[arg-type]
        if scope.cancelled_caught and scope.deadline <= current_time():
            raise TimeoutError
        return suppressed


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Alarm:
    """Wakes one task at a time on the clock, or when :meth:`set`, whichever comes
    first (:meth:`wait_until`). In an asyncio task: a future and one timer, so that a
    time reached costs one callback, not a cancellation delivered to the task and
    raised through it (as a cancel scope's deadline does); elsewhere (trio): an event
    awaited in a cancel scope."""

    __slots__ = ("_event", "_future", "_set")

    def __init__(self) -> None:
        self._set = False
        self._future: asyncio.Future[None] | None = None
        self._event: anyio.Event | None = None

    def set(self) -> None:
        self._set = True
        if self._future is not None:
            _resolve(self._future)
        elif self._event is not None:
            self._event.set()

    async def wait_until(self, at: float) -> None:
        """Return at time ``at`` (:func:`current_time`'s clock), or once set (at once
        if it was)."""
        if self._set:
            return
        loop = asyncio._get_running_loop()
        if loop is not None and asyncio.current_task(loop) is not None:
            future = self._future = loop.create_future()
            timer = None if at == math.inf else loop.call_at(at, _resolve, future)
            try:
                await future
            finally:
                if timer is not None:
                    timer.cancel()
            return
        woken = self._event = event()
        with cancel_scope(deadline=at):
            await woken.wait()
