"""A worker under trio that does its work only while it leads: start several on several
machines, and exactly one works at a time; kill it, and another takes over within a ttl.

Run it with ``AIOLEASE_URL=redis://127.0.0.1:6379/0 python docs/examples/trio_worker.py``
(drivers that need asyncio, such as Redis's, run on trio through ``aiolease[trio]``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import trio

import aiolease


async def worker(
    backend: aiolease.Backend,
    identity: str,
    *,
    ttl: float = 10.0,
    report: Callable[[str, int], object] = lambda who, token: print(who, "works, token", token),
) -> None:
    elector = aiolease.Elector(backend, "trio-worker", ttl=ttl, identity=identity)

    async def work(lease: aiolease.Lease) -> None:
        # One term: cancelled when it ends (lost, or this worker is stopped).
        while True:
            report(identity, lease.token)  # the work, fenced with lease.token
            await trio.sleep(ttl / 10)

    await elector.run(work)  # campaigns, works for each term won, campaigns again


async def main(url: str) -> None:
    async with aiolease.open_backend(url) as backend:
        await worker(backend, f"{socket.gethostname()}:{os.getpid()}")


if __name__ == "__main__":
    trio.run(main, os.environ.get("AIOLEASE_URL", "sqlite:///leases.db"))
