"""The controller: start the workers, inject faults, collect and check the records."""

from __future__ import annotations

import os
import secrets
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

import anyio
from anyio.abc import Process

from ..._exceptions import InvalidArgument
from ..._lease import Timing
from ..._registry import backend_class, scheme_of
from ..._urls import redact, scrub
from ..._validate import check_count, check_name, check_seconds
from ...abc import Capability
from ._check import check
from ._faults import Aim, Cuttable, Fault, Injector, ServerControl
from ._fence import Fence
from ._hosted import HostedServer
from ._procs import ChildError, first_line, python_module, stop_for_sure, tail
from ._proxies import open_proxy
from ._records import Pause, read_records
from ._report import SafetyReport
from ._target import import_root, load_factory, open_target

if TYPE_CHECKING:
    from ..etcd_cluster import EtcdCluster

__all__ = ["Plan", "run_safety"]

Loop = Literal["asyncio", "trio"]


@dataclass(frozen=True)
class Plan:
    """A validated safety run (see :func:`run_safety` for the fields)."""

    url: str
    fault: Fault
    processes: int
    duration: float | None
    rounds: int | None
    ttl: float
    margin: float | None
    loop: Loop
    backend_factory: str | None
    name: str
    fault_every: float
    fault_length: float
    fault_aim: Aim
    write_interval: float
    work: float
    hold: tuple[float, float]
    timeout: float
    server_control: ServerControl | None = None
    workdir: Path | None = None
    seed: int | None = None
    pythonpath: tuple[str, ...] = field(default=())
    election: bool = False
    limit: int | None = None
    rw: bool = False

    @property
    def permits(self) -> bool:
        """The semaphore or the read-write form."""
        return self.limit is not None or self.rw

    @property
    def scheme(self) -> str:
        """The URL's scheme."""
        return scheme_of(self.url)

    @property
    def label(self) -> str:
        """How the summary line names the backend."""
        if self.backend_factory is not None:
            return self.backend_factory.rpartition(":")[2]
        return self.scheme

    async def capabilities(self) -> frozenset[Capability]:
        """What the backend under test declares, once open (some backends, such as
        Redis with or without an fsynced append-only file, decide per server)."""
        async with open_target(self.url, self.backend_factory) as backend:
            return backend.capabilities

    async def not_applicable(self) -> str | None:
        """Why :attr:`fault` means nothing for this backend, or ``None`` if it applies."""
        scheme = self.scheme
        if self.permits and Capability.SEMAPHORE not in await self.capabilities():
            return "it serves no semaphores or read-write locks"
        if self.fault is Fault.BLACKHOLE and scheme == "sqlite":
            return "SQLite has no network connection to cut"
        if self.fault is Fault.SERVER_RESTART:
            if scheme == "sqlite":
                return "SQLite has no server to restart"
            if scheme == "memory":
                return "a restarted memory server forgets its tokens (no durable_tokens)"
            if Capability.DURABLE_TOKENS not in await self.capabilities():
                return "its tokens do not survive a restart (no durable_tokens)"
        return None


def _etcd_cluster(url: str) -> EtcdCluster:
    """The etcd cluster ``url`` names, to kill its leader.

    :raises InvalidArgument: ``url`` is not an etcd URL naming at least three members
    """
    parts = urlsplit(url)
    endpoints = parts.netloc.rpartition("@")[2].split(",")
    if parts.scheme != "etcd" or len(endpoints) < 3:
        raise InvalidArgument(
            "fault etcd-leader-kill needs an etcd cluster URL with at least three members "
            f"(etcd://HOST:PORT,HOST:PORT,HOST:PORT), got {url!r}"
        )
    from ..etcd_cluster import EtcdCluster

    try:
        return EtcdCluster(endpoints)
    except ValueError as exc:
        raise InvalidArgument(scrub(f"bad etcd cluster URL {redact(url)!r}: {exc}", url)) from None


#: The files a run leaves in its directory (removed before a run reuses it).
_RUN_FILES = ("fence.db*", "worker-*.jsonl", "worker-*.err", "server.err")


