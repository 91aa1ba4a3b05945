"""The ZooKeeper backend against the real server of ``scripts/services.sh``, under
asyncio and trio. Every test works under a prefix node of its own."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from aiolease.testing import CHECKS, Check
from aiolease.testing.model import make_model_machine
from tests.backends.zookeeper.support import opener

pytestmark = pytest.mark.anyio


@pytest.fixture
def zk_url(aiolease_server: Callable[[str], str]) -> str:
    return aiolease_server("zookeeper")


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(anyio_backend: str, zk_url: str, check: Check) -> None:
    await check(opener(zk_url))


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_agrees_with_the_model(zk_url: str, loop: str) -> None:
    # Tokens are czxids: increasing, not consecutive.
    machine = make_model_machine(opener(zk_url), anyio_backend=loop, exact_tokens=False)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=15,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
