"""One contending process of the safety harness.

Run by the controller as ``python -m aiolease.testing.safety._worker OPTIONS``. It
opens the backend and the fence, prints ``ready``, and waits for one line on
stdin: ``go STOP_AT`` (a ``time.monotonic()`` value after which it acquires no
more) or ``go none`` (stop after ``--rounds`` bodies). Then, in a loop::

    async with AsyncLock(backend, name, ttl=..., identity=f"safety-{pid}") as lease:
    # (--election: async with Elector(...).leadership() as lease:)
    # (--limit N: async with AsyncSemaphore(..., limit=N) as lease:)
    # (--rw: async with AsyncReadWriteLock(...).read() or .write() as lease:)
        write to the fence with lease.token      # registers the token
        record the start
        until the body's length is up:
            await anyio.sleep(write_interval)    # a checkpoint: a loss cancels here
            write; blocking work for --work seconds; write
        record the stop                          # in a finally: also when cancelled

In the semaphore form every write is unfenced, and in the read-write form a
reader's (see :mod:`._fence`): the fence logs them and never refuses them.

Everything goes to the ``--out`` file as flushed JSON lines (see :mod:`._records`).

**Why blocking work.** A body spends most of its time between two writes without
a checkpoint, as CPU-bound code does. A ``SIGSTOP`` then most likely freezes it
*after* it took its token and *before* it wrote with it, the classic GC pause:
after ``SIGCONT`` it writes with a token another holder has superseded meanwhile,
before its event loop can tell it that the lease is gone. That stale write is what
the fence must reject. (A body frozen at a checkpoint instead races the core's
own timers and I/O on resume; it may or may not get a write out.)
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from ..._elector import Elector
from ..._exceptions import BackendError, LeaseHeldError, LeaseLostError, LossReason
from ..._lease import Lease
from ..._lock import AsyncLock
from ..._semaphore import AsyncReadWriteLock, AsyncSemaphore
from ...abc import Backend
from ._fence import Fence
from ._records import Recorder
from ._target import open_target

__all__ = ["WorkerConfig", "build_parser", "main"]


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker does (see :func:`build_parser` for the meaning of each field)."""

    url: str
    backend_factory: str | None
    name: str
    ttl: float
    margin: float | None
    fence: str
    out: str
    rounds: int | None
    write_interval: float
    work: float
    hold_min: float
    hold_max: float
    acquire_timeout: float
    seed: int | None
    election: bool = False
    limit: int | None = None
    rw: bool = False
    read_share: float = 0.7


class _Body:
    """The records of one protected body (``mode``: ``read`` or ``write`` in the
    read-write form; ``fenced``: whether its writes may be refused)."""

    def __init__(
        self,
        lease: Lease,
        attempt: float,
        fence: Fence,
        recorder: Recorder,
        mode: str | None = None,
        *,
        fenced: bool = True,
    ) -> None:
        self.lease = lease
        self.token = lease.token
        self.attempt = attempt
        self.mode = mode
        self.fenced = fenced
        self._fence = fence
        self._recorder = recorder
        self._pid = recorder.pid
        lease._on_end(self._ended)

    def _ended(self, reason: LossReason) -> None:
        self._recorder.emit("end", token=self.token, reason=reason.value, at=time.monotonic())

    def write(self, *, register: bool = False) -> None:
        """Write once to the fence with this body's token, and record the answer."""
        begin = time.monotonic()
        answer = self._fence.write(self._pid, self.token, fenced=self.fenced)
        end = time.monotonic()
        self._recorder.emit(
            "write",
            token=self.token,
            begin=begin,
            end=end,
            accepted=answer.accepted,
            seq=answer.seq,
            register=register,
            fenced=self.fenced,
        )

    async def run(self, length: float, interval: float, work: float) -> None:
        """Register, record the start, then run steps for ``length`` seconds.

        Each step is a checkpoint (``interval`` seconds of sleep), a write, ``work``
        seconds of blocking work, and another write.
        """
        self.write(register=True)
        start = time.monotonic()
        mode = {} if self.mode is None else {"mode": self.mode}
        self._recorder.emit("start", token=self.token, attempt=self.attempt, start=start, **mode)
        try:
            while time.monotonic() < start + length:
                await anyio.sleep(interval)
                self.write()
                if work:
                    time.sleep(work)  # noqa: ASYNC251 - blocking on purpose: CPU-bound work
                    self.write()
        finally:
            self._recorder.emit("stop", token=self.token, stop=time.monotonic())

    def outcome(self, outcome: str, error: BaseException | None = None) -> None:
        """Record how ``async with`` finished."""
        text = None if error is None else describe(error)
        self._recorder.emit("outcome", token=self.token, outcome=outcome, error=text)


