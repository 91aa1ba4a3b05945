"""``python -m aiolease.testing.safety``: run the harness and print one line per fault.

::

    python -m aiolease.testing.safety --url URL [--fault F ...] [--processes 5]
        [--duration S | --rounds N] [--ttl S] [--margin S] [--runs N] [--long]
        [--loop asyncio|trio] [--backend-factory MODULE:ATTR] [--hold MIN MAX]
        [--fault-every S] [--fault-length S] [--fault-aim any|fresh]
        [--server-kill CMD --server-start CMD] [--workdir DIR] [--seed N]
        [--election | --limit N | --rw]

Exit status: 0 when every line is clean (a fault that does not apply prints
``n/a`` and counts as clean), 1 on any violation or failed run, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from ..._exceptions import AioleaseError, InvalidArgument
from ._faults import CommandServerControl, Fault
from ._procs import ChildError
from ._report import SafetyReport
from ._run import run_safety

__all__ = ["DEFAULT_FAULTS", "LONG", "build_parser", "main"]

#: The faults run when none is named.
DEFAULT_FAULTS = (Fault.NONE, Fault.SIGSTOP, Fault.BLACKHOLE)
#: What ``--long`` sets, unless given explicitly: the on-demand long run.
LONG: dict[str, Any] = {"duration": 60.0, "runs": 3, "processes": 8}


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m aiolease.testing.safety",
        description="Several OS processes contend for one lease under faults; "
        "check that bodies never overlap and stale writes are fenced.",
    )
    p.add_argument("--url", required=True, help="the backend, e.g. sqlite:///s.db or memory://")
    p.add_argument(
        "--fault",
        action="append",
        choices=[f.value for f in Fault],
        help="inject this fault (repeat for several; one line each). "
        "Default: " + " ".join(f.value for f in DEFAULT_FAULTS),
    )
    p.add_argument("--processes", type=int, help="contending processes (default 5)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--duration", type=float, help="seconds per run (default 10)")
    length.add_argument("--rounds", type=int, help="bodies per process, instead of a duration")
    p.add_argument("--ttl", type=float, default=1.0, help="lease ttl in seconds (default 1)")
    p.add_argument("--margin", type=float, help="lease margin in seconds (default the library's)")
    p.add_argument("--runs", type=int, help="runs per fault, added up (default 1)")
    p.add_argument("--long", action="store_true", help="the long run: " + repr(LONG))
    p.add_argument("--loop", choices=["asyncio", "trio"], default="asyncio")
    p.add_argument("--backend-factory", metavar="MODULE:ATTR", help="open --url with this")
    p.add_argument("--fault-every", type=float, help="seconds between faults (default 2 ttl)")
    p.add_argument("--fault-length", type=float, help="seconds a fault lasts (default 1.5 ttl)")
    p.add_argument(
        "--fault-aim",
        choices=["any", "fresh"],
        default="any",
        help="hit the holder anywhere in its body (any), or right after its grant (fresh)",
    )
    p.add_argument(
        "--hold",
        nargs=2,
        type=float,
        metavar=("MIN", "MAX"),
        default=(0.5, 1.5),
        help="shortest and longest body, in ttls (default 0.5 1.5)",
    )
    p.add_argument("--work", type=float, default=0.02, help="blocking work between writes, s")
    p.add_argument("--server-kill", metavar="CMD", help="shell command that kills the server")
    p.add_argument("--server-start", metavar="CMD", help="shell command that starts it again")
    p.add_argument(
        "--name", help="the contended lease name (default: safety- and random hex digits)"
    )
    p.add_argument("--workdir", help="keep each run's records under this directory")
    p.add_argument("--seed", type=int, help="seed the workers' random choices")
    p.add_argument(
        "--election", action="store_true", help="hold terms of an Elector, not AsyncLock blocks"
    )
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="the semaphore form: hold permits of an AsyncSemaphore; at most N bodies at once",
    )
    p.add_argument(
        "--rw",
        action="store_true",
        help="the read-write form: read or write an AsyncReadWriteLock; a writer is alone",
    )
    return p


def _options(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "processes": args.processes,
        "duration": args.duration,
        "rounds": args.rounds,
        "runs": args.runs,
    }
    if args.long:
        for key, value in LONG.items():
            if given[key] is None and not (key == "duration" and args.rounds is not None):
                given[key] = value
    options = {k: v for k, v in given.items() if v is not None}
    if (args.server_kill is None) != (args.server_start is None):
        raise InvalidArgument("give both --server-kill and --server-start, or neither")
    if args.server_kill is not None:
        options["server_control"] = CommandServerControl(args.server_kill, args.server_start)
    return {
        **options,
        "ttl": args.ttl,
        "margin": args.margin,
        "loop": args.loop,
        "backend_factory": args.backend_factory,
        "fault_every": args.fault_every,
        "fault_length": args.fault_length,
        "fault_aim": args.fault_aim,
        "hold": tuple(args.hold),
        "work": args.work,
        "name": args.name,
        "workdir": args.workdir,
        "seed": args.seed,
        "election": args.election,
        "limit": args.limit,
        "rw": args.rw,
    }


async def _run_all(url: str, faults: Sequence[Fault], options: dict[str, Any]) -> int:
    status = 0
    for fault in faults:
        report: SafetyReport = await run_safety(url, fault=fault, **options)
        print(report.line(), flush=True)
        for error in report.errors:
            print(f"  error: {error}", file=sys.stderr, flush=True)
        if not report.ok:
            status = 1
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the harness; return the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    faults = [Fault(f) for f in args.fault] if args.fault else list(DEFAULT_FAULTS)
    try:
        return anyio.run(_run_all, args.url, faults, _options(args))
    except InvalidArgument as exc:
        print(f"safety: {exc}", file=sys.stderr)
        return 2
    except (AioleaseError, ChildError) as exc:
        print(f"safety: {exc}", file=sys.stderr)
        return 1
