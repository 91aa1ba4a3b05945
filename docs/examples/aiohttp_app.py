"""An aiohttp app on aiolease: a job that runs in one process of the fleet at a time, a
lock per request, and a health endpoint.

Run it with ``AIOLEASE_URL=redis://127.0.0.1:6379/0 python docs/examples/aiohttp_app.py``.
"""

from __future__ import annotations

import os
import sys
import time

import anyio
from aiohttp import web

from aiolease import Lease
from aiolease.integrations.aiohttp import Leases

LEASES = web.AppKey("leases", Leases)


def create_app(url: str, *, ttl: float = 10.0) -> web.Application:
    leases = Leases(url)  # opened when the app starts, closed at its cleanup
    ticks = 0

    @leases.leader_job("scheduler", ttl=ttl)
    async def scheduler(lease: Lease) -> None:
        """Runs while this process leads; cancelled as soon as it no longer does.
        A crash is logged and the process campaigns again: the app keeps serving."""
        nonlocal ticks
        while True:
            ticks += 1  # the periodic work, fenced with lease.token
            await anyio.sleep(ttl / 10)

    routes = web.RouteTableDef()

    @routes.post("/invoices/{invoice_id}/charge")
    @leases.locked("invoices/{invoice_id}", ttl=ttl, timeout=10)
    async def charge(request: web.Request, lease: Lease) -> web.Response:
        # One request at a time per invoice, across every process: 409 after `timeout`,
        # 503 if the lease is lost (this handler is then cancelled).
        started = time.monotonic()
        await anyio.sleep(0.01)  # charge the card, passing lease.token as the fence
        invoice = request.match_info["invoice_id"]
        span = [started, time.monotonic()]
        return web.json_response({"invoice": invoice, "token": lease.token, "span": span})

    @routes.get("/leader")
    async def leader(request: web.Request) -> web.Response:
        current = await leases.leader("scheduler")
        if current is None:
            return web.json_response(None)
        return web.json_response({"identity": current.identity, "token": current.token})

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        status = {"leading": leases.leading("scheduler"), "ticks": ticks, **leases.status()}
        return web.json_response(status)

    app = web.Application()
    app[LEASES] = leases
    app.add_routes(routes)
    app.cleanup_ctx.append(leases.cleanup_ctx)
    return app


if __name__ == "__main__":
    app = create_app(os.environ.get("AIOLEASE_URL", "sqlite:///leases.db"))
    web.run_app(app)
    sys.exit(app[LEASES].exit_code)  # 1 if a leader job's crash stopped the app
