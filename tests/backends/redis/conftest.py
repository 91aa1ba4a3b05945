"""The Redis tests' fixtures: a key prefix of each test's own (its keys deleted
afterwards), an opener of backends on the test server, and the Cluster's and
Sentinel's URLs. (The Cluster and Sentinel modules delete their prefix's keys on
those servers: they override ``prefix``.)"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

import aiolease
from aiolease.abc import Backend
from tests.backends.redis.support import Opener, prefix_fixture

#: Keys are deleted from the URL's database and from database 5 (where a test of
#: the URL's database writes).
prefix = prefix_fixture("test", dbs=(None, 5))


@pytest.fixture
def open_redis(redis_url: str, prefix: str) -> Opener:
    """``open_redis(fair=True)``: ``aiolease.open_backend`` on the test server and prefix."""

    def opener(**options: Any) -> AbstractAsyncContextManager[Backend]:
        return aiolease.open_backend(redis_url, prefix=prefix, **options)

    return opener


@pytest.fixture
def cluster_url(aiolease_server: Callable[[str], str]) -> str:
    """The Redis Cluster's URL."""
    return aiolease_server("redis-cluster")


@pytest.fixture
def sentinel_url(aiolease_server: Callable[[str], str]) -> str:
    """The Sentinel-managed master's URL."""
    return aiolease_server("redis-sentinel")
