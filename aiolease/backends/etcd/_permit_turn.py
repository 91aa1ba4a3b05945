"""A refused permit request of the etcd backend, as its wait and a hand-off to it see it
(:class:`Turn`; ``docs/internals/etcd.md#permits``)."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from aetcd import rpc

__all__ = ["Change", "Turn", "decode"]


class Change(NamedTuple):
    """One watch event on a name's permit keys, as every waiter of the name counts it
    (:func:`decode`: once per reply, not once per waiter)."""

    #: The revision it happened at.
    revision: int
    #: The key's create revision (a deleted key's: its last version's).
    created: int
    deleted: bool
    #: A put of a key that existed already (moved to another lease, or refreshed).
    rewritten: bool
    #: The key's weight and whether it is queued; ``None``: not a value aiolease writes.
    counted: tuple[int, bool] | None


def decode(events: Sequence[Any]) -> tuple[Change, ...]:
    """The :class:`Change` of each of one watch reply's ``events`` (each with its
    previous key-value)."""
    changes = []
    for event in events:
        deleted: bool = event.type == rpc.Event.DELETE
        kv = event.prev_kv if deleted else event.kv
        created, revision = int(kv.create_revision), int(event.kv.mod_revision)
        rewritten = not deleted and created != revision
        changes.append(Change(revision, created, deleted, rewritten, _weight(kv.value)))
    return tuple(changes)


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
    permit key, the ``slot`` of its keys, and while it waits, its owner, ttl
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
    #: The slot of its permit key (its queue key's is :func:`._keys.queue_slot` of it).
    slot: str = ""
    #: While releases here send transactions that may hand it a place: each done when
    #: its reply came.
    handing: list[asyncio.Future[None]] = field(default_factory=list)
    #: The watch found that it fits (every event since the read counted, each a value
    #: aiolease writes): its next attempt may grant it without a read.
    ready: bool = False
    #: Its wait ended without a hand-off: it asks the server again.
    asking: bool = False
    #: Its queue key is live (not being deleted after an expiry here).
    queued: bool = True

    def accept(self, changes: Sequence[Change]) -> bool:
        """Whether ``changes`` (those of one watch reply) end the wait; :attr:`ready` if
        only because the request fits now."""
        ended = False
        mine, deficit = self.mine, self.deficit
        for _, created, deleted, rewritten, counted in changes:
            if created == mine:
                ended = ended or deleted  # its own queue key: gone (ask again), or its put
            elif rewritten:
                pass  # a key moved to another lease, or refreshed: no weight changed
            elif counted is None:
                ended = True  # not a value aiolease writes: let the next try report it
            elif not counted[1] or created < mine:  # (a queue key behind it: no change)
                deficit += -counted[0] if deleted else counted[0]
        self.deficit = deficit
        self.ready = not ended and deficit <= 0
        return ended or deficit <= 0


@functools.lru_cache(maxsize=4096)
def _weight(value: bytes) -> tuple[int, bool] | None:
    """The weight of a permit key's ``value`` and whether it is queued (``None``: not a
    value aiolease writes). Remembered: every waiter of a name is shown the same events,
    each a few values written again and again."""
    try:
        document = json.loads(value)
        return int(document["weight"]), bool(document["queued"])
    except (ValueError, KeyError, TypeError):
        return None
