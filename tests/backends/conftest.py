"""Fixtures of the SQL servers, shared by tests/backends/postgres/, mysql/, sql/ and the
cross-backend tests here: each declared once."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from aiolease.testing.servers import server
from tests.backends.mysql.support import scratch_database
from tests.backends.postgres.support import no_tls, schema_of_run


def _prefix(request: pytest.FixtureRequest) -> str:
    """``aiolease_`` and the test module's name: says which module left a schema."""
    module: str = request.module.__name__
    return "aiolease_" + module.rsplit(".", 1)[-1].removeprefix("test_")


@pytest.fixture
def pg(aiolease_server: Callable[[str], str]) -> str:
    """The PostgreSQL server's URL (no options of ours), without TLS (see ``no_tls``)."""
    return no_tls(aiolease_server("postgres"))


@pytest.fixture(scope="module")
def pg_schema(request: pytest.FixtureRequest) -> Iterator[str]:
    """A PostgreSQL schema of this test module's own (made on the server directly);
    dropped, with everything in it, at the end."""
    yield from schema_of_run(_prefix(request))


@pytest.fixture
def my(aiolease_server: Callable[[str], str]) -> str:
    """The MariaDB server's URL (no options of ours)."""
    return aiolease_server("mariadb")


@pytest.fixture(scope="module")
def my_database(request: pytest.FixtureRequest) -> Iterator[str]:
    """A MariaDB database of this test module's own; dropped, with everything in it, at
    the end."""
    with scratch_database(server("mariadb").url, _prefix(request)) as name:
        yield name