def _validate(
    url: str,
    fault: Fault | str,
    processes: int,
    duration: float | None,
    rounds: int | None,
    ttl: float,
    margin: float | None,
    hold: tuple[float, float],
    forms: tuple[bool, int | None, bool],
) -> tuple[Fault, float | None]:
    """Check the arguments of :func:`run_safety`; return the fault and the duration.

    :raises InvalidArgument: on any bad one
    """
    try:
        fault = Fault(fault)
    except ValueError:
        known = ", ".join(f.value for f in Fault)
        raise InvalidArgument(f"unknown fault {fault!r}; known: {known}") from None
    scheme_of(url)
    if check_count("processes", processes) < 2:
        raise InvalidArgument(f"at least 2 processes are needed to contend, got {processes}")
    if duration is not None and rounds is not None:
        raise InvalidArgument("give a duration or a number of rounds, not both")
    if rounds is not None:
        check_count("rounds", rounds)
    elif duration is not None:
        check_seconds("duration", duration)
    Timing._build(ttl, margin=margin)  # a bad ttl or margin
    if not 0 < check_seconds("hold[0]", hold[0]) <= check_seconds("hold[1]", hold[1]):
        raise InvalidArgument(f"hold must be (shortest, longest) body in ttls, got {hold!r}")
    election, limit, rw = forms
    if election + (limit is not None) + rw > 1:
        raise InvalidArgument("give one form at most: election, limit or rw")
    if limit is not None and not 1 <= check_count("limit", limit) < processes:
        raise InvalidArgument(
            f"limit must be at least 1 and below processes ({processes}) to contend, got {limit}"
        )
    return fault, (10.0 if duration is None and rounds is None else duration)


async def run_safety(
    url: str,
    *,
    fault: Fault | str = Fault.NONE,
    processes: int = 5,
    duration: float | None = None,
    rounds: int | None = None,
    ttl: float = 1.0,
    margin: float | None = None,
    runs: int = 1,
    loop: Loop = "asyncio",
    backend_factory: str | None = None,
    name: str | None = None,
    fault_every: float | None = None,
    fault_length: float | None = None,
    fault_aim: Aim = "any",
    write_interval: float = 0.002,
    work: float = 0.02,
    hold: tuple[float, float] = (0.5, 1.5),
    timeout: float | None = None,
    server_control: ServerControl | None = None,
    workdir: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    election: bool = False,
    limit: int | None = None,
    rw: bool = False,
) -> SafetyReport:
    """Let ``processes`` OS processes contend for ``name`` under ``fault``, and check.

    :param url: the backend (``memory://`` is hosted in a server process for the run)
    :param fault: what to inject (see :class:`Fault`)
    :param processes: how many worker processes contend
    :param duration: seconds to contend (default 10 s, unless ``rounds`` is given)
    :param rounds: instead, how many bodies each worker runs
    :param ttl: the lease ttl
    :param margin: the lease margin (default: the library's)
    :param runs: repeat the run this many times and add up the reports
    :param loop: the event loop of the workers (and of a hosted server)
    :param backend_factory: ``module:attr`` of a Backend class or async factory to
        open ``url`` with, instead of the one its scheme selects
    :param name: the contended lease name (default: ``safety-`` and a random suffix,
        so that runs sharing a server do not meet)
    :param fault_every: seconds from the end of one fault to the next (default ``ttl``);
        with a duration, no fault starts later than ``1.5 * ttl`` before the end
    :param fault_length: how long a fault lasts (default ``1.5 * ttl``)
    :param fault_aim: ``any``: hit the holder at whatever point of its body it is
        when the fault is due; ``fresh``: wait for the next grant and hit it at once
    :param write_interval: seconds a body sleeps at each checkpoint (between steps)
    :param work: seconds of blocking work between the two writes of a step (see
        :mod:`._worker`: a pause then most likely freezes a body between taking its
        token and writing with it)
    :param hold: shortest and longest body, in ttls
    :param timeout: give up on a run after this many seconds (default: generous)
    :param server_control: kills and starts the server, for ``server-restart``
    :param workdir: keep the records here (default: a temporary directory)
    :param seed: seeds the workers' random choices (worker ``i`` gets ``seed + i``)
    :param election: the election form: each body is a term of
        ``Elector.leadership()`` instead of an ``async with AsyncLock`` (for a backend
        that serves election only, and to check elections anywhere)
    :param limit: the semaphore form: each body holds one permit of an
        ``AsyncSemaphore`` of this limit; at most ``limit`` bodies may run at once.
        Its writes are unfenced (see :mod:`._fence`): there the checks are the count,
        and the tokens' uniqueness and order
    :param rw: the read-write form: each body reads or writes an
        ``AsyncReadWriteLock`` (at random, mostly reads); a writer's body must not
        overlap any other body, and a writer's stale write must be refused
    :raises InvalidArgument: bad arguments, or a fault that cannot be injected as asked
        (``etcd-leader-kill`` on anything but an etcd cluster; ``server-restart``
        without ``server_control`` on a backend that has a server)
    """
    fault, duration = _validate(
        url, fault, processes, duration, rounds, ttl, margin, hold, (election, limit, rw)
    )
    pythonpath: tuple[str, ...] = ()
    if backend_factory is not None:
        load_factory(backend_factory)
        root = import_root(backend_factory)
        pythonpath = () if root is None else (root,)
    if timeout is None:
        per_round = processes * (hold[1] + 1) * ttl * 3
        timeout = 60.0 + (duration if duration is not None else (rounds or 1) * per_round)
    plan = Plan(
        url=url,
        fault=fault,
        processes=processes,
        duration=duration,
        rounds=rounds,
        ttl=ttl,
        margin=margin,
        loop=loop,
        backend_factory=backend_factory,
        name=f"safety-{secrets.token_hex(4)}" if name is None else check_name(name),
        fault_every=check_seconds("fault_every", ttl if fault_every is None else fault_every),
        fault_length=check_seconds(
            "fault_length", 1.5 * ttl if fault_length is None else fault_length
        ),
        fault_aim=fault_aim,
        write_interval=check_seconds("write_interval", write_interval),
        work=check_seconds("work", work, allow_zero=True),
        hold=hold,
        timeout=check_seconds("timeout", timeout),
        server_control=server_control,
        workdir=None if workdir is None else Path(workdir),
        seed=seed,
        pythonpath=pythonpath,
        election=election,
        limit=limit,
        rw=rw,
    )
    cluster = _etcd_cluster(url) if fault is Fault.ETCD_LEADER_KILL else None
    if backend_factory is None:
        backend_class(plan.scheme)  # BackendNotFound now, not in every worker
    reason = await plan.not_applicable()
    if reason is not None:
        return SafetyReport.not_applicable(plan.label, fault, reason)
    if fault is Fault.SERVER_RESTART and server_control is None and plan.scheme != "memory":
        raise InvalidArgument(f"fault server-restart on {redact(url)!r} needs a server_control")
    report: SafetyReport | None = None
    for index in range(check_count("runs", runs)):
        with _run_dir(plan.workdir, f"{plan.label}-{fault.value}-{index}") as directory:
            one = await _one_run(plan, directory, cluster)
        report = one if report is None else report + one
    assert report is not None
    return report


