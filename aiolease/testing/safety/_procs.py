"""Child processes of the harness: start one, read its first line, stop it for sure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

__all__ = ["ChildError", "first_line", "python_module", "stop_for_sure", "tail"]


class ChildError(RuntimeError):
    """A child process failed to start or to say what it should."""


async def python_module(
    module: str,
    args: Sequence[str],
    *,
    stderr: Path,
    env: Mapping[str, str] | None = None,
) -> Process:
    """Start ``python -m module args`` with pipes for stdin/stdout and stderr to a file."""
    with open(stderr, "ab") as err:  # noqa: ASYNC230 - opening a local log file is instant
        return await anyio.open_process(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=dict(os.environ if env is None else env),
        )


def tail(path: Path, lines: int = 5) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


async def first_line(process: Process, timeout: float, stderr: Path) -> str:
    """Read the first line the child prints.

    :raises ChildError: it exits or stays silent for ``timeout`` seconds
    """
    assert process.stdout is not None
    reader = BufferedByteReceiveStream(process.stdout)
    try:
        with anyio.fail_after(timeout):
            return (await reader.receive_until(b"\n", 4096)).decode()
    except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead) as exc:
        raise ChildError(
            f"pid {process.pid} did not start ({type(exc).__name__}): {tail(stderr)}"
        ) from None


async def stop_for_sure(process: Process) -> None:
    """Continue (if stopped) and kill ``process`` unless it has exited; reap it. Shielded."""
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:
                    break
        await process.wait()
        await process.aclose()
