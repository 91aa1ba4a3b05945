"""A refused permit request of the etcd backend, as its wait and a hand-off to it see it
(:class:`Turn`; ``docs/internals/etcd.md#permits``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aetcd import rpc

__all__ = ["Turn"]


@dataclass
class Turn:
    """A refused permit request's wait: from the ``revision`` of its read, the weight
    by which it did not fit (``deficit``), and its queue key's create revision
    (``mine``). Events after the read change the deficit: a new permit key adds its
    weight, as does a new queue key ahead of ``mine``; a deleted permit key, or a deleted
    queue key ahead of it, takes its weight off. The deficit is judged after each
    revision's events, all of them (a grant deletes a queue key and puts a permit key in
    one revision: no change; a hand-off also deletes the permit it replaces).

    It also keeps what a hand-off to the request needs
    (:meth:`._permit_ops.PermitOps._hand_permit`): its ``weight``, the ``value`` of its
    permit key, and while it waits, its owner, ttl
    and the future that wakes it."""

    revision: int
    deficit: int
    mine: int
    owner: str = ""
    weight: int = 1
    value: bytes = b""
    ttl: float = 0.0
    woken: asyncio.Future[None] | None = None
    #: The limit it asked with.
    limit: int = 0
    #: While a release here sends the transaction that hands it a place: done when
    #: the reply came.
    handing: asyncio.Future[None] | None = None
    #: The watch found that it fits (every event since the read counted, each a value
    #: aiolease writes): its next attempt may grant it without a read.
    ready: bool = False
    #: Its wait ended without a hand-off: it asks the server again.
    asking: bool = False
    #: Its queue key is live (not being deleted after an expiry here).
    queued: bool = True

    def accept(self, events: Sequence[Any]) -> bool:
        """Whether ``events`` (those of one watch reply, each with its previous
        key-value) end the wait; :attr:`ready` if only because the request fits now."""
        ended = False
        for event in events:
            ended = self._count(event) or ended
        self.ready = not ended and self.deficit <= 0
        return ended or self.deficit <= 0

    def _count(self, event: Any) -> bool:
        """Count ``event`` in the deficit; ``True`` if it ends the wait by itself."""
        deleted: bool = event.type == rpc.Event.DELETE
        kv = event.prev_kv if deleted else event.kv
        if kv.create_revision == self.mine:
            return deleted  # its own queue key: gone (ask again), or its own put
        if not deleted and kv.create_revision != kv.mod_revision:
            return False  # a key moved to another lease, or refreshed: no weight changed
        try:
            document = json.loads(kv.value)
            weight, queued = int(document["weight"]), bool(document["queued"])
        except (ValueError, KeyError, TypeError):
            return True  # not a value aiolease writes: let the next try report it
        if queued and kv.create_revision > self.mine:
            return False  # behind it
        self.deficit += -weight if deleted else weight
        return False
