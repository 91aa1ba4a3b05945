"""Fixtures of the etcd tests: the single node and the 3-member cluster of
``scripts/services.sh``."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture(params=["etcd", "etcd-cluster"])
def etcd_url(request: pytest.FixtureRequest, aiolease_server: Callable[[str], str]) -> str:
    """The single node, then the cluster (its URL lists every member)."""
    return aiolease_server(str(request.param))


@pytest.fixture
def single_url(aiolease_server: Callable[[str], str]) -> str:
    return aiolease_server("etcd")


@pytest.fixture
def cluster_url(aiolease_server: Callable[[str], str]) -> str:
    return aiolease_server("etcd-cluster")
