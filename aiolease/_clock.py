"""The core's clock: ``anyio.current_time()``, read with one look-up instead of three.

``anyio.current_time()`` finds the running async library (sniffio), then anyio's
backend class for it, then asks that backend. On the hot path (every acquire,
release, renewal and deadline check) this asks for the running asyncio loop first
and reads its clock, which is what anyio's asyncio backend returns too (also on a
trio-asyncio loop, whose clock is trio's, ``MockClock`` included). With no asyncio
loop running (trio), it asks anyio as before, so trio's clock decides.

``asyncio._get_running_loop`` is looked up on every call: trio-asyncio replaces it
with one that also knows trio's tasks (whose loop is not the thread's).
"""

from __future__ import annotations

import asyncio
import math

import anyio

__all__ = ["cancel_scope", "current_time"]


def current_time() -> float:
    """``anyio.current_time()``: the running event loop's monotonic clock, in seconds."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop.time()
    return anyio.current_time()


#: The class of anyio's cancel scopes under asyncio, learned from the first one made in
#: an asyncio task (``anyio.CancelScope()`` finds its backend's class by sniffio on every
#: call: as costly as the scope itself).
_asyncio_scope: list[type[anyio.CancelScope]] = []


def cancel_scope(*, deadline: float = math.inf, shield: bool = False) -> anyio.CancelScope:
    """``anyio.CancelScope(deadline=deadline, shield=shield)``, made without asking sniffio
    in an asyncio task (as :func:`current_time` and ``aiolease._life.current_task`` tell
    one: a running asyncio loop, and an asyncio task on it; trio's tasks, trio-asyncio's
    included, have none)."""
    loop = asyncio._get_running_loop()
    if loop is not None and asyncio.current_task(loop) is not None:
        if _asyncio_scope:
            return _asyncio_scope[0](deadline=deadline, shield=shield)
        scope = anyio.CancelScope(deadline=deadline, shield=shield)
        _asyncio_scope.append(type(scope))
        return scope
    return anyio.CancelScope(deadline=deadline, shield=shield)
