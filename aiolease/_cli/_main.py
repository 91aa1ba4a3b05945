"""The ``aiolease`` command: hold a lock or lead an election around a program.

::

    aiolease lock NAME [--ttl S] [--timeout S] [--identity ID] [--grace S] -- CMD...
    aiolease elect NAME [--ttl S] [--identity ID] [--grace S] -- CMD...
    aiolease status NAME [--json]
    aiolease watch NAME [--json]
    aiolease demo [--ttl S]
    aiolease safety --url URL [--fault F]... [options]   (see aiolease.testing.safety)

Every subcommand takes ``--backend URL`` (else ``$AIOLEASE_URL``, else a SQLite
file in the user's state directory). Exit statuses: the command's own status
(``128 + s`` if it died of signal ``s``), 1 for runtime errors, 2 for usage
errors, 70 when the lease was lost while the command ran, 75 when ``--timeout``
ran out, ``128 + s`` when aiolease itself was stopped by signal ``s``.

``lock`` and ``elect`` run the command in a session of its own, under a keeper
process (:mod:`aiolease._cli._keeper`), with ``AIOLEASE_NAME``, ``AIOLEASE_TOKEN``
and ``AIOLEASE_IDENTITY`` in its environment. When the lease ends, its whole
process group gets SIGTERM, then SIGKILL ``--grace`` seconds later, timed so that
the SIGKILL lands before the lease can expire on the server: the lease's margin
is the usual safety margin (a tenth of the ttl) plus the grace, so the stop
starts ``--grace`` seconds before the old deadline. If aiolease dies, even by
SIGKILL, the keeper kills the group at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

import anyio

from .._bridge import adapt
from .._clock import current_time
from .._elector import Elector, LeaderInfo
from .._exceptions import (
    AioleaseError,
    BackendError,
    BackendNotFound,
    InvalidArgument,
    LeaseHeldError,
    LeaseLostError,
    LossReason,
    UnsupportedCapability,
)
from .._lease import Lease, Timing
from .._limits import check_duration
from .._lock import AsyncLock
from .._permits import MAX_LIMIT, RW_LIMIT, PermitHolders, check_limit
from .._registry import open_backend
from .._semaphore import AsyncSemaphore
from .._validate import check_identity, check_name, check_seconds
from ..abc import Backend, Capability, HolderInfo
from ._process import EXIT_ERROR, CommandError, interruptible, run_command, say
from ._where import ENV_URL, resolve_url, state_dir

__all__ = ["EXIT_ERROR", "EXIT_LOST", "EXIT_TIMEOUT", "EXIT_USAGE", "build_parser", "main", "run"]

logger = logging.getLogger("aiolease")

EXIT_USAGE = 2
#: The lease was lost while the command ran (EX_SOFTWARE).
EXIT_LOST = 70
#: ``--timeout`` ran out before the lock was granted (EX_TEMPFAIL).
EXIT_TIMEOUT = 75

#: ttl used by ``watch``: only bounds how long an observer waits between re-reads.
WATCH_TTL = 10.0
#: ``--grace`` when not given: this, or a third of the ttl if that is shorter.
DEFAULT_GRACE = 5.0


@asynccontextmanager
async def connect(args: argparse.Namespace, given: Backend | None) -> AsyncIterator[Backend]:
    """Yield ``given``, or open the backend the arguments name (and close it after)."""
    if given is not None:
        yield adapt(given)
        return
    async with open_backend(resolve_url(args.backend)) as backend:
        yield backend


# -- the parser --------------------------------------------------------------------------


#: The options every subcommand takes, also accepted before the subcommand.
COMMON_DEFAULTS: dict[str, Any] = {"backend": None, "verbose": 0, "loop": "asyncio"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        message = message.replace(", '_candidate'", "")  # hidden subcommand
        self.exit(EXIT_USAGE, f"aiolease: error: {message}\n")


def _add_common(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: an option given before the subcommand is not reset by the subparser's default.
    parser.add_argument(
        "--backend",
        metavar="URL",
        default=argparse.SUPPRESS,
        help=f"where the leases live (default: ${ENV_URL}, else a SQLite file in {state_dir()})",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="log to stderr (-v info, -vv debug)",
    )
    parser.add_argument(
        "--loop",
        choices=("asyncio", "trio"),
        default=argparse.SUPPRESS,
        help="the event loop to run on (default asyncio)",
    )


def _common() -> _Parser:
    common = _Parser(add_help=False)
    _add_common(common)
    return common


def _add_term_options(parser: argparse.ArgumentParser, *, ttl: float = 15.0) -> None:
    parser.add_argument("name", help="the lease name")
    parser.add_argument(
        "--ttl", type=float, default=ttl, help=f"lease ttl in seconds (default {ttl:g})"
    )
    parser.add_argument("--identity", help="who holds it, shown to others (default host:pid)")


def _add_command_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-hold",
        type=float,
        metavar="SECONDS",
        help="stop the command once the lease was held this long, and release it "
        "(lock: exit 70; elect: campaign again)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        help="seconds between SIGTERM and SIGKILL to the command's process group when the "
        "lease ends; the stop starts early enough that SIGKILL lands before the lease can "
        "expire (default 5, or a third of --ttl if less)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``aiolease`` argument parser (the command after ``--`` is split off before parsing)."""
    common = _common()
    parser = _Parser(
        prog="aiolease",
        description="Distributed locks, leases and leader election from the shell.",
        epilog="exit status: the command's own; 1 error; 2 usage; 70 lease lost or "
        "--max-hold reached; 75 timed out",
    )
    _add_common(parser)
    sub = parser.add_subparsers(dest="subcommand", metavar="{lock,elect,status,watch,demo,safety}")
    sub.required = True

    lock = sub.add_parser(
        "lock",
        parents=[common],
        help="run a command while holding a lock",
        usage="aiolease lock NAME [options] -- CMD [ARG...]",
    )
    _add_term_options(lock)
    lock.add_argument("--timeout", type=float, help="give up after this many seconds (exit 75)")
    _add_command_options(lock)
    lock.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="hold one of N permits of a semaphore named NAME instead of the lock: at "
        "most N commands run at once (every caller of NAME must give the same N)",
    )
    lock.add_argument(
        "--min-hold",
        type=float,
        metavar="SECONDS",
        help="keep the lock this long after it was granted, even if the command ended "
        "sooner: it does not run again under this name anywhere before then (with "
        "--timeout 0, for a cron job on every machine)",
    )

    elect = sub.add_parser(
        "elect",
        parents=[common],
        help="run a command during each term as leader",
        usage="aiolease elect NAME [options] -- CMD [ARG...]",
    )
    _add_term_options(elect)
    _add_command_options(elect)

    shows = (
        ("status", "show the current holder (and a semaphore's or read-write lock's)"),
        ("watch", "print each change of leader"),
    )
    for name, text in shows:
        shown = sub.add_parser(name, parents=[common], help=text)
        shown.add_argument("name", help="the lease name")
        shown.add_argument("--json", action="store_true", help="print JSON")

    demo = sub.add_parser(
        "demo", parents=[common], help="crash-test leader election with 3 processes"
    )
    demo.add_argument("--ttl", type=float, default=2.0, help="lease ttl in seconds (default 2)")

    # Parsed by aiolease.testing.safety itself (main() hands it the arguments); listed
    # here for --help.
    sub.add_parser(
        "safety", help="prove mutual exclusion under faults with several processes", add_help=False
    )

    # Hidden: one demo candidate (a separate OS process).
    candidate = sub.add_parser("_candidate", parents=[common])
    _add_term_options(candidate)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; the words after the first ``--`` are the command to run.

    :raises SystemExit: (status 2) on a usage error, after printing it
    """
    argv = list(argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    for key, value in COMMON_DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    wants_command = args.subcommand in ("lock", "elect")
    if wants_command and not command:
        parser.error(f"{args.subcommand} needs a command to run after '--'")
    if command and not wants_command:
        parser.error(f"{args.subcommand} does not run a command (unexpected '-- {command[0]}')")
    args.command = command
    return args


def validate(args: argparse.Namespace) -> None:
    """Check arguments before anything is opened.

    :raises InvalidArgument: a name, ttl, timeout, grace or identity is malformed
    """
    if hasattr(args, "name"):
        check_name(args.name)
    if hasattr(args, "ttl"):
        Timing._build(args.ttl)
    if getattr(args, "identity", None) is not None:
        check_identity(args.identity)
    if getattr(args, "timeout", None) is not None:
        check_seconds("timeout", args.timeout, allow_zero=True)
    if hasattr(args, "grace"):
        command_timing(args.ttl, args.grace)
    for option in ("max_hold", "min_hold"):
        if getattr(args, option, None) is not None:
            check_duration(option, getattr(args, option))
    if getattr(args, "limit", None) is not None:
        check_limit(args.limit, at_most=MAX_LIMIT)
        if args.max_hold is not None or args.min_hold is not None:
            raise InvalidArgument("--limit does not go with --max-hold or --min-hold")


@dataclass(frozen=True)
class CommandTiming:
    """How ``lock`` and ``elect`` time the stop of their command.

    :param grace: seconds between SIGTERM and SIGKILL
    :param margin: the lease's margin: the default one (clock drift, a tenth of the
        ttl) plus ``grace``, so that the lease is lost, and the command gets SIGTERM,
        ``grace`` seconds before the command must be dead
    """

    grace: float
    margin: float


def command_timing(ttl: float, grace: float | None) -> CommandTiming:
    """The grace (given or default) and the lease margin that makes room for it.

    :raises InvalidArgument: the grace leaves no time to renew the lease
    """
    drift = Timing._build(ttl).margin
    # Timing._build asks that a renewal (every ttl / 3) fit in ttl - margin.
    limit = ttl - ttl / 3 - drift
    if grace is None:
        grace_s = min(DEFAULT_GRACE, ttl / 3)
        grace_s = grace_s if grace_s < limit else limit / 2  # a ttl under 0.15s
    else:
        grace_s = check_seconds("grace", grace, allow_zero=True)
    if grace_s >= limit:
        raise InvalidArgument(
            f"--grace {grace_s:g}s does not fit in --ttl {ttl:g}s: the command must be dead "
            f"{drift:g}s before the lease can expire, and the lease is renewed every "
            f"{ttl / 3:g}s, so --grace must be under {limit:g}s (or use a longer --ttl)"
        )
    return CommandTiming(grace_s, drift + grace_s)


def command_env(lease: Lease) -> dict[str, str]:
    """The command's environment: aiolease's, plus the lease it runs under (for fencing)."""
    return {
        **os.environ,
        "AIOLEASE_NAME": lease.name,
        "AIOLEASE_TOKEN": str(lease.token),
        "AIOLEASE_IDENTITY": lease.identity,
    }


def kill_after(lease: Lease, grace: float) -> float:
    """Seconds from now until the command's group must get SIGKILL.

    The lease's margin includes ``grace`` (:func:`command_timing`): the command must
    be dead by ``lease.deadline + grace``. A lease the backend no longer has
    (STOLEN) may be somebody else's already: SIGKILL at once.
    """
    if lease.lost is LossReason.STOLEN:
        return 0.0
    return max(min(grace, lease.deadline + grace - current_time()), 0.0)


async def run_leased(command: Sequence[str], lease: Lease, grace: float) -> int:
    """Run the command while ``lease`` is held; return its exit status."""
    return await run_command(command, grace, command_env(lease), partial(kill_after, lease, grace))


# -- the subcommands ---------------------------------------------------------------------


async def _hold_and_run(
    args: argparse.Namespace, lock: AsyncLock | AsyncSemaphore, grace: float, timeout: float | None
) -> int:
    async with lock.hold(timeout=timeout) as lease:
        logger.info("holding %r, token %d; running %s", lease.name, lease.token, args.command)
        return await run_leased(args.command, lease, grace)


async def cmd_lock(args: argparse.Namespace, backend: Backend) -> int:
    """Hold the lock while the command runs; stop the command if the lock is lost.

    The first try does not wait: if the lock is held, say once who holds it, then wait.
    """
    timing = command_timing(args.ttl, args.grace)
    lock: AsyncLock | AsyncSemaphore
    what = f"lock {args.name!r}"
    if args.limit is not None:
        what = f"semaphore {args.name!r}"
        lock = AsyncSemaphore(
            backend,
            args.name,
            limit=args.limit,
            ttl=args.ttl,
            margin=timing.margin,
            identity=args.identity,
        )
    else:
        lock = AsyncLock(
            backend,
            args.name,
            ttl=args.ttl,
            margin=timing.margin,
            identity=args.identity,
            max_hold=args.max_hold,
            min_hold=args.min_hold,
        )
    started = current_time()
    try:
        try:
            return await _hold_and_run(args, lock, timing.grace, 0)  # one try
        except LeaseHeldError as exc:
            if args.timeout == 0:
                raise TimeoutError from exc
            holder = exc.holder
            who = f"{holder.identity!r} (token {holder.token})" if holder else "another owner"
            if args.limit is None:
                say(f"{what} is held by {who}; waiting")
            else:
                say(f"{what} has no free permit of {args.limit} (one is held by {who}); waiting")
        left = None if args.timeout is None else args.timeout - (current_time() - started)
        if left is not None and left <= 0:
            raise TimeoutError
        return await _hold_and_run(args, lock, timing.grace, left)
    except TimeoutError:
        who = ""
        if args.limit is None:
            holder = await adapt(backend).read(args.name)
            who = f" (held by {holder.identity!r}, token {holder.token})" if holder else ""
        say(f"timed out after {args.timeout:g}s waiting for {what}{who}")
        return EXIT_TIMEOUT
    except LeaseLostError as exc:
        if exc.reason is LossReason.MAX_HOLD:
            say(f"error: held {what} for --max-hold; the command was stopped")
        else:
            say(f"error: lost {what} ({exc.reason.value}); the command was stopped")
        return EXIT_LOST


async def cmd_elect(args: argparse.Namespace, backend: Backend) -> int:
    """Run the command during each term; return its status once it exits by itself."""

    def defeated(reason: LossReason) -> None:
        say(f"lost leadership of {args.name!r} ({reason.value}); the command was stopped")

    timing = command_timing(args.ttl, args.grace)
    elector = Elector(
        backend,
        args.name,
        ttl=args.ttl,
        margin=timing.margin,
        identity=args.identity,
        on_defeated=defeated,
        max_hold=args.max_hold,
    )

    async def term(lease: Lease) -> int:
        say(f"{lease.identity} leads {lease.name!r} (token {lease.token}); starting the command")
        return await run_leased(args.command, lease, timing.grace)

    code = await elector.run(term)
    say(f"the command exited with status {code}; resigned from {args.name!r}")
    return code


def _status_record(name: str, holder: HolderInfo | None) -> dict[str, Any]:
    return {
        "name": name,
        "held": holder is not None,
        "identity": None if holder is None else holder.identity,
        "token": None if holder is None else holder.token,
        "remaining": None if holder is None else holder.remaining,
        "metadata": {} if holder is None else dict(holder.metadata),
    }


def _holder_line(holder: HolderInfo) -> str:
    left = "" if holder.remaining is None else f", {holder.remaining:.2f}s left"
    return f"{holder.identity} (token {holder.token}{left})"


def _mode(weight: int) -> str:
    """A read-write lock's permit of ``weight``: a writer's or a reader's."""
    return "write" if weight == RW_LIMIT else "read"


