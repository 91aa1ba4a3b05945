"""What the Redis and Redlock tests share: key prefixes of their own, deleted afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import redis

__all__ = ["delete_under", "new_prefix"]


def new_prefix(label: str) -> str:
    """A key prefix no other test uses: ``aiolease-<label>-<random>:``."""
    return f"aiolease-{label}-{uuid.uuid4().hex[:12]}:"


def delete_under(prefix: str, clients: Iterable[redis.Redis]) -> None:
    """Delete every key under ``prefix`` through each of ``clients``, closing them."""
    for client in clients:
        with client:
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                client.delete(*keys)
