"""Driver exceptions as aiolease's errors: the one mapping of the Redis and Redlock backends.

Both transports (:mod:`aiolease.backends.redis._transport`) raise redis-py's
exception types, so this is the only place that reads them.
"""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._exceptions import BackendError, BackendTimeout, BackendUnavailable, ForeignDataError
from ._scripts import FOREIGN

__all__ = ["mapped_error"]


def mapped_error(
    exc: BaseException,
    name: str | None,
    *,
    server: str = "Redis",
    client: str = "the Redis client",
    prefix: str | None = None,
) -> BackendError:
    """A driver exception as aiolease's error (the Redis and the Redlock backends').

    :param server: who failed, as messages name it (``"Redlock instance host:port"``)
    :param client: the redis-py client, as messages name it
    :param prefix: the key prefix, named in a :class:`ForeignDataError`'s message
    """
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, ResponseError) and str(exc).startswith(FOREIGN):
        detail = str(exc)[len(FOREIGN) :].split(" script: ")[0].strip()
        named = "" if prefix is None else f" {prefix!r}"
        return ForeignDataError(
            f"{server} key {detail}. aiolease left it unchanged: another program seems to"
            f" write under the key prefix{named}; give aiolease another prefix",
            name=name or "",
        )
    if isinstance(exc, (RedisTimeoutError, TimeoutError)):
        return BackendTimeout(f"{server} did not answer in time: {exc!r}")
    if isinstance(exc, (RedisConnectionError, OSError)):
        return BackendUnavailable(f"{server} is unreachable: {exc}")
    if isinstance(exc, ResponseError):
        return BackendUnavailable(f"{server} refused the request: {exc}")
    if not isinstance(exc, RedisError):
        # redis-py failing in its own code (say, on a connection closed under it):
        # the command's fate is unknown, as when the server is unreachable.
        return BackendUnavailable(f"{client} failed: {exc!r}")
    return BackendError(f"{server} failed: {exc!r}")
