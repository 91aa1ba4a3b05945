"""Helpers for the ZooKeeper tests: opening backends, and the server seen from outside
(through kazoo, in a worker thread, so that it works under asyncio and trio alike)."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import anyio

from aiolease.abc import Backend
from aiolease.backends.zookeeper import ZooKeeperBackend
from aiolease.backends.zookeeper._url import parse_url
from aiolease.testing.pytest_plugin import server_missing
from aiolease.testing.servers import server, services_dir
from tests import support
from tests.support import Opener, prefixed_opener

REPO = Path(__file__).resolve().parents[3]


def unique_prefix() -> str:
    return f"aiolease-test/{uuid.uuid4().hex[:12]}"


def inner(backend: Backend) -> ZooKeeperBackend:
    """The :class:`ZooKeeperBackend` behind ``backend`` (a bridge under trio)."""
    return support.inner(backend, ZooKeeperBackend)


def opener(url: str, **options: Any) -> Opener:
    """Opens backends on ``url`` under one fresh prefix (``.prefix``)."""
    return prefixed_opener(url, options.pop("prefix", unique_prefix()), **options)


class Outside:
    """A kazoo client of its own on ``url``'s servers: the server seen from outside."""

    def __init__(self, url: str) -> None:
        from kazoo.client import KazooClient

        parsed = parse_url(url, {})
        self.chroot = parsed.chroot
        self.client = KazooClient(parsed.connect_string(), timeout=10)

    async def __aenter__(self) -> Outside:
        await anyio.to_thread.run_sync(self.client.start, 10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await anyio.to_thread.run_sync(self._stop)

    def _stop(self) -> None:
        self.client.stop()
        self.client.close()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.client, method)
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    async def children(self, path: str) -> list[str]:
        """The children of ``path`` (under the chroot), ``[]`` if it does not exist."""
        from kazoo.exceptions import NoNodeError

        try:
            found: list[str] = await self.call("get_children", self.chroot + path)
        except NoNodeError:
            return []
        return found

    async def tree(self, path: str) -> list[str]:
        """Every contender node under ``path`` (the prefix): ``<name node>/<node>``."""
        found = []
        for name_node in await self.children(path):
            for node in await self.children(f"{path}/{name_node}"):
                found.append(f"{name_node}/{node}")
        return found


async def four_letters(host: str, port: int, word: str) -> str:
    """A ZooKeeper server's answer to a four-letter command (``""``: no answer)."""
    try:
        with anyio.fail_after(5):
            async with await anyio.connect_tcp(host, port) as stream:
                await stream.send(word.encode())
                chunks = []
                try:
                    while True:
                        chunks.append(await stream.receive())
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    pass
    except (OSError, TimeoutError, anyio.BrokenResourceError):
        return ""  # refused, or reset by a member that is dying
    return b"".join(chunks).decode(errors="replace")


class Ensemble:
    """Kills members of the ``zookeeper-ensemble`` service of ``scripts/services.sh``
    (SIGKILL: no clean shutdown), and starts them again on their data: a
    :class:`~aiolease.testing.safety.ServerControl`.

    :param which: ``"leader"`` (the member that leads when the fault comes) or ``"all"``
    """

    SERVICE = "zookeeper-ensemble"

    def __init__(self, which: str) -> None:
        self.which = which
        self.kills = 0
        self.killed: list[int] = []

    @staticmethod
    def pidfile(member: int) -> Path:
        return services_dir() / Ensemble.SERVICE / f"z{member}" / "zookeeper.pid"

    def members(self) -> list[tuple[int, tuple[str, int]]]:
        addresses = server(self.SERVICE).addresses
        return [(i + 1, address) for i, address in enumerate(addresses)]

    async def leader(self) -> int | None:
        for member, (host, port) in self.members():
            if "Mode: leader" in await four_letters(host, port, "srvr"):
                return member
        return None

    async def kill(self) -> None:
        if self.which == "leader":
            leader = await self.leader()
            doomed = [] if leader is None else [leader]
        else:
            doomed = [member for member, _ in self.members()]
        for member in doomed:
            path = self.pidfile(member)
            if not path.exists():
                server_missing(f"{self.SERVICE} was not started by services.sh (no {path})")
            os.kill(int(path.read_text()), signal.SIGKILL)
            self.kills += 1
        addresses = dict(self.members())
        for member in doomed:
            # Not our child: its exit cannot be awaited; wait until its port is closed.
            while await four_letters(*addresses[member], "ruok") == "imok":  # noqa: ASYNC110
                await anyio.sleep(0.01)
        self.killed = doomed

    async def start(self) -> None:
        await anyio.run_process(
            ["bash", "scripts/services.sh", "start", self.SERVICE],
            cwd=REPO,
            stderr=subprocess.PIPE,
        )

    async def wait_ready(self) -> None:
        """Until every member serves and one leads (``services.sh start`` waits so)."""
        await self.start()
