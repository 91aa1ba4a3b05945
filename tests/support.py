"""Helpers shared by the PostgreSQL and MySQL backend tests."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import pytest

from aiolease import AsyncLock
from aiolease._bridge import AsyncioBridge, call_asyncio, running_trio
from aiolease.abc import Backend, Grant, HolderInfo

B = TypeVar("B", bound=Backend)

#: Hostile or malformed table / schema names: none may reach the server.
HOSTILE_IDENTIFIERS: list[object] = [
    "",
    "leases; DROP TABLE canary",
    'leases" ; DROP TABLE "canary',
    "leases` ; DROP TABLE `canary",
    "leases'--",
    "le ases",
    "1leases",
    "leases.other",
    "public.leases",
    "lease-s",
    "läses",
    "leases\x00",
    "leases\n",
    "x" * 64,
    None,
    42,
    b"leases",
]


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


async def check_oldest_waiter_gets_it(
    b: Backend, waiting: Callable[[int], Awaitable[None]]
) -> None:
    """Waiters of one backend queue oldest first; each release grants the next in line
    in the release statement itself (a herd would wake all, in no set order), with
    tokens one apart. ``waiting(n)`` returns once ``n`` waits are blocked."""
    name = unique("handoff")
    first = await AsyncLock(b, name, ttl=30).acquire()
    order: list[int] = []
    tokens: list[int] = []

    async def wait(i: int) -> None:
        lease = await AsyncLock(b, name, ttl=30).acquire()
        order.append(i)
        tokens.append(lease.token)
        assert await lease.release()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(wait, i)
                await waiting(i + 1)  # queued before the next one starts
            assert await first.release()
    assert order == [0, 1, 2, 3]
    assert tokens == [first.token + 1, first.token + 2, first.token + 3, first.token + 4]
    assert await b.read(name) is None


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


# -- many processes using a fresh table at once ----------------------------------------------

FIRST_USE = """
import json, sys, time
import anyio
import aiolease
from aiolease.abc import Grant

async def main(url, owner, start_at):
    async with aiolease.open_backend(url) as backend:
        await anyio.sleep(max(start_at - time.monotonic(), 0.0))
        result = await backend.try_acquire("first-use", owner, 30.0, owner, {})
        mine = await backend.try_acquire(f"own/{owner}", owner, 30.0, owner, {})
        assert isinstance(mine, Grant) and mine.token == 1, mine
        if isinstance(result, Grant):
            print(json.dumps({"owner": owner, "granted": result.token}))
        else:
            print(json.dumps({"owner": owner, "holder": result.owner, "token": result.token}))

url, owner, start_at, loop = sys.argv[1:]
anyio.run(main, url, owner, float(start_at), backend=loop)
"""


def first_use_by_processes(url: str, processes: int) -> list[dict[str, Any]]:
    """Start ``processes`` processes that use ``url``'s fresh table at the same moment.

    Each takes its own name and contends for one shared name; returns what each reported.
    """
    start_at = time.monotonic() + 2.0  # all pools are open by then
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                FIRST_USE,
                url,
                f"owner-{i}",
                repr(start_at),
                "trio" if i % 2 else "asyncio",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return reports


def check_one_winner(reports: list[dict[str, Any]]) -> None:
    """Exactly one process got the shared name (token 1); the rest saw it as the holder."""
    winners = [r for r in reports if "granted" in r]
    assert len(winners) == 1, reports
    assert winners[0]["granted"] == 1
    for report in reports:
        if report is not winners[0]:
            assert (report["holder"], report["token"]) == (winners[0]["owner"], 1), reports


# -- a cancel that comes together with a wake-up ----------------------------------------------


def suspended_in(task: asyncio.Task[Any], function: str) -> bool:
    """Whether ``task`` is suspended on a future (awaits no coroutine further down)
    inside a call of ``function``."""
    names = []
    awaited: Any = task.get_coro()
    while hasattr(awaited, "cr_await"):
        names.append(awaited.cr_code.co_name)
        awaited = awaited.cr_await
    return not task.done() and function in names and awaited is not None


async def cancel_as_woken(backend: Backend, name: str, owner: str, token: int) -> None:
    """Check that an asyncio task cancelled in the very step that wakes it is cancelled.

    A task acquires ``name`` (held by ``owner``) with an :class:`~aiolease.AsyncLock`;
    once it waits, ``owner`` releases through the same backend object, which wakes the
    waiter, and the task is cancelled before it runs again. ``asyncio.wait_for`` (before
    Python 3.12) would return the wake-up and drop the cancel: the acquire would go on
    and hold the lease although its caller was cancelled.
    """
    task = asyncio.create_task(AsyncLock(backend, name, ttl=30).acquire())
    await eventually(lambda: suspended_in(task, "wait_event"), "the acquire waiting")
    # No await between the wake-up (inside release) and the cancel.
    assert await backend.release(name, owner, token)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        lease = await task
        await lease.release()  # the acquire went on: do not leave it held
    assert await backend.read(name) is None  # and nothing is held in its name
