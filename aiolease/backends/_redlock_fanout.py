"""Sending one request to every Redlock instance at once, and deciding on a quorum.

Each instance's request runs in a task of its own, so that the caller waits only
until the outcome is decided (a majority agreed, or can no longer agree) or the
per-request timeout passes, never for the slowest instance; and so that a
cancellation of the caller takes effect at once, whatever redis-py does with it.
A request still under way when the caller stops waiting is handed to a *late*
handler (an acquire that is granted after all is released on that instance),
cancelled, or left to finish, as the operation chooses.

Asyncio-only, like the backend (the core bridges it under trio).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from .._exceptions import BackendError, BackendTimeout, BackendUnavailable
from ..abc import HolderInfo
from ._redis_clients import where
from ._redis_pubsub import Subscriptions
from ._redis_scripts import Script
from .redis import ForeignDataError, holder_from, mapped_error

__all__ = ["Fanout", "Instance", "Late", "Outcome", "holder_from", "mapped", "votes"]

T = TypeVar("T")
#: Loop turns given, at the timeout, to replies that have arrived but not been read.
_GRACE_TURNS = 4
#: What happens to a request still under way when the caller stops waiting for it.
Late = Callable[[int, "asyncio.Task[Any]"], None] | None


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
        self.subscriptions = Subscriptions(client, confirm_timeout)
        self._hard_timeout = hard_timeout

    async def call(self, *args: Any) -> Any:
        """One command, bounded by the hard timeout; driver errors are not mapped here."""
        command = cast(Any, self.client).execute_command(*args)
        return await asyncio.wait_for(command, self._hard_timeout)

    async def eval(self, script: Script, keys: Sequence[bytes], *args: Any) -> Any:
        """EVALSHA, loading the script on NOSCRIPT."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.call("SCRIPT LOAD", script.source)
        return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)


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


class Fanout:
    """Runs requests on every instance, and the late work they leave behind.

    :param instances: the Redlock's instances
    """

    def __init__(self, instances: Sequence[Instance]) -> None:
        self.instances = list(instances)
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
            ``"finish"`` it in the background, or a handler ``late(index, task)``
        """
        loop = asyncio.get_running_loop()
        tasks = {loop.create_task(_run(request, i)): n for n, i in enumerate(self.instances)}
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
                        self._record(name, outcome, tasks[task], task)
                    break
                done, pending = await asyncio.wait(
                    pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    self._record(name, outcome, tasks[task], task)
        finally:
            for task in pending:
                self._leave(tasks[task], task, late)
        outcome.silent = sorted(tasks[t] for t in pending)
        return outcome

    def _record(self, name: str | None, outcome: Outcome[T], n: int, task: asyncio.Task[T]) -> None:
        exc = task.exception()
        if exc is None:
            outcome.replies[n] = task.result()
        else:
            outcome.errors[n] = mapped(self.instances[n].where, name, exc)

    def _leave(self, n: int, task: asyncio.Task[Any], late: Late | str) -> None:
        if late == "cancel":
            task.cancel()
            task.add_done_callback(_retrieve)
        elif late == "finish":
            self._adopt(task)
        elif callable(late):
            self._adopt(task)
            task.add_done_callback(lambda t: late(n, t))

    def spawn(self, work: Awaitable[Any]) -> None:
        """Run ``work`` in the background (its failure is only logged by nobody:
        it is best effort, bounded by the instances' hard timeout)."""
        self._adopt(asyncio.ensure_future(work))

    def _adopt(self, task: asyncio.Task[Any] | asyncio.Future[Any]) -> None:
        self._background.add(cast("asyncio.Task[Any]", task))
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(cast("asyncio.Task[Any]", task))
        _retrieve(task)

    async def drain(self, timeout: float) -> None:
        """Let background work (also work it starts meanwhile) finish for up to
        ``timeout`` seconds in all, then cancel what is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._background:
            tasks = set(self._background)
            _, pending = await asyncio.wait(tasks, timeout=max(deadline - loop.time(), 0))
            if pending and loop.time() >= deadline:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending)


async def _run(request: Callable[[Instance], Awaitable[T]], instance: Instance) -> T:
    return await request(instance)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: asyncio does not log it as lost


def votes(replies: Mapping[int, HolderInfo | None]) -> dict[str, list[HolderInfo]]:
    """The holders the instances reported, grouped by owner."""
    found: dict[str, list[HolderInfo]] = {}
    for holder in replies.values():
        if holder is not None:
            found.setdefault(holder.owner, []).append(holder)
    return found
