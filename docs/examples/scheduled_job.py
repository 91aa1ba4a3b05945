"""A job that runs every `interval` seconds on one machine of the fleet at a time.

Every machine runs ``scheduled(...)``; the one that leads runs the job, the others
wait to take over. Under asyncio or trio alike.

Note: after a failover the new leader runs the job at once, even if the old one ran it
a moment before. For "at most once per interval across the fleet, whoever runs it",
hold the lease for at least the interval (``min_hold``, see the changelog).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable

import anyio

import aiolease


async def scheduled(
    backend: aiolease.Backend,
    job: Callable[[int], Awaitable[object]],
    *,
    interval: float,
    ttl: float = 10.0,
    identity: str | None = None,
) -> None:
    """Run ``await job(token)`` every ``interval`` seconds while this process leads."""
    elector = aiolease.Elector(backend, "report-scheduler", ttl=ttl, identity=identity)

    async def every_interval(lease: aiolease.Lease) -> None:
        while True:
            await job(lease.token)  # cancelled if leadership is lost mid-run
            await anyio.sleep(interval)

    await elector.run(every_interval)


async def nightly_report(token: int) -> None:
    print(f"{socket.gethostname()}:{os.getpid()} builds the report (fence {token})")


async def main(url: str) -> None:
    async with aiolease.open_backend(url) as backend:
        await scheduled(backend, nightly_report, interval=60)


if __name__ == "__main__":
    anyio.run(main, os.environ.get("AIOLEASE_URL", "sqlite:///leases.db"))
