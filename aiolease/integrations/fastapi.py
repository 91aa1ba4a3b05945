"""FastAPI and Starlette: the backend and leader-only jobs for the app's life, a lock per
request, leadership for health endpoints (extra ``[fastapi]``).

::

    leases = Leases("redis://127.0.0.1:6379/0")

    @leases.leader_job("scheduler", ttl=10)
    async def scheduler(lease: Lease) -> None: ...

    app = FastAPI()
    leases.install(app)  # exception handlers; the backend and jobs for the app's life

    @app.post("/invoices/{invoice_id}/charge")
    async def charge(invoice_id: int, lease: Lease = leases.lock("invoices/{invoice_id}", ttl=10)):
        ...  # cancelled if the lease is lost: the client then gets 503

The lock is a dependency with ``yield`` in FastAPI's ``scope="function"`` (FastAPI 0.121
and later), so it is released when the path operation returns, before the response is
sent; the default scope would hold it until the response has been sent.
"""

# No ``from __future__ import annotations``: FastAPI reads the dependency's parameter
# annotation (``request: Request``), and older versions do not evaluate strings there.
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, final

try:
    from fastapi import Depends, Request
    from fastapi.responses import JSONResponse
    from starlette.applications import Starlette
    from starlette.requests import Request as StarletteRequest
    from starlette.responses import Response
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "aiolease.integrations.fastapi needs FastAPI: pip install 'aiolease[fastapi]'"
    ) from exc

from .._elector import LeaderInfo
from .._exceptions import LeaseHeldError, LeaseLostError
from .._lease import Lease
from .._validate import check_name
from ._common import BAD_NAME_BODY, BadLockName, Hub, LockSpec, error_body

__all__ = ["Leases"]


@final
class _LockDependency:
    """The dependency that :meth:`Leases.lock` returns: holds the lock for one request."""

    def __init__(self, hub: "Leases", spec: LockSpec) -> None:
        self.hub = hub
        self.spec = spec

    def __repr__(self) -> str:
        return f"<aiolease lock {self.spec.name.template!r}>"

    async def __call__(self, request: Request) -> AsyncIterator[Lease]:
        async with self.hub._hold(self.spec, request.path_params) as lease:
            yield lease


def _calls(dependant: Any) -> Iterator[object]:
    """Every dependency callable under a route's dependant, depth first."""
    for sub in getattr(dependant, "dependencies", ()):
        yield sub.call
        yield from _calls(sub)


@final
class Leases(Hub):
    """aiolease for one FastAPI or Starlette app.

    Call :meth:`install` on the app once; declare leader-only jobs with
    :meth:`leader_job` before it starts.
    """

    def install(self, app: Starlette, *, lifespan: bool = True) -> None:
        """Install the exception handlers that turn a held lock into ``held_status``
        (default 409) and a lost one into ``lost_status`` (default 503); and, unless
        ``lifespan=False``, wrap the app's lifespan in :meth:`lifespan`, so that the
        backend is open (and the leader jobs run) around the app's own startup and
        shutdown code.

        Call it before the app serves (exception handlers cannot be added later).
        """
        app.add_exception_handler(LeaseHeldError, self._error_response)
        app.add_exception_handler(LeaseLostError, self._error_response)
        app.add_exception_handler(BadLockName, self._error_response)
        if lifespan:
            inner = app.router.lifespan_context

            @asynccontextmanager
            async def composed(app: Any) -> AsyncIterator[Any]:  # the app's own state
                async with self.lifespan(app), inner(app) as state:
                    yield state

            app.router.lifespan_context = composed

    def lifespan(self, app: Starlette) -> AbstractAsyncContextManager[None]:
        """The app's lifespan, or a part of your own: ``async with leases.lifespan(app):``.

        On entry it checks that every route's lock names only path parameters the route
        has (:class:`~aiolease.InvalidArgument` otherwise: the app does not start), opens
        the backend and starts the leader jobs; on exit it stops the jobs and closes the
        backend (one the app passed in is left open).
        """
        return self._lifespan(app)

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._check_routes(app)
        async with self.running():
            yield

    def _check_routes(self, app: Starlette) -> None:
        for route in app.routes:
            params = getattr(route, "param_convertors", {})
            for call in _calls(getattr(route, "dependant", None)):
                if isinstance(call, _LockDependency) and call.hub is self:
                    call.spec.name.check_params(params, f"the route {route.path!r}")  # type: ignore[attr-defined]

    async def _error_response(self, request: StarletteRequest, exc: Exception) -> Response:
        if isinstance(exc, BadLockName):
            return JSONResponse(BAD_NAME_BODY, status_code=400)
        assert isinstance(exc, (LeaseHeldError, LeaseLostError))
        status = self.lost_status if isinstance(exc, LeaseLostError) else self.held_status
        return JSONResponse(error_body(exc), status_code=status, headers={"Retry-After": "1"})

    def lock(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None = None,
        renew_interval: float | None = None,
        margin: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Any:
        """A dependency that holds the lock ``name`` while the path operation runs, and
        gives it the :class:`~aiolease.Lease` (with its fencing token)::

            lease: Lease = leases.lock("invoices/{invoice_id}", ttl=10, timeout=5)

        ``name`` may hold path parameters (``{invoice_id}``), filled from the request.
        The path operation is cancelled if the lease is lost; the client then gets
        ``lost_status``. If the lock is not had within ``timeout`` seconds (``0``: one
        try; ``None``: as long as it takes) the client gets ``held_status``.

        :raises InvalidArgument: on any bad argument
        """
        spec = LockSpec.build(
            name,
            ttl=ttl,
            timeout=timeout,
            renew_interval=renew_interval,
            margin=margin,
            metadata=metadata,
        )
        return Depends(_LockDependency(self, spec), scope="function")

    def hold(
        self,
        request: StarletteRequest,
        name: str,
        *,
        ttl: float,
        timeout: float | None = None,
        renew_interval: float | None = None,
        margin: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> AbstractAsyncContextManager[Lease]:
        """:meth:`lock` for Starlette endpoints, which have no dependencies::

            async with leases.hold(request, "invoices/{invoice_id}", ttl=10) as lease:
                ...

        The same names, errors and responses (through the handlers :meth:`install`
        installs), but the arguments are checked on each call, and the route's path
        parameters only when a request comes.

        :raises InvalidArgument: on any bad argument
        """
        spec = LockSpec.build(
            name,
            ttl=ttl,
            timeout=timeout,
            renew_interval=renew_interval,
            margin=margin,
            metadata=metadata,
        )
        return self._hold(spec, request.path_params)

    def is_leader(self, job: str) -> Any:
        """A dependency: whether this process leads for the leader job ``job`` now.

        :raises InvalidArgument: there is no such job (declare it first)
        """
        self._job(job)

        async def leading() -> bool:
            return self.leading(job)

        return Depends(leading)

    def current_leader(self, name: str) -> Any:
        """A dependency: who leads ``name`` now, in any process
        (:class:`~aiolease.LeaderInfo`, or ``None``); one round trip to the backend."""
        check_name(name)

        async def leader() -> LeaderInfo | None:
            return await self.leader(name)

        return Depends(leader)
