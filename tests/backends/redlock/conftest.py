"""The Redlock tests' fixtures: the instances' URL and endpoints, a key prefix of each
test's own (deleted on every instance afterwards), and an opener of backends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

import aiolease
from aiolease.abc import Backend
from tests.backends.redis.support import Opener, new_prefix
from tests.backends.redlock.support import instances_of, wipe


@pytest.fixture
def redlock_url(aiolease_server: Callable[[str], str]) -> str:
    return aiolease_server("redis-redlock")


@pytest.fixture
def endpoints(redlock_url: str) -> list[tuple[str, int]]:
    return list(instances_of(redlock_url))


@pytest.fixture
def prefix(endpoints: list[tuple[str, int]]) -> Iterator[str]:
    """A key prefix of this test alone; its keys are deleted on every instance afterwards."""
    prefix = new_prefix("redlock")
    yield prefix
    wipe(endpoints, prefix)


@pytest.fixture
def open_redlock(redlock_url: str, prefix: str) -> Opener:
    """Backends whose instances may take up to 2 s to answer (the default is 0.5 s, and a
    request's timeout is at most a fifth of the ttl): the conformance checks hold leases
    for seconds, and a loaded CI machine once left all three local instances unanswered
    for 0.5 s in an acquire (``reached no majority (0 of 3)``). Tests of the timeout
    itself pass their own."""

    def opener(**options: Any) -> AbstractAsyncContextManager[Backend]:
        options = {"request_timeout": 2.0, **options}
        return aiolease.open_backend(redlock_url, prefix=prefix, **options)

    return opener
