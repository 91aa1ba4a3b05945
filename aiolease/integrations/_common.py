"""What the web-framework integrations share: one backend for the app's life, leader-only
jobs that outlive their own crashes, and lock names made from request parameters.

A framework module (``fastapi.py``, ``aiohttp.py``) adds only what its framework needs:
how the app's life is entered, how a request's parameters are read and how an error
becomes a response.
"""

from __future__ import annotations

import logging
import os
import signal
import string
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, final

import anyio

from .._elector import Elector, LeaderInfo
from .._exceptions import InvalidArgument, LeaseHeldError, LeaseLostError
from .._lease import Lease, Timing
from .._lock import AsyncLock
from .._registry import open_backend
from .._validate import check_metadata, check_name, check_seconds
from ..abc import Backend

__all__ = [
    "BAD_NAME_BODY",
    "BadLockName",
    "Hub",
    "LockName",
    "LockSpec",
    "error_body",
    "logger",
    "signal_own_process",
]

#: The logger of every integration: job crashes (with their traceback), restarts, stops.
logger = logging.getLogger("aiolease.integrations")

Job = Callable[[Lease], Awaitable[object]]
OnCrash = Literal["restart", "exit"]

#: HTTP statuses that a lock that cannot be had, or a lease lost, may map to.
_ERROR_STATUSES = range(400, 600)


def _check_on_crash(value: object) -> OnCrash:
    if value == "restart":
        return "restart"
    if value == "exit":
        return "exit"
    raise InvalidArgument(f"on_crash must be 'restart' or 'exit', not {value!r}")


