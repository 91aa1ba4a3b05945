"""asyncmy's and the socket's errors as aiolease's (the driver is imported lazily)."""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager

from ..._exceptions import BackendError, BackendTimeout, BackendUnavailable
from ..sql._running import mapped_errors

__all__ = ["answered", "errno", "map_error", "mapped"]

#: Server error numbers that mean "try again later": lock wait timeout, deadlock,
#: statement time limit (MySQL, MariaDB).
_TIMEOUT_ERRNOS = frozenset({1205, 1213, 3024, 1969})


def errno(exc: BaseException) -> int | None:
    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def answered(exc: BaseException) -> bool:
    """Whether ``exc`` is an error the server sent (client-side errors are 2000 and up)."""
    from asyncmy import errors

    number = errno(exc)
    return isinstance(exc, errors.Error) and number is not None and number < 2000


def map_error(exc: BaseException) -> BackendError:
    """The aiolease error for an asyncmy or socket error (most specific first)."""
    from asyncmy import errors

    number = errno(exc)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or number in _TIMEOUT_ERRNOS:
        return BackendTimeout(f"MySQL did not answer in time: {exc!r}")
    if isinstance(exc, (OSError, errors.OperationalError, errors.InterfaceError)):
        return BackendUnavailable(f"MySQL unreachable: {exc!r}")
    return BackendError(f"MySQL error: {exc!r}")


def mapped() -> AbstractContextManager[None]:
    """Raise driver and socket errors as :class:`BackendError` ``from`` the original
    (asyncmy's packets it could not parse too)."""
    return mapped_errors(map_error, "asyncmy")
