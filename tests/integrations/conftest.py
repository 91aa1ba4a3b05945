"""Fixtures of the web-framework integration tests: backend URLs of their own (a Redis
key prefix, a PostgreSQL schema), so that runs and tests do not see each other's leases."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from tests.backends.postgres.support import no_tls, schema_of_run
from tests.backends.redis.support import delete_under, new_prefix
from tests.support import unique, with_query


@pytest.fixture(scope="module")
def pg_schema() -> Iterator[str]:
    """A PostgreSQL schema of this test module's own, dropped at the end."""
    yield from schema_of_run("aiolease_web")


@pytest.fixture
def redis_app_url(aiolease_server: Callable[[str], str]) -> Iterator[str]:
    """The Redis server, under a key prefix of this test's own (its keys deleted after)."""
    url = aiolease_server("redis")
    prefix = new_prefix("web")
    yield with_query(url, prefix=prefix)
    delete_under(prefix, [redis.Redis.from_url(url)])


@pytest.fixture
def postgres_app_url(aiolease_server: Callable[[str], str], pg_schema: str) -> str:
    """The PostgreSQL server, in a schema of this module's own, under a table of this
    test's own."""
    url = no_tls(aiolease_server("postgres"))
    return with_query(url, schema=pg_schema, table=unique("leases"))
