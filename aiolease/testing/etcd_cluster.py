"""Kill and restart members of the test etcd cluster, for the safety tests.

``bash scripts/services.sh start etcd-cluster`` runs three etcd members (``m0``,
``m1``, ``m2``) and keeps each one's pidfile in
``$AIOLEASE_SERVICES_DIR/etcd-cluster/<name>/etcd.pid``. :class:`EtcdCluster`
asks the members who leads through etcd's HTTP/JSON gateway, kills a member with
``SIGKILL`` (a crash, not a clean shutdown) and restarts it through
``services.sh``, which keeps its data dir so that it rejoins the cluster::

    cluster = EtcdCluster()
    await cluster.wait_healthy()
    old = await cluster.kill_leader()
    new = await cluster.wait_leader(excluding=old)   # elected among the other two
    await cluster.put("k", "v")
    await cluster.restart(old)                       # three healthy members again

Only members that ``services.sh`` started can be killed: a member without a
pidfile, or whose pid is no longer an etcd, raises :class:`EtcdClusterError`.
Works under asyncio and trio (anyio sockets and subprocesses only).
"""

from __future__ import annotations

import base64
import json
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from .servers import services_dir

__all__ = [
    "DEFAULT_ENDPOINTS",
    "ClusterTimeout",
    "EtcdCluster",
    "EtcdClusterError",
    "Member",
    "default_state_dir",
]

#: The client addresses of ``services.sh``'s etcd-cluster (see :mod:`.servers`).
DEFAULT_ENDPOINTS: tuple[str, ...] = ("127.0.0.1:23790", "127.0.0.1:23791", "127.0.0.1:23792")
#: Between two looks at the cluster while waiting for it (it has no push API for this).
POLL_INTERVAL = 0.1

_REPO = Path(__file__).resolve().parents[2]


class EtcdClusterError(Exception):
    """A member could not be found, killed or restarted, or a member answered with an error."""


class ClusterTimeout(EtcdClusterError, TimeoutError):
    """The cluster did not reach the awaited state in time; the message says what was missing."""


@dataclass(frozen=True)
class Member:
    """One etcd member, as :meth:`EtcdCluster.members` finds it.

    :param name: its ``--name`` (``m0``, ``m1``, ``m2``)
    :param client_url: its first advertised client URL, e.g. ``http://127.0.0.1:23790``
    :param pidfile: where ``services.sh`` keeps its pid
    """

    name: str
    client_url: str
    pidfile: Path

    @property
    def endpoint(self) -> str:
        """``host:port`` of :attr:`client_url`."""
        return self.client_url.partition("://")[2].rstrip("/")


