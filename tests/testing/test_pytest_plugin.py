"""The pytest plugin loads for everyone who installs aiolease: it must not patch
asyncio (import trio-asyncio) for a session that runs no trio test."""

from __future__ import annotations

import pytest

_ASYNCIO_ONLY = """
import sys

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_plain_asyncio() -> None:
    assert "trio_asyncio" not in sys.modules
"""

_BOTH_LOOPS = """
import sys

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.anyio
async def test_either_loop() -> None:
    assert "trio_asyncio" in sys.modules  # before the first test, asyncio's included
"""


def test_an_asyncio_session_does_not_import_trio_asyncio(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_ASYNCIO_ONLY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_a_session_with_trio_tests_imports_it_first(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_BOTH_LOOPS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
