"""The faults the harness injects, and the handles it injects them through.

=====================  =====================================================  ===============
fault                  what happens                                           applies to
=====================  =====================================================  ===============
``none``               nothing: the baseline                                  every backend
``sigstop``            ``SIGSTOP`` of the current holder for longer than the  every backend
                       ttl (a GC pause), then ``SIGCONT``
``sigkill``            ``SIGKILL`` of the current holder (a crash): it stays  every backend
                       dead, and the others must take over (a kill only
                       while three or more workers live, so that two still
                       contend)
``blackhole``          the holder's own proxy to the server swallows all      one-server URLs,
                       traffic for longer than the ttl, then passes again     and memory://
``server-restart``     the server is killed, then started again               servers that keep
                                                                              tokens
``etcd-leader-kill``   the etcd cluster's leader member is killed, then       an etcd cluster
                       restarted
=====================  =====================================================  ===============

``sigstop``, ``sigkill`` and ``blackhole`` first find the current holder through the
controller's own backend connection (``read(name).identity`` is
``safety-<pid>``), so that they hit the process that matters. A fault is always
undone (``SIGCONT``, pass, start) even when the run is cancelled meanwhile.
"""

from __future__ import annotations

import enum
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import anyio

from ..._exceptions import BackendError
from ...abc import Backend, HolderInfo

if TYPE_CHECKING:
    from ..etcd_cluster import EtcdCluster

__all__ = [
    "Aim",
    "CommandServerControl",
    "Cuttable",
    "Fault",
    "FaultEvent",
    "Injector",
    "ServerControl",
]


#: Where in a holder's body a fault lands (see :class:`Injector`).
Aim = Literal["any", "fresh"]
#: ``sigkill`` kills only while at least this many workers live.
KILL_WHILE = 3


class Fault(str, enum.Enum):
    """A kind of fault the harness can inject."""

    NONE = "none"
    SIGSTOP = "sigstop"
    SIGKILL = "sigkill"
    BLACKHOLE = "blackhole"
    SERVER_RESTART = "server-restart"
    ETCD_LEADER_KILL = "etcd-leader-kill"


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One injected fault, on ``time.monotonic()``.

    :param fault: what was done
    :param pid: the holder it was aimed at, if any
    :param begin: just before it started
    :param end: just after it was undone
    :param detail: e.g. the etcd member that was killed
    """

    fault: Fault
    pid: int | None
    begin: float
    end: float
    detail: str = ""


@runtime_checkable
class ServerControl(Protocol):
    """Kills and starts the server of a backend (``server-restart``)."""

    async def kill(self) -> None:
        """Kill the server abruptly (no clean shutdown) and wait until it is gone."""

    async def start(self) -> None:
        """Start the server again and wait until it accepts connections."""


class CommandServerControl:
    """A :class:`ServerControl` made of two shell commands.

    :param kill: e.g. ``"bash scripts/services.sh stop redis"``
    :param start: e.g. ``"bash scripts/services.sh start redis"``
    :param cwd: where to run them
    """

    def __init__(self, kill: str, start: str, cwd: str | None = None) -> None:
        self.kill_command = kill
        self.start_command = start
        self.cwd = cwd

    def __repr__(self) -> str:
        return f"<CommandServerControl kill={self.kill_command!r} start={self.start_command!r}>"

    async def kill(self) -> None:
        """Run the kill command. :raises subprocess.CalledProcessError: it failed"""
        await anyio.run_process(self.kill_command, cwd=self.cwd)

    async def start(self) -> None:
        """Run the start command. :raises subprocess.CalledProcessError: it failed"""
        await anyio.run_process(self.start_command, cwd=self.cwd)


class Cuttable(Protocol):
    """A worker's own fault proxy, as the injector needs it."""

    async def blackhole(self) -> None:
        """Swallow all traffic from now on (connections stay open, nothing arrives)."""

    async def restore(self) -> None:
        """Pass traffic again."""


def holder_pid(holder: HolderInfo | None, pids: Sequence[int]) -> int | None:
    """The pid of the worker ``holder`` names (identity ``safety-<pid>``), if it is ours."""
    if holder is None or not holder.identity.startswith("safety-"):
        return None
    try:
        pid = int(holder.identity.removeprefix("safety-"))
    except ValueError:
        return None
    return pid if pid in pids else None