def default_state_dir() -> Path:
    """``etcd-cluster`` under :func:`aiolease.testing.servers.services_dir`."""
    return services_dir() / "etcd-cluster"


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class EtcdCluster:
    """The etcd cluster of the test suite, seen from outside.

    :param endpoints: every member's client address, ``host:port``
    :param state_dir: the directory with one ``<member>/etcd.pid`` per member
        (default: :func:`default_state_dir`)
    :param services_sh: the script that (re)starts members (default: the repo's
        ``scripts/services.sh``)
    :param request_timeout: how long one HTTP request to a member may take
    """

    def __init__(
        self,
        endpoints: Sequence[str] = DEFAULT_ENDPOINTS,
        state_dir: Path | None = None,
        *,
        services_sh: Path | None = None,
        request_timeout: float = 2.0,
    ) -> None:
        if not endpoints:
            raise ValueError("an etcd cluster needs at least one endpoint")
        self.endpoints = tuple(endpoints)
        for endpoint in self.endpoints:
            _split_endpoint(endpoint)
        self.state_dir = state_dir if state_dir is not None else default_state_dir()
        self.services_sh = services_sh or _REPO / "scripts" / "services.sh"
        self.request_timeout = request_timeout

    def __repr__(self) -> str:
        return f"<EtcdCluster {','.join(self.endpoints)} state_dir={str(self.state_dir)!r}>"

    async def _post(self, endpoint: str, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``body`` as JSON to the gateway at ``endpoint``; the decoded JSON answer.

        :raises EtcdClusterError: unreachable, too slow, or not ``200 OK`` (e.g. no leader)
        """
        host, port = _split_endpoint(endpoint)
        payload = json.dumps(body).encode()
        # HTTP/1.0: the member closes the connection after the answer, which ends it.
        head = f"POST {path} HTTP/1.0\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        request = f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload
        chunks: list[bytes] = []
        try:
            with anyio.fail_after(self.request_timeout):
                async with await anyio.connect_tcp(host, port) as stream:
                    await stream.send(request)
                    try:
                        while True:
                            chunks.append(await stream.receive())
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        pass
        except (OSError, TimeoutError) as exc:
            raise EtcdClusterError(f"etcd member {endpoint}: {path} failed: {exc!r}") from exc
        status_line, _, rest = b"".join(chunks).partition(b"\r\n")
        answer = rest.partition(b"\r\n\r\n")[2]
        if status_line.split(b" ")[1:2] != [b"200"]:
            detail = status_line.decode(errors="replace"), answer.decode(errors="replace")
            raise EtcdClusterError(f"etcd member {endpoint}: {path} answered {detail}")
        decoded: dict[str, Any] = json.loads(answer)
        return decoded

    async def _post_any(
        self, path: str, body: Mapping[str, Any], member: Member | None = None
    ) -> dict[str, Any]:
        """:meth:`_post` to ``member``, or else to the first endpoint that answers."""
        if member is not None:
            return await self._post(member.endpoint, path, body)
        problems = []
        for endpoint in self.endpoints:
            try:
                return await self._post(endpoint, path, body)
            except EtcdClusterError as exc:
                problems.append(str(exc))
        raise EtcdClusterError("no etcd member answered: " + "; ".join(problems))

    async def _member_records(self) -> list[dict[str, Any]]:
        """The member list from the first endpoint that answers."""
        found = await self._post_any("/v3/cluster/member/list", {})
        records: list[dict[str, Any]] = found.get("members", [])
        return records

    def _member(self, record: Mapping[str, Any]) -> Member:
        name = str(record.get("name", ""))
        urls = record.get("clientURLs") or [""]
        return Member(name, str(urls[0]), self.state_dir / name / "etcd.pid")

    async def members(self) -> list[Member]:
        """The started members (a member added but never started has no name yet).

        :raises EtcdClusterError: no endpoint answered
        """
        records = await self._member_records()
        return [self._member(r) for r in records if r.get("name")]

    async def _leader_once(self, excluding: Member | None = None) -> Member:
        """The leader that every answering member agrees on (and that answers itself)."""
        by_id = {str(r["ID"]): self._member(r) for r in await self._member_records()}
        claims: dict[str, str] = {}
        for endpoint in self.endpoints:
            try:
                status = await self._post(endpoint, "/v3/maintenance/status", {})
            except EtcdClusterError:
                continue
            claims[str(status["header"]["member_id"])] = str(status.get("leader", "0"))
        leaders = set(claims.values())
        if len(leaders) != 1 or "0" in leaders:
            raise EtcdClusterError(f"the members do not agree on a leader: {claims}")
        (leader_id,) = leaders
        if leader_id not in claims or leader_id not in by_id:
            raise EtcdClusterError(f"leader {leader_id} does not answer itself: {claims}")
        leader = by_id[leader_id]
        if leader == excluding:
            raise EtcdClusterError(f"{leader.name} still leads")
        return leader

    async def leader(self) -> Member:
        """The current leader, as the members that answer agree.

        :raises EtcdClusterError: no leader, or the members disagree (an election runs)
        """
        return await self._leader_once()

    async def _wait(self, what: str, timeout: float, excluding: Member | None = None) -> Member:
        """Poll until the members agree on a leader (and, for ``"healthy"``, all are)."""
        problem = "not checked yet"
        with anyio.move_on_after(timeout):
            while True:
                try:
                    if what == "healthy":
                        await self._check_all_healthy()
                    return await self._leader_once(excluding)
                except (EtcdClusterError, KeyError, ValueError) as exc:
                    problem = str(exc) or repr(exc)
                await anyio.sleep(POLL_INTERVAL)
        raise ClusterTimeout(
            f"etcd cluster {self.endpoints} not {what} after {timeout}s: {problem}"
        )

    async def _check_all_healthy(self) -> None:
        """Every endpoint answers a quorum read (as ``etcdctl endpoint health`` does) and
        the member list holds one started member per endpoint."""
        for endpoint in self.endpoints:
            await self._post(endpoint, "/v3/kv/range", {"key": _b64("health")})
        records = await self._member_records()
        started = [r for r in records if r.get("name")]
        if len(started) != len(records) or len(records) != len(self.endpoints):
            names = [r.get("name") or "(unstarted)" for r in records]
            raise EtcdClusterError(f"members are {names}, expected {len(self.endpoints)} started")

    async def wait_healthy(self, timeout: float = 30) -> Member:
        """Wait until every member answers a quorum read and all agree on one leader.

        :return: the leader
        :raises ClusterTimeout: naming what was still missing
        """
        return await self._wait("healthy", timeout)

    async def wait_leader(self, timeout: float = 30, *, excluding: Member | None = None) -> Member:
        """Wait until the members that answer agree on a leader other than ``excluding``.

        :return: the leader
        :raises ClusterTimeout: naming what was still missing
        """
        return await self._wait("led", timeout, excluding)

    def _pidfd(self, member: Member) -> int:
        """A pidfd for the process in ``member``'s pidfile, checked to be a live etcd.

        The pidfd pins the process, so a pid reused after the check is never signalled.

        :raises EtcdClusterError: no pidfile, or its pid is not a running etcd
        """
        try:
            pid = int(member.pidfile.read_text().strip())
        except FileNotFoundError:
            raise EtcdClusterError(
                f"no pidfile {member.pidfile} for etcd member {member.name}: the cluster was not "
                f"started by `bash scripts/services.sh start etcd-cluster` (or not with this "
                f"AIOLEASE_SERVICES_DIR), so its members cannot be killed from here"
            ) from None
        except ValueError:
            raise EtcdClusterError(f"pidfile {member.pidfile} does not hold a pid") from None
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = -1
        if pidfd < 0 or not _is_etcd(pid):
            if pidfd >= 0:
                os.close(pidfd)
            raise EtcdClusterError(
                f"pid {pid} from {member.pidfile} is not a running etcd (stale pidfile?); "
                f"restart the cluster with `bash scripts/services.sh start etcd-cluster`"
            )
        return pidfd

    async def kill(self, member: Member, timeout: float = 10) -> None:
        """``SIGKILL`` ``member`` and wait until its process has exited.

        :raises EtcdClusterError: no pidfile, or its pid is not a running etcd
        :raises ClusterTimeout: the process outlived ``timeout``
        """
        pidfd = self._pidfd(member)
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            # A pidfd turns readable when its process exits (a zombie has exited).
            with anyio.move_on_after(timeout):
                await anyio.wait_readable(pidfd)
                return
        finally:
            os.close(pidfd)
        raise ClusterTimeout(f"etcd member {member.name} survived SIGKILL for {timeout}s")

    async def kill_leader(self, timeout: float = 30) -> Member:
        """Kill the current leader (see :meth:`kill`), once the members agree on one that
        answers (a member restarted a moment ago may not answer yet).

        :return: the member that was killed
        :raises ClusterTimeout: no agreed, answering leader within ``timeout``
        """
        leader = await self._wait("led", timeout)
        await self.kill(leader)
        return leader

    async def restart(self, member: Member, timeout: float = 90) -> Member:
        """Start ``member`` again (and any other member that is down) and wait until healthy.

        Runs ``bash scripts/services.sh start etcd-cluster``, which keeps the data
        dirs: a killed member restarts from its log and rejoins.

        :return: the leader once the cluster is healthy
        :raises EtcdClusterError: ``services.sh`` failed (its output is in the message)
        :raises ClusterTimeout: not healthy within ``timeout``
        """
        env = {**os.environ, "AIOLEASE_SERVICES_DIR": str(self.state_dir.parent)}
        command = ["bash", str(self.services_sh), "start", "etcd-cluster"]
        with anyio.fail_after(timeout):
            done = await anyio.run_process(command, env=env, check=False)
        if done.returncode != 0:
            output = done.stderr.decode(errors="replace")[-2000:]
            raise EtcdClusterError(
                f"{' '.join(command)} failed restarting {member.name}:\n{output}"
            )
        return await self.wait_healthy(timeout)

    async def put(self, key: str, value: str, *, member: Member | None = None) -> int:
        """Write ``key`` through ``member`` (default: the first endpoint that answers).

        :return: the revision of the write
        :raises EtcdClusterError: the write failed (e.g. no leader yet)
        """
        body = {"key": _b64(key), "value": _b64(value)}
        answer = await self._post_any("/v3/kv/put", body, member)
        return int(answer["header"]["revision"])

    async def get(
        self, key: str, *, member: Member | None = None, local: bool = False
    ) -> str | None:
        """Read ``key`` through ``member`` (default: the first endpoint that answers): a
        quorum read, or that member's own copy when ``local``.

        :return: the value, or ``None`` when the key does not exist
        :raises EtcdClusterError: the read failed
        """
        body = {"key": _b64(key), "serializable": local}
        kvs = (await self._post_any("/v3/kv/range", body, member)).get("kvs", [])
        return base64.b64decode(kvs[0]["value"]).decode() if kvs else None


def _is_etcd(pid: int) -> bool:
    """``pid`` runs an etcd that has not exited (a zombie has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    comm, _, fields = stat.partition("(")[2].rpartition(")")
    return comm == "etcd" and fields.split()[0] not in {"Z", "X"}
