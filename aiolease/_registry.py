"""open_backend(url): choose a backend by URL scheme, load it lazily, connect it."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from importlib.metadata import entry_points
from typing import Any

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

import anyio

from ._bridge import adapt, call_asyncio, running_trio
from ._exceptions import BackendNotFound, InvalidArgument, UnsupportedCapability
from ._life import end_leases
from ._renewal_state import AsyncioTasks
from ._renewer import Renewer
from ._urls import redact, split_url
from .abc import Backend, Capability

ENTRY_POINT_GROUP = "aiolease.backends"

logger = logging.getLogger("aiolease.registry")

#: Backends shipped with aiolease, used when the package metadata is not installed.
BUILTIN: dict[str, str] = {
    "memory": "aiolease.backends.memory:MemoryBackend",
    "sqlite": "aiolease.backends.sqlite:SQLiteBackend",
    "redis": "aiolease.backends.redis:RedisBackend",
    "rediss": "aiolease.backends.redis:RedisBackend",
    "unix": "aiolease.backends.redis:RedisBackend",
    "redis+cluster": "aiolease.backends.redis:RedisBackend",
    "rediss+cluster": "aiolease.backends.redis:RedisBackend",
    "redis+sentinel": "aiolease.backends.redis:RedisBackend",
    "rediss+sentinel": "aiolease.backends.redis:RedisBackend",
    "redis+redlock": "aiolease.backends.redlock:RedlockBackend",
    "rediss+redlock": "aiolease.backends.redlock:RedlockBackend",
    "postgres": "aiolease.backends.postgres:PostgresBackend",
    "postgresql": "aiolease.backends.postgres:PostgresBackend",
    "mysql": "aiolease.backends.mysql:MySQLBackend",
    "mariadb": "aiolease.backends.mysql:MySQLBackend",
    "etcd": "aiolease.backends.etcd:EtcdBackend",
    "mongodb": "aiolease.backends.mongo:MongoBackend",
    "mongodb+srv": "aiolease.backends.mongo:MongoBackend",
    "kafka": "aiolease.backends.kafka:KafkaBackend",
    "zookeeper": "aiolease.backends.zookeeper:ZooKeeperBackend",
    "zk": "aiolease.backends.zookeeper:ZooKeeperBackend",
    "remote": "aiolease.testing.remote:RemoteBackend",
}

#: Which extra provides the driver for a scheme (for the install hint).
EXTRAS: dict[str, str] = {
    "redis": "redis",
    "rediss": "redis",
    "unix": "redis",
    "redis+cluster": "redis",
    "rediss+cluster": "redis",
    "redis+sentinel": "redis",
    "rediss+sentinel": "redis",
    "redis+redlock": "redis",
    "rediss+redlock": "redis",
    "postgres": "postgres",
    "postgresql": "postgres",
    "mysql": "mysql",
    "mariadb": "mysql",
    "etcd": "etcd",
    "mongodb": "mongo",
    "mongodb+srv": "mongo",
    "kafka": "kafka",
    "zookeeper": "zookeeper",
    "zk": "zookeeper",
}

#: Schemes of backends that are planned but not written yet: no extra installs them.
PLANNED: dict[str, str] = {}


def _hint(scheme: str) -> str:
    """What to do about a scheme without a loadable backend: the extra to install, if
    one provides it; else that its backend is not written yet, or the known schemes."""
    extra = EXTRAS.get(scheme)
    if extra is not None:
        return f"install it with: pip install 'aiolease[{extra}]'"
    planned = PLANNED.get(scheme)
    if planned is not None:
        return f"the {planned} backend is planned but not written yet"
    known = ", ".join(sorted(set(BUILTIN) | set(EXTRAS)))
    return f"known schemes: {known}"


def backend_class(scheme: str) -> type[Backend]:
    """The backend class registered for ``scheme``.

    :raises BackendNotFound: nothing is registered, or its driver is not installed
    """
    target = None
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == scheme:
            target = ep.value
            break
    target = target or BUILTIN.get(scheme)
    if target is None:
        raise BackendNotFound(f"no aiolease backend for scheme {scheme!r}; {_hint(scheme)}")
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise BackendNotFound(
            f"the backend for {scheme!r} cannot be loaded ({exc}); {_hint(scheme)}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendNotFound(f"{target} (for {scheme!r}) is not an aiolease Backend")
    return cls


def scheme_of(url: object) -> str:
    """:raises InvalidArgument: ``url`` is not a str with a scheme"""
    scheme = split_url(url, "backend").scheme
    if not scheme:
        raise InvalidArgument(
            f"backend URL {redact(url)!r} has no scheme (like 'sqlite:///path/to/file')"
        )
    return scheme.lower()


@asynccontextmanager
async def open_backend(
    url: str, *, require: Iterable[Capability] = (), **options: Any
) -> AsyncIterator[Backend]:
    """Connect to the backend that ``url`` names, and close it on exit.

    Under trio, a backend whose driver needs asyncio is opened on a trio-asyncio
    loop and handed out behind a bridge, so it works unchanged.

    :param require: capabilities the backend must have
    :param options: passed to the backend's ``from_url``
    :raises InvalidArgument: the URL is malformed
    :raises BackendNotFound: no backend for the scheme, or its extra is missing
    :raises UnsupportedCapability: the backend lacks a required capability
    :raises BackendUnavailable: the server cannot be reached
    """
    cls = backend_class(scheme_of(url))
    required = frozenset(require)
    opened = False
    thrown: BaseException | None = None
    try:
        async with _opened(cls, url, required, options) as bridged:
            opened = True
            try:
                yield bridged
            except BaseException as exc:
                thrown = exc
                raise
    except BaseExceptionGroup as group:
        # trio-asyncio's loop runs in a nursery, which wraps what escapes it. Give
        # the caller the error itself: one raised while opening, or the one its
        # own block raised (and only that one: anything else stays grouped).
        leaf = _sole_leaf(group)
        if leaf is None or (opened and leaf is not thrown):
            raise
    else:
        return
    # Raised outside the handler, so that the group does not become its context.
    raise leaf


def _log_asyncio_error(loop: object, context: dict[str, Any]) -> None:
    """Log what asyncio would log for an error nobody awaited, as asyncio does."""
    exc = context.get("exception")
    logger.warning(
        "asyncio (under trio): %s",
        context.get("message", "unhandled error"),
        exc_info=(type(exc), exc, exc.__traceback__) if isinstance(exc, BaseException) else None,
    )


def _sole_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception at the bottom of nested single-member groups, else None."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc


@asynccontextmanager
async def _opened(
    cls: type[Backend], url: str, required: frozenset[Capability], options: dict[str, Any]
) -> AsyncIterator[Backend]:
    async with AsyncExitStack() as stack:
        if cls.requires_asyncio and running_trio():
            import trio_asyncio

            if trio_asyncio.current_loop.get() is None:
                loop = await stack.enter_async_context(trio_asyncio.open_loop())
                # trio-asyncio's default handler raises what asyncio would only log
                # (a driver's "Future exception was never retrieved", say) into the
                # loop's nursery, which tears down every backend on it.
                loop.set_exception_handler(_log_asyncio_error)
            backend = await call_asyncio(lambda: cls.from_url(url, **options))
        else:
            backend = await cls.from_url(url, **options)
        bridged = adapt(backend)
        stack.push_async_callback(bridged.aclose)
        # The renewal scheduler's home while the backend is open: holding a lease then
        # starts no task.
        renewer = Renewer.of(bridged)
        if running_trio():
            service = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(renewer.serve(service))
        else:
            # Not a task group: on asyncio, another task may close the backend.
            stack.callback(renewer.serve(AsyncioTasks()))
        # First on the way out, while the backend is still open: end the leases still
        # held and release them (the scheduler's stop would only end them).
        stack.push_async_callback(end_leases, bridged)
        # Checked on the open instance: a proxy backend (remote://) learns its
        # capabilities from the server it connects to.
        missing = required - bridged.capabilities
        if missing:
            names = ", ".join(sorted(c.value for c in missing))
            raise UnsupportedCapability(f"the {cls.__name__} for {redact(url)!r} lacks: {names}")
        yield bridged
