"""A candidate in its own process, for the failover tests: ``python -m
tests.backends.kafka._leader URL PREFIX NAME`` campaigns for ``NAME`` (groups and
topics under ``PREFIX``) and prints ``lead TOKEN`` when elected (and ``lost REASON``
when a term ends), until killed."""

from __future__ import annotations

import os
import sys
from typing import Any

import anyio

import aiolease
from aiolease import Elector, Lease
from tests.backends.kafka.support import SESSION


async def main(url: str, prefix: str, name: str) -> None:
    options: dict[str, Any] = {
        "session_timeout": SESSION,
        "group_prefix": prefix,
        "topic_prefix": prefix,
    }
    async with aiolease.open_backend(url, **options) as backend:
        elector = Elector(
            backend,
            name,
            ttl=SESSION,
            identity=f"process-{os.getpid()}",
            on_defeated=lambda reason: print(f"lost {reason.value}", flush=True),
        )

        async def work(lease: Lease) -> None:
            print(f"lead {lease.token}", flush=True)
            await anyio.sleep_forever()

        await elector.run(work)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
