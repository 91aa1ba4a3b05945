from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs under asyncio and under trio."""
    return str(request.param)
