"""Fixtures of the PostgreSQL tests (``pg`` and ``pg_schema``: tests/backends/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.backends.postgres.support import no_tls
from tests.support import unique, with_query


@pytest.fixture
def schema(pg_schema: str) -> str:
    """The schema of this test module's leases."""
    return pg_schema


@pytest.fixture
def pg_url(pg: str, schema: str) -> str:
    """A URL whose leases live in this module's schema."""
    return with_query(pg, schema=schema)


@pytest.fixture
def table_url(pg: str, schema: str) -> tuple[str, str]:
    """A URL with a table of this test's own, and the table's name."""
    table = unique("queue")
    return with_query(pg, schema=schema, table=table), table


@pytest.fixture
def bouncer(aiolease_server: Callable[[str], str]) -> str:
    """PgBouncer in front of the server (no options of ours)."""
    return no_tls(aiolease_server("pgbouncer"))


@pytest.fixture
def pooled(bouncer: str, schema: str) -> str:
    """A backend URL whose statements go through PgBouncer, in this module's schema."""
    return with_query(bouncer, schema=schema, pooler="transaction")
