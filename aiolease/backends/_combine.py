"""Operations of one key (a name), combined while one is in flight (the permits of
PostgreSQL, MySQL / MariaDB and MongoDB; PostgreSQL's fast releases).

Every acquire and release of a name's permits locks the name's row on the server, so
the statements of one name run one after the other there, each a transaction with its
own round trip, lock and commit. :class:`Combiner` sends a name's operation at once
when none of the name's is in flight (no cost when uncontended); the operations that
arrive meanwhile wait, and go together, in arrival order, as one statement (one
transaction) once it is back. So a name's operations leave a backend object in the
order they were asked, one statement at a time, and many tasks of one process that
take turns on a name cost the server a few transactions instead of one each.

A batch is sent by a task of its own (:class:`~aiolease.backends._asyncio.Tasks`),
never by a caller that could be cancelled halfway. A caller cancelled while its
operation waits or is in flight stops waiting at once: whatever it sends next for the
name (the core's compensating release) goes after it, in order, so a grant it missed
is never left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from .._exceptions import BackendUnavailable
from ._asyncio import Tasks, retrieve
from .sql._running import finished

__all__ = ["Combiner"]

Op = TypeVar("Op")
R = TypeVar("R")

#: The most operations in one combined statement (the rest go in the next).
MOST = 64
#: The most statements of one key in flight at once.
DEPTH = 1


class Combiner(Generic[Op, R]):
    """Per key, at most ``depth`` statements in flight; operations that arrive
    meanwhile go together in the next.

    :param one: sends one operation of a key, alone
    :param many: sends several operations of a key (two or more) as one statement;
        answers one result per operation, in order
    :param tasks: where the batches' senders run (closed with the backend)
    :param depth: the most statements of one key in flight at once
    :param most: the most operations in one statement
    """

    def __init__(
        self,
        one: Callable[[str, Op], Awaitable[R]],
        many: Callable[[str, Sequence[Op]], Awaitable[Sequence[R]]],
        tasks: Tasks,
        *,
        depth: int = DEPTH,
        most: int = MOST,
    ) -> None:
        self._one = one
        self._many = many
        self._tasks = tasks
        self._depth = depth
        self._most = most
        #: Keys with a statement in flight: how many, and the operations waiting.
        self._keys: dict[str, _Key[Op, R]] = {}
        #: Statements that carried more than one operation (for tests and benchmarks).
        self.combined = 0

    async def run(self, key: str, op: Op, *, to_end: bool = True, gather: bool = False) -> R:
        """Send ``op`` of ``key`` (now, or with the next statement of ``key``); its result.

        :param to_end: an operation sent at once is seen to its end if the caller is
            cancelled meanwhile (:func:`finished`: one that may grant); else the caller
            shields it itself (a release)
        :param gather: if it would go at once, it goes after the tasks ready to run now
            instead, with the operations of ``key`` that they ask meanwhile (the caller
            knows others are about to ask: the waiters that a release just granted
            leave their blocks together, and ask again together)
        :raises BackendError: the statement that carried it failed
        """
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _Key()
        if gather and state.flying < self._depth and not state.waiting:
            asyncio.get_running_loop().call_soon(self._pump_if_current, key, state)
        elif state.flying < self._depth and not state.waiting:
            state.flying += 1
            try:
                return await (finished(self._one(key, op)) if to_end else self._one(key, op))
            finally:
                state.flying -= 1
                self._pump(key, state)
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        future.add_done_callback(retrieve)  # its caller may have stopped waiting
        state.waiting.append((op, future))
        return await asyncio.shield(future)

    def _pump_if_current(self, key: str, state: _Key[Op, R]) -> None:
        if self._keys.get(key) is state:
            self._pump(key, state)

    def _pump(self, key: str, state: _Key[Op, R]) -> None:
        """Send what waits, while fewer than ``depth`` statements of ``key`` fly."""
        most = self._most
        while state.waiting and state.flying < self._depth:
            if self._tasks.closed:
                _fail(state.waiting)
                state.waiting = []
                break
            batch, state.waiting = state.waiting[:most], state.waiting[most:]
            state.flying += 1
            self._tasks.spawn(self._send(key, state, batch), f"aiolease-combine-{key[:40]}")
        if not state.flying and not state.waiting:
            del self._keys[key]

    async def _send(
        self, key: str, state: _Key[Op, R], batch: list[tuple[Op, asyncio.Future[R]]]
    ) -> None:
        """Send ``batch`` as one statement and answer its operations."""
        try:
            try:
                if len(batch) == 1:
                    results: Sequence[R] = [await self._one(key, batch[0][0])]
                else:
                    self.combined += 1
                    results = await self._many(key, [op for op, _ in batch])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
            else:
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        except BaseException:  # cancelled: the backend closes
            _fail(batch)
            _fail(state.waiting)
            state.waiting = []
            raise
        finally:
            state.flying -= 1
            self._pump(key, state)


class _Key(Generic[Op, R]):
    __slots__ = ("flying", "waiting")

    def __init__(self) -> None:
        self.flying = 0
        self.waiting: list[tuple[Op, asyncio.Future[R]]] = []


def _fail(batch: Sequence[tuple[object, asyncio.Future[R]]]) -> None:
    """Fail the operations of ``batch`` not answered yet: the backend closed."""
    for _, future in batch:
        if not future.done():
            future.set_exception(BackendUnavailable("the backend closed before it answered"))
