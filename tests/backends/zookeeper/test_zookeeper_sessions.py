"""The backend's one session: expired by the server under it, nodes of other sessions,
and order across processes (a crashed waiter does not stall the queue)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import pytest

import aiolease
from aiolease import AsyncLock, LeaseLostError, LossReason
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.zookeeper._nodes import Layout
from tests.backends.zookeeper.support import REPO, Outside, inner, unique_prefix
from tests.support import eventually

pytestmark = pytest.mark.anyio

#: Bound on each test's waits (the machine is shared and slow): a hang guard.
WAIT = 60.0


@pytest.fixture
def zk_url(aiolease_server: Callable[[str], str]) -> str:
    return aiolease_server("zookeeper")


async def expire_session(url: str, session_id: int, password: bytes) -> None:
    """Make the server expire a session: attach a client of our own to it, then close
    it (the classic ZooKeeper test trick)."""
    from kazoo.client import KazooClient

    from aiolease.backends.zookeeper._url import parse_url

    def expire() -> None:
        client = KazooClient(
            parse_url(url, {}).connect_string(), client_id=(session_id, password), timeout=10
        )
        client.start(10)
        client.stop()
        client.close()

    await anyio.to_thread.run_sync(expire)


async def test_a_session_the_server_expired_loses_its_leases(
    anyio_backend: str, zk_url: str
) -> None:
    """Replies on a new session: the server dropped the old one, and every lease on it
    is lost (``STOLEN``); its nodes are gone, and the backend goes on, on the new one."""
    prefix = unique_prefix()
    async with (
        aiolease.open_backend(zk_url, prefix=prefix, session_timeout=4) as backend,
        Outside(zk_url) as outside,
    ):
        zk = inner(backend)
        old = zk.statistics().session_id
        password = zk._wire.client.session.password
        with pytest.raises(LeaseLostError) as info, anyio.fail_after(WAIT):
            async with AsyncLock(backend, "a", ttl=4) as first:
                async with AsyncLock(backend, "b", ttl=4):
                    await expire_session(zk_url, old, password)
                    await anyio.sleep_forever()
        assert info.value.reason is LossReason.STOLEN
        assert first.lost is LossReason.STOLEN
        statistics = zk.statistics()
        assert statistics.session_id not in (0, old) and statistics.lost_sessions == 1
        assert await outside.tree(f"/{prefix}") == []
        async with AsyncLock(backend, "a", ttl=4) as again:
            assert again.token > first.token


async def test_a_body_that_outlived_its_lease_in_a_stall_ends_with_lease_lost(
    anyio_backend: str, zk_url: str
) -> None:
    """The process stalls (here: blocking the loop, as a ``SIGSTOP`` does) past the
    lease's deadline, and the body returns without a checkpoint: leaving the block
    raises ``LeaseLostError``, not a plain release. (The backend's own release used to
    end the lease as released before the core looked at the deadline.)"""
    async with aiolease.open_backend(zk_url, prefix=unique_prefix(), session_timeout=1) as backend:
        with pytest.raises(LeaseLostError) as info:
            async with AsyncLock(backend, "stalled", ttl=1, margin=0.3) as lease:
                time.sleep(2 * lease.remaining + 0.5)  # noqa: ASYNC251 - the stall on purpose
        assert info.value.reason in (LossReason.EXPIRED, LossReason.UNREACHABLE)


async def test_a_node_of_another_session_is_never_taken_for_ours(
    anyio_backend: str, zk_url: str
) -> None:
    """A node with the owner's name but another session (a lost session's, or anyone's)
    is not adopted when the backend looks for a create whose reply it lost."""
    prefix = unique_prefix()
    async with (
        aiolease.open_backend(zk_url, prefix=prefix) as backend,
        Outside(zk_url) as outside,
    ):
        owner = "a" * 32
        node = Layout(f"/{prefix}").new_node("n", owner)
        theirs = await outside.call(
            "create", node, b'{"i": "them", "m": {}}', ephemeral=True, sequence=True, makepath=True
        )
        zk = inner(backend)
        zk._unsure.add(("n", owner))  # as after a create whose reply was lost
        result = await backend.try_acquire("n", owner, 5, "me", {})
        assert isinstance(result, HolderInfo) and result.identity == "them"
        assert await outside.children(Layout(f"/{prefix}").name_node("n")) == [
            theirs.rsplit("/", 1)[1]
        ]
        await outside.call("delete", theirs)
        granted = await backend.try_acquire("n", owner, 5, "me", {})
        assert isinstance(granted, Grant)


# -- across processes -----------------------------------------------------------------------

#: A worker: takes the lock (queueing behind whoever holds it), appends its index to
#: the file, and releases.
WORKER = """
import sys, anyio, aiolease

async def main(url, prefix, index, out):
    async with aiolease.open_backend(url, prefix=prefix, session_timeout=1) as backend:
        async with aiolease.AsyncLock(backend, "queue", ttl=1):
            with open(out, "a") as f:
                f.write(f"{index}\\n")

anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
"""


async def test_waiters_in_other_processes_are_served_in_order_and_a_crashed_one_is_skipped(
    anyio_backend: str, zk_url: str, tmp_path: Path
) -> None:
    """Four processes queue behind a holder in a known order; the second is killed
    (SIGKILL) while it waits. The others get the lock in arrival order, and the
    queue does not stall on the dead one: ZooKeeper deletes its node once its session
    expires."""
    prefix = unique_prefix()
    out = tmp_path / "order"
    out.touch()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    name_node = Layout(f"/{prefix}").name_node("queue")
    with anyio.fail_after(2 * WAIT):  # a hang guard
        async with (
            aiolease.open_backend(zk_url, prefix=prefix) as backend,
            Outside(zk_url) as outside,
            anyio.create_task_group() as tg,
        ):
            # Held in a block (kept for the session's life), not a bare grant, which
            # the backend drops once its ttl passes unrenewed: four interpreters
            # starting on a loaded machine took longer than that.
            release = anyio.Event()

            async def hold(*, task_status: anyio.abc.TaskStatus[None]) -> None:
                async with AsyncLock(backend, "queue", ttl=5):
                    task_status.started()
                    await release.wait()

            await tg.start(hold)
            processes = []
            for index in range(4):
                process = await anyio.open_process(
                    [sys.executable, str(script), zk_url, prefix, str(index), str(out)],
                    cwd=REPO,
                )
                processes.append(process)

                async def queued(count: int = index + 2) -> bool:
                    return len(await outside.children(name_node)) >= count

                await eventually(queued, f"worker {index} queued", WAIT)
            processes[1].kill()
            await processes[1].wait()
            release.set()
            for index in (0, 2, 3):
                tg.start_soon(processes[index].wait)
    assert out.read_text().split() == ["0", "2", "3"]
    for process in processes:
        await process.aclose()
