"""Fixtures of the MySQL / MariaDB tests (``my`` and ``my_database``:
tests/backends/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.backends.mysql.support import in_database, scratch_database
from tests.support import unique, with_query


@pytest.fixture
def database(my_database: str) -> str:
    """The database of this test module's leases."""
    return my_database


@pytest.fixture
def my_url(my: str, database: str) -> str:
    """A URL whose leases live in this module's database."""
    return in_database(my, database)


@pytest.fixture
def table() -> str:
    """A table of this test's own."""
    return unique("leases")


@pytest.fixture
def table_url(my_url: str, table: str) -> str:
    """A URL whose leases (and waiters) live in a table of this test's own."""
    return with_query(my_url, table=table)


@pytest.fixture
def own_database(my: str) -> Iterator[str]:
    """A database of this test's own, so that its connections can be counted."""
    with scratch_database(my, "aiolease_pool") as name:
        yield name