def _permits_record(permits: PermitHolders) -> dict[str, Any]:
    rw = permits.limit == RW_LIMIT
    return {
        "kind": "read-write lock" if rw else "semaphore",
        "limit": permits.limit,
        "used": permits.used,
        "waiting": permits.waiting,
        "holders": [
            {
                **_status_record(permits.name, holder),
                "weight": weight,
                **({"mode": _mode(weight)} if rw else {}),
            }
            for holder, weight in zip(permits.holders, permits.weights, strict=True)
        ],
    }


def _print_permits(permits: PermitHolders) -> None:
    """``status``'s lines for a semaphore's permits, or a read-write lock's readers or
    writer (whose limit and weights are the encoding's, not worth showing)."""
    name = permits.name
    waiting = f", {permits.waiting} waiting" if permits.waiting else ""
    pairs = zip(permits.holders, permits.weights, strict=True)
    if permits.limit != RW_LIMIT:
        print(f"{name}: {permits.used} of {permits.limit} permits held{waiting}", flush=True)
        for permit, weight in pairs:
            share = "" if weight == 1 else f", weight {weight}"
            print(f"  {_holder_line(permit)}{share}", flush=True)
        return
    readers = sum(weight != RW_LIMIT for weight in permits.weights)
    if len(permits.holders) > readers:
        held = "held for writing"
    elif permits.holders:
        held = f"{readers} reader{'' if readers == 1 else 's'}"
    else:
        held = "free"
    print(f"{name}: read-write lock, {held}{waiting}", flush=True)
    for permit, weight in pairs:
        who = "writer" if weight == RW_LIMIT else "reader"
        print(f"  {who} {_holder_line(permit)}", flush=True)


