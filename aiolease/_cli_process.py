"""Child processes and signals for the ``aiolease`` command.

The command runs a user's program while it holds a lease, and must stop that
program when the lease ends: SIGTERM first, SIGKILL after a grace period. The
stop is shielded, so that outer cancellation (Ctrl-C, SIGTERM to aiolease) still
waits for the child to be gone before the lease is released.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import TypeVar

import anyio
from anyio import CancelScope
from anyio.abc import Process

T = TypeVar("T")

#: The exit status of a command that could not be found (as in POSIX shells).
EXIT_NOT_FOUND = 127
#: The exit status of a command that was found but could not be run.
EXIT_CANNOT_RUN = 126


class CommandError(Exception):
    """The user's command could not be started.

    :ivar exit_code: 127 if it was not found, 126 if it could not be run
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def say(message: str) -> None:
    """Print one ``aiolease: ...`` line on stderr (stdout belongs to the child or the output)."""
    print(f"aiolease: {message}", file=sys.stderr, flush=True)


def exit_status(returncode: int) -> int:
    """A shell-style exit status: ``n`` for exit code ``n``, ``128 + s`` for death by signal."""
    return returncode if returncode >= 0 else 128 - returncode


async def start_child(command: Sequence[str], **options: object) -> Process:
    """Start ``command``; by default it inherits stdin, stdout and stderr.

    :raises CommandError: it cannot be found or run
    """
    kwargs: dict[str, object] = {"stdin": None, "stdout": None, "stderr": None}
    kwargs.update(options)
    try:
        return await anyio.open_process(list(command), **kwargs)  # type: ignore[arg-type]
    except FileNotFoundError as exc:
        raise CommandError(f"command not found: {command[0]!r}", EXIT_NOT_FOUND) from exc
    except PermissionError as exc:
        raise CommandError(f"cannot run {command[0]!r}: {exc.strerror}", EXIT_CANNOT_RUN) from exc
    except OSError as exc:
        raise CommandError(f"cannot run {command[0]!r}: {exc}", EXIT_CANNOT_RUN) from exc


async def stop_child(process: Process, grace: float) -> None:
    """Terminate ``process``: SIGTERM, then SIGKILL if it is still alive after ``grace`` seconds.

    Shielded from cancellation: when this returns, the process is gone and reaped.
    """
    with anyio.CancelScope(shield=True):
        if process.returncode is not None:
            return
        with suppress(ProcessLookupError):
            process.terminate()
        with anyio.move_on_after(grace):
            await process.wait()
            return
        say(f"command (pid {process.pid}) still running {grace:g}s after SIGTERM; sending SIGKILL")
        with suppress(ProcessLookupError):
            process.kill()
        await process.wait()


async def run_child(command: Sequence[str], grace: float) -> int:
    """Run ``command`` to completion and return its exit status.

    If this is cancelled (the lease was lost, or aiolease is interrupted), the child
    is stopped with :func:`stop_child` before the cancellation goes on.

    :raises CommandError: it cannot be found or run
    """
    process = await start_child(command)
    try:
        return exit_status(await process.wait())
    finally:
        await stop_child(process, grace)


async def _cancel_on_signal(scope: CancelScope, received: list[int]) -> None:
    try:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                received.append(int(signum))
                scope.cancel()
                return
    except NotImplementedError:  # pragma: no cover - Windows: Ctrl-C raises KeyboardInterrupt
        return


async def interruptible(fn: Callable[[], Awaitable[T]]) -> tuple[T | None, int | None]:
    """Run ``fn()``, cancelling it on SIGINT or SIGTERM.

    The exception of ``fn`` propagates as is (not wrapped in an exception group).

    :returns: ``(result, None)``, or ``(None, signal number)`` if a signal cancelled it
    """
    received: list[int] = []
    outcome: list[T] = []
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_signal, tg.cancel_scope, received)
        try:
            outcome.append(await fn())
        except Exception as exc:  # re-raised below, outside the task group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return (outcome[0], None) if outcome else (None, received[0])