class Injector:
    """Injects one kind of fault on a schedule until cancelled.

    :param fault: what to inject
    :param backend: the controller's own connection, to find the holder
    :param name: the contended lease name
    :param pids: the worker processes
    :param every: seconds between the end of one fault and the start of the next
    :param length: how long each fault lasts
    :param aim: ``any``: hit the holder whenever the fault is due, at any point of
        its body; ``fresh``: wait for the next grant and hit its holder at once (so
        that a body outlasting ``ttl`` is sure to lose its lease)
    :param started: tells whether the body of a grant (by token) has started; with
        ``fresh``, the fault waits for it
    :param proxies: each worker's proxy, for ``blackhole``
    :param server: for ``server-restart``
    :param cluster: for ``etcd-leader-kill``
    :param permits: the name is a semaphore's or a read-write lock's: its holder is
        the permit of most weight (a writer), the newest among equals
    """

    def __init__(
        self,
        fault: Fault,
        backend: Backend,
        name: str,
        pids: Sequence[int],
        *,
        every: float,
        length: float,
        aim: Aim = "any",
        started: Callable[[int], bool] | None = None,
        proxies: Mapping[int, Cuttable] | None = None,
        server: ServerControl | None = None,
        cluster: EtcdCluster | None = None,
        permits: bool = False,
    ) -> None:
        self.fault = fault
        self._permits = permits
        self.events: list[FaultEvent] = []
        self._backend = backend
        self._name = name
        self._pids = list(pids)
        self._every = every
        self._length = length
        self._aim = aim
        self._started = started
        self._proxies = dict(proxies or {})
        self._server = server
        self._cluster = cluster
        #: The workers killed (``sigkill``), and when.
        self.killed: dict[int, float] = {}

    async def run(self, last_start: float | None = None) -> None:
        """Inject a fault every ``every`` seconds until cancelled.

        :param last_start: start no fault after this ``time.monotonic()`` value (so
            that each fault ends while the workers still contend)
        """
        if self.fault is Fault.NONE:
            return
        while True:
            await anyio.sleep(self._every)
            if last_start is not None and time.monotonic() > last_start:
                return
            await self.inject_once()

    async def find_holder(self) -> int:
        """Wait until one of the workers holds the name; return its pid.

        Aiming at ``fresh`` grants, wait for the next grant after the current one.
        """
        before: int | None = None  # the token held when we started looking
        seen: HolderInfo | None = None
        looked = False
        while True:
            try:
                seen = await self._read()
            except BackendError:
                await anyio.sleep(0.05)  # the server may be restarting
                continue
            token = None if seen is None else seen.token
            if not looked:
                before, looked = token, True
            pid = holder_pid(seen, self._pids)
            if pid is not None and self._aim == "any":
                return pid
            if pid is not None and token is not None and token != before:
                await self._wait_started(token)
                return pid
            if self._permits:  # no change feed covers every permit: poll
                await anyio.sleep(0.01)
                continue
            with anyio.move_on_after(self._length):
                try:
                    await self._backend.wait_changed(self._name, seen)
                except BackendError:
                    await anyio.sleep(0.05)

    async def _read(self) -> HolderInfo | None:
        """The holder of the name (of permits: the one of most weight, newest first)."""
        if not self._permits:
            return await self._backend.read(self._name)
        permits = await self._backend.read_permits(self._name)
        if permits is None or not permits.holders:
            return None
        pairs = zip(permits.weights, permits.holders, strict=True)
        return max(pairs, key=lambda p: (p[0], p[1].token))[1]

    async def _wait_started(self, token: int) -> None:
        """Wait (polling) until the body of grant ``token`` has registered with the fence.

        The controller may see a grant before its holder has the reply (and a
        blackhole would then cut the reply off, not the holder); the fence is where
        a body shows that it started. Gives up after a ttl: the grant never made it.
        """
        if self._started is None:
            return
        with anyio.move_on_after(self._length):
            while not self._started(token):  # noqa: ASYNC110 - another process's file
                await anyio.sleep(0.005)

    async def inject_once(self) -> None:
        """Inject one fault (on the current holder where that matters) and undo it."""
        if self.fault is Fault.SERVER_RESTART:
            assert self._server is not None
            await self._window(None, self._server.kill, self._server.start)
            return
        if self.fault is Fault.ETCD_LEADER_KILL:
            await self._kill_etcd_leader()
            return
        if self.fault is Fault.SIGKILL and len(self._pids) < KILL_WHILE:
            return  # a kill now would leave fewer than two to contend
        pid = await self.find_holder()
        if self.fault in (Fault.SIGKILL, Fault.SIGSTOP):
            started = time.monotonic()
            kill = self.fault is Fault.SIGKILL
            if not _signalled(pid, signal.SIGKILL if kill else signal.SIGSTOP):
                return  # it has just exited: nothing was injected
            if kill:
                # Not reaped yet, a dead worker could still be "killed": aim at it no more.
                self._pids.remove(pid)
                self.killed[pid] = started
            undo = _nothing if kill else _signaller(pid, signal.SIGCONT)
            await self._window(pid, _nothing, undo, started=started)
        elif self.fault is Fault.BLACKHOLE:
            proxy = self._proxies[pid]
            await self._window(pid, proxy.blackhole, proxy.restore)

    async def _window(
        self,
        pid: int | None,
        begin: Callable[[], Awaitable[None]],
        end: Callable[[], Awaitable[None]],
        *,
        started: float | None = None,
    ) -> None:
        """Run ``begin``, wait the fault's length, run ``end`` (always), record the event."""
        started = time.monotonic() if started is None else started
        try:
            await begin()
            await anyio.sleep(self._length)
        finally:
            with anyio.CancelScope(shield=True):
                await end()
                self.events.append(FaultEvent(self.fault, pid, started, time.monotonic()))

    async def _kill_etcd_leader(self) -> None:
        assert self._cluster is not None
        cluster = self._cluster
        started = time.monotonic()
        member = await cluster.kill_leader()
        try:
            await anyio.sleep(self._length)
        finally:
            with anyio.CancelScope(shield=True):
                await cluster.restart(member)
                self.events.append(
                    FaultEvent(self.fault, None, started, time.monotonic(), member.name)
                )


async def _nothing() -> None:
    pass


def _signalled(pid: int, signum: signal.Signals) -> bool:
    """Send ``signum`` to ``pid``; whether it was still there to get it."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def _signaller(pid: int, signum: signal.Signals) -> Callable[[], Awaitable[None]]:
    async def send() -> None:
        _signalled(pid, signum)  # gone: nothing left to undo

    return send
