from __future__ import annotations

from collections.abc import Callable

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs under asyncio and under trio."""
    return str(request.param)


@pytest.fixture
def redis_url(aiolease_server: Callable[[str], str]) -> str:
    """The URL of the ``redis`` server (tests/backends/redis/)."""
    return aiolease_server("redis")
