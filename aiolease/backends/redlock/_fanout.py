"""Sending one request to every Redlock instance at once, and deciding on a quorum.

Each instance's request runs in a task of its own, so that the caller waits only
until the outcome is decided (a majority agreed, or can no longer agree) or the
per-request timeout passes, never for the slowest instance; and so that a
cancellation of the caller takes effect at once, whatever redis-py does with it.
A request still under way when the caller stops waiting is handed to a *late*
handler (an acquire that is granted after all is released on that instance),
cancelled, or left to finish, as the operation chooses.

**No task ends with a driver's error, and none outlives** :meth:`Fanout.drain`. A
request's task catches its driver's error and returns it, mapped, as a value; a
cancelled request may still end otherwise (redis-py, and ``asyncio.wait_for`` up to
Python 3.11, now and then lose a cancellation, and the command then runs on to its
reply or its socket timeout). Every task the fanout starts is tracked until it ends,
so closing the backend waits for (or cancels, and waits for) each of them. Under
trio that matters twice over: when trio-asyncio's loop closes it awaits every task
still running and raises what they end with into its nursery, past the loop's
exception handler, so a raw ``redis.exceptions.TimeoutError`` of a request nobody
waited for any more would reach the caller of ``open_backend``.

Asyncio-only, like the backend (the core bridges it under trio).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from redis.asyncio import Redis

from ..._exceptions import BackendError, BackendTimeout, BackendUnavailable, ForeignDataError
from ...abc import HolderInfo
from .._asyncio import retrieve, timeout_after
from ..redis._shared import RedisPyTransport, Script, Subscriptions, evaluate, mapped_error, where

__all__ = ["Fanout", "Instance", "Late", "Outcome", "mapped", "votes"]

T = TypeVar("T")
#: Loop turns given, at the timeout, to replies that have arrived but not been read.
_GRACE_TURNS = 4
#: Called with ``(index, reply)`` when a request the caller stopped waiting for
#: succeeds after all (not when it fails or is cancelled).
Late = Callable[[int, Any], None]


def mapped(where_: str, name: str | None, exc: BaseException) -> BackendError:
    """A driver exception from one instance as aiolease's error."""
    server = f"Redlock instance {where_}"
    return mapped_error(exc, name, server=server, client=f"the Redis client of {where_}")


class Instance:
    """One Redis server of a Redlock: its client and its change notifications.

    :param client: the redis-py client (closed by the backend only if it made it)
    :param confirm_timeout: seconds to wait for a subscription to be confirmed
    :param hard_timeout: no request to this instance lasts longer than this
    """

    def __init__(self, client: Redis, confirm_timeout: float, hard_timeout: float) -> None:
        self.client = client
        self.where = where(client)
        self.subscriptions = Subscriptions(RedisPyTransport(client).subscriber, confirm_timeout)
        self._hard_timeout = hard_timeout

    async def call(self, *args: Any) -> Any:
        """One command, bounded by the hard timeout; driver errors are not mapped here.

        Not ``asyncio.wait_for``: its inner task, with the driver's error, could outlive
        a cancellation of the caller (see the module docstring); this runs in the caller's
        task, where a cancellation is always raised.
        """
        async with timeout_after(self._hard_timeout):
            return await cast(Any, self.client).execute_command(*args)

    async def eval(self, script: Script, keys: Sequence[bytes], *args: Any) -> Any:
        """EVALSHA, loading the script on NOSCRIPT; each command bounded as :meth:`call`."""
        return await evaluate(self.call, script, keys, *args)


@dataclass
class Outcome(Generic[T]):
    """What the instances answered so far: replies, mapped errors, and the silent ones."""

    size: int
    replies: dict[int, T] = field(default_factory=dict)
    errors: dict[int, BackendError] = field(default_factory=dict)
    silent: list[int] = field(default_factory=list)

    @property
    def waiting(self) -> int:
        """Instances that have not answered (yet)."""
        return self.size - len(self.replies) - len(self.errors)

    def error(self, what: str) -> BackendError:
        """The error to raise when no quorum was reached: a timeout if some instance
        stayed silent, else the first instance's own error."""
        foreign = [e for e in self.errors.values() if isinstance(e, ForeignDataError)]
        if foreign:
            return foreign[0]
        detail = "; ".join(str(e) for e in self.errors.values())
        if self.silent:
            late = ", ".join(str(i) for i in self.silent)
            return BackendTimeout(f"{what}: instance(s) {late} did not answer in time. {detail}")
        first = next(iter(self.errors.values()), None)
        kind = type(first) if isinstance(first, (BackendTimeout, BackendUnavailable)) else None
        return (kind or BackendUnavailable)(f"{what}: {detail or 'no quorum'}")


class _Failed:
    """What a request's task returns when its instance failed: the error, mapped."""

    __slots__ = ("error",)

    def __init__(self, error: BackendError) -> None:
        self.error = error


