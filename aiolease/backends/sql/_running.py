"""Running statements: seen to their end when they may grant, driver errors mapped."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from ..._exceptions import BackendError
from .._asyncio import run_to_end

__all__ = ["FINISH_GRACE", "finished", "mapped_errors"]

T = TypeVar("T")

#: Seconds a cancelled caller still waits for its statement that may grant a lease.
FINISH_GRACE = 5.0


async def finished(statement: Awaitable[T], grace: float | None = None) -> T:
    """Await ``statement`` (one that may grant a lease) to its end even if the caller is
    cancelled meanwhile (for at most ``grace`` more seconds, default
    :data:`FINISH_GRACE`), then re-raise the cancellation (see
    :func:`~aiolease.backends._asyncio.run_to_end`).

    Interrupting the statement at once would only close its connection: the server
    still runs it to its commit, possibly *after* the compensating release that the
    cancelled caller sends next on another connection, and the grant would stay held
    until its ttl ran out.
    """
    return await run_to_end(statement, FINISH_GRACE if grace is None else grace)


@contextmanager
def mapped_errors(
    map_error: Callable[[BaseException], BackendError], driver: str
) -> Iterator[None]:
    """Raise socket errors, timeouts and every error of the ``driver`` package (by its
    module name: a driver's internal errors derive from none of its public ones) as
    ``map_error`` maps them, ``from`` the original; aiolease's own errors pass."""
    try:
        yield
    except BackendError:
        raise
    except (OSError, asyncio.TimeoutError) as exc:
        raise map_error(exc) from exc
    except Exception as exc:
        if type(exc).__module__.startswith(driver):
            raise map_error(exc) from exc
        raise
