"""Run asyncio-only backends under trio, through trio-asyncio.

Most drivers (redis-py, asyncpg, pymongo, aetcd, aiokafka, asyncmy) run only on
asyncio. A backend built on one sets ``requires_asyncio = True`` and is written
for asyncio alone. When the application runs under trio, the core passes every
backend call through :class:`AsyncioBridge`, which runs it as an asyncio task on
the trio-asyncio loop. Cancellation crosses the bridge both ways.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ._exceptions import BackendUnavailable, UnsupportedCapability
from .abc import Backend, WrappingBackend

T = TypeVar("T")

_bridges: weakref.WeakKeyDictionary[Backend, AsyncioBridge] = weakref.WeakKeyDictionary()


def running_trio() -> bool:
    """Whether the calling task is a trio task (not an asyncio task on trio-asyncio)."""
    if "trio" not in sys.modules:
        return False
    import sniffio  # trio depends on it

    try:
        return sniffio.current_async_library() == "trio"
    except sniffio.AsyncLibraryNotFoundError:
        return False


def adapt(backend: Backend) -> Backend:
    """Return ``backend``, or a bridge to it when it needs asyncio and trio is running."""
    if not backend.requires_asyncio or not running_trio():
        return backend
    bridge = _bridges.get(backend)
    if bridge is None:
        bridge = _bridges[backend] = AsyncioBridge(backend)
    return bridge


async def call_asyncio(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Await ``fn(*args)`` as an asyncio task on the current trio-asyncio loop.

    :raises UnsupportedCapability: trio runs, but no trio-asyncio loop is open
    """
    try:
        import trio_asyncio
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise UnsupportedCapability(
            "this backend needs asyncio; to use it under trio, install 'aiolease[trio]'"
        ) from None
    if trio_asyncio.current_loop.get() is None:
        raise UnsupportedCapability(
            "this backend needs asyncio; under trio, open it with aiolease.open_backend(), "
            "or inside 'async with trio_asyncio.open_loop():'"
        )
    result: T = await trio_asyncio.aio_as_trio(fn)(*args)
    return result


class AsyncioBridge(WrappingBackend):
    """A backend that forwards every call to an asyncio-only backend, from trio."""

    requires_asyncio = False

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._closed = False

    def __repr__(self) -> str:
        return f"<AsyncioBridge to {self.inner!r}>"

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """:func:`call_asyncio`, or, once closed, what a closed backend raises under asyncio.

        :raises BackendUnavailable: the bridge was closed (its trio-asyncio loop may be
            gone too, which would be an :class:`UnsupportedCapability` under trio only),
            or the call was cancelled on the asyncio side (its loop closing under it)
        """
        if self._closed:
            raise BackendUnavailable(f"{self.inner!r} is closed")
        try:
            return await call_asyncio(fn, *args)
        except asyncio.CancelledError as exc:
            # Not trio's cancellation (trio-asyncio raises trio's own for that): the
            # call's asyncio task was cancelled on the asyncio side, as when the
            # trio-asyncio loop closes under a call still in flight (a block's release
            # racing the close of its backend). To trio code it is no cancellation.
            raise BackendUnavailable(
                f"{self.inner!r}: the call was cancelled on its asyncio loop"
            ) from exc

    async def _forward(self, op: str, *args: Any) -> Any:
        """``inner``'s ``op``, awaited on the asyncio loop."""
        return await self._call(getattr(self.inner, op), *args)

    def _forward_now(self, op: str, *args: Any) -> Any:
        """``inner``'s plain hook ``op``, called as it is (:meth:`hold` and
        :meth:`on_taken` only record: their callbacks run on the trio-asyncio loop,
        which runs inside trio, so they may touch trio objects); but
        :meth:`release_now`'s early send needs the asyncio loop, which a plain call
        from trio is not on: it is made, then awaited, there when the core awaits it."""
        if op == "release_now":
            return self._call(self._release_now, *args)
        return super()._forward_now(op, *args)

    async def _release_now(self, name: str, owner: str, token: int) -> bool:
        """``inner``'s :meth:`release_now`, or its :meth:`release` if it has none."""
        sent = self.inner.release_now(name, owner, token)
        return await (self.inner.release(name, owner, token) if sent is None else sent)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await call_asyncio(self.inner.aclose)
