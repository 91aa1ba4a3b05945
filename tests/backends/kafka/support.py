"""Helpers for the Kafka tests: opening backends with a short session timeout.

Tansu answers a JoinGroup after half the rebalance timeout (at least 1 s), which the
backend sets to the session timeout: the tests use 2 s sessions, so that a
rebalance costs about 1 s.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import aiolease
from aiolease.abc import Backend
from aiolease.backends.kafka import KafkaBackend

Opener = Callable[..., AbstractAsyncContextManager[Backend]]

#: The session timeout of the tests' members, in seconds.
SESSION = 2.0


def unique_prefix() -> str:
    return f"aiolease-test.{uuid.uuid4().hex[:12]}."


def opener(url: str, **options: Any) -> Opener:
    """Opens backends on ``url`` with 2 s sessions, under one fresh group and topic prefix."""
    prefix = options.pop("prefix", unique_prefix())
    options = {"session_timeout": SESSION, **options}

    @asynccontextmanager
    async def open_(**more: Any) -> AsyncIterator[Backend]:
        merged = {"group_prefix": prefix, "topic_prefix": prefix, **options, **more}
        async with aiolease.open_backend(url, **merged) as backend:
            yield backend

    return open_


def inner(backend: Backend) -> KafkaBackend:
    """The :class:`KafkaBackend` behind ``backend`` (a bridge under trio)."""
    found = getattr(backend, "inner", backend)
    assert isinstance(found, KafkaBackend)
    return found
