"""The Kafka backend under faults: a leader stopped (``SIGSTOP``) beyond the session
timeout, a leader killed (``SIGKILL``), and a broker killed and started again.

The stopped and the killed leader are the safety harness's election form: worker
processes take terms of ``Elector.leadership()`` on one name, each records its
interval and token, and a fenced resource rejects stale writes; no interval may
overlap another (but for a pause itself), and tokens increase in interval order. A
leader frozen past its session must find its work cancelled with ``LeaseLostError``
when it resumes; a killed leader's last interval runs until the kill.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

import aiolease
from aiolease import Elector, Lease
from aiolease.testing.safety import Fault, SafetyReport, assert_safe, run_safety
from tests.backends.kafka.support import SESSION, opener
from tests.backends.safety import restartable

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# The stop and the restart run once, the members' loop taking turns from one fault to
# the next (docs/testing.md, "Keeping the suite short"); the kill, the failover the
# issue names with the stop, runs under both.

#: A bound on anything these tests wait for (a hang guard, not a timing claim).
WAIT = 30.0


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_safe_when_the_leader_is_stopped(
    tmp_path: Path, anyio_backend: str, kafka_url: str
) -> None:
    """Each fault stops a leader right after it was elected for 1.5 sessions: the
    coordinator drops it and another member leads; on resuming, the stopped leader's
    term has ended (its deadline passed) and its work is cancelled."""
    report = await _election_run(kafka_url, Fault.SIGSTOP, 12.0, anyio_backend, tmp_path)
    assert_safe(report, min_acquisitions=2)
    assert report.losses >= 1, report.line()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_safe_when_the_leader_is_killed(
    tmp_path: Path, anyio_backend: str, kafka_url: str
) -> None:
    """A leader is killed (``SIGKILL``) right after it was elected: its member never
    leaves the group, so the coordinator drops it one session after its last
    heartbeat, and a survivor leads. Its last body counts as running until the kill;
    no body of a survivor may start before that, tokens go on increasing, and the
    harness fails the run unless a survivor's body started after the kill."""
    report = await _election_run(kafka_url, Fault.SIGKILL, 14.0, anyio_backend, tmp_path)
    assert_safe(report, min_acquisitions=2)
    assert report.faults == 1, report.line()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_leadership_recovers_after_a_broker_restart(
    anyio_backend: str, aiolease_server: Callable[[str], str]
) -> None:
    """The broker of ``kafka-restart`` (memory storage) is killed and started again: it
    forgets the group and the committed token. The leader's term ends (its heartbeats
    fail, then the member is unknown), the candidates join the new broker's group, and
    the next term's token is still greater: the members carry the highest token they
    saw into the new group, and the assignor starts above it."""
    url = aiolease_server("kafka-restart")
    broker = restartable("kafka-restart", "tansu.pid")
    name = f"restart-{uuid.uuid4().hex[:8]}"
    tokens: list[int] = []
    lost: list[aiolease.LossReason] = []
    elected = [anyio.Event(), anyio.Event()]

    async def work(lease: Lease) -> None:
        tokens.append(lease.token)
        elected[len(tokens) - 1].set()
        await anyio.sleep_forever()

    open_ = opener(url, timeout=1.0)
    async with open_() as one, open_() as two:
        electors = [
            Elector(backend, name, ttl=SESSION, identity=who, on_defeated=lost.append)
            for backend, who in ((one, "one"), (two, "two"))
        ]
        async with anyio.create_task_group() as tg:
            for elector in electors:
                tg.start_soon(elector.run, work)
            with anyio.fail_after(WAIT):
                await elected[0].wait()
            await broker.kill()
            await broker.start()
            with anyio.fail_after(WAIT):
                await elected[1].wait()
            tg.cancel_scope.cancel()
    assert lost, "the term that outlived its broker did not end"
    assert tokens[1] > tokens[0], tokens


async def _election_run(
    kafka_url: str, fault: Fault, duration: float, loop: str, workdir: Path
) -> SafetyReport:
    """The harness's election form on Kafka: three processes (a kill only while three
    live: one kill, two survivors contend), each fault aimed at a leader just elected."""
    return await run_safety(
        f"{kafka_url}?session_timeout={SESSION:g}",
        fault=fault,
        election=True,
        processes=3,
        duration=duration,
        ttl=SESSION,
        margin=0.4,
        fault_every=0.5,
        fault_aim="fresh",
        loop="trio" if loop == "trio" else "asyncio",
        workdir=workdir,
    )
