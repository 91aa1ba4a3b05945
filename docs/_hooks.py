"""mkdocs hooks: the capability matrix on the Backends page is built from the code.

A backend's capabilities depend on the mode it is opened in (``fair=true`` adds
:attr:`Capability.FAIR_QUEUE`, say), so the matrix asks instances: one column per
backend and mode, each built around a client that is never connected. Rendering the
table from them means the docs cannot drift from what the code promises.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiolease.abc import Backend, Capability

MARKER = "<!-- capability-matrix -->"


def _memory() -> Backend:
    from aiolease.backends.memory import MemoryBackend

    return MemoryBackend()


def _sqlite() -> Backend:
    from aiolease.backends.sqlite import SQLiteBackend

    return SQLiteBackend(Path(tempfile.gettempdir()) / "aiolease-docs.db")  # never opened


def _redis(**mode: Any) -> Backend:
    import redis.asyncio

    from aiolease.backends.redis import RedisBackend

    return RedisBackend(redis.asyncio.Redis(), **mode)


def _redlock() -> Backend:
    import redis.asyncio

    from aiolease.backends.redlock import RedlockBackend

    return RedlockBackend([redis.asyncio.Redis(port=port) for port in (6381, 6382, 6383)])


def _postgres(**mode: Any) -> Backend:
    import asyncpg

    from aiolease.backends.postgres import PostgresBackend

    return PostgresBackend(asyncpg.create_pool("postgresql://localhost/docs", min_size=0), **mode)


def _mysql() -> Backend:
    from asyncmy.pool import Pool

    from aiolease.backends.mysql import MySQLBackend

    return MySQLBackend(Pool(minsize=0, maxsize=1))


def _etcd(**mode: Any) -> Backend:
    from aiolease.backends.etcd import EtcdBackend

    return EtcdBackend(None, **mode)


def _mongo(**mode: Any) -> Backend:
    from pymongo import AsyncMongoClient

    from aiolease.backends.mongo import MongoBackend

    client: Any = AsyncMongoClient("mongodb://localhost/docs", connect=False)
    return MongoBackend(client, **mode)


def _kafka() -> Backend:
    from aiokafka import AIOKafkaClient

    from aiolease.backends.kafka import KafkaBackend

    return KafkaBackend(AIOKafkaClient(bootstrap_servers="localhost:9092"))


def _zookeeper() -> Backend:
    from aiolease.backends.zookeeper import ZooKeeperBackend

    return ZooKeeperBackend(None)


#: The backends shipped today, in each mode that changes what they guarantee, in the
#: order the matrix lists them.
MODES: dict[str, Callable[[], Backend]] = {
    "memory": _memory,
    "SQLite": _sqlite,
    "Redis": _redis,
    "Redis `fair=true`": lambda: _redis(fair=True),
    "Redlock": _redlock,
    "PostgreSQL": _postgres,
    "PostgreSQL `listen=false`": lambda: _postgres(listen=False),
    "MySQL": _mysql,
    "etcd": _etcd,
    "etcd `fair=true`": lambda: _etcd(fair=True),
    "MongoDB (replica set)": lambda: _mongo(topology="replica set"),
    "MongoDB standalone": lambda: _mongo(topology="standalone"),
    "MongoDB `fair=false`": lambda: _mongo(fair=False, topology="replica set"),
    "Kafka": _kafka,
    "ZooKeeper": _zookeeper,
}


async def _instances() -> dict[str, Backend]:
    """One backend per mode (inside a loop: some drivers' pools ask for one)."""
    return {label: make() for label, make in MODES.items()}


def capability_matrix() -> str:
    """A Markdown table: one row per capability, one column per backend and mode."""
    backends = asyncio.run(_instances())
    header = "| capability | " + " | ".join(backends) + " |"
    rule = "|---|" + "---|" * len(backends)
    rows = [
        f"| `{cap.name}` | "
        + " | ".join("yes" if cap in b.capabilities else "no" for b in backends.values())
        + " |"
        for cap in Capability
    ]
    bridged = " | ".join("yes" if b.requires_asyncio else "no" for b in backends.values())
    rows.append(f"| needs asyncio (bridged under trio) | {bridged} |")
    return "\n".join([header, rule, *rows])


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace the marker with the generated matrix.

    :param markdown: the page's Markdown source
    :param kwargs: the page, config and files mkdocs passes
    """
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, capability_matrix())
