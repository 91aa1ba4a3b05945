"""The ``aiolease`` command in-process, with fault injection: status, timeouts, exit codes,
loss and cancellation, elect, arguments (the real processes: test_cli_processes.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import cast

import anyio
import pytest
from anyio.abc import SocketListener, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from aiolease import AsyncLock, AsyncReadWriteLock, AsyncSemaphore
from aiolease._cli._where import default_url, sqlite_url, state_dir
from aiolease.backends.memory import MemoryBackend
from aiolease.cli import EXIT_LOST, EXIT_TIMEOUT, EXIT_USAGE, main, run
from aiolease.testing.faults import FaultyBackend

PY = sys.executable

#: A child that reports to the test over TCP: "ready" once its SIGTERM handler is
#: in place, "term" on SIGTERM (then exits, unless told to ignore it), and exits
#: with status N when the test sends "exit N".
CHILD = r"""
import signal, socket, sys
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def on_term(signum, frame):
    conn.sendall(b"term\n")
    if sys.argv[2] == "obey":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
conn.sendall(b"ready\n")
data = b""
while not data.endswith(b"\n"):
    chunk = conn.recv(100)
    if not chunk:
        sys.exit(0)
    data += chunk
sys.exit(int(data.split()[1]))
"""


class Child:
    """The test's end of one child's connection."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.lines = BufferedByteReceiveStream(stream)

    async def line(self) -> bytes:
        """The child's next report, or ``b""`` once it is gone."""
        try:
            return await self.lines.receive_until(b"\n", 100)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            return b""

    async def exit(self, status: int) -> None:
        await self.stream.send(f"exit {status}\n".encode())


class Children:
    """Accepts the connections of :data:`CHILD` processes."""

    def __init__(self, listener: SocketListener, port: int) -> None:
        self.listener = listener
        self.port = port
        self.accepted: list[SocketStream] = []

    def command(self, on_sigterm: str = "obey") -> list[str]:
        return [PY, "-c", CHILD, str(self.port), on_sigterm]

    async def accept_ready(self) -> Child:
        stream = await self.listener.accept()
        self.accepted.append(stream)
        child = Child(stream)
        assert await child.line() == b"ready"
        return child


@asynccontextmanager
async def children() -> AsyncIterator[Children]:
    multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with multi:
        listener = cast(SocketListener, multi.listeners[0])
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        kids = Children(listener, port)
        try:
            yield kids
        finally:
            for stream in kids.accepted:
                await stream.aclose()


def lock_argv(name: str, command: list[str], *options: str) -> list[str]:
    return ["lock", name, *options, "--", *command]


# -- in-process: status, timeout, exit codes ---------------------------------------------


@pytest.mark.anyio
async def test_status_json_free(capsys: pytest.CaptureFixture[str]) -> None:
    assert await run(["status", "jobs/free", "--json"], backend=MemoryBackend()) == 0
    record = json.loads(capsys.readouterr().out)
    assert record == {
        "name": "jobs/free",
        "held": False,
        "identity": None,
        "token": None,
        "remaining": None,
        "metadata": {},
    }


@pytest.mark.anyio
async def test_status_json_held(capsys: pytest.CaptureFixture[str]) -> None:
    backend = MemoryBackend()
    lock = AsyncLock(backend, "jobs/held", ttl=10, identity="worker-1", metadata={"k": "v"})
    async with lock as lease:
        assert await run(["status", "jobs/held", "--json"], backend=backend) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["held"] is True
    assert (record["identity"], record["token"]) == ("worker-1", lease.token)
    assert record["metadata"] == {"k": "v"}
    assert 0 < record["remaining"] <= 10


@pytest.mark.anyio
async def test_status_text(capsys: pytest.CaptureFixture[str]) -> None:
    backend = MemoryBackend()
    assert await run(["status", "n"], backend=backend) == 0
    async with AsyncLock(backend, "n", ttl=10, identity="me"):
        assert await run(["status", "n"], backend=backend) == 0
    free, held = capsys.readouterr().out.splitlines()
    assert free == "n: free"
    assert held.startswith("n: held by me (token 1, ")


