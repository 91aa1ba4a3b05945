"""asyncpg's and the socket's errors as aiolease's (the driver is imported lazily)."""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager

from ..._exceptions import BackendError, BackendTimeout, BackendUnavailable
from ..sql._running import mapped_errors

__all__ = ["map_error", "mapped"]

#: SQLSTATEs (or their two-character classes) that mean "try again later", not "down".
_TIMEOUT_STATES = ("57014", "55P03", "40P01", "40001")
_UNAVAILABLE_STATES = ("08", "53", "57P", "3D000", "28")


def map_error(exc: BaseException) -> BackendError:
    """The aiolease error for an asyncpg or socket error (most specific first)."""
    import asyncpg

    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return BackendTimeout(f"PostgreSQL did not answer in time: {exc!r}")
    if isinstance(exc, asyncpg.PostgresError):
        state = str(getattr(exc, "sqlstate", "") or "")
        text = f"PostgreSQL error {state}: {exc}"
        if state in _TIMEOUT_STATES:
            return BackendTimeout(text)
        if state.startswith(_UNAVAILABLE_STATES):
            return BackendUnavailable(text)
        return BackendError(text)
    return BackendUnavailable(f"PostgreSQL unreachable: {exc!r}")


def mapped() -> AbstractContextManager[None]:
    """Raise driver and socket errors as :class:`BackendError` ``from`` the original
    (asyncpg's InternalClientError too, seen on a connection the server killed
    mid-statement, which derives from none of its other errors)."""
    return mapped_errors(map_error, "asyncpg")
