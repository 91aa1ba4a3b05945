"""``aiolease demo``: three candidate processes elect a leader; the leader is crashed.

Each candidate is a separate OS process (``python -m aiolease _candidate``) that
reports its terms as JSON lines on stdout. The demo SIGKILLs the leader (a real
crash: no release, no goodbye), measures how long the others take to elect a new
leader, checks that fencing tokens only increase, restarts the crashed candidate,
and does that three times.

No candidate outlives the demo: each reads its stdin, a pipe from the demo, and
exits when that pipe closes, which happens even if the demo itself is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio import CancelScope
from anyio.abc import Process, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._elector import Elector
from .._exceptions import InvalidArgument, LossReason
from .._lease import Lease
from .._registry import open_backend
from .._urls import redact
from ..abc import Backend, Capability
from ._process import say, start_child
from ._where import ENV_URL, sqlite_url

IDENTITIES = ("candidate-a", "candidate-b", "candidate-c")
CRASHES = 3
#: Seconds the three processes get to start and elect the first leader.
STARTUP_LIMIT = 15.0


# -- one candidate (runs in its own process) ----------------------------------------------


def emit(event: str, **fields: Any) -> None:
    """Report one event to the demo as a JSON line on stdout."""
    print(json.dumps({"event": event, **fields}), flush=True)


async def _cancel_at_eof(scope: CancelScope) -> None:
    fd = sys.stdin.fileno()
    while True:
        await anyio.wait_readable(fd)
        if not os.read(fd, 4096):
            scope.cancel()
            return


async def _until_eof(fn: Callable[[], Awaitable[int]]) -> int:
    """Run ``fn()`` until it returns or stdin reaches end-of-file (the demo went away)."""
    outcome: list[int] = []
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_at_eof, tg.cancel_scope)
        try:
            outcome.append(await fn())
        except Exception as exc:  # re-raised below, not wrapped in an exception group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return outcome[0] if outcome else 0


async def run_candidate(args: argparse.Namespace, backend: Backend) -> int:
    """Campaign for ``args.name`` forever, reporting terms on stdout, until stdin closes."""

    def defeated(reason: LossReason) -> None:
        emit("lost", reason=reason.value)

    elector = Elector(
        backend, args.name, ttl=args.ttl, identity=args.identity, on_defeated=defeated
    )

    async def term(lease: Lease) -> int:
        emit("elected", token=lease.token)
        await anyio.sleep_forever()
        return 0

    async def campaign() -> int:
        emit("campaigning", pid=os.getpid())
        return await elector.run(term)

    return await _until_eof(campaign)


# -- the orchestration --------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One line a candidate reported."""

    identity: str
    pid: int
    kind: str
    token: int | None
    reason: str | None


class DemoFailed(Exception):
    """A failover did not happen in time, or a token did not increase."""