class _run_dir:
    """The directory of one run: ``workdir/name`` (kept), or temporary (removed)."""

    def __init__(self, workdir: Path | None, name: str) -> None:
        self._temp: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._temp = tempfile.TemporaryDirectory(prefix="aiolease-safety-")
            self.path = Path(self._temp.name)
            return
        self.path = workdir / name
        self.path.mkdir(parents=True, exist_ok=True)
        for pattern in _RUN_FILES:  # records of an earlier run must not mix in
            for old in self.path.glob(pattern):
                old.unlink()

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        if self._temp is not None:
            self._temp.cleanup()


@dataclass
class _Worker:
    process: Process
    out: Path
    err: Path

    @property
    def pid(self) -> int:
        return self.process.pid


def _worker_args(plan: Plan, url: str, fence: Path, out: Path, index: int) -> list[str]:
    args = ["--url", url, "--name", plan.name, "--ttl", repr(plan.ttl), "--fence", str(fence)]
    args += ["--out", str(out), "--write-interval", repr(plan.write_interval)]
    args += ["--work", repr(plan.work)]
    args += ["--hold-min", repr(plan.hold[0]), "--hold-max", repr(plan.hold[1])]
    args += ["--acquire-timeout", repr(max(5 * plan.ttl, 2.0)), "--loop", plan.loop]
    if plan.election:
        args += ["--election"]
    if plan.limit is not None:
        args += ["--limit", str(plan.limit)]
    if plan.rw:
        args += ["--rw"]
    if plan.margin is not None:
        args += ["--margin", repr(plan.margin)]
    if plan.backend_factory is not None:
        args += ["--backend-factory", plan.backend_factory]
    if plan.rounds is not None:
        args += ["--rounds", str(plan.rounds)]
    if plan.seed is not None:
        args += ["--seed", str(plan.seed + index)]
    return args


def _env(plan: Plan) -> dict[str, str]:
    env = dict(os.environ)
    if plan.pythonpath:
        given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([*plan.pythonpath, *given])
    return env


