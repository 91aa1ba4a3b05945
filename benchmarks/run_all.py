"""Every benchmark in one command: one markdown table of every figure, with the machine,
the versions and the date.

Runs each ``bench_*.py`` of this directory (in a process of its own, one after the
other, so that they do not measure each other) ``--runs`` times (default 3), collects
the figures each prints (:func:`_common.record`), and writes one table with the
median of the runs of each figure, the target it has (if any), and the verdict of the
run that gave the median.

``--quick``: each benchmark's quick pass, once unless ``--runs`` says otherwise,
two benchmarks at a time (``--serial``: one after the other): 1 min 40-52 s in six
runs on a 2-core machine at load average 0.5-4.5 with other work running (1 min 51 s
and 1 min 40 s at 0.5-1.2; 2 min 53 s and 2 min 56 s ``--serial`` at 3-4). Most of a
pass is waiting: leases held through windows of whole renewal ticks, ttls and
sessions to expire, Kafka's rebalances. So two benchmarks run at once and take
turns (:data:`PAIRED`): each holds the turn (a file lock, ``_turn.TURN_ENV``)
while it measures, and gives it up only while it holds leases through a window
whose figures are its own CPU and counts (``_turn.idle``); the other measures
meanwhile. No two figures are taken at once; a figure taken beside another's window
shares the machine with that window's renewals (one batched call per tick, 0.001-0.01
CPU s/s) and with Kafka's benchmark, which runs alongside without a turn (its
figures are 1-2 s waits that the broker's timers set; its processes use about 1 s of
CPU in all). Two benchmarks that use the same server never run at once. Beside
that, the quick figures move more than the full ones (shorter windows, fewer
cycles); the contended, failover and held figures keep only the floors, aiolease
and the peers a target names (``_common.quick_cut``; the uncontended ones keep
every peer); the in-process anyio floors of the permit figures run once (in
``bench_embedded.py``'s memory figures); failovers run with a 1 s ttl or session
where the server allows it (etcd's shortest lease is 2 s), settles last one renewal
tick, and the worker processes of a cross-process figure start once and serve each
of its contenders in turn (``_common.run_processes``). Each quick benchmark alone
(``--serial``, load average about 3): core 3 s, embedded 10 s, scale 17 s, Redis
21 s, SQL 36 s, etcd 25 s, Kafka 17 s, MongoDB 29 s, ZooKeeper 14 s.

Usage::

    pip install -e '.[bench]'   # the peer libraries the benchmarks compare against
    bash scripts/services.sh start
    python benchmarks/run_all.py [--quick [--serial]] [--runs 3] [--only redis,sql] [--out FILE]

Writes ``benchmarks/RESULTS.md`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import RESULTS_ENV
from _turn import TURN_ENV

HERE = Path(__file__).resolve().parent
#: When this run began (the times it prints are from then).
BEGUN = time.monotonic()

#: The benchmarks, and the arguments of their quick pass. A ``bench_*.py`` not named
#: here runs too, with ``--quick``.
QUICK: dict[str, list[str]] = {
    "bench_core.py": ["--cycles", "500", "--seconds", "0.5"],
    "bench_embedded.py": ["--cycles", "200", "--seconds", "0.5", "--quick"],
    "bench_scale.py": ["--quick"],
    "bench_redis.py": ["--quick"],
    "bench_sql.py": ["--quick"],
    "bench_etcd.py": ["--quick"],
}

#: ``--quick`` runs two benchmarks at a time (:func:`run_paired`). Each one holds the
#: turn (:data:`_turn.TURN_ENV`) while it measures, except in its waits that nothing
#: else distorts (:func:`_turn.idle`: leases held through a window, their CPU this
#: process's own, counted in this process or on the server): no two figures are taken
#: at once, and one benchmark measures while the other waits. Two benchmarks that use
#: the same server never run at once (a window counts every client's requests on
#: it). Here: the servers each one uses, first the longest chains; a benchmark not
#: named here runs alone after the others. The last ones wait least (an idle
#: section with nothing beside it is time lost). ``bench_scale.py`` runs in two parts, so
#: that its Redis, MySQL and etcd leases do not wait for the others' benchmarks
#: (PostgreSQL: the benchmark's ``test`` database; ``bench_sql.py`` counts its own).
PAIRED: tuple[tuple[str, tuple[str, ...], frozenset[str]], ...] = (
    (
        "bench_scale.py",
        ("--quick", "--backends", "redis,mysql,etcd"),
        frozenset({"redis", "mysql", "etcd"}),
    ),
    ("bench_sql.py", ("--quick",), frozenset({"postgres", "mysql"})),
    ("bench_redis.py", ("--quick",), frozenset({"redis"})),
    ("bench_etcd.py", ("--quick",), frozenset({"etcd"})),
    ("bench_mongo.py", ("--quick",), frozenset({"mongo"})),
    ("bench_scale.py", ("--quick", "--backends", "memory,sqlite,postgres"), frozenset()),
    ("bench_zookeeper.py", ("--quick",), frozenset({"zookeeper"})),
    ("bench_embedded.py", tuple(QUICK["bench_embedded.py"]), frozenset()),
    ("bench_core.py", tuple(QUICK["bench_core.py"]), frozenset()),
)
#: Run alongside the others with ``--quick``, without a turn: its figures are waits of
#: 1-2 s that the broker's timers set (rebalances, session expiries), and its
#: processes use about 1 s of CPU in all (1.2 s user+sys over its 17 s, measured).
ALONGSIDE = ("bench_kafka.py",)

#: Packages whose versions the table's header names (those installed).
PACKAGES = (
    "aiolease",
    "anyio",
    "trio",
    "redis",
    "hiredis",
    "asyncpg",
    "asyncmy",
    "aetcd",
    "pymongo",
    "kazoo",
    "aiokafka",
    "python-redis-lock",
    "pottery",
    "aioredlock",
    "tooz",
)


def scripts(only: Sequence[str] | None) -> list[str]:
    found = sorted(p.name for p in HERE.glob("bench_*.py"))
    ordered = [s for s in QUICK if s in found] + [s for s in found if s not in QUICK]
    if only:
        ordered = [s for s in ordered if s.removeprefix("bench_").removesuffix(".py") in only]
    return ordered


_printing = threading.Lock()


#: Runs ``sys.argv[1]`` as ``__main__`` with the rest of the arguments, once the turn
#: is taken (``_turn`` takes it when imported).
TAKE_TURN = (
    sys.executable,
    "-c",
    "import runpy, sys, _turn; sys.argv = sys.argv[1:];"
    " runpy.run_path(sys.argv[0], run_name='__main__')",
)
Rows = list[dict[str, Any]]
Job = tuple[str, Sequence[str]]


def run_one(script: str, args: Sequence[str], turn: Path | None = None) -> tuple[Rows, float, int]:
    """Run ``script`` once with ``args``; its recorded figures, its wall time and its
    exit status. With ``turn`` (``--quick``'s pairs), it takes turns through that
    file, and what it prints is printed whole once it ends."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
        env = dict(os.environ, **{RESULTS_ENV: out.name})
        env.pop(TURN_ENV, None)
        if turn is not None:
            env[TURN_ENV] = str(turn)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p
        )
        started = time.monotonic()
        print(
            f"run_all: +{started - BEGUN:.0f} s: {script} {' '.join(args)}",
            file=sys.stderr,
            flush=True,
        )
        # With a turn, the script runs after _turn took it: its imports too wait.
        command = [sys.executable, script] if turn is None else [*TAKE_TURN, script]
        done = subprocess.run(
            [*command, *args],
            cwd=HERE,
            env=env,
            check=False,
            stdout=None if turn is None else subprocess.PIPE,
            text=True,
        )
        if done.stdout is not None:
            with _printing:
                print(f"\n===== {script} {' '.join(args)}\n{done.stdout}", end="", flush=True)
        rows = [json.loads(line) for line in out if line.strip()]
    ended = time.monotonic()
    print(f"run_all: +{ended - BEGUN:.0f} s: {script} ended", file=sys.stderr, flush=True)
    return rows, ended - started, done.returncode