@pytest.mark.anyio
async def test_status_of_a_read_write_lock_says_readers_and_writer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``status`` of a read-write lock names its readers or its writer and who waits,
    not the permits of its encoding (limit and a writer's weight 2**31 - 1)."""
    backend = MemoryBackend()
    rw = AsyncReadWriteLock(backend, "rw", ttl=10, identity="me")

    async def status(*options: str) -> str:
        assert await run(["status", "rw", *options], backend=backend) == 0
        return capsys.readouterr().out

    async with rw.read(), rw.read():
        readers = (await status()).splitlines()
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(rw.write().acquire, timeout=10))
            await anyio.wait_all_tasks_blocked()  # the writer waits behind the readers
            queued = (await status()).splitlines()
            queued_json = json.loads(await status("--json"))["permits"]
            tg.cancel_scope.cancel()
    async with rw.write():
        writer = (await status()).splitlines()
        writer_json = json.loads(await status("--json"))["permits"]
    assert not any(str(2**31 - 1) in line for line in readers + queued + writer)
    assert readers[0] == "rw: read-write lock, 2 readers"
    assert [line.split(" (")[0] for line in readers[1:]] == ["  reader me", "  reader me"]
    assert queued[0] == "rw: read-write lock, 2 readers, 1 waiting"
    assert (queued_json["kind"], queued_json["waiting"]) == ("read-write lock", 1)
    assert [h["mode"] for h in queued_json["holders"]] == ["read", "read"]
    head, line = writer
    assert head == "rw: read-write lock, held for writing"
    assert line.startswith("  writer me (token 3, ")
    assert [(h["mode"], h["token"]) for h in writer_json["holders"]] == [("write", 3)]


@pytest.mark.anyio
async def test_status_of_a_semaphore_says_its_kind_in_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = MemoryBackend()
    async with AsyncSemaphore(backend, "pool", limit=3, ttl=10, identity="me"):
        assert await run(["status", "pool"], backend=backend) == 0
        assert await run(["status", "pool", "--json"], backend=backend) == 0
    text, record = capsys.readouterr().out.splitlines()[::2][:2]
    assert text == "pool: 1 of 3 permits held"
    permits = json.loads(record)["permits"]
    assert (permits["kind"], permits["limit"], permits["used"]) == ("semaphore", 3, 1)
    assert "mode" not in permits["holders"][0]


@pytest.mark.anyio
async def test_lock_timeout_exits_75(capsys: pytest.CaptureFixture[str]) -> None:
    backend = MemoryBackend()
    # A bare acquire: a block of this task would make the command's wait reentrant.
    other = await AsyncLock(backend, "busy", ttl=10, identity="other").acquire()
    argv = lock_argv("busy", [PY, "-c", "raise SystemExit(9)"], "--timeout", "0.1")
    assert await run(argv, backend=backend) == EXIT_TIMEOUT
    assert await other.release()
    err = capsys.readouterr().err
    assert "timed out after 0.1s waiting for lock 'busy'" in err
    assert "'other'" in err


@pytest.mark.anyio
@pytest.mark.parametrize("status", [0, 3])
async def test_lock_returns_command_status_and_releases(status: int) -> None:
    backend = MemoryBackend()
    argv = lock_argv("n", [PY, "-c", f"raise SystemExit({status})"])
    assert await run(argv, backend=backend) == status
    assert await backend.read("n") is None


@pytest.mark.anyio
async def test_lock_holds_while_command_runs(capsys: pytest.CaptureFixture[str]) -> None:
    backend = MemoryBackend()
    async with children() as kids, anyio.create_task_group() as tg:
        codes: list[int] = []

        async def lock() -> None:
            argv = lock_argv("n", kids.command(), "--identity", "cli")
            codes.append(await run(argv, backend=backend))

        tg.start_soon(lock)
        child = await kids.accept_ready()
        holder = await backend.read("n")
        assert holder is not None and holder.identity == "cli"
        await child.exit(6)
    assert codes == [6]
    assert await backend.read("n") is None


# -- in-process: loss and cancellation stop the command -------------------------------------


@pytest.mark.anyio
async def test_lost_lease_terminates_command(capsys: pytest.CaptureFixture[str]) -> None:
    faulty = FaultyBackend(MemoryBackend())
    async with children() as kids, anyio.create_task_group() as tg:
        codes: list[int] = []

        async def lock() -> None:
            argv = lock_argv("n", kids.command(), "--ttl", "0.6")
            codes.append(await run(argv, backend=faulty))

        tg.start_soon(lock)
        child = await kids.accept_ready()
        faulty.fail("renew")
        assert await child.line() == b"term"
    assert codes == [EXIT_LOST]
    assert "lost lock 'n' (unreachable); the command was stopped" in capsys.readouterr().err


@pytest.mark.anyio
async def test_command_ignoring_sigterm_is_killed_after_grace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    faulty = FaultyBackend(MemoryBackend())
    async with children() as kids, anyio.create_task_group() as tg:
        codes: list[int] = []
        argv = lock_argv("n", kids.command("ignore"), "--ttl", "0.6", "--grace", "0.2")

        async def lock() -> None:
            codes.append(await run(argv, backend=faulty))

        tg.start_soon(lock)
        child = await kids.accept_ready()
        faulty.hang("renew")
        assert await child.line() == b"term"
        assert await child.line() == b""  # SIGKILL: gone without another word
    assert codes == [EXIT_LOST]
    assert "after SIGTERM; sent SIGKILL" in capsys.readouterr().err


