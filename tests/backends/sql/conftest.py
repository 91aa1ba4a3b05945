"""Fixtures of the tests of both SQL backends (the servers': tests/backends/conftest.py)."""

from __future__ import annotations

import pytest

from tests.backends.sql.support import DATABASES, Database


@pytest.fixture(params=list(DATABASES))
def database(request: pytest.FixtureRequest) -> Database:
    """Each SQL server kind in turn."""
    return DATABASES[request.param]
