"""Each worker's own fault proxy (``blackhole``), run in the controller's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..._exceptions import InvalidArgument
from ..._urls import redact

if TYPE_CHECKING:
    from ..proxy import FaultProxy

__all__ = ["WorkerProxy", "open_proxy"]


class WorkerProxy:
    """A :class:`~aiolease.testing.proxy.FaultProxy` as the injector uses it."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy

    def url_for(self, url: str) -> str:
        """``url`` rewritten to go through this proxy."""
        return self.proxy.url_for(url)

    async def blackhole(self) -> None:
        """Swallow all traffic (held, and delivered after :meth:`restore`)."""
        await self.proxy.blackhole()

    async def restore(self) -> None:
        """Pass traffic again."""
        await self.proxy.pass_through()


@asynccontextmanager
async def open_proxy(url: str) -> AsyncIterator[WorkerProxy]:
    """A proxy in front of the one server ``url`` names.

    :raises InvalidArgument: ``url`` names no host and port, or several
    """
    parts = urlsplit(url)
    if not parts.hostname or parts.port is None or "," in parts.netloc:
        raise InvalidArgument(
            f"a blackhole proxy needs a URL naming one HOST:PORT, got {redact(url)!r}"
        )
    from ..proxy import FaultProxy  # only blackhole runs need it

    async with FaultProxy(parts.hostname, parts.port) as proxy:
        yield WorkerProxy(proxy)
