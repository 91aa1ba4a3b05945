"""Helpers shared by the conformance checks: typed failures, time bounds, names."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager

import anyio
from anyio.abc import TaskGroup

from ..abc import Backend, Capability, Grant, HolderInfo

__all__ = [
    "LONG_TTL",
    "PROMPT",
    "SHORT_TTL",
    "TOLERANCE",
    "BackendFactory",
    "Check",
    "grant",
    "holder_of",
    "increasing",
    "new_owner",
    "refused",
    "require",
    "require_remaining",
    "task_group",
    "unique_name",
    "wait_free",
    "within",
]

#: Opens a backend for one check: ``lambda: aiolease.open_backend(url)``.
BackendFactory = Callable[[], AbstractAsyncContextManager[Backend]]
#: One conformance check.
Check = Callable[[BackendFactory], Awaitable[None]]

#: Seconds of slack for server clocks with coarse resolution and for round trips.
TOLERANCE = 0.25
#: A ttl that is waited out by the checks about expiry.
SHORT_TTL = 0.3
#: A ttl that never runs out during a check.
LONG_TTL = 30.0
#: How long a "prompt" return of ``wait_changed`` may take.
PROMPT = 1.0


def require(condition: bool, message: str) -> None:
    """Raise :class:`AssertionError` with ``message`` unless ``condition`` (``-O`` proof).

    :raises AssertionError: ``condition`` is false
    """
    if not condition:
        raise AssertionError(message)


@contextmanager
def within(seconds: float, what: str) -> Iterator[None]:
    """Cancel the block after ``seconds`` and report that ``what`` did not happen in time.

    :raises AssertionError: the block did not finish within ``seconds``
    """
    with anyio.move_on_after(seconds) as scope:
        yield
    if scope.cancelled_caught:
        raise AssertionError(f"{what} did not happen within {seconds:g}s")


def _assertion_in(group: BaseException) -> AssertionError | None:
    # Duck-typed so that Python 3.10 needs no exceptiongroup import here.
    for exc in getattr(group, "exceptions", ()):
        if isinstance(exc, AssertionError):
            return exc
        found = _assertion_in(exc)
        if found is not None:
            return found
    return None


@asynccontextmanager
async def task_group() -> AsyncIterator[TaskGroup]:
    """A task group whose failed check in any task surfaces as a plain AssertionError.

    :raises AssertionError: a task (or the body) failed a check
    """
    try:
        async with anyio.create_task_group() as tg:
            yield tg
    except BaseException as group:
        failure = _assertion_in(group)
        if failure is None:
            raise
        raise failure from group


def increasing(values: Sequence[int]) -> bool:
    """Whether ``values`` strictly increase."""
    return all(a < b for a, b in itertools.pairwise(values))


def unique_name(suffix: str = "") -> str:
    """A lease name no earlier run has used."""
    return f"aiolease-check-{uuid.uuid4().hex[:12]}{suffix}"


def new_owner() -> str:
    """A fresh owner id, as the core makes one per acquire attempt."""
    return uuid.uuid4().hex


async def grant(
    backend: Backend,
    name: str,
    owner: str,
    ttl: float = LONG_TTL,
    identity: str = "checker",
    metadata: Mapping[str, str] | None = None,
) -> Grant:
    """``try_acquire`` that must succeed.

    :raises AssertionError: the backend reported a holder instead of granting
    """
    result = await backend.try_acquire(name, owner, ttl, identity, metadata or {})
    require(
        isinstance(result, Grant),
        f"try_acquire({name!r}) by a new owner should grant, but reported holder {result!r}",
    )
    assert isinstance(result, Grant)
    require(
        isinstance(result.token, int) and not isinstance(result.token, bool),
        f"a grant's token must be an int, got {result.token!r}",
    )
    return result


async def refused(backend: Backend, name: str, owner: str, ttl: float = LONG_TTL) -> HolderInfo:
    """``try_acquire`` that must be refused.

    :raises AssertionError: the backend granted it
    """
    result = await backend.try_acquire(name, owner, ttl, "intruder", {})
    require(
        isinstance(result, HolderInfo),
        f"try_acquire({name!r}) by another owner while held should report the holder, "
        f"but granted {result!r}",
    )
    assert isinstance(result, HolderInfo)
    return result


async def holder_of(backend: Backend, name: str) -> HolderInfo:
    """``read`` that must find a holder.

    :raises AssertionError: the name reads as free
    """
    holder = await backend.read(name)
    require(holder is not None, f"read({name!r}) returned None while the name is held")
    assert holder is not None
    return holder


async def wait_free(backend: Backend, name: str, within_s: float) -> None:
    """Wait (on ``wait_changed``, not by polling) until ``name`` reads as free.

    :raises AssertionError: it is still held after ``within_s`` seconds
    """
    with within(within_s, f"expiry of {name!r}"):
        while (holder := await backend.read(name)) is not None:
            await backend.wait_changed(name, holder)


def _remaining(holder: HolderInfo, backend: Backend) -> float | None:
    if holder.remaining is None:
        require(
            Capability.SESSION in backend.capabilities,
            f"read({holder.name!r}) gave no remaining ttl; only session backends may omit it",
        )
    return holder.remaining


async def require_remaining(backend: Backend, name: str, low: float, high: float) -> None:
    """Require the remaining ttl of ``name`` in ``(low, high + TOLERANCE]``.

    :raises AssertionError: it is outside, or the name is free
    """
    remaining = _remaining(await holder_of(backend, name), backend)
    if remaining is not None:
        require(
            low < remaining <= high + TOLERANCE,
            f"remaining ttl of {name!r} should be in ({low:g}, {high:g}], got {remaining!r}",
        )
