from __future__ import annotations

import os
from collections.abc import Callable

import pytest

pytest_plugins = ["pytester"]


#: Keeps pytest-asyncio (in the test extra, for tests/testing/test_pytest_asyncio.py)
#: out of a pytest, as pyproject.toml's addopts keep it out of this one.
NO_PYTEST_ASYNCIO = "-p no:asyncio"


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester, whose pytests (in process or not) run without pytest-asyncio, as this
    suite does (tests/testing/test_pytest_asyncio.py lets it in)."""
    given = os.environ.get("PYTEST_ADDOPTS", "")
    monkeypatch.setenv("PYTEST_ADDOPTS", f"{given} {NO_PYTEST_ASYNCIO}".strip())
    return pytester


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs under asyncio and under trio."""
    return str(request.param)


@pytest.fixture
def redis_url(aiolease_server: Callable[[str], str]) -> str:
    """The URL of the ``redis`` server (tests/backends/redis/)."""
    return aiolease_server("redis")
