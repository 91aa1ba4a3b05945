"""aiolease.testing in an application's test suite that runs on pytest-asyncio, not anyio:
the plugin's backend fixtures open their backend on the loop of the test (in strict and
auto mode, in a function, module or session loop), the application's own
``pytest_asyncio.fixture`` works with aiolease, and so does the driven memory backend.

Each suite runs in a pytest of its own (this suite runs on anyio's plugin): a lock held
past its ttl in a test must be renewed, which fails when the backend was opened on
another loop than the test's (the renewals never run).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import NO_PYTEST_ASYNCIO

_SUITE = '''
import asyncio

import pytest
import pytest_asyncio

import aiolease
from aiolease import AsyncLock, LeaseLostError, LossReason
from aiolease.testing import CHECKS

pytestmark = MARKS


@pytest_asyncio.fixture
async def app_backend(aiolease_url):
    """The application's own fixture, on pytest-asyncio's loop."""
    async with aiolease.open_backend(aiolease_url) as backend:
        yield backend


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_backend():
    async with aiolease.open_backend("memory://") as backend:
        yield backend


async def held_past_its_ttl(backend):
    # Renewed every third of the ttl: a ttl of 1 s leaves a renewal about half a second
    # to be late on a loaded machine (0.15 s left it under 0.1 s: a CI run lost it).
    async with AsyncLock(backend, "job", ttl=1.0) as lease:
        await asyncio.sleep(1.2)  # longer than the ttl: renewed on this loop
        assert lease.lost is None
    assert lease.renewals >= 1


async def test_the_plugins_backend(aiolease_backend):
    await held_past_its_ttl(aiolease_backend)


@pytest.mark.asyncio(loop_scope="module")
async def test_the_plugins_backend_in_a_module_loop(aiolease_backend):
    await held_past_its_ttl(aiolease_backend)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_module_scoped_backend(shared_backend):
    await held_past_its_ttl(shared_backend)


async def test_the_applications_own_fixture(app_backend):
    await held_past_its_ttl(app_backend)


async def test_the_factory(aiolease_backend_factory):
    await dict(CHECKS)["lock_mutual_exclusion"](aiolease_backend_factory)


async def test_the_driven_backend(aiolease_driven_backend):
    backend = aiolease_driven_backend
    with pytest.raises(LeaseLostError) as info:
        async with AsyncLock(backend, "job", ttl=10):
            backend.lose("job", LossReason.UNREACHABLE)
            await asyncio.sleep(10)
    assert info.value.reason is LossReason.UNREACHABLE
    async with AsyncLock(backend, "job", ttl=10, min_hold=60):
        pass
    assert await backend.read("job") is not None
    backend.advance(60)
    assert await backend.read("job") is None
'''

#: Tests in the suite, times the default URLs (memory and SQLite) for those using them.
PASSED = 10


def _suite(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *, ini: str, marks: str
) -> None:
    if importlib.util.find_spec("pytest_asyncio") is None:
        pytest.fail("pytest-asyncio is not installed: install the [test] extra", pytrace=False)
    # Let it in (tests/conftest.py keeps it out of the pytests that tests run).
    given = os.environ.get("PYTEST_ADDOPTS", "").replace(NO_PYTEST_ASYNCIO, "").strip()
    monkeypatch.setenv("PYTEST_ADDOPTS", given)
    pytester.makeini(f"[pytest]\nfilterwarnings = error\n{ini}\n")
    pytester.makepyfile(test_app=_SUITE.replace("MARKS", marks))


def test_a_strict_mode_suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    _suite(
        pytester,
        monkeypatch,
        ini="asyncio_mode = strict\nasyncio_default_fixture_loop_scope = function",
        marks="[pytest.mark.asyncio]",
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=PASSED)


def test_an_auto_mode_suite_in_a_session_loop_without_anyio(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _suite(
        pytester,
        monkeypatch,
        ini=(
            "asyncio_mode = auto\nasyncio_default_fixture_loop_scope = session\n"
            "asyncio_default_test_loop_scope = session"
        ),
        marks="[]",
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:anyio")
    result.assert_outcomes(passed=PASSED)
