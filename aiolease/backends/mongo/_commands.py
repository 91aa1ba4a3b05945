"""Running one MongoDB command to its end, for the backend and its permits."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from .._asyncio import run_to_end

__all__ = ["GRACE", "whole"]

T = TypeVar("T")

#: Seconds a cancelled caller still waits for a command that grants nothing to end
#: (see :func:`whole`): long enough for any answer of a server that answers, short
#: enough that a lost lease's bounded release does not hold up its error.
GRACE = 1.0


async def whole(command: Awaitable[T]) -> T:
    """Await a command to its end even if the caller is cancelled meanwhile (for at most
    :data:`GRACE` more seconds), then raise the cancellation: pymongo's asyncio client
    abandons the connection of a command cancelled mid-reply without closing it."""
    return await run_to_end(command, GRACE)
