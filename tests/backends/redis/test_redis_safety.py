"""The Redis backend under the safety harness: OS processes contend for one lease
while holders are paused, cut off, or the server is killed.

Short runs (a few seconds each), on the test's own event loop. The runs against
``redis-aof`` (a Redis that fsyncs every write before it answers) kill that server
with SIGKILL and start it again: its tokens survive, so ``server-restart`` applies.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aiolease import (
    AsyncLock,
    BackendUnavailable,
    Capability,
    UnsupportedCapability,
    open_backend,
)
from aiolease.abc import Backend, HolderInfo
from aiolease.testing.safety import Fault, assert_safe, run_safety
from tests.backends.safety import (
    CUT_OFF_FRESH,
    alternating_loops,
    assert_fault_took_effect,
    assert_pause_took_effect,
    restartable,
    short_run,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

DURATION = {
    Fault.NONE: 1.5,
    Fault.SIGSTOP: 2.5,
    Fault.BLACKHOLE: 2.0,
    Fault.SERVER_RESTART: 3.0,
}
#: The server that server-restart runs kill: services.sh's ``redis-aof``.
AOF = ("redis-aof", "redis.pid")


async def read_again(backend: Backend, name: str) -> HolderInfo | None:
    """``read(name)``, once the client's pooled connections have noticed the restart
    (each fails one command with BackendUnavailable, as a keepalive's retry would)."""
    for _ in range(10):
        try:
            return await backend.read(name)
        except BackendUnavailable:
            pass
    return await backend.read(name)


#: The two queueing modes (``fair=1`` is the default): each fault meets both, and
#: both loops, in four runs. (No ``none`` run: every run checks that no bodies overlap
#: outside a pause.)
MODES = {"fair": "?fair=1", "plain": "?fair=0"}


@pytest.mark.parametrize(
    ("fault", "mode", "anyio_backend"),
    [
        case
        for offset, fault in enumerate((Fault.SIGSTOP, Fault.BLACKHOLE))
        for case in alternating_loops([(fault, mode) for mode in MODES], offset)
    ],
)
async def test_redis_is_safe(
    aiolease_server: Callable[[str], str],
    tmp_path: Path,
    anyio_backend: str,
    fault: Fault,
    mode: str,
) -> None:
    url = aiolease_server("redis") + MODES[mode]
    options: dict[str, Any] = {}
    if fault is Fault.BLACKHOLE:
        options = dict(CUT_OFF_FRESH)
    report = await short_run(url, fault, anyio_backend, tmp_path, DURATION, **options)
    assert_fault_took_effect(report, fault)


async def test_restart_of_a_redis_without_persistence_is_not_applicable(
    aiolease_server: Callable[[str], str],
) -> None:
    report = await run_safety(aiolease_server("redis"), fault=Fault.SERVER_RESTART, duration=1)
    assert not report.applicable and "durable_tokens" in report.reason
    assert report.acquisitions == 0


async def test_a_persistent_redis_declares_durable_tokens(
    aiolease_server: Callable[[str], str],
) -> None:
    async with open_backend(aiolease_server("redis-aof")) as backend:
        assert Capability.DURABLE_TOKENS in backend.capabilities
    async with open_backend(aiolease_server("redis")) as backend:
        assert Capability.DURABLE_TOKENS not in backend.capabilities
    with pytest.raises(UnsupportedCapability, match="durable_tokens"):
        async with open_backend(aiolease_server("redis"), require=[Capability.DURABLE_TOKENS]):
            pass


@pytest.mark.parametrize(("mode", "anyio_backend"), alternating_loops([(mode,) for mode in MODES]))
async def test_a_persistent_redis_is_safe_across_restarts(
    aiolease_server: Callable[[str], str], tmp_path: Path, anyio_backend: str, mode: str
) -> None:
    url = aiolease_server("redis-aof") + MODES[mode]
    control = restartable(*AOF)
    # The harness asks the open backend: this Redis fsyncs every write, so its
    # tokens are durable and the fault applies.
    report = await short_run(
        url, Fault.SERVER_RESTART, anyio_backend, tmp_path, DURATION, server_control=control
    )
    assert_safe(report)
    assert control.kills >= 1


async def test_tokens_and_the_holder_survive_a_restart(
    aiolease_server: Callable[[str], str], anyio_backend: str
) -> None:
    """A grant confirmed before the server died is still there after it starts again:
    nobody else gets the name, and the next token is higher."""
    url = aiolease_server("redis-aof")
    control = restartable(*AOF)
    name = f"restart-{os.getpid()}-{anyio_backend}"
    async with open_backend(url) as backend:
        lock = AsyncLock(backend, name, ttl=60)
        lease = await lock.acquire_nowait()
        try:
            await control.kill()
            await control.start()
            holder = await read_again(backend, name)
            assert holder is not None and holder.owner == lease.owner, holder
            assert holder.token == lease.token
        finally:
            assert await lease.release()
        async with lock as again:
            assert again.token > lease.token


@pytest.mark.parametrize("anyio_backend", ["trio"])  # asyncio: the runs above
async def test_restarts_leave_no_driver_error_in_any_worker(
    aiolease_server: Callable[[str], str], tmp_path: Path, anyio_backend: str
) -> None:
    """A longer run, with more restarts and more waiters: no worker may stop on an error.

    Regression: after a restart, watchers (un)subscribing while the pub/sub reader
    reconnected used one redis-py connection from two tasks, and raw driver errors
    (``AttributeError`` on a closed writer, ``RuntimeError`` from two reads of one
    stream) crashed about half of such runs instead of surfacing as BackendError.
    """
    control = restartable(*AOF)
    report = await short_run(
        aiolease_server("redis-aof"),
        Fault.SERVER_RESTART,
        anyio_backend,
        tmp_path,
        DURATION,
        server_control=control,
        duration=8.0,
        processes=6,
    )
    assert report.errors == (), report.errors
    assert_safe(report)
    assert control.kills >= 3, report.line()


@pytest.mark.parametrize(
    ("form", "service", "fault", "anyio_backend"),
    alternating_loops(
        [("semaphore", "redis", Fault.SIGSTOP), ("rw", "redis-aof", Fault.SERVER_RESTART)]
    ),
)
async def test_redis_permits_are_safe(
    aiolease_server: Callable[[str], str],
    tmp_path: Path,
    anyio_backend: str,
    form: str,
    service: str,
    fault: Fault,
) -> None:
    """Semaphore (limit 2 of 4 workers): never more than two bodies at once outside a
    pause, under SIGSTOP of a holder. Read-write: a writer never with anyone, across
    kills of a Redis that fsyncs every write (tokens survive)."""
    options: dict[str, Any] = {"limit": 2} if form == "semaphore" else {"rw": True}
    control = None
    if fault is Fault.SERVER_RESTART:
        control = options["server_control"] = restartable(*AOF)
    report = await short_run(
        aiolease_server(service), fault, anyio_backend, tmp_path, DURATION, **options
    )
    print(report.line())
    assert report.applicable, report.reason
    assert_safe(report)
    if fault is Fault.SIGSTOP:
        assert_pause_took_effect(report)
    if control is not None:
        assert control.kills >= 1, report.line()
