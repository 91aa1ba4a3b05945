"""A FastAPI app on aiolease: a job that runs in one process of the fleet at a time, a
lock per request, and a health endpoint.

Run two copies against one backend, and kill either::

    export AIOLEASE_URL=redis://127.0.0.1:6379/0
    uvicorn docs.examples.fastapi_app:app --port 8001 &
    uvicorn docs.examples.fastapi_app:app --port 8002 &
    curl -X POST localhost:8001/invoices/42/charge
    curl localhost:8002/health
"""

import os
import time
from typing import Annotated, Any

import anyio
from fastapi import FastAPI

from aiolease import LeaderInfo, Lease
from aiolease.integrations.fastapi import Leases


def create_app(url: str, *, ttl: float = 10.0) -> FastAPI:
    leases = Leases(url)  # opened when the app starts, closed when it stops
    ticks = 0

    @leases.leader_job("scheduler", ttl=ttl)
    async def scheduler(lease: Lease) -> None:
        """Runs while this process leads; cancelled as soon as it no longer does.
        A crash is logged and the process campaigns again: the app keeps serving."""
        nonlocal ticks
        while True:
            ticks += 1  # the periodic work, fenced with lease.token
            await anyio.sleep(ttl / 10)

    app = FastAPI()
    app.state.leases = leases
    leases.install(app)  # error responses; the backend and the job for the app's life
    # Dependencies. This module has no `from __future__ import annotations`: FastAPI
    # reads these names from the annotations of functions local to create_app.
    InvoiceLock = Annotated[Lease, leases.lock("invoices/{invoice_id}", ttl=ttl, timeout=10)]
    Leading = Annotated[bool, leases.is_leader("scheduler")]
    CurrentLeader = Annotated[LeaderInfo | None, leases.current_leader("scheduler")]

    @app.post("/invoices/{invoice_id}/charge")
    async def charge(invoice_id: str, lease: InvoiceLock) -> dict[str, Any]:
        # One request at a time per invoice, across every process. A request that waits
        # more than `timeout` gets 409; if the lease is lost, this is cancelled and the
        # client gets 503.
        started = time.monotonic()
        await anyio.sleep(0.01)  # charge the card, passing lease.token as the fence
        return {"invoice": invoice_id, "token": lease.token, "span": [started, time.monotonic()]}

    @app.get("/leader")
    async def leader(current: CurrentLeader) -> dict[str, Any] | None:
        if current is None:
            return None
        return {"identity": current.identity, "token": current.token}

    @app.get("/health")
    async def health(leading: Leading) -> dict[str, Any]:
        return {"pid": os.getpid(), "leading": leading, "ticks": ticks, **leases.status()}

    return app


app = create_app(os.environ.get("AIOLEASE_URL", "sqlite:///leases.db"))
