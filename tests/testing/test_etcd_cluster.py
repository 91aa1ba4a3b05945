"""The etcd-cluster fault controller against the real 3-member cluster of services.sh.

Killing the leader must leave a working cluster (a new leader among the other two
that takes writes), and restarting the killed member must bring back three
healthy members, the restarted one holding the writes it missed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from aiolease.testing.etcd_cluster import EtcdCluster, EtcdClusterError, Member
from aiolease.testing.servers import server

pytestmark = pytest.mark.anyio

#: Bound on each wait for the cluster; elections take ~1-2 s, the machine is shared.
WAIT = 30


@pytest.fixture
def endpoints(aiolease_server: Callable[[str], str]) -> list[str]:
    """The etcd-cluster's client addresses, checked reachable."""
    aiolease_server("etcd-cluster")
    return [f"{host}:{port}" for host, port in server("etcd-cluster").addresses]


async def put_eventually(cluster: EtcdCluster, key: str, value: str) -> int:
    """Write until a member takes it: the first write may race the end of an election."""
    problem: Exception | None = None
    with anyio.move_on_after(WAIT):
        while True:
            try:
                return await cluster.put(key, value)
            except EtcdClusterError as exc:
                problem = exc
            await anyio.sleep(0.1)
    pytest.fail(f"no write succeeded within {WAIT}s: {problem}")


async def test_killing_the_leader_elects_another_and_restart_rejoins(endpoints: list[str]) -> None:
    cluster = EtcdCluster(endpoints)
    await cluster.wait_healthy(WAIT)
    names = sorted(m.name for m in await cluster.members())
    killed = await cluster.kill_leader()
    try:
        with pytest.raises(EtcdClusterError):
            await cluster.get("any", member=killed, local=True)

        new_leader = await cluster.wait_leader(WAIT, excluding=killed)
        assert new_leader != killed
        assert new_leader.name in names

        key, value = f"aiolease-test/failover/{uuid.uuid4()}", "written without the old leader"
        await put_eventually(cluster, key, value)
        assert await cluster.get(key) == value
    finally:
        with anyio.CancelScope(shield=True):
            await cluster.restart(killed, WAIT)

    await cluster.wait_healthy(WAIT)
    assert sorted(m.name for m in await cluster.members()) == names
    # wait_healthy made a quorum read through every member, which waits until that
    # member has applied everything committed before it: the write is there locally.
    assert await cluster.get(key, member=killed, local=True) == value


async def test_kill_refuses_a_member_without_pidfile(endpoints: list[str], tmp_path: Path) -> None:
    cluster = EtcdCluster(endpoints, state_dir=tmp_path)
    leader = await cluster.wait_healthy(WAIT)
    assert leader.pidfile == tmp_path / leader.name / "etcd.pid"
    with pytest.raises(EtcdClusterError, match="no pidfile .*services.sh start etcd-cluster"):
        await cluster.kill(leader)


async def test_kill_refuses_a_pid_that_is_not_etcd(tmp_path: Path) -> None:
    cluster = EtcdCluster(state_dir=tmp_path)
    member = Member("m0", "http://127.0.0.1:23790", tmp_path / "m0" / "etcd.pid")
    member.pidfile.parent.mkdir()
    member.pidfile.write_text(f"{os.getpid()}\n")  # a stale pidfile whose pid was reused
    with pytest.raises(EtcdClusterError, match="is not a running etcd"):
        await cluster.kill(member)


def test_endpoints_are_validated() -> None:
    with pytest.raises(ValueError, match="host:port"):
        EtcdCluster(["127.0.0.1"])
    with pytest.raises(ValueError, match="at least one"):
        EtcdCluster([])
