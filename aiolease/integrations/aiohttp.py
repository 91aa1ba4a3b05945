"""aiohttp: the backend and leader-only jobs for the app's life, a lock per request
(extra ``[aiohttp]``).

::

    leases = Leases("redis://127.0.0.1:6379/0")

    @leases.leader_job("scheduler", ttl=10)
    async def scheduler(lease: Lease) -> None: ...

    app = web.Application()
    app.cleanup_ctx.append(leases.cleanup_ctx)

    @routes.post("/invoices/{invoice_id}/charge")
    @leases.locked("invoices/{invoice_id}", ttl=10, timeout=5)
    async def charge(request: web.Request, lease: Lease) -> web.Response: ...
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import final

try:
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "aiolease.integrations.aiohttp needs aiohttp: pip install 'aiolease[aiohttp]'"
    ) from exc

from .._exceptions import LeaseHeldError, LeaseLostError
from .._lease import Lease
from ._common import BAD_NAME_BODY, BadLockName, Hub, LockSpec, error_body, logger

__all__ = ["Leases"]

LockedHandler = Callable[[web.Request, Lease], Awaitable[web.StreamResponse]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: The attribute that marks a handler made by :meth:`Leases.locked`, for the check at start.
_SPEC = "__aiolease_lock__"


@final
class Leases(Hub):
    """aiolease for one aiohttp app.

    Append :meth:`cleanup_ctx` to ``app.cleanup_ctx``; declare leader-only jobs with
    :meth:`leader_job` before the app starts.
    """

    async def cleanup_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """For ``app.cleanup_ctx``: check the routes' lock names, open the backend and
        start the leader jobs at startup; stop the jobs and close the backend at cleanup.

        The backend and the jobs live in a task of their own, started here and awaited at
        cleanup, so that they do not depend on which task aiohttp (or a test) starts and
        cleans up the app in. Should that task end early, which only a bug can make
        happen, it is logged and the app is stopped as for ``on_crash="exit"``.

        :raises InvalidArgument: a route's lock names a parameter the route lacks
        """
        self._check_routes(app)
        started = asyncio.Event()
        stopping = asyncio.Event()

        async def host() -> None:
            async with self.running():
                started.set()
                await stopping.wait()

        task = asyncio.get_running_loop().create_task(host(), name="aiolease")
        ready = asyncio.get_running_loop().create_task(started.wait())
        try:
            await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the startup was cancelled: leave nothing running
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            ready.cancel()
        if task.done():
            await task  # the backend could not be opened: the app does not start
        task.add_done_callback(functools.partial(self._host_ended, stopping))
        try:
            yield
        finally:
            stopping.set()
            await task

    def _host_ended(self, stopping: asyncio.Event, task: asyncio.Task[None]) -> None:
        if stopping.is_set():
            return
        exc = task.exception() if not task.cancelled() else asyncio.CancelledError()
        logger.critical("the aiolease task ended while the app runs: %r", exc, exc_info=exc)
        self._crashed("(all)", exc or RuntimeError("the aiolease task ended"))

    def _check_routes(self, app: web.Application) -> None:
        for resource in app.router.resources():
            pattern = resource.get_info().get("pattern")
            params = getattr(pattern, "groupindex", {})
            for route in resource:
                spec = getattr(route.handler, _SPEC, None)
                if isinstance(spec, LockSpec):
                    where = f"the route {resource.canonical!r}"
                    spec.name.check_params(params, where)

    def locked(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None = None,
        renew_interval: float | None = None,
        margin: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Callable[[LockedHandler], Handler]:
        """Decorate ``async def handler(request, lease)`` to hold the lock ``name`` while
        it runs; aiohttp calls it as ``handler(request)``.

        ``name`` may hold path parameters (``{invoice_id}``), filled from
        ``request.match_info``. The handler is cancelled if the lease is lost; the client
        then gets ``lost_status`` (default 503). If the lock is not had within
        ``timeout`` seconds (``0``: one try; ``None``: as long as it takes) the client
        gets ``held_status`` (default 409). Both are JSON bodies with a ``Retry-After``
        header.

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

        def decorate(handler: LockedHandler) -> Handler:
            @functools.wraps(handler)
            async def locked_handler(request: web.Request) -> web.StreamResponse:
                try:
                    async with self._hold(spec, request.match_info) as lease:
                        return await handler(request, lease)
                except BadLockName:
                    return web.json_response(BAD_NAME_BODY, status=400)
                except (LeaseHeldError, LeaseLostError) as exc:
                    status = (
                        self.lost_status if isinstance(exc, LeaseLostError) else self.held_status
                    )
                    return web.json_response(
                        error_body(exc), status=status, headers={"Retry-After": "1"}
                    )

            setattr(locked_handler, _SPEC, spec)
            return locked_handler

        return decorate
