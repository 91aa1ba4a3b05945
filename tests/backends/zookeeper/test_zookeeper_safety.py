"""The safety harness on ZooKeeper: OS processes contend for one lease while the
holder is paused or cut off (and, on the ensemble, while members die).

The backends' session timeout is the server's minimum (1 s: ``minSessionTimeout``
of ``scripts/services.sh``'s servers), and so is the lease ttl: a holder that stops
answering keeps its node on the server for the session timeout, whatever the ttl.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

import pytest

from aiolease.testing.safety import Fault, SafetyReport, assert_safe, run_safety
from tests.backends.zookeeper.support import Ensemble
from tests.support import with_query

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

#: The session timeout, and so the ttl of these runs.
TTL = 1.0
#: The margin is wider than the default: a holder starved of CPU on a busy machine
#: for longer than its margin would really overlap (that is what the margin is for).
SHORT: dict[str, Any] = {"ttl": TTL, "margin": 0.3, "processes": 4, "fault_every": 0.5}
DURATION = {
    Fault.SIGSTOP: 8.0,
    Fault.BLACKHOLE: 5.0,
    Fault.SERVER_RESTART: 9.0,
}


async def short_run(
    url: str, fault: Fault, loop: str, workdir: Path, session_timeout: float = TTL, **options: Any
) -> SafetyReport:
    asyncio_or_trio: Literal["asyncio", "trio"] = "trio" if loop == "trio" else "asyncio"
    options = {**SHORT, "duration": DURATION[fault], **options}
    url = with_query(url, session_timeout=session_timeout)
    return await run_safety(url, fault=fault, loop=asyncio_or_trio, workdir=workdir, **options)


# Each fault runs once, the workers' loop taking turns from one fault to the next
# (docs/testing.md, "Keeping the suite short").


@pytest.fixture
def zk_url(aiolease_server: Callable[[str], str]) -> str:
    return aiolease_server("zookeeper")


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_zookeeper_is_safe_when_the_holder_is_paused(
    tmp_path: Path, anyio_backend: str, zk_url: str
) -> None:
    """The holder is stopped (SIGSTOP) for longer than the session timeout: ZooKeeper
    expires its session and another takes the name; what the frozen holder writes on
    waking is refused by the fence (the tokens only grow), and its body ends with
    ``LeaseLostError``. Bodies never end on their own (hold: 1000 ttls, cut only by
    the end of the run), so a paused holder has no way out but its loss."""
    report = await short_run(
        zk_url, Fault.SIGSTOP, anyio_backend, tmp_path, fault_length=2.5 * TTL, hold=(1e3, 1e3)
    )
    assert_safe(report, min_acquisitions=2)
    # The fault took effect: a frozen holder came back after others had taken the
    # name, and the writes it made then were refused by the fence.
    assert report.paused_overlaps >= 1 and report.stale_rejected >= 1, report.line()
    # Every fault froze a holder, and each lost its lease (bad stops, checked above,
    # would count a loss that did not surface as LeaseLostError).
    assert report.losses >= report.faults >= 1, report.line()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_zookeeper_is_safe_when_the_holder_is_cut_off(
    tmp_path: Path, anyio_backend: str, zk_url: str
) -> None:
    """Each worker reaches ZooKeeper through its own proxy; the holder's is blackholed
    right after its grant (no reconnect gets through), and bodies outlast the session
    timeout, so it surely loses its lease while cut off and must stop, with
    ``LeaseLostError``, before ZooKeeper expires its session."""
    report = await short_run(
        zk_url,
        Fault.BLACKHOLE,
        anyio_backend,
        tmp_path,
        fault_aim="fresh",
        hold=(1.5, 2.5),
        fault_length=3 * TTL,
    )
    assert_safe(report, min_acquisitions=1)
    assert report.losses >= 1 and report.worst_stop_latency is not None, report.line()


@pytest.mark.parametrize(
    ("form", "anyio_backend"),
    [
        pytest.param("semaphore", "asyncio", id="semaphore-asyncio"),
        pytest.param("rw", "trio", id="rw-trio"),
    ],
)
async def test_zookeeper_permits_are_safe_when_a_holder_is_paused(
    tmp_path: Path, anyio_backend: str, zk_url: str, form: str
) -> None:
    """Semaphore (limit 2 of 4 workers): never more than two bodies at once outside a
    pause. Read-write: a writer never with anyone outside a pause. A holder stopped
    past the session timeout loses its permit (its node goes with its session) and
    its body ends with ``LeaseLostError``; the fence refuses a stale writer's writes."""
    options: dict[str, Any] = {"limit": 2} if form == "semaphore" else {"rw": True}
    report = await short_run(
        zk_url,
        Fault.SIGSTOP,
        anyio_backend,
        tmp_path,
        fault_length=2.5 * TTL,
        **options,
    )
    print(report.line())
    assert report.applicable, report.reason
    assert_safe(report, min_acquisitions=2)
    assert report.losses >= 1 and report.faults >= 1, report.line()


@pytest.fixture
async def ensemble(aiolease_server: Callable[[str], str]) -> AsyncIterator[str]:
    """The ensemble's URL; every member serves again, with a leader, afterwards."""
    url = aiolease_server("zookeeper-ensemble")
    await Ensemble("all").wait_ready()
    yield url
    await Ensemble("all").wait_ready()


#: On the ensemble: a longer session (2 s) rides out an election without losing it.
ENSEMBLE_TTL = 2.0


@pytest.mark.parametrize(
    ("members", "kills", "anyio_backend", "form"),
    [
        # The leader member is killed (SIGKILL) and started again: the two others elect
        # a leader and go on serving; sessions move to them.
        pytest.param("leader", 1, "trio", "lock", id="leader-killed-trio"),
        # Every member is killed and started again on its data: sessions, nodes and
        # transaction ids (tokens) go on from where they were.
        pytest.param("all", 3, "asyncio", "lock", id="every-member-restarts-asyncio"),
        # The same under a semaphore's permits (limit 2 of 4 workers): never more than
        # two bodies at once outside a pause, tokens never given twice.
        pytest.param("all", 3, "trio", "semaphore", id="semaphore-every-member-restarts-trio"),
    ],
)
async def test_zookeeper_ensemble_is_safe_when_members_restart(
    tmp_path: Path,
    anyio_backend: str,
    ensemble: str,
    members: Literal["leader", "all"],
    kills: int,
    form: str,
) -> None:
    control = Ensemble(members)
    options: dict[str, Any] = {"limit": 2} if form == "semaphore" else {}
    report = await short_run(
        ensemble,
        Fault.SERVER_RESTART,
        anyio_backend,
        tmp_path,
        ttl=ENSEMBLE_TTL,
        margin=0.5,
        session_timeout=ENSEMBLE_TTL,
        server_control=control,
        fault_length=ENSEMBLE_TTL,
        **options,
    )
    print(report.line())
    assert_safe(report, min_acquisitions=1)
    assert control.kills >= kills
