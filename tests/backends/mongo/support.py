"""Helpers for the MongoDB tests: opening backends on a collection of the test's own,
and a synchronous pymongo client that looks at the server behind the backend's back."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any

from pymongo import MongoClient

import aiolease
from aiolease.abc import Backend
from aiolease.backends.mongo import MongoBackend

Opener = Callable[..., AbstractAsyncContextManager[Backend]]


def unique_collection(what: str = "leases") -> str:
    return f"t_{what}_{uuid.uuid4().hex[:10]}"


@contextmanager
def raw(url: str) -> Iterator[MongoClient[dict[str, Any]]]:
    """A synchronous client on ``url`` (for looking behind the backend's back)."""
    client: MongoClient[dict[str, Any]] = MongoClient(url, serverSelectionTimeoutMS=10_000)
    try:
        yield client
    finally:
        client.close()


def drop(url: str, database: str, collection: str) -> None:
    with raw(url) as client:
        client[database].drop_collection(collection)
        client[database].drop_collection(f"{collection}_permits")


def opener(url: str, **options: Any) -> Opener:
    """Opens backends on ``url`` (with ``options``) through ``open_backend``."""

    @asynccontextmanager
    async def open_(**more: Any) -> AsyncIterator[Backend]:
        async with aiolease.open_backend(url, **options, **more) as backend:
            yield backend

    return open_


def inner(backend: Backend) -> MongoBackend:
    """The :class:`MongoBackend` behind ``backend`` (a bridge under trio)."""
    found = getattr(backend, "inner", backend)
    assert isinstance(found, MongoBackend)
    return found