@pytest.mark.anyio
async def test_cancellation_terminates_command_and_releases() -> None:
    backend = MemoryBackend()
    async with children() as kids, anyio.create_task_group() as tg:
        tg.start_soon(partial(run, lock_argv("n", kids.command()), backend=backend))
        child = await kids.accept_ready()
        assert await backend.read("n") is not None
        tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            assert await child.line() == b"term"
    assert await backend.read("n") is None


# -- in-process: elect ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_elect_restarts_command_per_term_and_exits_with_its_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    faulty = FaultyBackend(MemoryBackend())
    async with children() as kids, anyio.create_task_group() as tg:
        codes: list[int] = []
        argv = ["elect", "e", "--ttl", "0.6", "--identity", "cand", "--", *kids.command()]

        async def elect() -> None:
            codes.append(await run(argv, backend=faulty))

        tg.start_soon(elect)
        first = await kids.accept_ready()
        faulty.hang("renew")
        assert await first.line() == b"term"
        faulty.heal()
        second = await kids.accept_ready()  # a fresh child for the next term
        holder = await faulty.read("e")
        assert holder is not None and holder.identity == "cand"
        await second.exit(7)
    assert codes == [7]
    assert await faulty.read("e") is None
    err = capsys.readouterr().err
    assert "lost leadership of 'e' (unreachable)" in err
    assert "cand leads 'e' (token 1)" in err and "cand leads 'e' (token 2)" in err


# -- arguments and configuration -------------------------------------------------------------


@pytest.mark.anyio
async def test_invalid_ttl_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert await run(lock_argv("n", ["true"], "--ttl", "0"), backend=MemoryBackend()) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("aiolease: error: ttl must be")


@pytest.mark.anyio
async def test_grace_must_fit_in_the_ttl(capsys: pytest.CaptureFixture[str]) -> None:
    argv = lock_argv("n", ["true"], "--ttl", "3", "--grace", "2")
    assert await run(argv, backend=MemoryBackend()) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--grace 2s does not fit in --ttl 3s" in err
    assert "--grace must be under 1.7s" in err


def test_missing_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["lock", "n"])
    assert exc.value.code == EXIT_USAGE
    assert "needs a command to run after '--'" in capsys.readouterr().err


def test_state_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if sys.platform in ("win32", "darwin"):
        pytest.skip("XDG applies to Linux and other Unix")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_url() == sqlite_url(tmp_path / "state" / "aiolease" / "leases.db")
    assert (tmp_path / "state" / "aiolease").is_dir()
    monkeypatch.setenv("XDG_STATE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert state_dir() == tmp_path / ".local" / "state" / "aiolease"


# -- --max-hold and --min-hold ----------------------------------------------------------------


#: A command that runs until it is stopped (it may be stopped before it even started).
SLEEPER = [PY, "-c", "import time; time.sleep(60)"]


@pytest.mark.anyio
async def test_max_hold_stops_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    backend = MemoryBackend()
    with anyio.fail_after(30):
        code = await run(
            lock_argv("n", SLEEPER, "--ttl", "5", "--max-hold", "0.3"), backend=backend
        )
    assert code == EXIT_LOST
    assert "held lock 'n' for --max-hold; the command was stopped" in capsys.readouterr().err
    assert await backend.read("n") is None


@pytest.mark.anyio
async def test_min_hold_keeps_the_lock_after_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = MemoryBackend()
    argv = lock_argv("n", [PY, "-c", "pass"], "--min-hold", "60", "--timeout", "0")
    assert await run(argv, backend=backend) == 0
    assert await backend.read("n") is not None
    assert await run(argv, backend=backend) == EXIT_TIMEOUT  # it ran less than 60 s ago
    assert "(held by " in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--max-hold", "--min-hold"])
def test_bad_hold_limits_are_usage_errors(option: str) -> None:
    assert main(lock_argv("n", [PY, "-c", "pass"], option, "0")) == EXIT_USAGE


#: Runs until it is stopped in the first term; exits by itself (0) in any later one.
FIRST_TERM_SLEEPS = [
    PY,
    "-c",
    "import os, sys, time\nif os.environ['AIOLEASE_TOKEN'] == '1': time.sleep(60)",
]


@pytest.mark.anyio
async def test_elect_max_hold_ends_each_term(capsys: pytest.CaptureFixture[str]) -> None:
    backend = MemoryBackend()
    argv = ["elect", "e", "--ttl", "0.3", "--max-hold", "0.5", "--", *FIRST_TERM_SLEEPS]
    with anyio.fail_after(30):
        code = await run(argv, backend=backend)  # campaigned again after the first term
    assert code == 0
    assert "lost leadership of 'e' (max_hold)" in capsys.readouterr().err
