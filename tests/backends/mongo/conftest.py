"""Fixtures of the MongoDB tests: the replica set rs0 of ``scripts/services.sh``, a
collection of each test's own (dropped at the end)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.backends.mongo.support import drop, unique_collection
from tests.support import with_query

DATABASE = "aiolease"


@pytest.fixture
def mongo(aiolease_server: Callable[[str], str]) -> str:
    """The replica set's URL (no options of ours)."""
    return aiolease_server("mongo")


@pytest.fixture
def collection(mongo: str) -> Iterator[str]:
    """A collection of this test's own, dropped at the end."""
    name = unique_collection()
    yield name
    drop(mongo, DATABASE, name)


@pytest.fixture
def mongo_url(mongo: str, collection: str) -> str:
    """A URL whose leases live in this test's collection (fair, the default)."""
    return with_query(mongo, collection=collection)