def describe(error: BaseException) -> str:
    """``Type: message``, with the leaves of an exception group, and where it came from."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, BaseExceptionGroup):
        text += " [" + "; ".join(describe(leaf) for leaf in error.exceptions) + "]"
    elif error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        text += f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"
    return text


#: Opens one body's hold of the lease: acquire within ``timeout`` seconds, then hold;
#: with the body's mode (``read``/``write``, or ``None``) and whether its writes are fenced.
Holder = Callable[[float], tuple[AbstractAsyncContextManager[Lease], str | None, bool]]


@asynccontextmanager
async def _term(elector: Elector, timeout: float) -> AsyncIterator[Lease]:
    """One term of ``elector``: campaign for at most ``timeout`` seconds, then lead.

    :raises TimeoutError: not elected in time
    """
    with anyio.CancelScope(deadline=anyio.current_time() + timeout) as campaign:
        async with elector.leadership() as lease:
            campaign.deadline = math.inf  # elected: the term is not bounded
            yield lease
    if campaign.cancelled_caught:
        raise TimeoutError(f"not elected for {elector.name!r} within {timeout:g}s")


def _holder(backend: Backend, cfg: WorkerConfig, identity: str) -> Holder:
    if cfg.election:
        elector = Elector(backend, cfg.name, ttl=cfg.ttl, margin=cfg.margin, identity=identity)
        return lambda timeout: (_term(elector, timeout), None, True)
    if cfg.limit is not None:
        sem = AsyncSemaphore(
            backend, cfg.name, limit=cfg.limit, ttl=cfg.ttl, margin=cfg.margin, identity=identity
        )
        return lambda timeout: (sem.hold(timeout=timeout), None, False)
    if cfg.rw:
        rw = AsyncReadWriteLock(
            backend, cfg.name, ttl=cfg.ttl, margin=cfg.margin, identity=identity
        )

        def either(timeout: float) -> tuple[AbstractAsyncContextManager[Lease], str, bool]:
            if random.random() < cfg.read_share:
                return rw.read().hold(timeout=timeout), "read", False
            return rw.write().hold(timeout=timeout), "write", True

        return either
    lock = AsyncLock(backend, cfg.name, ttl=cfg.ttl, margin=cfg.margin, identity=identity)
    return lambda timeout: (lock.hold(timeout=timeout), None, True)


async def _hold_once(
    hold: Holder,
    cfg: WorkerConfig,
    stop_at: float | None,
    fence: Fence,
    recorder: Recorder,
) -> bool:
    """Acquire, run one body (cut short at ``stop_at``), and record it.

    :returns: whether a body ran
    """
    attempt = time.monotonic()
    timeout = (
        cfg.acquire_timeout if stop_at is None else min(cfg.acquire_timeout, stop_at - attempt)
    )
    body: _Body | None = None
    length = random.uniform(cfg.hold_min, cfg.hold_max) * cfg.ttl
    holding, mode, fenced = hold(max(timeout, 0.0))
    try:
        async with holding as lease:
            body = _Body(lease, attempt, fence, recorder, mode, fenced=fenced)
            if stop_at is not None:
                length = max(min(length, stop_at - time.monotonic()), 0.0)
            await body.run(length, cfg.write_interval, cfg.work)
    except LeaseLostError as exc:
        if body is None:
            raise
        body.outcome("lost", exc)
    except (TimeoutError, LeaseHeldError, BackendError) as exc:
        # LeaseHeldError: hold(timeout=0), a last try as the run ends, found it taken.
        if body is not None:
            body.outcome("error", exc)
            return True
        recorder.emit("acquire_error", error=f"{type(exc).__name__}: {exc}", at=time.monotonic())
        return False
    except Exception as exc:
        if body is None:
            raise
        body.outcome("error", exc)
    else:
        assert body is not None
        body.outcome("released")
    return True


def parse_go(line: str) -> float | None:
    """The stop time in a ``go STOP_AT`` / ``go none`` line.

    :raises ValueError: anything else (the controller went away: an empty line)
    """
    word, _, value = line.strip().partition(" ")
    if word != "go":
        raise ValueError(f"expected 'go STOP_AT' on stdin, got {line!r}")
    return None if value == "none" else float(value)


async def contend(cfg: WorkerConfig) -> None:
    """Hold the lease again and again until the stop time or ``cfg.rounds`` bodies."""
    pid = os.getpid()
    with Fence(cfg.fence) as fence, Recorder(cfg.out, pid) as recorder:
        async with open_target(cfg.url, cfg.backend_factory) as backend:
            hold = _holder(backend, cfg, f"safety-{pid}")
            print("ready", flush=True)
            stop_at = parse_go(await anyio.to_thread.run_sync(sys.stdin.readline))
            bodies = 0
            while cfg.rounds is None or bodies < cfg.rounds:
                if stop_at is not None and time.monotonic() >= stop_at:
                    break
                if await _hold_once(hold, cfg, stop_at, fence, recorder):
                    bodies += 1
                    # Give the others a chance now and then, without relying on it.
                    await anyio.sleep(random.uniform(0.0, 0.02))
                else:
                    await anyio.sleep(cfg.ttl / 10)  # the backend failed: do not hammer it


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line (the controller builds it; people need not)."""
    p = argparse.ArgumentParser(prog="python -m aiolease.testing.safety._worker")
    p.add_argument("--url", required=True)
    p.add_argument("--backend-factory")
    p.add_argument("--name", required=True)
    p.add_argument("--ttl", type=float, required=True)
    p.add_argument("--margin", type=float)
    p.add_argument("--fence", required=True, help="the fence's SQLite file")
    p.add_argument("--out", required=True, help="the JSON-lines file to record to")
    p.add_argument("--rounds", type=int, help="stop after this many bodies")
    p.add_argument("--write-interval", type=float, default=0.002, help="checkpoint sleep")
    p.add_argument("--work", type=float, default=0.02, help="blocking work between writes")
    p.add_argument("--hold-min", type=float, default=0.5, help="shortest body, in ttls")
    p.add_argument("--hold-max", type=float, default=1.5, help="longest body, in ttls")
    p.add_argument("--acquire-timeout", type=float, default=10.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--loop", choices=["asyncio", "trio"], default="asyncio")
    p.add_argument("--election", action="store_true", help="hold terms of an Elector")
    p.add_argument("--limit", type=int, help="hold permits of an AsyncSemaphore of this limit")
    p.add_argument("--rw", action="store_true", help="read or write an AsyncReadWriteLock")
    p.add_argument("--read-share", type=float, default=0.7, help="--rw: the share of reads")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and contend; returns the exit status."""
    args = build_parser().parse_args(argv)
    cfg = WorkerConfig(
        url=args.url,
        backend_factory=args.backend_factory,
        name=args.name,
        ttl=args.ttl,
        margin=args.margin,
        fence=args.fence,
        out=args.out,
        rounds=args.rounds,
        write_interval=args.write_interval,
        work=args.work,
        hold_min=args.hold_min,
        hold_max=args.hold_max,
        acquire_timeout=args.acquire_timeout,
        seed=args.seed,
        election=args.election,
        limit=args.limit,
        rw=args.rw,
        read_share=args.read_share,
    )
    random.seed(cfg.seed)
    anyio.run(contend, cfg, backend=args.loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
