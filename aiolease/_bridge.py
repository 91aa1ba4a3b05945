"""Run asyncio-only backends under trio, through trio-asyncio.

Most drivers (redis-py, asyncpg, pymongo, aetcd, aiokafka, asyncmy) run only on
asyncio. A backend built on one sets ``requires_asyncio = True`` and is written
for asyncio alone. When the application runs under trio, the core passes every
backend call through :class:`AsyncioBridge`, which runs it as an asyncio task on
the trio-asyncio loop. Cancellation crosses the bridge both ways.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from ._exceptions import BackendUnavailable, LossReason, UnsupportedCapability
from .abc import Backend, Grant, HolderInfo, Renewal, RenewResult, SessionClock

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


class AsyncioBridge(Backend):
    """A backend that forwards every call to an asyncio-only backend, from trio."""

    requires_asyncio = False

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities  # type: ignore[misc]
        self.poll_interval = inner.poll_interval
        self.reports_takeover = inner.reports_takeover
        self.renews_many = inner.renews_many
        self._closed = False

    def __repr__(self) -> str:
        return f"<AsyncioBridge to {self.inner!r}>"

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> AsyncioBridge:
        raise UnsupportedCapability("bridges are made by adapt(), not from URLs")

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """:func:`call_asyncio`, or, once closed, what a closed backend raises under asyncio.

        :raises BackendUnavailable: the bridge was closed (its trio-asyncio loop may be
            gone too, which would be an :class:`UnsupportedCapability` under trio only)
        """
        if self._closed:
            raise BackendUnavailable(f"{self.inner!r} is closed")
        return await call_asyncio(fn, *args)

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        return await self._call(self.inner.try_acquire, name, owner, ttl, identity, metadata)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        return await self._call(self.inner.renew, name, owner, token, ttl)

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        return await self._call(self.inner.renew_many, renewals)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        return await self._call(self.inner.release, name, owner, token)

    async def read(self, name: str) -> HolderInfo | None:
        return await self._call(self.inner.read, name)

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        await self._call(self.inner.wait_changed, name, seen)

    async def wait_taken(self, name: str, held: HolderInfo) -> None:
        await self._call(self.inner.wait_taken, name, held)

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await self._call(self.inner.wait_turn, name, owner, ttl, seen)

    async def wait_lost(self, name: str, owner: str, token: int) -> LossReason:
        return await self._call(self.inner.wait_lost, name, owner, token)

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> SessionClock | None:
        # A plain call: it only records. ``ended`` runs on the trio-asyncio loop, which
        # runs inside trio, so it may touch trio objects (events, cancel scopes).
        return self.inner.hold(name, owner, token, ended)

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None] | None:
        # A plain call, like hold(): ``taken`` only records.
        return self.inner.on_taken(name, owner, token, taken)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await call_asyncio(self.inner.aclose)
