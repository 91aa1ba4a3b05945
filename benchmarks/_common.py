"""What the benchmarks share: leases held the way an application holds them, and the
PASS/MISS column."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AsyncExitStack

from aiolease import AsyncLock, Lease
from aiolease.abc import Backend

__all__ = ["hold_in_tasks", "verdict"]


async def hold_in_tasks(
    backend: Backend,
    names: Sequence[str],
    ttl: float,
    stack: AsyncExitStack,
    *,
    return_exceptions: bool = False,
) -> list[Lease]:
    """Hold every name through :class:`~aiolease.AsyncLock`, each in a task of its own
    (its keepalive running), until ``stack`` closes; return once all are held.

    :param return_exceptions: at the close, ignore a holder's failure (a lost lease)
        instead of raising it, as :func:`asyncio.gather` does
    """
    stop, leases = asyncio.Event(), list[Lease]()

    async def hold(name: str) -> None:
        async with AsyncLock(backend, name, ttl=ttl) as lease:
            leases.append(lease)
            await stop.wait()

    holders = [asyncio.ensure_future(hold(name)) for name in names]

    async def release_all() -> None:
        stop.set()
        await asyncio.gather(*holders, return_exceptions=return_exceptions)

    stack.push_async_callback(release_all)
    while len(leases) < len(names):  # noqa: ASYNC110 - a benchmark's set-up
        await asyncio.sleep(0.05)
    return leases


def verdict(ok: bool | None) -> str:
    """``PASS`` or ``MISS`` for a figure with a target, ``""`` for one without."""
    return "" if ok is None else ("PASS" if ok else "MISS")