def _check_status(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in _ERROR_STATUSES:
        raise InvalidArgument(f"{what} must be an HTTP error status (400-599), not {value!r}")
    return value


def signal_own_process() -> None:
    """Ask the server this process runs to shut down, as ``kill -TERM`` would: a graceful
    stop (requests in flight finish, the app's shutdown runs), after which uvicorn
    re-raises the signal, so that the process ends by SIGTERM (exit status 143 in a shell,
    -15 for ``subprocess``)."""
    os.kill(os.getpid(), signal.SIGTERM)


class BadLockName(InvalidArgument):
    """A request's parameters make a lock name that is not a valid lease name (more
    than 255 bytes, a NUL): the client's doing, answered with 400."""


#: The JSON body of the response to :class:`BadLockName` (the name is not repeated).
BAD_NAME_BODY = {"detail": "the request's parameters make no valid lock name"}


@final
class LockName:
    """A lock name template such as ``"invoices/{invoice_id}"``, filled from a request's
    path parameters.

    :raises InvalidArgument: a field is not a plain parameter name (``{}``, ``{a.b}``,
        ``{a!r}`` and ``{a:>5}`` are refused), or a template without fields is not a
        valid lease name
    """

    def __init__(self, template: object) -> None:
        if not isinstance(template, str):
            raise InvalidArgument(f"a lock name template must be a str, not {template!r}")
        try:
            parts = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise InvalidArgument(f"lock name template {template!r}: {exc}") from None
        fields: list[str] = []
        for _, field, spec, conversion in parts:
            if field is None:
                continue
            if not field.isidentifier() or spec or conversion:
                raise InvalidArgument(
                    f"lock name template {template!r}: each field must be a path parameter"
                    f" name such as {{invoice_id}}, not {{{field}}}"
                )
            fields.append(field)
        if not fields:
            check_name(template)
        self.template = template
        self.fields = frozenset(fields)

    def __repr__(self) -> str:
        return f"LockName({self.template!r})"

    def check_params(self, params: Iterable[str], where: str) -> None:
        """:raises InvalidArgument: ``params`` lacks a field of the template"""
        missing = self.fields.difference(params)
        if missing:
            raise InvalidArgument(
                f"lock name {self.template!r} needs the path parameter(s)"
                f" {', '.join(sorted(missing))}, which {where} does not have"
            )

    def format(self, params: Mapping[str, object]) -> str:
        """The lease name for one request (not checked: :class:`AsyncLock` does that).

        :raises InvalidArgument: ``params`` lacks a field of the template
        """
        self.check_params(params, "the request")
        return self.template.format_map({field: params[field] for field in self.fields})


@final
@dataclass(frozen=True)
class LockSpec:
    """How one route's requests lock: validated when the route is declared."""

    name: LockName
    ttl: float
    timeout: float | None
    options: Mapping[str, Any]

    @classmethod
    def build(
        cls,
        template: object,
        *,
        ttl: float,
        timeout: float | None,
        renew_interval: float | None,
        margin: float | None,
        metadata: Mapping[str, str] | None,
    ) -> LockSpec:
        """:raises InvalidArgument: on any bad argument"""
        Timing._build(ttl, renew_interval, margin)
        if timeout is not None:
            check_seconds("timeout", timeout, allow_zero=True)
        options: dict[str, Any] = {"renew_interval": renew_interval, "margin": margin}
        if metadata is not None:
            options["metadata"] = check_metadata(metadata)
        return cls(LockName(template), ttl, timeout, options)


@final
class _LeaderJob:
    """One leader-only job: its elector, and what became of its terms."""

    def __init__(self, name: str, fn: Job, on_crash: OnCrash, options: Mapping[str, Any]) -> None:
        self.name = name
        self.fn = fn
        self.on_crash = on_crash
        self.options = options
        self.elector: Elector | None = None
        self.crashes = 0
        self.last_crash: str | None = None

    async def supervise(self, backend: Backend, hub: Hub) -> None:
        """Campaign and run the job for each term won, for as long as the app runs.

        A crash is logged with its traceback and the job campaigns again after the
        hub's ``restart_backoff`` (or, with ``on_crash="exit"``, the hub stops the app);
        it never escapes, so it cannot close the backend under the app.
        """
        self.elector = elector = Elector(backend, self.name, **self.options)
        while True:
            try:
                await elector.run(self.fn)
            except Exception as exc:
                self.crashes += 1
                self.last_crash = type(exc).__name__
                logger.error(
                    "leader job %r crashed (crash %d): %r",
                    self.name,
                    self.crashes,
                    exc,
                    exc_info=exc,
                    extra={"job": self.name, "crashes": self.crashes},
                )
                if self.on_crash == "exit":
                    hub._crashed(self.name, exc)
                    return
                logger.info("leader job %r: campaigning again", self.name)
            else:
                logger.info("leader job %r returned: its term ended", self.name)
            await anyio.sleep(hub.restart_backoff)

    def status(self) -> dict[str, object]:
        elector = self.elector
        stats = None if elector is None else elector.statistics()
        return {
            "leading": stats is not None and stats.is_leader,
            "token": None if stats is None else stats.token,
            "identity": None if elector is None else elector.identity,
            "terms": 0 if stats is None else stats.terms,
            "crashes": self.crashes,
            "last_crash": self.last_crash,
        }


class Hub:
    """The app-wide part of an integration: the backend, open while the app runs, and
    the leader-only jobs run in the background meanwhile.
    """

    def __init__(
        self,
        backend: str | Backend,
        *,
        on_crash: OnCrash = "restart",
        restart_backoff: float = 1.0,
        stop: Callable[[], object] | None = None,
        held_status: int = 409,
        lost_status: int = 503,
        open_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Nothing is opened here: a backend URL is opened when the app starts.

        :param backend: a backend URL (opened when the app starts, closed when it stops) or
            an open :class:`~aiolease.Backend` (used as it is, never closed here)
        :param on_crash: what a crash of a leader job does, unless the job says otherwise:
            ``"restart"`` (log it, campaign again after ``restart_backoff``) or ``"exit"``
            (log it, then stop the app through ``stop``)
        :param restart_backoff: seconds between a job's crash (or return) and its next campaign
        :param stop: how ``on_crash="exit"`` stops the app (default: SIGTERM to this
            process, which uvicorn and aiohttp's ``run_app``, like most servers, take as a
            request to shut down gracefully)
        :param held_status: the HTTP status of a request whose lock is held elsewhere (or
            that waited ``timeout`` for it)
        :param lost_status: the HTTP status of a request whose lock was lost while it ran
        :param open_options: passed to :func:`~aiolease.open_backend` with a URL
        :raises InvalidArgument: on any bad argument
        """
        if not isinstance(backend, (str, Backend)):
            raise InvalidArgument(f"backend must be a URL or a Backend, not {type(backend)!r}")
        self._source = backend
        self._open_options = dict(open_options or {})
        self._on_crash = _check_on_crash(on_crash)
        self.restart_backoff = check_seconds("restart_backoff", restart_backoff, allow_zero=True)
        self._stop = signal_own_process if stop is None else stop
        self.held_status = _check_status("held_status", held_status)
        self.lost_status = _check_status("lost_status", lost_status)
        self._jobs: dict[str, _LeaderJob] = {}
        self._backend: Backend | None = None
        self._running = False
        #: The crash that stopped the app (``on_crash="exit"``), if one did.
        self.crash: BaseException | None = None

    # -- leader-only jobs --------------------------------------------------------------

    def leader_job(
        self,
        name: str,
        *,
        ttl: float,
        on_crash: OnCrash | None = None,
        identity: str | None = None,
        metadata: Mapping[str, str] | None = None,
        **elector_options: Any,
    ) -> Callable[[Job], Job]:
        """Decorate ``async def job(lease)`` to run it while this process leads ``name``.

        The job runs for each term won (cancelled when the term is lost), under an
        :class:`~aiolease.Elector` made with ``ttl`` and ``elector_options``. A job that
        returns ends its term; a job that raises is logged (logger
        ``aiolease.integrations``, with the traceback); either way this process campaigns
        again after ``restart_backoff``, unless ``on_crash="exit"``.

        :raises InvalidArgument: a bad argument, or a job of that name exists already
        :raises RuntimeError: the app runs already
        """
        check_name(name)
        if name in self._jobs:
            raise InvalidArgument(f"there is a leader job named {name!r} already")
        if self._running:
            raise RuntimeError("leader jobs must be declared before the app starts")
        crash = self._on_crash if on_crash is None else _check_on_crash(on_crash)
        options = {"ttl": ttl, "identity": identity, "metadata": metadata, **elector_options}
        # An elector on a backend that is never used checks the options now, where the
        # job is declared, rather than when the app starts.
        from ..backends.memory import MemoryBackend

        Elector(MemoryBackend(), name, **options)

        def register(fn: Job) -> Job:
            if not callable(fn):
                raise InvalidArgument(f"a leader job must be an async callable, not {fn!r}")
            self._jobs[name] = _LeaderJob(name, fn, crash, options)
            return fn

        return register

    def leading(self, job: str) -> bool:
        """Whether this process leads for the leader job ``job`` right now.

        :raises InvalidArgument: there is no such job
        """
        return bool(self._job(job).status()["leading"])

    async def leader(self, name: str) -> LeaderInfo | None:
        """Who leads ``name`` now, any process (``None``: nobody): one round trip.

        :raises BackendError: the backend failed
        :raises RuntimeError: the app is not running
        """
        return await _read_leader(self.backend, check_name(name))

    def status(self) -> dict[str, object]:
        """A JSON-ready snapshot for a health endpoint: whether the backend is open and,
        per leader job, whether this process leads, its token, terms and crashes."""
        return {
            "backend": "open" if self._backend is not None else "closed",
            "jobs": {name: job.status() for name, job in self._jobs.items()},
        }

    def _job(self, name: str) -> _LeaderJob:
        try:
            return self._jobs[name]
        except KeyError:
            raise InvalidArgument(f"there is no leader job named {name!r}") from None

    def _crashed(self, job: str, exc: BaseException) -> None:
        logger.critical(
            "leader job %r crashed and on_crash='exit': stopping the app", job, exc_info=exc
        )
        if self.crash is None:
            self.crash = exc
        self._stop()

    @property
    def exit_code(self) -> int:
        """``1`` if a crash stopped the app (``on_crash="exit"``), else ``0``: for
        ``sys.exit`` after the server returns."""
        return 0 if self.crash is None else 1

    # -- the app's life ----------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The backend, while the app runs.

        :raises RuntimeError: the app is not running (before its start, after its stop)
        """
        backend = self._backend
        if backend is None:
            raise RuntimeError(
                "the aiolease backend is not open: the app has not started, or has stopped"
            )
        return backend

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Backend]:
        """Open the backend and run the leader jobs until the block ends; then stop the
        jobs (each resigns) and close the backend, in that order.

        :raises RuntimeError: the hub runs already (one app at a time)
        """
        if self._running:
            raise RuntimeError("this aiolease hub serves one app at a time, and runs already")
        self._running = True
        try:
            async with AsyncExitStack() as stack:
                if isinstance(self._source, str):
                    backend = await stack.enter_async_context(
                        open_backend(self._source, **self._open_options)
                    )
                else:
                    backend = self._source
                self._backend = backend
                stack.callback(setattr, self, "_backend", None)
                async with anyio.create_task_group() as jobs:
                    for job in self._jobs.values():
                        jobs.start_soon(job.supervise, backend, self, name=f"aiolease {job.name}")
                    try:
                        yield backend
                    finally:
                        jobs.cancel_scope.cancel()
        finally:
            self._running = False

    # -- per-request locks -------------------------------------------------------------

    @asynccontextmanager
    async def _hold(self, spec: LockSpec, params: Mapping[str, object]) -> AsyncIterator[Lease]:
        """Hold the lock that ``spec`` names for ``params`` while the block runs.

        :raises LeaseHeldError: ``spec.timeout`` ran out (``0``: it was held); ``.holder``
            says who held it, when known
        :raises LeaseLostError: the lease was lost while the block ran (it was cancelled)
        :raises InvalidArgument: ``params`` lack a field of the name
        :raises BadLockName: ``params`` make a name that is not valid (too long, a NUL)
        """
        name = spec.name.format(params)
        try:
            check_name(name)
        except InvalidArgument as exc:
            raise BadLockName(str(exc)) from None
        lock = AsyncLock(self.backend, name, ttl=spec.ttl, **spec.options)
        async with AsyncExitStack() as stack:
            try:
                lease = await stack.enter_async_context(lock.hold(timeout=spec.timeout))
            except TimeoutError as exc:
                cause = exc.__cause__
                holder = cause.holder if isinstance(cause, LeaseHeldError) else None
                raise LeaseHeldError(lock.name, holder) from exc
            yield lease


async def _read_leader(backend: Backend, name: str) -> LeaderInfo | None:
    """Who leads ``name`` now, as :meth:`Elector.leader` reads it (any name: the app
    need not run an elector for it)."""
    holder = await backend.read(name)
    return None if holder is None else LeaderInfo._from_holder(holder)


def error_body(exc: LeaseHeldError | LeaseLostError) -> dict[str, str]:
    """The JSON body of a held or lost lock's response. The holder's identity (a host
    and a pid) is not shown to clients."""
    if isinstance(exc, LeaseLostError):
        return {"detail": f"lock lost while the request ran: {exc.reason.value}", "lock": exc.name}
    return {"detail": "locked: try again later", "lock": exc.name}
