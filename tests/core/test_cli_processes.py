"""The ``aiolease`` command as real processes: exit statuses, contention, the
command's whole process group, its environment, watch, bad URLs and the demo."""

from __future__ import annotations

import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from aiolease._cli._where import sqlite_url
from aiolease.cli import EXIT_LOST, EXIT_TIMEOUT, EXIT_USAGE, main

PY = sys.executable

# -- as real processes ------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-m", "aiolease", *args], text=True, env=env, **kwargs)


def finish(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "aiolease", *args], text=True, capture_output=True, env=env, timeout=60
    )


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment whose default backend is a fresh SQLite file."""
    yield {**os.environ, "AIOLEASE_URL": sqlite_url(tmp_path / "leases.db")}


@contextmanager
def holding(
    env: dict[str, str], name: str, *options: str, identity: str = "holder-1"
) -> Iterator[subprocess.Popen[str]]:
    """``aiolease lock NAME [OPTIONS]`` running a child that waits for a line on stdin."""
    script = "import sys; print('holding', flush=True); sys.exit(len(sys.stdin.readline()))"
    argv = ("lock", name, *options, "--identity", identity, "--", PY, "-c", script)
    proc = cli(*argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    with proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "holding\n"
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.parametrize(
    ("code", "status"),
    [("pass", 0), ("raise SystemExit(4)", 4), ("import os; os.kill(os.getpid(), 9)", 128 + 9)],
)
def test_process_lock_exit_status(code: str, status: int) -> None:
    result = finish("lock", "n", "--backend", "memory://", "--", PY, "-c", code)
    assert result.returncode == status, result.stderr


def test_process_lock_contention_and_status(env: dict[str, str]) -> None:
    free = finish("status", "shared", "--json", env=env)
    assert (free.returncode, json.loads(free.stdout)["held"]) == (0, False)
    with holding(env, "shared") as proc:
        held = json.loads(finish("status", "shared", "--json", env=env).stdout)
        assert (held["held"], held["identity"], held["token"]) == (True, "holder-1", 1)
        late = finish("lock", "shared", "--timeout", "0.2", "--", PY, "-c", "pass", env=env)
        assert late.returncode == EXIT_TIMEOUT
        assert "timed out after 0.2s waiting for lock 'shared'" in late.stderr
        assert proc.stdin is not None
        proc.stdin.write("bye\n")  # the child exits with status len("bye\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 4
    assert json.loads(finish("status", "shared", "--json", env=env).stdout)["held"] is False


def test_process_lock_with_a_limit_runs_that_many_at_once(env: dict[str, str]) -> None:
    """``lock --limit 2``: two commands hold permits of the semaphore at once, a third
    waits (and times out), ``status`` shows both permits, and a lock of the same name
    is apart (another keyspace)."""
    with (
        holding(env, "pool", "--limit", "2", identity="first") as first,
        holding(env, "pool", "--limit", "2", identity="second") as second,
    ):
        shown = json.loads(finish("status", "pool", "--json", env=env).stdout)
        assert shown["held"] is False
        permits = shown["permits"]
        assert (permits["limit"], permits["used"]) == (2, 2), permits
        assert sorted(h["identity"] for h in permits["holders"]) == ["first", "second"]
        assert sorted(h["token"] for h in permits["holders"]) == [1, 2]
        text = finish("status", "pool", env=env).stdout
        assert "pool: 2 of 2 permits held" in text, text
        argv = ("lock", "pool", "--limit", "2", "--timeout", "0.2", "--", PY, "-c", "pass")
        late = finish(*argv, env=env)
        assert late.returncode == EXIT_TIMEOUT, late.stderr
        assert "waiting for semaphore 'pool'" in late.stderr
        # It tried once, said so, and then waited (regression: timeout=0 of a
        # semaphore raised TimeoutError, so the command gave up at its first try).
        assert "has no free permit of 2" in late.stderr, late.stderr
        mismatch = finish("lock", "pool", "--limit", "3", "--timeout", "0", "--", PY, env=env)
        assert mismatch.returncode not in (0, EXIT_TIMEOUT), mismatch.stderr
        assert "limit" in mismatch.stderr
        for proc in (first, second):
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.wait(timeout=30) == 1
    assert "permits" not in json.loads(finish("status", "pool", "--json", env=env).stdout)


def test_process_lock_limit_is_checked() -> None:
    for argv in (("--limit", "0"), ("--limit", "2", "--max-hold", "5")):
        result = finish("lock", "x", *argv, "--backend", "memory://", "--", PY, "-c", "pass")
        assert result.returncode == EXIT_USAGE, result.stderr


def test_process_sigterm_stops_command_and_releases(env: dict[str, str]) -> None:
    with holding(env, "n") as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert json.loads(finish("status", "n", "--json", env=env).stdout)["held"] is False


# -- as real processes: the command's whole process group ---------------------------------

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and uses pidfds (Linux)"
)

#: A command whose shell starts a grandchild and prints "SHELL_PID GRANDCHILD_PID". The
#: grandchild does not hold aiolease's pipes: a survivor fails a test instead of hanging it.
SLEEPER = "sleep 300 </dev/null >/dev/null 2>&1 & echo $$ $!"
GROUP = SLEEPER + "; wait"
#: The same, with SIGTERM ignored by the shell and (inherited) by the grandchild.
STUBBORN = "trap '' TERM; " + GROUP


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited: no such process, or a zombie (not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def gone_by(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` exits (a pidfd tells) or ``time.monotonic()`` reaches ``deadline``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
        return bool(readable)
    finally:
        os.close(fd)


def printed_pids(proc: subprocess.Popen[str]) -> list[int]:
    """The two pids the :data:`SLEEPER` command prints on aiolease's stdout."""
    assert proc.stdout is not None
    pids = [int(word) for word in proc.stdout.readline().split()]
    assert len(pids) == 2, pids
    return pids


