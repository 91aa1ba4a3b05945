"""The SQLite backend's thread: where its groups of calls run on its connection.

``anyio.to_thread.run_sync`` costs the event loop about 90 us of CPU per call here
(its capacity limiter, a cancel scope, a pool of workers that come and go), about
twice a bare hand-off to a thread and back; 16 tasks on a semaphore of 4 send a
group every 1.4 acquisitions, and their client's CPU is what bounds them. So in an
asyncio task a backend object runs its groups on a thread of its own: a queue in, a
``call_soon_threadsafe`` out (about 42 us). The thread ends after :data:`IDLE`
seconds without a call (the next call starts another) and when the backend closes;
a child process forked meanwhile starts its own. Under trio,
``anyio.to_thread.run_sync`` runs them, as before.

The callers shield the call (a group's outcome is every caller's), so that anyio
never cancels the wait; a cancellation of the task by other means stops the wait,
not the call, which runs to its end in the thread, as anyio's does.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.to_thread

from .._clock import in_asyncio_task

__all__ = ["IDLE", "ConnectionThread"]

T = TypeVar("T")

#: Seconds the thread waits for a call before it ends.
IDLE = 10.0

#: A call for the thread: the function, its arguments, the future that gets its
#: outcome and that future's loop; ``None`` tells the thread to end.
_Item = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]", asyncio.AbstractEventLoop]


class ConnectionThread:
    """Runs one backend object's blocking calls, one at a time, off the event loop."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        #: Guards ``_alive`` against the thread ending while a call is put in.
        self._guard = threading.Lock()
        self._alive = False
        #: The process that started the thread (a child forked since has none).
        self._pid = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the thread (in an asyncio task) or in anyio's worker
        threads (elsewhere); its result, or its exception raised here."""
        if not in_asyncio_task():
            return await anyio.to_thread.run_sync(fn, *args)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._guard:
            self._queue.put((fn, args, future, loop))
            if not self._alive or self._pid != os.getpid():
                self._alive, self._pid = True, os.getpid()
                threading.Thread(target=self._serve, name=self._name, daemon=True).start()
        return await future

    def stop(self) -> None:
        """End the thread once the calls already put in have run."""
        with self._guard:
            if self._alive:
                self._queue.put(None)
                self._alive = False

    def _serve(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=IDLE)
            except queue.Empty:
                with self._guard:
                    if self._queue.empty():
                        self._alive = False
                        return
                continue
            if item is None:
                return
            fn, args, future, loop = item
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, as anyio does
                _answer(loop, future, None, exc)
            else:
                _answer(loop, future, result, None)


def _answer(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the loop closed meanwhile: nobody waits any more
        pass


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its waiter was cancelled
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, StopIteration):  # a future refuses it (TypeError): wrap it
        future.set_exception(RuntimeError(f"the call raised {error!r}"))
    else:
        future.set_exception(error)
