"""A backend that works only on asyncio, to prove the trio bridge.

It is the memory model, but every operation and wake-up goes through asyncio
primitives (``asyncio.get_running_loop()``, ``asyncio.Event``, ``asyncio.wait_for``),
the way a backend on redis-py or asyncpg does. Under trio it fails unless the core
bridges it through trio-asyncio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from .._exceptions import InvalidArgument
from .._records import state_of
from .._urls import redact
from ..abc import Grant, HolderInfo, PermitHolders
from ..backends._asyncio import now, timeout_after
from ..backends.memory import MemoryBackend

__all__ = ["AsyncioOnlyBackend"]


async def _step() -> None:
    asyncio.get_running_loop()  # as drivers do: RuntimeError outside asyncio
    await asyncio.sleep(0)


class AsyncioOnlyBackend(MemoryBackend):
    """The memory model on asyncio primitives only (``requires_asyncio = True``)."""

    requires_asyncio = True

    def __init__(self) -> None:
        super().__init__(clock=now)
        self._events: dict[str, asyncio.Event] = {}

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> AsyncioOnlyBackend:
        """``asyncio-memory://``"""
        if urlsplit(url).netloc or urlsplit(url).path not in ("", "/"):
            raise InvalidArgument(f"expected 'asyncio-memory://', got {redact(url)!r}")
        if options:
            raise InvalidArgument(f"asyncio-memory backend takes no options, got {sorted(options)}")
        await asyncio.sleep(0)
        return cls()

    def _notify(self, name: str) -> None:
        event = self._events.pop(name, None)
        if event is not None:
            event.set()

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        await _step()
        return await super().try_acquire(name, owner, ttl, identity, metadata)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        await _step()
        return await super().renew(name, owner, token, ttl)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        await _step()
        return await super().release(name, owner, token)

    async def read(self, name: str) -> HolderInfo | None:
        await _step()
        return await super().read(name)

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        holder = await self.read(name)
        if state_of(holder) != state_of(seen):
            return
        event = self._events.setdefault(name, asyncio.Event())
        timeout = None if holder is None else holder.remaining
        try:  # not asyncio.wait_for, which can drop a cancel before Python 3.12
            async with timeout_after(timeout):
                await event.wait()
        except asyncio.TimeoutError:
            pass

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        await _step()
        return await super().try_acquire_permit(name, owner, ttl, identity, metadata, limit, weight)

    async def read_permits(self, name: str) -> PermitHolders | None:
        await _step()
        return await super().read_permits(name)

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await _step()
        seconds = self._permit_wait(name, owner, ttl)
        if seconds is None:
            return
        key = self._start_waiting(name, owner)
        event = self._events.setdefault(key, asyncio.Event())
        try:
            async with timeout_after(seconds):
                await event.wait()
        except asyncio.TimeoutError:
            pass
        finally:
            if self._events.get(key) is event:
                del self._events[key]  # not woken: no event left behind
            self._stop_waiting(name, owner)