async def cmd_status(args: argparse.Namespace, backend: Backend) -> int:
    """Print who holds the name now, as a lock and, where the backend serves them, as
    a semaphore or read-write lock (exit 0 whether held or not)."""
    bridged = adapt(backend)
    holder = await bridged.read(args.name)
    permits = None
    if Capability.SEMAPHORE in bridged.capabilities:
        permits = await bridged.read_permits(args.name)
    if args.json:
        record = _status_record(args.name, holder)
        if permits is not None:
            record["permits"] = _permits_record(permits)
        print(json.dumps(record), flush=True)
        return 0
    if holder is None and permits is None:
        print(f"{args.name}: free", flush=True)
        return 0
    if holder is not None:
        print(f"{args.name}: held by {_holder_line(holder)}", flush=True)
        for key, value in sorted(holder.metadata.items()):
            print(f"  {key}: {value}", flush=True)
    if permits is not None:
        _print_permits(permits)
    return 0


def _leader_line(name: str, leader: LeaderInfo | None, as_json: bool) -> str:
    now = datetime.now().astimezone().isoformat(timespec="milliseconds")
    if as_json:
        record: dict[str, Any] = {"time": now, "name": name, "leader": leader is not None}
        if leader is not None:
            record.update(identity=leader.identity, token=leader.token)
            record["metadata"] = dict(leader.metadata)
        return json.dumps(record)
    if leader is None:
        return f"{now} {name}: no leader"
    return f"{now} {name}: {leader.identity} leads (token {leader.token})"


