"""Helpers shared by the tests of any backend: names, URLs, loops, grants, waits."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import pytest

from aiolease import Lease, LossReason, Observer, open_backend
from aiolease._bridge import AsyncioBridge, call_asyncio, running_trio
from aiolease.abc import Backend, Grant, HolderInfo

B = TypeVar("B", bound=Backend)


def raises(exc: type[BaseException], match: str | None = None) -> pytest.RaisesGroup[Any]:
    """``pytest.raises(exc)`` that also sees through exception groups.

    Under trio, ``open_backend`` of an asyncio-only backend runs it in a trio-asyncio
    loop whose nursery wraps what escapes it in an exception group.
    """
    return pytest.RaisesGroup(
        pytest.RaisesExc(exc, match=match), allow_unwrapped=True, flatten_subgroups=True
    )


def unique(prefix: str) -> str:
    """A name no other run uses: ``prefix`` and 10 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def with_query(url: str, **params: object) -> str:
    """``url`` with ``params`` added to its query."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    query += [(key, str(value)) for key, value in params.items()]
    return urlunsplit(parts._replace(query=urlencode(query)))


def inner(backend: Backend, kind: type[B]) -> B:
    """The backend behind the trio bridge (or ``backend`` itself under asyncio)."""
    found = backend.inner if isinstance(backend, AsyncioBridge) else backend
    assert isinstance(found, kind), found
    return found


#: Opens a backend: ``async with open_(**options) as backend``.
Opener = Callable[..., AbstractAsyncContextManager[Backend]]


def prefixed_opener(url: str, prefix: str, **options: Any) -> Opener:
    """Opens backends on ``url`` under the key prefix ``prefix`` (``.prefix``), with
    ``options`` and whatever more each opening gives."""

    @asynccontextmanager
    async def open_(**more: Any) -> AsyncIterator[Backend]:
        async with open_backend(url, prefix=prefix, **options, **more) as backend:
            yield backend

    open_.prefix = prefix  # type: ignore[attr-defined]
    return open_


T = TypeVar("T")


async def on_asyncio(fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``fn()`` on asyncio under either loop (on trio through trio-asyncio)."""
    if not running_trio():
        return await fn()
    import trio_asyncio

    if trio_asyncio.current_loop.get() is None:
        async with trio_asyncio.open_loop():
            return await call_asyncio(fn)
    return await call_asyncio(fn)


async def grant(backend: Backend, name: str, owner: str, ttl: float = 30.0) -> Grant:
    """``try_acquire`` that must succeed."""
    result = await backend.try_acquire(name, owner, ttl, f"id-{owner}", {"by": owner})
    assert isinstance(result, Grant), result
    return result


async def refused(backend: Backend, name: str, owner: str) -> HolderInfo:
    """``try_acquire`` that must be refused."""
    result = await backend.try_acquire(name, owner, 30.0, f"id-{owner}", {})
    assert isinstance(result, HolderInfo), result
    return result


async def _holds(predicate: Callable[[], bool | Awaitable[bool]]) -> bool:
    result = predicate()
    return await result if isinstance(result, Awaitable) else result


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], what: str, within: float = 20.0
) -> None:
    """Wait until ``predicate()`` holds (a state of another loop, or of the server, that
    no event reports); it may be a coroutine function.

    :raises AssertionError: it did not hold within ``within`` seconds (a hang guard)
    """
    with anyio.move_on_after(within):
        while not await _holds(predicate):  # noqa: ASYNC110 - no event to await
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"{what} did not happen within {within:g}s")


def suspended_in(task: asyncio.Task[Any], function: str) -> bool:
    """Whether ``task`` is suspended on a future (awaits no coroutine further down)
    inside a call of ``function``."""
    names = []
    awaited: Any = task.get_coro()
    while hasattr(awaited, "cr_await"):
        names.append(awaited.cr_code.co_name)
        awaited = awaited.cr_await
    return not task.done() and function in names and awaited is not None


class Recorder(Observer):
    """An :class:`Observer` that records every event as a tuple (its kind first), and
    wakes whoever waits for an event of a kind."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self._waiting: dict[str, anyio.Event] = {}

    def _record(self, *event: Any) -> None:
        self.log.append(event)
        waiting = self._waiting.pop(event[0], None)
        if waiting is not None:
            waiting.set()

    async def next(self, kind: str) -> tuple[Any, ...]:
        """Wait for the next event of ``kind`` and return it."""
        await self._waiting.setdefault(kind, anyio.Event()).wait()
        return [e for e in self.log if e[0] == kind][-1]

    def kinds(self) -> list[str]:
        return [event[0] for event in self.log]

    def acquired(self, lease: Lease, wait: float) -> None:
        self._record("acquired", lease, wait)

    def acquire_failed(self, name: str, wait: float, error: BaseException) -> None:
        self._record("acquire_failed", name, wait, error)

    def released(self, lease: Lease, held: float) -> None:
        self._record("released", lease, held)

    def lost(self, lease: Lease, reason: LossReason, held: float) -> None:
        self._record("lost", lease, reason, held)

    def renewed(self, leases: Sequence[Lease], latency: float) -> None:
        self._record("renewed", list(leases), latency)

    def renew_failed(self, lease: Lease, error: BaseException) -> None:
        self._record("renew_failed", lease, error)

    def release_finished(self, name: str, token: int | None, duration: float, freed: bool) -> None:
        self._record("release_finished", name, token, duration, freed)

    def elected(self, lease: Lease) -> None:
        self._record("elected", lease)

    def deposed(self, lease: Lease, reason: LossReason) -> None:
        self._record("deposed", lease, reason)