class Demo:
    """Three candidate processes on one backend URL, and the crash rounds."""

    def __init__(self, url: str, name: str, ttl: float, verbose: int) -> None:
        self.url = url
        self.name = name
        self.ttl = ttl
        self.verbose = verbose
        self.t0 = anyio.current_time()
        self.processes: dict[str, Process] = {}
        #: Who leads by its own reports (terms not yet reported lost, crashed or stopped).
        self.leading: dict[str, int | None] = {}
        self.overlaps: list[str] = []
        self._send: MemoryObjectSendStream[Event]
        self._receive: MemoryObjectReceiveStream[Event]
        self._send, self._receive = anyio.create_memory_object_stream[Event](100)

    def log(self, message: str) -> None:
        """Print one line, stamped with the seconds since the demo started."""
        print(f"[{anyio.current_time() - self.t0:5.2f}s] {message}", flush=True)

    def _argv(self, identity: str) -> list[str]:
        # The URL goes in the environment, not on the command line, where ``ps`` would
        # show its password to every user of the machine.
        argv = [sys.executable, "-m", "aiolease", "_candidate", self.name]
        argv += ["--ttl", repr(self.ttl), "--identity", identity]
        return argv + ["-v"] * self.verbose

    async def spawn(self, tg: TaskGroup, identity: str) -> None:
        """Start the candidate process for ``identity`` and follow its reports."""
        process = await start_child(
            self._argv(identity),
            env={**os.environ, ENV_URL: self.url},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            start_new_session=True,  # Ctrl-C reaches the demo only; it stops them in order
        )
        self.processes[identity] = process
        tg.start_soon(self._follow, identity, process)

    async def _follow(self, identity: str, process: Process) -> None:
        assert process.stdout is not None
        lines = BufferedByteReceiveStream(process.stdout)
        while True:
            try:
                line = await lines.receive_until(b"\n", 65536)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
                break
            event = self._parse(identity, process.pid, line)
            if event is not None:
                self._show(event)
                self._track(event)
                await self._send.send(event)
        if self.processes.get(identity, process) is process:  # not yet replaced by a restart
            self.leading.pop(identity, None)

    def _parse(self, identity: str, pid: int, line: bytes) -> Event | None:
        try:
            data = json.loads(line)
            return Event(identity, pid, str(data["event"]), data.get("token"), data.get("reason"))
        except (ValueError, KeyError, TypeError):
            self.log(f"{identity}: unexpected output {line!r}")
            return None

    def _show(self, event: Event) -> None:
        if event.kind == "campaigning":
            self.log(f"{event.identity} (pid {event.pid}) is campaigning")
        elif event.kind == "elected":
            self.log(f"{event.identity} is leader (token {event.token})")
        elif event.kind == "lost":
            self.log(f"{event.identity} lost leadership ({event.reason})")

    def _track(self, event: Event) -> None:
        if event.kind == "lost":
            self.leading.pop(event.identity, None)
        elif event.kind == "elected":
            for other, token in self.leading.items():
                if other != event.identity:
                    self.overlaps.append(
                        f"{event.identity} (token {event.token}) was elected while {other} "
                        f"(token {token}) still led"
                    )
            self.leading[event.identity] = event.token

    async def next_leader(self, limit: float) -> Event:
        """The next ``elected`` report.

        :raises DemoFailed: none within ``limit`` seconds
        """
        with anyio.move_on_after(limit):
            async for event in self._receive:
                if event.kind == "elected":
                    return event
        raise DemoFailed(f"no leader was elected within {limit:g}s")

    def latest_leader(self, leader: Event) -> Event:
        """``leader``, or a later ``elected`` report already waiting."""
        while True:
            try:
                event = self._receive.receive_nowait()
            except anyio.WouldBlock:
                return leader
            if event.kind == "elected":
                leader = event

    async def crash(self, identity: str) -> None:
        """SIGKILL ``identity``'s process: it cannot release or say goodbye."""
        process = self.processes.pop(identity)
        self.leading.pop(identity, None)
        process.kill()
        await process.wait()
        self.log(f"SIGKILL {identity} (pid {process.pid}), the leader")

    async def shutdown(self) -> None:
        """Stop every candidate: end-of-file first (they resign), SIGKILL if they linger."""
        processes, self.processes = list(self.processes.values()), {}
        for process in processes:
            if process.stdin is not None:
                await process.stdin.aclose()
        with anyio.move_on_after(max(self.ttl, 2.0)):
            for process in processes:
                await process.wait()
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()

    async def rounds(self, tg: TaskGroup) -> list[float]:
        """Elect, then crash the leader :data:`CRASHES` times.

        :returns: the measured failover times
        :raises DemoFailed: a failover did not happen, or a token did not increase
        """
        for identity in IDENTITIES:
            await self.spawn(tg, identity)
        leader = await self.next_leader(STARTUP_LIMIT)
        tokens = [leader.token or 0]
        failovers: list[float] = []
        crashed: str | None = None
        for _ in range(CRASHES):
            if crashed is not None:
                await self.spawn(tg, crashed)  # back from the crash of the last round
            # Pacing for the reader: let the leader lead (and renew) for a while.
            await anyio.sleep(self.ttl / 2)
            crashed = self.latest_leader(leader).identity
            await self.crash(crashed)
            crashed_at = anyio.current_time()
            leader = await self.next_leader(3 * self.ttl + 2)
            failovers.append(anyio.current_time() - crashed_at)
            self.log(f"failover took {failovers[-1]:.2f}s (ttl {self.ttl:g}s)")
            if leader.token is None or leader.token <= tokens[-1]:
                raise DemoFailed(f"token did not increase: {tokens[-1]} then {leader.token}")
            tokens.append(leader.token)
            if self.overlaps:
                raise DemoFailed("; ".join(self.overlaps))
        self.log("tokens: " + " < ".join(map(str, tokens)))
        return failovers

    async def run(self) -> int:
        """Run the crash rounds and stop every process on the way out."""
        print(
            f"aiolease demo: 3 processes elect a leader for {self.name!r} on {redact(self.url)}, "
            f"ttl {self.ttl:g}s; the leader is SIGKILLed {CRASHES} times",
            flush=True,
        )
        failure: DemoFailed | None = None
        failovers: list[float] = []
        async with anyio.create_task_group() as tg:
            try:
                failovers = await self.rounds(tg)
            except DemoFailed as exc:  # reported below, not wrapped in an exception group
                failure = exc
            finally:
                with anyio.CancelScope(shield=True):
                    await self.shutdown()
            tg.cancel_scope.cancel()
        if failure is not None:
            say(f"error: demo failed: {failure}")
            return 1
        print(
            f"OK: {CRASHES} crashes, {CRASHES} failovers, slowest {max(failovers):.2f}s "
            f"with ttl {self.ttl:g}s; fencing tokens always increased",
            flush=True,
        )
        return 0


async def check_multi_process(url: str) -> None:
    """Open the backend once, to ask it (its capabilities may depend on its mode).

    :raises InvalidArgument: the backend cannot be shared by several processes
    """
    async with open_backend(url) as backend:
        shared = Capability.MULTI_PROCESS in backend.capabilities
    if not shared:
        raise InvalidArgument(
            f"the demo runs several processes; {redact(url)!r} cannot be shared by them"
        )


async def run_demo(args: argparse.Namespace) -> int:
    """``aiolease demo``: on ``--backend``, or a fresh SQLite file in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="aiolease-demo-") as tmp:
        url = args.backend or sqlite_url(Path(tmp) / "leases.db")
        await check_multi_process(url)
        name = "demo" if args.backend is None else f"aiolease-demo-{os.getpid()}"
        return await Demo(url, name, args.ttl, args.verbose).run()
