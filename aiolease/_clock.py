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

import anyio

__all__ = ["current_time"]


def current_time() -> float:
    """``anyio.current_time()``: the running event loop's monotonic clock, in seconds."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop.time()
    return anyio.current_time()
