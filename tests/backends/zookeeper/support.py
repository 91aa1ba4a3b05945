"""Helpers for the ZooKeeper tests: opening backends, and the server seen from outside
(through kazoo, in a worker thread, so that it works under asyncio and trio alike)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio

import aiolease
from aiolease.abc import Backend
from aiolease.backends.zookeeper import ZooKeeperBackend
from aiolease.backends.zookeeper._url import parse_url

Opener = Callable[..., AbstractAsyncContextManager[Backend]]


def unique_prefix() -> str:
    return f"aiolease-test/{uuid.uuid4().hex[:12]}"


def inner(backend: Backend) -> ZooKeeperBackend:
    """The :class:`ZooKeeperBackend` behind ``backend`` (a bridge under trio)."""
    found = getattr(backend, "inner", backend)
    assert isinstance(found, ZooKeeperBackend)
    return found


def opener(url: str, **options: Any) -> Opener:
    """Opens backends on ``url`` under one fresh prefix (``.prefix``)."""
    prefix = options.pop("prefix", unique_prefix())

    @asynccontextmanager
    async def open_(**more: Any) -> AsyncIterator[Backend]:
        async with aiolease.open_backend(url, prefix=prefix, **options, **more) as backend:
            yield backend

    open_.prefix = prefix  # type: ignore[attr-defined]
    return open_


class Outside:
    """A kazoo client of its own on ``url``'s servers: the server seen from outside."""

    def __init__(self, url: str) -> None:
        from kazoo.client import KazooClient

        parsed = parse_url(url, {})
        self.chroot = parsed.chroot
        self.client = KazooClient(parsed.connect_string(), timeout=10)

    async def __aenter__(self) -> Outside:
        await anyio.to_thread.run_sync(self.client.start, 10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await anyio.to_thread.run_sync(self._stop)

    def _stop(self) -> None:
        self.client.stop()
        self.client.close()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.client, method)
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    async def children(self, path: str) -> list[str]:
        """The children of ``path`` (under the chroot), ``[]`` if it does not exist."""
        from kazoo.exceptions import NoNodeError

        try:
            found: list[str] = await self.call("get_children", self.chroot + path)
        except NoNodeError:
            return []
        return found

    async def tree(self, path: str) -> list[str]:
        """Every contender node under ``path`` (the prefix): ``<name node>/<node>``."""
        found = []
        for name_node in await self.children(path):
            for node in await self.children(f"{path}/{name_node}"):
                found.append(f"{name_node}/{node}")
        return found
