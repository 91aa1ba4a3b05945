"""The safety harness on MongoDB: OS processes contend for one lease while holders are
paused (``SIGSTOP``) or cut off (a blackholing proxy), while the replica set's primary
steps down under load, and while a server of the test's own is killed and started
again. Server kills never touch the shared replica set rs0: they SIGKILL the
``mongo-standalone`` server (:27018) of ``scripts/services.sh`` and start it again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from aiolease.testing.safety import Fault, assert_safe
from tests.backends.mongo.support import raw
from tests.backends.safety import (
    CUT_OFF_FRESH,
    assert_fault_took_effect,
    restartable,
    short_run,
)
from tests.support import with_query

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

DURATION = {
    Fault.NONE: 4.5,
    Fault.SIGSTOP: 2.5,
    Fault.BLACKHOLE: 2.5,
    # A killed mongod recovers its journal and answers again in ~1 s here.
    Fault.SERVER_RESTART: 6.0,
}


def direct(url: str) -> str:
    """``url`` for one member as it is (through a proxy): not the replica set's own
    addresses, which a client would otherwise go to directly."""
    return url.replace("replicaSet=rs0", "directConnection=true")


@pytest.mark.parametrize(
    ("fault", "anyio_backend"),
    [(Fault.SIGSTOP, "asyncio"), (Fault.BLACKHOLE, "trio")],
    ids=["sigstop-asyncio", "blackhole-trio"],
)
async def test_mongo_is_safe(
    mongo_url: str, tmp_path: Path, anyio_backend: str, fault: Fault
) -> None:
    options = dict(CUT_OFF_FRESH) if fault is Fault.BLACKHOLE else {}
    url = direct(mongo_url) if fault is Fault.BLACKHOLE else mongo_url
    report = await short_run(url, fault, anyio_backend, tmp_path, DURATION, **options)
    print(report.line())
    assert report.applicable, report.reason
    assert_fault_took_effect(report, fault)


def step_down(url: str) -> None:
    """The primary steps down for a second (a single-node set elects itself again)."""
    with raw(url) as client:
        client.admin.command("replSetStepDown", 1, secondaryCatchUpPeriodSecs=0, force=True)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_mongo_is_safe_while_the_primary_steps_down(
    mongo: str, mongo_url: str, tmp_path: Path, anyio_backend: str
) -> None:
    """Writes in flight when the primary steps down fail or are retried (an unknown
    outcome is released by the core); no two holders overlap, tokens stay in order."""
    steps = 0
    done = anyio.Event()

    async def stepping() -> None:
        nonlocal steps
        await anyio.sleep(1.5)  # contention first
        while not done.is_set():
            await anyio.to_thread.run_sync(step_down, mongo)
            steps += 1
            with anyio.move_on_after(2.0):
                await done.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stepping)
        try:
            report = await short_run(
                mongo_url, Fault.NONE, anyio_backend, tmp_path, DURATION, ttl=1.0, margin=0.3
            )
        finally:
            done.set()
    print(report.line(), f"step-downs: {steps}")
    assert steps >= 2
    assert_safe(report, min_acquisitions=2)


@pytest.mark.parametrize(
    ("form", "anyio_backend"),
    [("lock", "trio"), ("rw", "asyncio")],
    ids=["lock-trio", "rw-asyncio"],
)
async def test_mongo_is_safe_when_the_server_restarts(
    tmp_path: Path, anyio_backend: str, form: str, aiolease_server: Callable[[str], str]
) -> None:
    """The server is killed (``SIGKILL``) and started again on its journal, under a
    lock's holders or (the read-write form) readers and writers: a writer never with
    anyone outside a pause, tokens never given twice, across the restart."""
    url = with_query(aiolease_server("mongo-standalone"), collection="safety")
    control = restartable("mongo-standalone", "mongod.pid")
    options: dict[str, Any] = {"rw": True} if form == "rw" else {}
    report = await short_run(
        url,
        Fault.SERVER_RESTART,
        anyio_backend,
        tmp_path,
        DURATION,
        server_control=control,
        fault_every=1.5,
        **options,
    )
    print(report.line())
    assert report.applicable, report.reason
    assert_fault_took_effect(report, Fault.SERVER_RESTART)
    assert control.kills >= 1, report.line()


@pytest.mark.parametrize(
    ("form", "anyio_backend"),
    [("semaphore", "asyncio"), ("rw", "trio")],
    ids=["semaphore-asyncio", "rw-trio"],
)
async def test_mongo_permits_are_safe(
    mongo_url: str, tmp_path: Path, anyio_backend: str, form: str
) -> None:
    """Semaphore (limit 2 of 4 workers): never more than two bodies at once outside a
    pause. Read-write: a writer never with anyone outside a pause, a stale writer
    refused by the fence. Holders paused (SIGSTOP) beyond their ttl."""
    options: dict[str, Any] = {"limit": 2} if form == "semaphore" else {"rw": True}
    report = await short_run(mongo_url, Fault.SIGSTOP, anyio_backend, tmp_path, DURATION, **options)
    print(report.line())
    assert report.applicable, report.reason
    assert_safe(report)
    assert report.losses >= 1 and report.faults >= 2, report.line()