class Fanout:
    """Runs requests on every instance, and the late work they leave behind.

    :param instances: the Redlock's instances
    """

    def __init__(self, instances: Sequence[Instance]) -> None:
        self.instances = list(instances)
        #: Every task started and not yet ended: requests (also those a caller still
        #: waits for) and background work.
        self._background: set[asyncio.Task[Any]] = set()

    async def run(
        self,
        name: str | None,
        request: Callable[[Instance], Awaitable[T]],
        timeout: float,
        decided: Callable[[Outcome[T]], bool],
        late: Late | str = "cancel",
    ) -> Outcome[T]:
        """Send ``request`` to every instance; return once ``decided(outcome)`` or after
        ``timeout`` seconds.

        :param late: for a request still under way at the end: ``"cancel"`` it,
            ``"finish"`` it in the background, or call ``late(index, reply)`` if it
            succeeds after all (see :data:`Late`)
        """
        loop = asyncio.get_running_loop()
        tasks = {
            loop.create_task(_attempt(request, i, name)): n for n, i in enumerate(self.instances)
        }
        for task in tasks:
            self._adopt(task)
        outcome: Outcome[T] = Outcome(len(tasks))
        pending = set(tasks)
        try:
            deadline = loop.time() + timeout
            while pending and not decided(outcome):
                left = deadline - loop.time()
                if left <= 0:
                    # A loop starved of CPU sees the timer and the replies at once: let
                    # it read what has already arrived before calling anyone silent.
                    for _ in range(_GRACE_TURNS):
                        await asyncio.sleep(0)
                    done = {t for t in pending if t.done()}
                    pending -= done
                    for task in done:
                        self._record(outcome, tasks[task], task)
                    break
                done, pending = await asyncio.wait(
                    pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    self._record(outcome, tasks[task], task)
        finally:
            for task in pending:
                self._leave(tasks[task], task, late)
        outcome.silent = sorted(tasks[t] for t in pending)
        return outcome

    def _record(self, outcome: Outcome[T], n: int, task: asyncio.Task[T | _Failed]) -> None:
        if task.cancelled():  # only drain() cancels a request its caller waits for
            where_ = self.instances[n].where
            outcome.errors[n] = BackendUnavailable(
                f"Redlock instance {where_}: the request was cancelled, the backend closes"
            )
            return
        reply = task.result()
        if isinstance(reply, _Failed):
            outcome.errors[n] = reply.error
        else:
            outcome.replies[n] = reply

    def _leave(self, n: int, task: asyncio.Task[Any], late: Late | str) -> None:
        # The task stays tracked until it ends, whatever is chosen here.
        if late == "cancel":
            task.cancel()
        elif callable(late):
            task.add_done_callback(lambda t: _succeeded(t, lambda reply: late(n, reply)))

    def spawn(self, work: Awaitable[Any]) -> asyncio.Task[None]:
        """Run ``work`` in the background, tracked until it ends. Best effort: its
        failure is dropped (it is bounded by the instances' hard timeout, and what it
        did not clean up expires)."""
        task = asyncio.ensure_future(_quietly(work))
        self._adopt(task)
        return task

    def _adopt(self, task: asyncio.Task[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        retrieve(task)

    async def drain(self, timeout: float) -> None:
        """Let every task (requests, background work, and what they start meanwhile)
        end for up to ``timeout`` seconds in all, then cancel what is left, and wait
        for it to end (a task whose driver lost the cancellation ends at its
        timeout): no task of the fanout outlives this."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._background:
            tasks = set(self._background)
            _, pending = await asyncio.wait(tasks, timeout=max(deadline - loop.time(), 0))
            if pending and loop.time() >= deadline:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending)


async def _attempt(
    request: Callable[[Instance], Awaitable[T]], instance: Instance, name: str | None
) -> T | _Failed:
    """One instance's request; its driver's error is returned, mapped, never raised."""
    try:
        return await request(instance)
    except Exception as exc:  # noqa: BLE001 - handed back as a value, see the docstring
        return _Failed(mapped(instance.where, name, exc))


async def _quietly(work: Awaitable[Any]) -> None:
    try:
        await work
    except Exception:  # noqa: BLE001 - best-effort clean-up: left to the keys' expiry
        pass


def _succeeded(task: asyncio.Task[Any], then: Callable[[Any], None]) -> None:
    if not task.cancelled():
        reply = task.result()
        if not isinstance(reply, _Failed):
            then(reply)


def votes(replies: Mapping[int, HolderInfo | None]) -> dict[str, list[HolderInfo]]:
    """The holders the instances reported, grouped by owner."""
    found: dict[str, list[HolderInfo]] = {}
    for holder in replies.values():
        if holder is not None:
            found.setdefault(holder.owner, []).append(holder)
    return found
