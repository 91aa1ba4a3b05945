"""The keeper: a small process between ``aiolease`` and the command it runs (POSIX).

``aiolease lock`` / ``elect`` start ``python -I _keeper.py FD PARENT GRACE -- CMD...``.
The keeper starts the command in a session of its own (so its process group holds
the command and everything it starts), and stops that whole group:

* when ``aiolease`` asks (``stop S`` on the channel): SIGTERM to the group, then
  SIGKILL ``S`` seconds later (at once if ``S`` is 0); aiolease works out ``S`` so
  that the SIGKILL lands before the lease can expire;
* when ``aiolease`` dies, even by SIGKILL: the channel (one end of a socket pair)
  reaches end-of-file, and on Linux ``PR_SET_PDEATHSIG`` sends the keeper SIGTERM.
  Either way the group gets SIGKILL at once: nobody renews the lease any more,
  so there is no time for a grace period;
* when the command exits by itself but left processes in its group: SIGTERM,
  then SIGKILL after ``GRACE``, so nothing runs on once the lease is released.

On Linux the keeper is a child subreaper: the group's orphans become its children,
and it exits only once the group is empty. Elsewhere it stops waiting once the
group got SIGKILL.

The channel carries lines. aiolease sends ``stop S``; the keeper reports
``started PID``, ``error CODE MESSAGE`` (the command could not be run),
``leftovers`` (the command exited, its group did not), ``killed S`` (the group was
still there ``S`` seconds after SIGTERM: SIGKILL sent) and last ``exit STATUS``
(the command's shell-style status).

The keeper obeys nobody else: SIGINT, SIGTERM and SIGHUP from a terminal or a
process manager reach aiolease too, and aiolease says ``stop``. It imports only the
standard library (it runs with ``-I``, isolated from the user's ``PYTHON*`` settings).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

#: The exit status of a command that could not be found (as in POSIX shells).
EXIT_NOT_FOUND = 127
#: The exit status of a command that was found but could not be run.
EXIT_CANNOT_RUN = 126
#: What the keeper exits with if ``aiolease`` was gone before the command started.
EXIT_ORPHANED = 70

#: Seconds between looks at whether a stopping group is empty. A member whose parent
#: is outside the keeper's reach dies without telling the keeper; this bounds the wait.
GROUP_POLL = 0.05

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

#: Signals the keeper notes instead of dying of them (see :meth:`Keeper.on_signal`);
#: names, as Windows has not all of them (and imports this module for its helpers).
NOTED = ("SIGCHLD", "SIGTERM", "SIGINT", "SIGHUP")


def prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` on Linux; ``False`` where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def exit_status(returncode: int) -> int:
    """A shell-style exit status: ``n`` for exit code ``n``, ``128 + s`` for death by signal."""
    return returncode if returncode >= 0 else 128 - returncode


def start_error(program: str, exc: OSError) -> tuple[int, str]:
    """The exit status (127 or 126) and message for a command that could not be started."""
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND, f"command not found: {program!r}"
    if isinstance(exc, PermissionError):
        return EXIT_CANNOT_RUN, f"cannot run {program!r}: {exc.strerror}"
    return EXIT_CANNOT_RUN, f"cannot run {program!r}: {exc}"


def _noted(signum: int, frame: object) -> None:
    """The Python-level handler: the wakeup fd already carries the signal number."""


class Keeper:
    """Runs one command in its own session and stops its process group."""

    def __init__(self, channel: socket.socket, parent: int, grace: float) -> None:
        self.channel = channel
        self.parent = parent
        self.grace = grace
        self.subreaper = False
        self.child: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self.status: int | None = None
        self.open = True  # the channel has not reached end-of-file
        self.term_at: float | None = None
        self.kill_at: float | None = None
        self.killed = False
        self.buffer = b""
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for name in NOTED:
            signal.signal(getattr(signal, name), _noted)

    def send(self, line: str) -> None:
        """Report one line to aiolease (if it is still there)."""
        if self.open:
            try:
                self.channel.sendall(line.encode() + b"\n")
            except OSError:
                pass

    def start(self, command: Sequence[str]) -> bool:
        """Start ``command`` as the leader of a new session; report ``started`` or ``error``."""
        try:
            child = subprocess.Popen(list(command), start_new_session=True)
        except OSError as exc:
            code, message = start_error(command[0], exc)
            self.send(f"error {code} {message}")
            return False
        # The keeper reaps with waitpid(-1) itself (orphans too), not through Popen.
        self.child = child
        self.leader = child.pid
        self.send(f"started {child.pid}")
        return True

    # -- the group --------------------------------------------------------------------

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the command's process group (gone or not ours: nothing)."""
        try:
            os.killpg(self.leader, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        """Whether any process of the group exists (zombies included)."""
        try:
            os.killpg(self.leader, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, seconds: float) -> None:
        """SIGTERM the group now and SIGKILL it ``seconds`` later (0: SIGKILL now).

        A later stop can only bring the SIGKILL forward.
        """
        if self.killed:
            return
        if seconds <= 0:
            self.kill()
            return
        now = time.monotonic()
        if self.term_at is None:
            self.term_at = now
            self.signal_group(signal.SIGTERM)
        at = now + seconds
        self.kill_at = at if self.kill_at is None else min(self.kill_at, at)

    def kill(self) -> None:
        """SIGKILL the group."""
        self.signal_group(signal.SIGKILL)
        self.killed = True
        self.kill_at = None

    def orphaned(self) -> None:
        """aiolease is gone: nobody renews the lease, so the group dies now."""
        self.open = False
        self.kill()

    def reap(self) -> None:
        """Reap every child that exited; note the leader's status."""
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.leader:
                code = os.waitstatus_to_exitcode(wait_status)
                if self.child is not None:
                    self.child.returncode = code
                self.status = exit_status(code)

    def done(self) -> bool:
        """The leader exited, and its group is empty (or got SIGKILL and can't be watched)."""
        if self.status is None:
            return False
        if not self.group_alive():
            return True
        return self.killed and not self.subreaper

    # -- events -----------------------------------------------------------------------

    def on_signal(self, signum: int) -> None:
        """SIGTERM is the parent-death signal (or a thread of aiolease that ended: trio
        starts processes from worker threads, and the signal follows the thread), so it
        counts only if the parent changed. SIGINT and SIGHUP reach aiolease too."""
        if signum == signal.SIGTERM and os.getppid() != self.parent:
            self.orphaned()

    def on_message(self) -> None:
        """Read what aiolease sent; end-of-file means it is gone."""
        try:
            data = self.channel.recv(4096)
        except OSError:
            data = b""
        if not data:
            self.orphaned()
            return
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            word, _, value = line.decode().partition(" ")
            if word == "stop":
                self.stop(float(value))

    def timeout(self) -> float | None:
        """How long the next wait for an event may last."""
        waits: list[float] = []
        if self.kill_at is not None:
            waits.append(max(self.kill_at - time.monotonic(), 0.0))
        if self.status is not None:  # waiting for the rest of the group to go
            waits.append(GROUP_POLL)
        return min(waits) if waits else None

    def supervise(self) -> int:
        """Wait for the command and its group; stop them as told. Returns its status."""
        while True:
            self.reap()
            if self.status is not None and self.term_at is None and not self.killed:
                if self.group_alive():
                    self.send("leftovers")
                    self.stop(self.grace)
            if self.done():
                assert self.status is not None
                return self.status
            watched = [self.wake_r, self.channel.fileno()] if self.open else [self.wake_r]
            ready, _, _ = select.select(watched, [], [], self.timeout())
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                assert self.term_at is not None
                self.send(f"killed {time.monotonic() - self.term_at:.3g}")
                self.kill()
            if self.wake_r in ready:
                for signum in os.read(self.wake_r, 256):
                    self.on_signal(signum)
            if self.open and self.channel.fileno() in ready:
                self.on_message()


def main(argv: Sequence[str]) -> int:
    """``FD PARENT GRACE -- CMD...``: keep ``CMD`` for the aiolease process ``PARENT``."""
    fd, parent, grace = int(argv[0]), int(argv[1]), float(argv[2])
    assert argv[3] == "--", argv
    channel = socket.socket(fileno=fd)
    keeper = Keeper(channel, parent, grace)
    keeper.subreaper = prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # aiolease died before the death signal was armed
        return EXIT_ORPHANED
    if not keeper.start(argv[4:]):
        return EXIT_CANNOT_RUN
    status = keeper.supervise()
    keeper.send(f"exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
