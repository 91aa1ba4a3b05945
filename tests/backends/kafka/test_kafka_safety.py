"""The Kafka backend under faults: a leader stopped (``SIGSTOP``) beyond the session
timeout, a leader killed (``SIGKILL``), and a broker killed and started again.

The stopped leader is the safety harness's election form: worker processes take
terms of ``Elector.leadership()`` on one name, each records its interval and token,
and a fenced resource rejects stale writes; a leader frozen past its session must
find its work cancelled with ``LeaseLostError`` when it resumes, and no interval may
overlap another but for the pause itself.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process

import aiolease
from aiolease import Elector, Lease
from aiolease.testing.safety import Fault, assert_safe, run_safety
from tests.backends.kafka.support import SESSION, opener, unique_prefix
from tests.backends.safety import restartable

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
# Each fault runs once, the members' loop taking turns from one fault to the next
# (docs/testing.md, "Keeping the suite short").

#: A bound on anything these tests wait for (a hang guard, not a timing claim).
WAIT = 30.0


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_safe_when_the_leader_is_stopped(
    tmp_path: Path, anyio_backend: str, kafka_url: str
) -> None:
    """Each fault stops a leader right after it was elected for 1.5 sessions: the
    coordinator drops it and another member leads; on resuming, the stopped leader's
    term has ended (its deadline passed) and its work is cancelled."""
    report = await run_safety(
        f"{kafka_url}?session_timeout={SESSION:g}",
        fault=Fault.SIGSTOP,
        election=True,
        processes=3,
        duration=12.0,
        ttl=SESSION,
        margin=0.4,
        fault_every=0.5,
        fault_aim="fresh",
        loop="trio" if anyio_backend == "trio" else "asyncio",
        workdir=tmp_path,
    )
    assert_safe(report, min_acquisitions=2)
    assert report.losses >= 1, report.line()


async def _line(process: Process, prefix: str) -> str:
    """The next line of ``process``'s output that starts with ``prefix``."""
    assert process.stdout is not None
    buffered = b""
    with anyio.fail_after(WAIT):
        while True:
            while b"\n" not in buffered:
                buffered += await process.stdout.receive()
            line, _, buffered = buffered.partition(b"\n")
            if line.decode().startswith(prefix):
                return line.decode()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_failover_after_the_leader_is_killed(anyio_backend: str, kafka_url: str) -> None:
    """A leader in a process of its own is killed with ``SIGKILL``: once the coordinator
    drops it (one session timeout), the survivor leads, with a greater token."""
    name, prefix = "killed", unique_prefix()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tests.backends.kafka._leader", kafka_url, prefix, name]
    async with await anyio.open_process(command, cwd=REPO, env=env) as process:
        try:
            first = int((await _line(process, "lead ")).split()[1])
            elected = anyio.Event()
            tokens: list[int] = []

            async def work(lease: Lease) -> None:
                tokens.append(lease.token)
                elected.set()
                await anyio.sleep_forever()

            async with opener(kafka_url, prefix=prefix)() as backend:
                survivor = Elector(backend, name, ttl=SESSION, identity="survivor")
                async with anyio.create_task_group() as tg:
                    tg.start_soon(survivor.run, work)
                    # The survivor has joined (the leader leads again, in a new term) ...
                    await _holder(backend, name, lambda h: h.identity.startswith("process-"))
                    assert not elected.is_set()
                    process.kill()  # ... when the leader dies without a word.
                    with anyio.fail_after(WAIT):
                        await elected.wait()
                    tg.cancel_scope.cancel()
            assert tokens[0] > first
        finally:
            if process.returncode is None:
                process.kill()
    assert process.returncode == -signal.SIGKILL


async def _holder(
    backend: aiolease.abc.Backend, name: str, wanted: Callable[[aiolease.abc.HolderInfo], bool]
) -> aiolease.abc.HolderInfo:
    with anyio.fail_after(WAIT):
        while True:
            holder = await backend.read(name)
            if holder is not None and wanted(holder):
                return holder
            await backend.wait_changed(name, holder)


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
