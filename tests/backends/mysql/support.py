"""What the MySQL/MariaDB tests share: connection arguments, and statements run on a
connection of their own, behind the backends' back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncmy

from tests.support import on_asyncio, unique


def connect_args(url: str) -> dict[str, Any]:
    """``asyncmy.connect`` arguments for the server of ``url`` (no database)."""
    parts = urlsplit(url)
    return {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 3306,
        "user": parts.username or "root",
        "password": parts.password or "",
        "autocommit": True,
    }


def in_database(url: str, database: str) -> str:
    """``url`` with ``database`` as its database."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{database}"))


async def raw_asyncio(url: str, sql: str, *args: Any) -> list[Any]:
    """:func:`raw` on asyncio itself (``asyncio.run``, or a backend's own loop)."""
    conn = await asyncmy.connect(**connect_args(url))
    try:
        async with conn.cursor() as cur:
            await cur.execute(sql, args or None)
            return list(await cur.fetchall())
    finally:
        conn.close()


async def raw(url: str, sql: str, *args: Any) -> list[Any]:
    """Run one statement on a connection of its own, behind the backends' back."""
    return await on_asyncio(lambda: raw_asyncio(url, sql, *args))


@contextmanager
def scratch_database(url: str, prefix: str) -> Iterator[str]:
    """A database of its own on the server of ``url``, dropped with everything in it."""
    name = unique(prefix)
    asyncio.run(raw_asyncio(url, f"CREATE DATABASE `{name}`"))
    try:
        yield name
    finally:
        asyncio.run(raw_asyncio(url, f"DROP DATABASE `{name}`"))
