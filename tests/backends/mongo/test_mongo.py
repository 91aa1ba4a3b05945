"""The MongoDB backend against the real replica set rs0 of ``scripts/services.sh``,
under asyncio and trio: the conformance checks (fair, the default, and plain) and the
model test."""

from __future__ import annotations

import pytest

from aiolease.testing import CHECKS, Check
from tests.backends.model import agrees_with_the_model
from tests.backends.mongo.support import opener
from tests.backends.postgres.support import leaving_the_queue
from tests.support import with_query

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(anyio_backend: str, mongo_url: str, check: Check) -> None:
    await check(opener(mongo_url))


#: The checks whose waits go another way without the fair queue (``wait_changed``, not
#: ``wait_turn``): the plain mode's differences, not the whole suite a second time.
PLAIN_CHECKS = {
    "wait_changed_on_release",
    "lock_mutual_exclusion",
    "lock_acquire_timeout",
    "lock_wakes_on_release",
    "lock_cancel_while_waiting",
    "elector_one_leader",
}


@pytest.mark.parametrize(
    "check",
    [c for n, c in CHECKS if n in PLAIN_CHECKS],
    ids=[n for n, _ in CHECKS if n in PLAIN_CHECKS],
)
async def test_conformance_plain(anyio_backend: str, mongo_url: str, check: Check) -> None:
    await check(opener(with_query(mongo_url, fair=0)))


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_agrees_with_the_model(mongo_url: str, loop: str) -> None:
    # The model has no queue: a refused caller leaves it at once (as acquire_nowait does).
    agrees_with_the_model(
        lambda: leaving_the_queue(opener(mongo_url)()), loop, examples=10, steps=30
    )
