"""The safety harness on etcd: OS processes contend for one lease while the holder is
paused, cut off, or the server or the cluster's leader member is killed.

etcd grants whole seconds and at least 2 s (its minimum with a 1 s election timeout),
so the runs use ``ttl=2``: a holder that stops answering keeps its key on the server
for at least that long, and a shorter ttl would only make every fault a wait for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest

from aiolease.testing.etcd_cluster import EtcdCluster
from aiolease.testing.safety import Fault, SafetyReport, assert_safe, run_safety
from aiolease.testing.servers import server
from tests.backends.etcd.support import WAIT, private_etcd

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

#: etcd's smallest granted TTL, and so the ttl of these runs.
TTL = 2.0
#: What every run shares: the margin is wider than the default (0.2 s) because a
#: holder starved of CPU on a busy machine for longer than its margin would really
#: overlap (that is what the margin is for).
SHORT: dict[str, Any] = {"ttl": TTL, "margin": 0.4, "processes": 4, "fault_every": 0.5}
#: Seconds per run: a few bodies (each 0.5-1.5 ttl), or a fault with time on both sides.
DURATION = {
    Fault.SIGSTOP: 9.0,
    Fault.BLACKHOLE: 9.0,
    Fault.SERVER_RESTART: 10.0,
    Fault.ETCD_LEADER_KILL: 12.0,
}


async def short_run(
    url: str, fault: Fault, loop: str, workdir: Path, **options: Any
) -> SafetyReport:
    """A short run whose workers run on ``loop`` (the test's own); the records stay in
    ``workdir`` (pytest keeps the last few), to study a failure."""
    asyncio_or_trio: Literal["asyncio", "trio"] = "trio" if loop == "trio" else "asyncio"
    options = {**SHORT, "duration": DURATION[fault], **options}
    return await run_safety(url, fault=fault, loop=asyncio_or_trio, workdir=workdir, **options)


# Each fault runs once, the workers' loop taking turns from one fault to the next
# (docs/testing.md, "Keeping the suite short"). No ``none`` run: every run checks
# that no bodies overlap outside a pause.


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_etcd_is_safe_when_the_holder_is_paused(
    tmp_path: Path, anyio_backend: str, single_url: str
) -> None:
    report = await short_run(single_url, Fault.SIGSTOP, anyio_backend, tmp_path)
    assert_safe(report, min_acquisitions=1)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_etcd_is_safe_when_the_holder_is_cut_off(
    tmp_path: Path, anyio_backend: str, single_url: str
) -> None:
    """Each worker reaches etcd through its own proxy; the holder's is blackholed right
    after its grant, and bodies outlast the ttl, so it surely loses its lease while cut
    off and must stop, with ``LeaseLostError``, before etcd drops its key."""
    report = await short_run(
        single_url, Fault.BLACKHOLE, anyio_backend, tmp_path, fault_aim="fresh", hold=(1.2, 2.0)
    )
    assert_safe(report, min_acquisitions=1)
    assert report.losses >= 1 and report.worst_stop_latency is not None, report.line()


@pytest.mark.parametrize(
    ("form", "anyio_backend"),
    [("lock", "asyncio"), ("semaphore", "trio")],
    ids=["lock-asyncio", "semaphore-trio"],
)
async def test_etcd_is_safe_when_the_server_restarts(
    tmp_path: Path, anyio_backend: str, form: str
) -> None:
    """A node of the test's own is killed (``SIGKILL``) and started again on its data:
    revisions, and so tokens, go on from where they were. The semaphore form (limit 2
    of 4 workers): never more than two bodies at once outside a pause, tokens never
    given twice, across the restart."""
    options: dict[str, Any] = {"limit": 2} if form == "semaphore" else {}
    async with private_etcd(tmp_path / "etcd") as etcd:
        report = await short_run(
            etcd.url,
            Fault.SERVER_RESTART,
            anyio_backend,
            tmp_path / "records",
            server_control=etcd,
            fault_length=TTL,
            **options,
        )
    print(report.line())
    assert report.applicable, report.reason
    assert_safe(report, min_acquisitions=1)
    assert report.faults >= 1, report.line()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_etcd_cluster_is_safe_when_its_leader_is_killed(
    tmp_path: Path, anyio_backend: str, aiolease_server: Callable[[str], str]
) -> None:
    url = aiolease_server("etcd-cluster")
    cluster = EtcdCluster([f"{h}:{p}" for h, p in server("etcd-cluster").addresses])
    await cluster.wait_healthy(WAIT)
    report = await short_run(url, Fault.ETCD_LEADER_KILL, anyio_backend, tmp_path)
    await cluster.wait_healthy(WAIT)
    assert_safe(report, min_acquisitions=1)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_etcd_read_write_lock_is_safe_when_a_holder_is_paused(
    tmp_path: Path, anyio_backend: str, single_url: str
) -> None:
    """The read-write form: a writer's body never runs with any other outside a pause,
    readers share, and a stale writer's writes are refused by the fence."""
    report = await short_run(single_url, Fault.SIGSTOP, anyio_backend, tmp_path, rw=True)
    print(report.line())
    assert report.applicable, report.reason
    assert_safe(report, min_acquisitions=2)
    assert report.faults >= 1, report.line()
