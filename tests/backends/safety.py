"""What the safety-harness tests share: the short runs' settings, and the control that
kills a dedicated server of ``scripts/services.sh`` and starts it again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest

from aiolease import AsyncSemaphore
from aiolease.testing.pytest_plugin import server_missing
from aiolease.testing.safety import Fault, SafetyReport, assert_safe, run_safety
from aiolease.testing.servers import server, services_dir

__all__ = [
    "CUT_OFF_FRESH",
    "REPO",
    "SHORT",
    "ServiceRestart",
    "alternating_loops",
    "assert_fault_took_effect",
    "restartable",
    "short_run",
]

REPO = Path(__file__).resolve().parents[2]
#: Short runs: the margin covers a holder starved of CPU.
SHORT: dict[str, Any] = {
    "ttl": 0.5,
    "margin": 0.15,
    "processes": 4,
    "fault_every": 0.05,
    "fault_length": 0.75,
}

#: Blackhole options: hit a holder right after its grant, with bodies longer than the
#: ttl, so that it surely loses its lease while cut off, and must stop in time.
CUT_OFF_FRESH: dict[str, Any] = {"fault_aim": "fresh", "hold": (1.2, 2.0)}


def alternating_loops(cases: Sequence[Sequence[Any]], offset: int = 0) -> list[Any]:
    """``cases`` as ``pytest.param(*case, loop)``, the workers' loop alternating from one
    case to the next (starting with asyncio, or trio with an odd ``offset``).

    A safety run costs seconds of real time; running each fault once, with the loops
    taking turns, meets both loops under faults on every backend without running every
    fault twice (docs/testing.md, "Keeping the suite short"). Each id ends in its loop.
    """
    params = []
    for index, case in enumerate(cases):
        loop = ("asyncio", "trio")[(index + offset) % 2]
        label = "-".join(getattr(part, "value", str(part)) for part in case)
        params.append(pytest.param(*case, loop, id=f"{label}-{loop}"))
    return params


async def short_run(
    url: str,
    fault: Fault,
    loop: str,
    workdir: Path,
    durations: Mapping[Fault, float],
    **options: Any,
) -> SafetyReport:
    """A :data:`SHORT` run of ``durations[fault]`` seconds; ``options`` override both.

    :param loop: the workers' event loop, ``"asyncio"`` or ``"trio"``
    """
    asyncio_or_trio: Literal["asyncio", "trio"] = "trio" if loop == "trio" else "asyncio"
    options = {**SHORT, "duration": durations[fault], **options}
    return await run_safety(url, fault=fault, loop=asyncio_or_trio, workdir=workdir, **options)


def assert_pause_took_effect(report: SafetyReport) -> None:
    """A ``sigstop`` run did what it is there for: a frozen holder lost its lease (or
    permit) and another body ran while it was frozen. How many pauses fit in a short
    run depends on the machine's load (a trio worker behind the bridge starts later),
    so the count of pauses is not asserted.

    :raises AssertionError: no loss, or nobody ran during a pause
    """
    assert pause_took_effect(report), report.line()


def pause_took_effect(report: SafetyReport) -> bool:
    """Whether a frozen holder lost its lease (or permit) and another body ran while it
    was frozen (see :func:`assert_pause_took_effect`)."""
    return report.losses >= 1 and report.paused_overlaps >= 1


def assert_fault_took_effect(report: SafetyReport, fault: Fault) -> None:
    """The run was safe, and its fault did what it is there for.

    :raises AssertionError: an unsafe run, a ``sigstop`` run in which no frozen holder
        lost its lease to another (or no stale write was refused), or a ``blackhole``
        run in which no cut-off holder lost its lease and stopped
    """
    assert_safe(report)
    if fault is Fault.SIGSTOP:
        # Frozen holders lost their leases, others took over, the fence refused
        # what the frozen ones wrote on waking up.
        assert_pause_took_effect(report)
        assert report.stale_rejected >= 1, report.line()
    if fault is Fault.BLACKHOLE:
        assert report.losses >= 1 and report.worst_stop_latency is not None, report.line()


class ServiceRestart:
    """Kills a dedicated server of ``scripts/services.sh`` with SIGKILL, and starts it
    again with ``bash scripts/services.sh start SERVICE`` (on the same data)."""

    def __init__(self, service: str, pidfile: Path) -> None:
        self.service = service
        self._pidfile = pidfile
        self.kills = 0

    async def kill(self) -> None:
        pid = int(self._pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        self.kills += 1
        # Not our child: its exit cannot be awaited; wait until the port is closed.
        while _port_open(server(self.service).addresses[0]):  # noqa: ASYNC110
            await anyio.sleep(0.01)

    async def start(self) -> None:
        await anyio.run_process(
            ["bash", "scripts/services.sh", "start", self.service],
            cwd=REPO,
            stderr=subprocess.PIPE,
        )


def _port_open(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=0.5).close()
    except OSError:
        return False
    return True


def restartable(service: str, pidfile: str) -> ServiceRestart:
    """The control of ``service``, which must be a server services.sh started (its
    pidfile, ``pidfile`` in the service's directory, exists; else a failure)."""
    path = services_dir() / service / pidfile
    if not path.exists():
        server_missing(
            f"server-restart needs the {service} server that `bash scripts/services.sh"
            f" start {service}` starts (no pidfile at {path})"
        )
    return ServiceRestart(service, path)


async def race_for_permits(
    sem: AsyncSemaphore, *, tasks: int = 32, rounds: int = 8, wait: float = 60.0
) -> None:
    """``tasks`` tasks take a permit of ``sem`` ``rounds`` times each, with no hold, so
    every request races others for a free one (the storm that made etcd's requests give
    up with ``BackendUnavailable``): every request is served within ``wait`` seconds,
    and never more than ``sem.limit`` are inside at once."""
    inside = peak = 0
    served: list[int] = []

    async def task(i: int) -> None:
        nonlocal inside, peak
        for _ in range(rounds):
            async with sem:
                inside += 1
                peak = max(peak, inside)
                await anyio.lowlevel.checkpoint()
                inside -= 1
            served.append(i)

    with anyio.fail_after(wait):
        async with anyio.create_task_group() as tg:
            for i in range(tasks):
                tg.start_soon(task, i)
    assert peak <= sem.limit
    assert sorted(served) == sorted(list(range(tasks)) * rounds)