async def cmd_watch(args: argparse.Namespace, backend: Backend) -> int:
    """Print one line per change of leader until interrupted (observing never campaigns)."""
    elector = Elector(backend, args.name, ttl=WATCH_TTL)
    async for leader in elector.observe():
        print(_leader_line(args.name, leader, args.json), flush=True)
    return 0  # pragma: no cover - observe() never ends by itself


async def _dispatch(args: argparse.Namespace, given: Backend | None) -> int:
    if args.subcommand == "demo":
        from ._demo import run_demo

        return await run_demo(args)
    handlers = {
        "lock": cmd_lock,
        "elect": cmd_elect,
        "status": cmd_status,
        "watch": cmd_watch,
    }
    async with connect(args, given) as backend:
        if args.subcommand == "_candidate":
            from ._demo import run_candidate

            return await run_candidate(args, backend)
        return await handlers[args.subcommand](args, backend)


def _error_code(exc: AioleaseError) -> int:
    usage = (InvalidArgument, BackendNotFound, UnsupportedCapability)
    return EXIT_USAGE if isinstance(exc, usage) else EXIT_ERROR


async def execute(
    args: argparse.Namespace, *, backend: Backend | None = None, handle_signals: bool = False
) -> int:
    """Run parsed arguments; expected errors become one stderr line and an exit status.

    :param backend: use this backend instead of opening ``--backend`` (in-process use, tests)
    :param handle_signals: stop cleanly on SIGINT/SIGTERM (main thread only)
    """
    try:
        validate(args)
        if not handle_signals:
            return await _dispatch(args, backend)
        code, signum = await interruptible(partial(_dispatch, args, backend))
    except CommandError as exc:
        say(f"error: {exc}")
        return exc.exit_code
    except (InvalidArgument, BackendNotFound, UnsupportedCapability, BackendError) as exc:
        say(f"error: {exc}")
        return _error_code(exc)
    if signum is None:
        assert code is not None
        return code
    logger.info("stopped by signal %d", signum)
    return 0 if args.subcommand == "watch" else 128 + signum


async def run(argv: Sequence[str], *, backend: Backend | None = None) -> int:
    """Run the ``aiolease`` command in this event loop (no signal handling).

    :param backend: use this backend instead of opening ``--backend`` (tests, embedding)
    :raises SystemExit: (status 2) on a usage error
    """
    return await execute(parse_args(argv), backend=backend)


def configure_logging(verbosity: int) -> None:
    """Log the ``aiolease`` logger to stderr: warnings, or info (``-v``), or debug (``-vv``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("aiolease: %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel((logging.WARNING, logging.INFO, logging.DEBUG)[min(verbosity, 2)])
    logger.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """The console entry point: parse, run on asyncio (or ``--loop trio``), return the status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["safety"]:
        from ..testing.safety import main as safety_main

        return safety_main(argv[1:])
    args = parse_args(argv)
    configure_logging(args.verbose)
    if importlib.util.find_spec(args.loop) is None:
        say(f"error: the {args.loop} event loop is not installed (pip install 'aiolease[trio]')")
        return EXIT_USAGE
    try:
        return anyio.run(partial(execute, args, handle_signals=True), backend=args.loop)
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130
