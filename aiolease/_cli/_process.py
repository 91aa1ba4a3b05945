"""Child processes and signals for the ``aiolease`` command.

The command runs a user's program while it holds a lease, and must stop that
program when the lease ends: SIGTERM first, SIGKILL after a grace period. The
stop is shielded, so that outer cancellation (Ctrl-C, SIGTERM to aiolease) still
waits for the program to be gone before the lease is released.

On POSIX the program runs under a keeper process (:mod:`aiolease._cli._keeper`), in
a session of its own: the stop reaches its whole process group, and the keeper
kills that group at once if aiolease dies, even by SIGKILL. On Windows the program
is a plain child: only it is stopped, and nothing stops it if aiolease is killed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

import anyio
from anyio import CancelScope
from anyio.abc import Process

# The keeper imports only the standard library: it runs as a script, not from the package.
from ._keeper import EXIT_CANNOT_RUN, exit_status, start_error

T = TypeVar("T")

#: aiolease's own runtime error.
EXIT_ERROR = 1


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


#: Whether commands run under a keeper (process groups, ``pass_fds``: POSIX only).
KEEPER_SUPPORTED = sys.platform != "win32"
KEEPER_SCRIPT = Path(__file__).with_name("_keeper.py")


async def start_child(command: Sequence[str], **options: object) -> Process:
    """Start ``command``; by default it inherits stdin, stdout and stderr.

    :raises CommandError: it cannot be found or run
    """
    kwargs: dict[str, object] = {"stdin": None, "stdout": None, "stderr": None}
    kwargs.update(options)
    try:
        return await anyio.open_process(list(command), **kwargs)  # type: ignore[arg-type]
    except OSError as exc:
        code, message = start_error(command[0], exc)
        raise CommandError(message, code) from exc


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


async def run_child(
    command: Sequence[str], grace: float, env: Mapping[str, str] | None = None
) -> int:
    """Run ``command`` to completion and return its exit status.

    If this is cancelled (the lease was lost, or aiolease is interrupted), the child
    is stopped with :func:`stop_child` before the cancellation goes on.

    :raises CommandError: it cannot be found or run
    """
    process = await start_child(command, env=env)
    try:
        return exit_status(await process.wait())
    finally:
        await stop_child(process, grace)


class Keeper:
    """aiolease's end of one keeper process (see :mod:`aiolease._cli._keeper`)."""

    def __init__(self, process: Process, channel: socket.socket) -> None:
        self._process = process
        self._channel = channel
        self._buffer = b""
        self._eof = False
        self._error: CommandError | None = None
        #: The command's pid, which is also its process group id.
        self.group: int | None = None
        #: The command's exit status, once the keeper reported it.
        self.status: int | None = None

    @classmethod
    async def spawn(
        cls, command: Sequence[str], grace: float, env: Mapping[str, str] | None
    ) -> Keeper:
        """Start a keeper that runs ``command`` (:meth:`started` says when it does).

        :raises CommandError: the keeper itself cannot be started
        """
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        argv = [sys.executable, "-I", str(KEEPER_SCRIPT), str(fd), str(os.getpid()), repr(grace)]
        try:
            process = await start_child([*argv, "--", *command], env=env, pass_fds=(fd,))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(process, ours)

    async def _line(self) -> str | None:
        """The keeper's next line, or ``None`` at end-of-file."""
        while b"\n" not in self._buffer:
            if self._eof:
                return None
            await anyio.wait_readable(self._channel)
            try:
                data = self._channel.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            self._eof = not data
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _note(self, line: str) -> None:
        word, _, rest = line.partition(" ")
        if word == "started":
            self.group = int(rest)
        elif word == "error":
            code, _, message = rest.partition(" ")
            self._error = CommandError(message, int(code))
            self.status = int(code)
        elif word == "exit":
            self.status = int(rest)
        elif word == "killed":
            say(
                f"command (process group {self.group}) still running {rest}s after SIGTERM; "
                "sent SIGKILL"
            )
        elif word == "leftovers":
            say(f"the command exited and left processes in its group ({self.group}); stopping them")

    async def started(self) -> None:
        """Wait until the command runs.

        :raises CommandError: it cannot be found or run
        """
        while self.group is None and self.status is None:
            line = await self._line()
            if line is None:
                code = exit_status(await self._process.wait())
                self.status = EXIT_CANNOT_RUN
                raise CommandError(
                    f"the keeper of the command exited with status {code}", EXIT_CANNOT_RUN
                )
            self._note(line)
        if self._error is not None:
            raise self._error

    async def wait(self) -> int:
        """Wait until the command and its group are gone; return the command's status."""
        while self.status is None:
            line = await self._line()
            if line is None:
                return await self._vanished()
            self._note(line)
        await self._process.wait()
        return self.status

    async def _vanished(self) -> int:
        """The keeper died without a report: kill the group it kept; status 1."""
        code = await self._process.wait()
        if self.group is not None:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signal.SIGKILL)
        say(
            f"error: the keeper of the command (pid {self._process.pid}) died with status "
            f"{exit_status(code)}; the command's process group was killed"
        )
        self.status = EXIT_ERROR
        return self.status

    async def stop(self, kill_after: float) -> None:
        """Stop the command's group unless it is gone (SIGTERM, then SIGKILL ``kill_after``
        seconds later; at once if 0), and wait until it is. Shielded from cancellation."""
        with anyio.CancelScope(shield=True):
            try:
                if self.status is None:
                    with suppress(OSError):  # the keeper is gone: wait() finds out
                        self._channel.send(f"stop {max(kill_after, 0.0)!r}\n".encode())
                    await self.wait()
                else:
                    await self._process.wait()
            finally:
                self._channel.close()


async def run_command(
    command: Sequence[str],
    grace: float,
    env: Mapping[str, str] | None,
    kill_after: Callable[[], float],
) -> int:
    """Run ``command`` to completion (under a keeper on POSIX) and return its status.

    If this is cancelled (the lease was lost, or aiolease is interrupted), the
    command's process group gets SIGTERM, then SIGKILL ``kill_after()`` seconds
    later (asked at that moment), before the cancellation goes on.

    :param grace: seconds between SIGTERM and SIGKILL for what the command leaves
        running in its group when it exits by itself
    :raises CommandError: it cannot be found or run
    """
    if not KEEPER_SUPPORTED:  # pragma: no cover - Windows: a plain child
        return await run_child(command, grace, env)
    keeper = await Keeper.spawn(command, grace, env)
    try:
        await keeper.started()
        return await keeper.wait()
    finally:
        await keeper.stop(kill_after())


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