@asynccontextmanager
async def _workers(
    plan: Plan, urls: Sequence[str], directory: Path, fence: Path
) -> AsyncIterator[list[_Worker]]:
    """Start one worker per URL; wait until all are ready; stop the rest on exit."""
    workers: list[_Worker] = []
    try:
        for index, url in enumerate(urls):
            out, err = directory / f"worker-{index}.jsonl", directory / f"worker-{index}.err"
            args = _worker_args(plan, url, fence, out, index)
            process = await python_module(
                "aiolease.testing.safety._worker", args, stderr=err, env=_env(plan)
            )
            workers.append(_Worker(process, out, err))
        for worker in workers:
            line = await first_line(worker.process, 60.0, worker.err)
            if line.strip() != "ready":
                raise ChildError(f"worker {worker.pid} said {line!r}: {tail(worker.err)}")
        yield workers
    finally:
        for worker in workers:
            await stop_for_sure(worker.process)


async def _go(workers: Sequence[_Worker], stop_at: float | None) -> None:
    line = f"go {'none' if stop_at is None else repr(stop_at)}\n".encode()
    for worker in workers:
        assert worker.process.stdin is not None
        await worker.process.stdin.send(line)
        await worker.process.stdin.aclose()


async def _contend(plan: Plan, workers: Sequence[_Worker], injector: Injector) -> list[str]:
    """Let the workers run (faults injected meanwhile); return what went wrong."""
    errors: list[str] = []
    stop_at = last_start = None
    if plan.duration is not None:
        stop_at = time.monotonic() + plan.duration
        # The others must still contend when the holder's lease runs out under the fault.
        last_start = stop_at - 1.5 * plan.ttl
    await _go(workers, stop_at)
    with anyio.move_on_after(plan.timeout) as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(injector.run, last_start)
            for worker in workers:
                await worker.process.wait()
            tg.cancel_scope.cancel()
    if scope.cancelled_caught:
        errors.append(f"the run did not finish within {plan.timeout:g}s")
    for worker in workers:
        code = worker.process.returncode
        if worker.pid in injector.killed and code == -signal.SIGKILL:
            continue
        if code not in (0, None):
            errors.append(f"worker {worker.pid} exited with {code}: {tail(worker.err)}")
    return errors


async def _one_run(plan: Plan, directory: Path, cluster: EtcdCluster | None) -> SafetyReport:
    fence_path = directory / "fence.db"
    Fence(fence_path).close()  # created here, once, before the workers race to open it
    async with AsyncExitStack() as stack:
        url, control = plan.url, plan.server_control
        if plan.scheme == "memory":
            hosted = HostedServer(plan.url, directory / "server.err", loop=plan.loop)
            await hosted.start()
            stack.push_async_callback(hosted.aclose)
            url, control = hosted.url(request_timeout=max(2 * plan.ttl, 1.0)), hosted
        urls: list[str] = []
        proxies: list[Cuttable] = []
        for _ in range(plan.processes):
            if plan.fault is Fault.BLACKHOLE:
                proxy = await stack.enter_async_context(open_proxy(url))
                proxies.append(proxy)
                urls.append(proxy.url_for(url))
            else:
                urls.append(url)
        backend = await stack.enter_async_context(open_target(url, plan.backend_factory))
        workers = await stack.enter_async_context(_workers(plan, urls, directory, fence_path))
        pids = [w.pid for w in workers]
        fence = stack.enter_context(Fence(fence_path))
        injector = Injector(
            plan.fault,
            backend,
            plan.name,
            pids,
            every=plan.fault_every,
            length=plan.fault_length,
            aim=plan.fault_aim,
            started=lambda token: fence.highest() >= token,
            proxies=dict(zip(pids, proxies, strict=False)),  # none unless blackhole
            server=control,
            cluster=cluster,
            permits=plan.permits,
        )
        errors = await _contend(plan, workers, injector)
    return _report(plan, directory, fence_path, injector, errors)


def _report(
    plan: Plan, directory: Path, fence_path: Path, injector: Injector, errors: list[str]
) -> SafetyReport:
    records = read_records(sorted(directory.glob("worker-*.jsonl")))
    with Fence(fence_path) as fence:
        log, rejections = fence.log(), fence.rejections()
    events, killed = injector.events, injector.killed
    pauses = [Pause(e.pid, e.begin, e.end) for e in events if e.fault is Fault.SIGSTOP and e.pid]
    findings = check(records, log, rejections, pauses, limit=plan.limit, kills=killed)
    for pid, at in killed.items():
        if not any(h.pid != pid and h.start > at for h in records.holds):
            errors.append(f"no body started after worker {pid} was killed: no takeover was seen")
    if findings.acquisitions == 0:
        errors.append("no body ran: nothing was tested")
    if plan.fault is not Fault.NONE and not events:
        errors.append(f"no {plan.fault.value} fault was injected: make the run longer")
    return SafetyReport.of_run(
        plan.label, plan.fault, findings, len(events), records.acquire_errors, errors
    )
