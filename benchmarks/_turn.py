"""The turn that the benchmarks of ``run_all.py --quick`` take, two at a time.

:data:`TURN_ENV` names a file whose lock (``flock``) a benchmark holds while it
measures. ``run_all.py --quick`` runs two benchmarks at once and sets it for both:
each one takes the lock when this module is imported (``run_all.py`` imports it
before the benchmark's own imports: their CPU is not spent beside the other one's
figures) and holds it to its end, except in :func:`idle` sections. So every figure
but the waits of those sections runs alone. The variable is removed from the
environment at once: the worker processes a benchmark starts do not take the lock.
This module imports nothing but the standard library until an :func:`idle` section.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["TURN_ENV", "idle"]

TURN_ENV = "AIOLEASE_BENCH_TURN"


def _take_turn() -> int | None:
    path = os.environ.pop(TURN_ENV, None)
    if not path:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


_turn = _take_turn()


@asynccontextmanager
async def idle() -> AsyncIterator[None]:
    """A wait whose figures nothing else running on the machine distorts: leases held
    through a window whose CPU is this process's own (``time.process_time``), counted
    in this process or on a server that no benchmark beside it uses (see
    ``run_all.py``), a few requests per second. Under ``run_all.py --quick`` the
    other benchmark measures meanwhile (:data:`TURN_ENV`); this one waits for its
    turn again at the end. Elsewhere nothing. Never around what starts, grants, ends
    or times anything (acquires, hand-offs, expiries, process start-ups)."""
    if _turn is None:
        yield
        return
    import anyio.to_thread

    fcntl.flock(_turn, fcntl.LOCK_UN)
    try:
        yield
    finally:
        await anyio.to_thread.run_sync(fcntl.flock, _turn, fcntl.LOCK_EX)
