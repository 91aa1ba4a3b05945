"""Every benchmark in one command: one markdown table of every figure, with the machine,
the versions and the date.

Runs each ``bench_*.py`` of this directory (in a process of its own, one after the
other, so that they do not measure each other) ``--runs`` times (default 3), collects
the figures each prints (:func:`_common.record`), and writes one table with the
median of the runs of each figure, the target it has (if any), and the verdict of the
run that gave the median. ``--quick``: each benchmark's quick pass, once unless
``--runs`` says otherwise: 3 min 2 s and 3 min 16 s in all (two runs) on a 2-core
machine at load average 2-3.5 with other work running (5 min 15 s before at load
average 5-10: 4 min 14 s at 3-4 in the session before). The issue's two minutes are
missed: most of what is left is waiting that the figures measure or need (hold
windows of whole renewal ticks, ttls and session timeouts to expire, Kafka's
rebalances, 0.5-1 s per contender of each contended figure). The figures move more;
the figures that start processes or wait for expiries keep only the floors, aiolease
and the peers a target names (``_common.quick_cut``); failovers run with a 1 s ttl or
session where the server allows it (etcd's shortest lease is 2 s), settles last one
renewal tick, and the worker processes of a cross-process figure start once and serve
each of its contenders in turn (``_common.run_processes``). Per benchmark, quick, at
load average 2-3: core 3 s, embedded 12 s, scale 17-22 s, Redis 25-27 s, SQL
39-44 s, etcd 28 s, Kafka 16 s, MongoDB 29-31 s, ZooKeeper 13 s.

Usage::

    pip install -e '.[bench]'   # the peer libraries the benchmarks compare against
    bash scripts/services.sh start
    python benchmarks/run_all.py [--quick] [--runs 3] [--only redis,sql] [--out FILE]

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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import RESULTS_ENV

HERE = Path(__file__).resolve().parent

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


def run_one(script: str, quick: bool) -> tuple[list[dict[str, Any]], float, int]:
    """Run ``script`` once; its recorded figures, its wall time and its exit status."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
        env = dict(os.environ, **{RESULTS_ENV: out.name})
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p
        )
        args = QUICK.get(script, ["--quick"]) if quick else []
        started = time.monotonic()
        print(f"run_all: {script} {' '.join(args)}", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, script, *args], cwd=HERE, env=env, check=False)
        rows = [json.loads(line) for line in out if line.strip()]
    return rows, time.monotonic() - started, done.returncode


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
        f" benchmark ({took / 60:.0f} min in all)",
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
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    started = time.monotonic()
    collected: list[list[dict[str, Any]]] = []
    failed = []
    for script in scripts(args.only):
        for _ in range(runs):
            rows, took, status = run_one(script, args.quick)
            print(f"run_all: {script} took {took:.0f} s", file=sys.stderr, flush=True)
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
