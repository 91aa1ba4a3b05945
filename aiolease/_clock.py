"""The core's clock: ``anyio.current_time()``, read with one look-up instead of three.

``anyio.current_time()`` finds the running async library (sniffio), then anyio's
backend class for it, then asks that backend. On the hot path (every acquire,
release, renewal and deadline check) this reads the running asyncio loop's clock
directly, which is what anyio's asyncio backend returns too (also on a trio-asyncio
loop, whose clock is trio's); under trio it asks anyio as before, so trio's clock
(``MockClock`` included) decides.
"""

from __future__ import annotations

import asyncio

import anyio
import sniffio

__all__ = ["current_time"]


def current_time() -> float:
    """``anyio.current_time()``: the running event loop's monotonic clock, in seconds."""
    if sniffio.current_async_library() == "asyncio":
        return asyncio.get_running_loop().time()
    return anyio.current_time()
