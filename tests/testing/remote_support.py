"""What the remote backend's tests share: a backend served in this process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

import aiolease
from aiolease.abc import Backend
from aiolease.testing.remote import BackendServer

__all__ = ["owner", "remote", "serving"]


@asynccontextmanager
async def serving(backend: Backend, port: int = 0) -> AsyncIterator[str]:
    """Serve ``backend`` in a task of this process; yield its ``remote://`` URL."""
    async with anyio.create_task_group() as tg:
        bound = await tg.start(BackendServer(backend, port=port).serve)
        yield f"remote://127.0.0.1:{bound}"
        tg.cancel_scope.cancel()


@asynccontextmanager
async def remote(backend: Backend, **options: Any) -> AsyncIterator[Backend]:
    """A :class:`RemoteBackend` connected to ``backend`` served in this process."""
    async with serving(backend) as url, aiolease.open_backend(url, **options) as client:
        yield client


def owner(n: int) -> str:
    return f"owner-{n}"
