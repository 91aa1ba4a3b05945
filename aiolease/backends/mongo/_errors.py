"""pymongo's and the socket's errors as aiolease's (the driver is imported lazily)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from ..._exceptions import BackendError, BackendTimeout, BackendUnavailable, InvalidArgument
from ..._urls import scrub
from ..sql._running import mapped_errors

__all__ = ["DUPLICATE_KEY", "NO_CHANGE_STREAMS", "code_of", "map_error", "mapped"]

#: A unique index refused a write: two first upserts of one name raced.
DUPLICATE_KEY = 11000
#: "The $changeStream stage is only supported on replica sets" (a standalone mongod).
NO_CHANGE_STREAMS = 40573
#: Server error codes that say "not now" rather than "down": a write concern or an
#: operation that timed out, a lock that was not granted in time.
_TIMEOUT_CODES = frozenset({50, 64, 24, 46, 262, 112})


def code_of(exc: BaseException) -> int | None:
    """The server's error code of a pymongo error, if it has one."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, int) else None


def map_error(exc: BaseException, url: object = None) -> BackendError:
    """The aiolease error for a pymongo or socket error (most specific first); the text
    is scrubbed of ``url``'s password."""
    import pymongo.errors as errors

    def text(what: str) -> str:
        return scrub(f"MongoDB {what}: {exc}", url)

    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, errors.WTimeoutError)):
        return BackendTimeout(text("did not answer in time"))
    if isinstance(exc, errors.ServerSelectionTimeoutError):
        return BackendUnavailable(text("unreachable (no server selected in time)"))
    if isinstance(exc, errors.NetworkTimeout) or (
        isinstance(exc, errors.PyMongoError) and exc.timeout
    ):
        return BackendTimeout(text("did not answer in time"))
    if isinstance(exc, (errors.ConnectionFailure, errors.NotPrimaryError)):
        return BackendUnavailable(text("unreachable"))
    if isinstance(exc, errors.ConfigurationError):  # at connect: a mongodb+srv:// DNS lookup
        return BackendUnavailable(text("unreachable"))
    if isinstance(exc, errors.OperationFailure):
        if code_of(exc) in _TIMEOUT_CODES:
            return BackendTimeout(text(f"error {exc.code}"))
        return BackendError(text(f"error {exc.code}"))
    if isinstance(exc, OSError):
        return BackendUnavailable(text("unreachable"))
    return BackendError(text("error"))


class mapped:
    """Raise pymongo, bson and socket errors as :class:`BackendError` ``from`` the
    original (the password of ``url`` scrubbed from the message).

    A class, not a generator: it wraps every command, and costs next to nothing when
    the command succeeds; an error goes through :func:`_mapping`.
    """

    __slots__ = ("_url",)

    def __init__(self, url: object = None) -> None:
        self._url = url

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None or not isinstance(exc, Exception):
            return  # success, or a cancellation: as it is
        with _mapping(self._url):
            raise exc


@contextmanager
def _mapping(url: object) -> Iterator[None]:
    try:
        with mapped_errors(lambda exc: map_error(exc, url), "pymongo"):
            yield
    except InvalidArgument:
        raise
    except Exception as exc:
        if type(exc).__module__.startswith("bson"):
            raise BackendError(scrub(f"MongoDB error: {exc}", url)) from exc
        raise
