"""Fixtures of the Kafka tests: the Tansu broker of ``scripts/services.sh``."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def kafka_url(aiolease_server: Callable[[str], str]) -> str:
    """The broker's URL (no options of ours)."""
    return aiolease_server("kafka")