@contextmanager
def group_of(proc: subprocess.Popen[str]) -> Iterator[list[int]]:
    """The pids of a running :data:`GROUP` command; whatever survives the test is killed."""
    pids = printed_pids(proc)
    try:
        assert not any(map(gone, pids)), pids
        yield pids
    finally:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def db_path(env: dict[str, str]) -> str:
    return env["AIOLEASE_URL"].removeprefix("sqlite://")


@linux_only
def test_process_lost_lease_kills_the_whole_group(env: dict[str, str]) -> None:
    argv = ("lock", "n", "--ttl", "3", "--", "sh", "-c", GROUP)
    with (
        cli(*argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc,
        group_of(proc) as pids,
    ):
        with sqlite3.connect(db_path(env)) as db:  # the lock is gone behind its back
            assert db.execute("DELETE FROM aiolease_leases WHERE name = 'n'").rowcount == 1
        assert proc.wait(timeout=60) == EXIT_LOST
        assert proc.stderr is not None
        assert "lost lock 'n' (stolen)" in proc.stderr.read()
        assert [pid for pid in pids if not gone(pid)] == []


@linux_only
@pytest.mark.parametrize("subcommand", ["lock", "elect"])
def test_process_sigkill_of_aiolease_kills_the_whole_group(
    env: dict[str, str], subcommand: str
) -> None:
    argv = (subcommand, "n", "--", "sh", "-c", GROUP)
    with cli(*argv, env=env, stdout=subprocess.PIPE) as proc, group_of(proc) as pids:
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        assert [pid for pid in pids if not gone_by(pid, deadline)] == []


@linux_only
@pytest.mark.slow
def test_process_command_ignoring_sigterm_is_dead_before_the_lease_expires(
    env: dict[str, str],
) -> None:
    # Renewals are blocked by holding SQLite's write lock; the row's expires_at is then
    # the server's expiry, on the same system-wide monotonic clock as time.monotonic().
    argv = ("lock", "n", "--ttl", "8", "--grace", "2", "--", "sh", "-c", STUBBORN)
    with (
        cli(*argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc,
        group_of(proc) as pids,
    ):
        db = sqlite3.connect(db_path(env), timeout=30, isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")
            (expires_at,) = db.execute(
                "SELECT expires_at FROM aiolease_leases WHERE name = 'n'"
            ).fetchone()
            assert [pid for pid in pids if not gone_by(pid, expires_at)] == []
        finally:
            db.execute("ROLLBACK")
            db.close()
        assert proc.wait(timeout=60) == EXIT_LOST
        assert proc.stderr is not None
        assert "after SIGTERM; sent SIGKILL" in proc.stderr.read()


@linux_only
def test_process_leftovers_of_the_command_are_stopped(env: dict[str, str]) -> None:
    argv = ("lock", "n", "--", "sh", "-c", SLEEPER)  # the shell exits, its sleep does not
    with cli(*argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        shell, sleeper = printed_pids(proc)
        try:
            assert proc.wait(timeout=60) == 0
            assert proc.stderr is not None
            assert "the command exited and left processes in its group" in proc.stderr.read()
            assert gone(sleeper)
        finally:
            with suppress(ProcessLookupError):
                os.kill(sleeper, signal.SIGKILL)


#: trio's idle worker threads end after this many seconds (trio's own default: 10).
TRIO_IDLE = 1.0


def test_process_command_outlives_the_thread_that_started_its_keeper() -> None:
    # trio starts processes from a worker thread, which ends once idle for
    # IDLE_TIMEOUT (no SQLite queries reuse it on memory://); the keeper's parent-death
    # signal follows that thread, but aiolease is still there. The CLI runs with trio's
    # idle timeout cut to TRIO_IDLE, so that the command outlives the thread in 3 s
    # rather than 12 (trio reads the timeout each time a thread waits for work).
    script = "import time; time.sleep(3); print('finished')"
    argv = ["--loop", "trio", "lock", "n", "--backend", "memory://", "--", PY, "-c", script]
    main = (
        "import runpy, sys, trio._core._thread_cache as cache;"
        f"cache.IDLE_TIMEOUT = {TRIO_IDLE}; sys.argv = ['aiolease', *sys.argv[1:]];"
        "runpy.run_module('aiolease', run_name='__main__', alter_sys=True)"
    )
    result = subprocess.run([PY, "-c", main, *argv], text=True, capture_output=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "finished\n"), result.stderr


def test_process_command_gets_the_lease_in_its_environment(env: dict[str, str]) -> None:
    show = 'echo "$AIOLEASE_NAME $AIOLEASE_TOKEN $AIOLEASE_IDENTITY"'
    outputs = [
        finish(sub, "jobs/a", "--identity", "me", "--", "sh", "-c", show, env=env).stdout
        for sub in ("lock", "elect", "lock")
    ]
    assert outputs == ["jobs/a 1 me\n", "jobs/a 2 me\n", "jobs/a 3 me\n"]


def test_process_lock_says_once_who_holds_it_while_waiting(env: dict[str, str]) -> None:
    with holding(env, "shared") as holder:
        argv = ("lock", "shared", "--timeout", "20", "--", PY, "-c", "pass")
        with cli(*argv, env=env, stderr=subprocess.PIPE) as waiter:
            assert waiter.stderr is not None
            line = waiter.stderr.readline()
            assert line == "aiolease: lock 'shared' is held by 'holder-1' (token 1); waiting\n"
            assert holder.stdin is not None
            holder.stdin.close()  # the holder's command exits, and the lock is released
            assert holder.wait(timeout=30) == 0
            assert waiter.wait(timeout=30) == 0
            assert "waiting" not in waiter.stderr.read()


def test_process_watch_prints_changes(env: dict[str, str]) -> None:
    watch = cli("watch", "w", "--json", env=env, stdout=subprocess.PIPE)
    with watch:
        try:
            assert watch.stdout is not None
            assert json.loads(watch.stdout.readline())["leader"] is False
            with holding(env, "w") as proc:
                change = json.loads(watch.stdout.readline())
                leader = (change["leader"], change["identity"], change["token"])
                assert leader == (True, "holder-1", 1)
                assert proc.stdin is not None
                proc.stdin.close()
                assert proc.wait(timeout=30) == 0
            assert json.loads(watch.stdout.readline())["leader"] is False
            watch.send_signal(signal.SIGINT)
            assert watch.wait(timeout=30) == 0
        finally:
            if watch.poll() is None:
                watch.kill()


@pytest.mark.parametrize(
    ("url", "message"),
    [("nope://x", "no aiolease backend for scheme 'nope'"), ("no-scheme", "has no scheme")],
)
def test_process_bad_url(url: str, message: str) -> None:
    result = finish("status", "n", "--backend", url)
    assert result.returncode == EXIT_USAGE
    assert result.stderr.startswith("aiolease: error: ") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_process_command_not_found() -> None:
    result = finish("lock", "n", "--backend", "memory://", "--", "no-such-command-aiolease")
    assert result.returncode == 127
    assert "command not found" in result.stderr


def test_process_demo_needs_a_shared_backend() -> None:
    result = finish("demo", "--backend", "memory://")
    assert result.returncode == EXIT_USAGE
    assert "cannot be shared" in result.stderr


@pytest.mark.slow
def test_process_demo() -> None:
    result = finish("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("failover took") == 3
    assert "OK: 3 crashes, 3 failovers" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_safety_subcommand_runs_the_harness(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    argv = ["safety", "--url", url, "--fault", "none", "--processes", "2", "--rounds", "2"]
    argv += ["--ttl", "0.5", "--workdir", str(tmp_path / "work")]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("safety sqlite") and " none " in line, line
    assert "acquisitions=4 " in line and "overlaps=0 " in line, line


@pytest.mark.slow
def test_demo_candidates_get_the_url_out_of_sight_of_ps(aiolease_server: Any) -> None:
    """The candidates' command lines (``ps``) never show the backend URL's password:
    it reaches them in their environment."""
    secret = "s3cret-demo"  # PostgreSQL trusts loopback and ignores it
    url = aiolease_server("postgres").replace("://postgres@", f"://postgres:{secret}@")
    assert secret in url
    command = [sys.executable, "-m", "aiolease", "demo", "--backend", url]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as demo:
        try:
            assert demo.stdout is not None
            seen = ""
            while "campaigning" not in seen and demo.poll() is None:
                seen = demo.stdout.readline()
            commands = []
            for entry in Path("/proc").iterdir():
                with suppress(OSError):
                    line = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                    if b"_candidate" in line:
                        commands.append(line.decode(errors="replace"))
        finally:
            demo.send_signal(signal.SIGINT)  # the demo stops its candidates in order
            demo.wait(timeout=60)
    assert "campaigning" in seen and commands, (seen, commands)
    assert not any(secret in line for line in commands), commands