def run_paired(order: Sequence[str], runs: int) -> list[tuple[Job, list[tuple[Rows, float, int]]]]:
    """``--quick``: the jobs of :data:`PAIRED` (of the scripts of ``order``), two at a
    time, none beside one that uses a server it uses, each taking turns; those of
    :data:`ALONGSIDE` at the same time; then any other alone. ``runs`` times each."""
    jobs = [(s, a, servers) for s, a, servers in PAIRED if s in order] * runs
    found: dict[int, list[tuple[Rows, float, int]]] = {}
    alone = [s for s in order if s not in {j[0] for j in PAIRED} | set(ALONGSIDE)]
    pending = list(range(len(jobs)))
    busy: dict[int, frozenset[str]] = {}
    changed = threading.Condition()
    with tempfile.TemporaryDirectory() as where:
        turn = Path(where) / "turn"

        def worker() -> None:
            while True:
                with changed:
                    while True:
                        if not pending:
                            return
                        in_use = frozenset().union(*busy.values())
                        free = [i for i in pending if not jobs[i][2] & in_use]
                        if free:
                            break
                        changed.wait()
                    index = free[0]
                    pending.remove(index)
                    busy[index] = jobs[index][2]
                script, args, _ = jobs[index]
                found[index] = [run_one(script, args, turn)]
                with changed:
                    del busy[index]
                    changed.notify_all()

        def beside() -> None:
            for script in ALONGSIDE:
                if script in order:
                    for _ in range(runs):
                        found.setdefault(-1 - ALONGSIDE.index(script), []).append(
                            run_one(script, QUICK.get(script, ["--quick"]), turn=None)
                        )

        threads = [threading.Thread(target=t) for t in (worker, worker, beside)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    results: list[tuple[Job, list[tuple[Rows, float, int]]]] = []
    for script in order:  # the table in the usual order, however they ran
        for i, (s, a, _) in enumerate(jobs):
            if s == script:
                results.append(((s, a), found[i]))
        if script in ALONGSIDE:
            args = QUICK.get(script, ["--quick"])
            results.append(((script, args), found.get(-1 - ALONGSIDE.index(script), [])))
        if script in alone:
            args = QUICK.get(script, ["--quick"])
            results.append(((script, args), [run_one(script, args) for _ in range(runs)]))
    return results


def medians(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per figure: the median of its values over the runs, and the verdict of
    the run whose value is that median (the lower middle one, for an even count)."""
    grouped: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            key = (row["backend"], row["figure"], row["contender"], row["unit"])
            grouped.setdefault(key, []).append(row)
    table = []
    for rows in grouped.values():
        ordered = sorted(rows, key=lambda r: float(r["value"]))
        middle = ordered[(len(ordered) - 1) // 2]
        value = statistics.median(float(r["value"]) for r in rows)
        table.append(dict(middle, value=value, runs=[float(r["value"]) for r in rows]))
    return table


def versions() -> list[str]:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def servers() -> list[str]:
    """The versions of the servers the benchmarks use, those that answer."""
    probes = {
        "Redis": ["redis-cli", "-p", "6379", "INFO", "server"],
        "PostgreSQL": ["psql", "-h", "127.0.0.1", "-U", "postgres", "-tAc", "SHOW server_version"],
        "MariaDB/MySQL": ["mysql", "-h", "127.0.0.1", "-uroot", "-N", "-e", "SELECT VERSION()"],
        "etcd": ["etcd", "--version"],
    }
    found = []
    for server, command in probes.items():
        try:
            text = subprocess.run(command, capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("redis_version:"):
                found.append(f"{server} {line.split(':', 1)[1]}")
            elif line.startswith("etcd Version:"):
                found.append(f"{server} {line.split(':', 1)[1].strip()}")
            elif line and server in ("PostgreSQL", "MariaDB/MySQL"):
                found.append(f"{server} {line.split()[0]}")
                break
    return found


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs"


def markdown(table: Sequence[dict[str, Any]], runs: int, quick: bool, took: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark results",
        "",
        f"- date: {now}; {'--quick, ' if quick else ''}median of {runs} run(s) of each"
        f" benchmark ({int(took // 60)} min {took % 60:.0f} s in all"
        + (", two at a time, taking turns: see run_all.py)" if quick else ")"),
        f"- machine: {machine()}; Python {platform.python_version()}",
        f"- packages: {', '.join(versions())}",
        f"- servers: {', '.join(servers()) or 'none answered'}",
        "- command: `python benchmarks/run_all.py"
        + (" --quick" if quick else "")
        + f" --runs {runs}"
        + "`; what each figure measures: the docstring of its `benchmarks/bench_*.py`",
        "",
        "| backend | figure | contender | median | unit | runs | target | verdict |",
        "|---|---|---|---:|---|---|---|---|",
    ]
    for row in table:
        each = " / ".join(f"{v:.3g}" for v in row["runs"])
        ok = {True: "PASS", False: "MISS", None: ""}[row["ok"]]
        cells = [
            row["backend"],
            row["figure"],
            row["contender"],
            f"{row['value']:.3g}",
            row["unit"],
            each,
            row["target"],
            ok,
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one quick pass of each")
    parser.add_argument(
        "--runs", type=int, help="runs of each benchmark (default 3; 1 with --quick)"
    )
    parser.add_argument("--only", type=lambda s: s.split(","), help="e.g. redis,sql,scale")
    parser.add_argument(
        "--serial", action="store_true", help="with --quick: one benchmark after the other"
    )
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    started = time.monotonic()
    collected: list[list[dict[str, Any]]] = []
    failed = []
    order = scripts(args.only)
    if args.quick and not args.serial:
        found = run_paired(order, runs)
    else:
        found = []
        for script in order:
            its = QUICK.get(script, ["--quick"]) if args.quick else []
            found.append(((script, its), [run_one(script, its) for _ in range(runs)]))
    for (script, its_args), done in found:
        for rows, took, status in done:
            print(
                f"run_all: {script} {' '.join(its_args)} took {took:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            collected.append(rows)
            if status != 0:
                failed.append(script)
    table = medians(collected)
    args.out.write_text(markdown(table, runs, args.quick, time.monotonic() - started))
    print(f"run_all: {len(table)} figures written to {args.out}", file=sys.stderr)
    if failed:
        print(f"run_all: failed: {', '.join(sorted(set(failed)))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
