"""The values of permit keys, and the grant rule over a name's keys.

Every permit of a name has a key ``<prefix>%permits/<escaped name>/<slot>``, and
every queued request one ``<prefix>%permits/<escaped name>/permit:q<slot>`` (see
:meth:`._keys.Layout.permit_start`), on the session lease of the backend that
wrote it, whose value is compact JSON::

    {"owner": ..., "identity": ..., "metadata": {...}, "limit": L, "weight": W,
     "queued": true|false}

The slot (``permit:<random>.<n>``) is the writing backend's, reused by its later
requests once it has seen both keys deleted; the value names the request's owner id.
A value without ``owner`` is a key of the older layout, whose slot is the owner id
(``permit:<32 hex digits>``): it is read as that owner's.

A request is granted when the weight of the permit keys, of the queue keys created
before its own and its own fit in the limit: then its queue key (if any) is deleted
and its permit key put in one txn, so the token, the permit key's create revision,
is larger than every earlier grant's of the name (etcd's revision never goes back).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._exceptions import ForeignDataError
from ..._permits import is_permit_owner
from ...abc import HolderInfo
from ._keys import permit_slot

__all__ = ["PermitKey", "encode_permit", "parse_permits"]


def encode_permit(
    identity: str,
    metadata: Mapping[str, str],
    limit: int,
    weight: int,
    queued: bool,
    owner: str | None = None,
) -> bytes:
    """The value of a permit key (of the request ``owner``: ``None`` only for a key of
    the older layout, whose slot is the owner id)."""
    document: dict[str, object] = {} if owner is None else {"owner": owner}
    document |= {
        "identity": identity,
        "metadata": dict(metadata),
        "limit": limit,
        "weight": weight,
        "queued": queued,
    }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, slots=True)
class PermitKey:
    """One permit key as read: its owner, token (create revision), lease, value, and
    slot: the end of its key (see :mod:`._keys`)."""

    owner: str
    token: int
    lease: int
    identity: str
    metadata: dict[str, str]
    limit: int
    weight: int
    queued: bool
    slot: str

    @property
    def permit_slot(self) -> str:
        """The slot of the request's permit key (:attr:`slot` is its queue key's, when
        :attr:`queued`)."""
        return permit_slot(self.slot)

    def holder(self, name: str, token: int | None = None) -> HolderInfo:
        """The :class:`HolderInfo` this key stands for (with ``token`` if given)."""
        return HolderInfo(
            name,
            self.owner,
            self.identity,
            self.token if token is None else token,
            dict(self.metadata),
            None,
        )


@functools.lru_cache(maxsize=4096)
def _parse(name: str, start: bytes, key: bytes, value: bytes, token: int, lease: int) -> PermitKey:
    """One key, parsed. Remembered by everything it depends on, its value included: a
    waiter's every read answers the same keys again. The :class:`PermitKey` answered
    is shared: its metadata must not be changed."""
    slot = key[len(start) :].decode(errors="replace")
    held = permit_slot(slot)
    try:
        document = json.loads(value)
    except ValueError:
        document = None
    ok = isinstance(document, dict) and is_permit_owner(held)
    if ok:
        owner = document.get("owner", held)  # none: the older layout, its slot is the owner
        identity, metadata = document.get("identity"), document.get("metadata")
        limit, weight = document.get("limit"), document.get("weight")
        queued = document.get("queued")
        ok = (
            isinstance(owner, str)
            and is_permit_owner(owner)
            and isinstance(identity, str)
            and isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
            and _int(limit)
            and _int(weight)
            and isinstance(queued, bool)
        )
    if not ok:
        raise ForeignDataError(
            f"etcd permit key {key!r} of {name!r} holds a value aiolease did not write"
            f" ({value[:80]!r}); it was left unchanged, and nothing is granted"
            " over it: another program seems to write under the key prefix",
            name=name,
        )
    return PermitKey(
        owner,
        token,
        lease,
        identity,
        dict(metadata),
        limit,
        weight,
        held != slot,
        slot,
    )


def parse_permits(name: str, start: bytes, kvs: Sequence[Any]) -> list[PermitKey]:
    """The permit keys ``kvs`` of ``name`` (under ``start``), oldest first.

    :raises ForeignDataError: a value aiolease does not write
    """
    keys = [_parse(name, start, kv.key, kv.value, kv.create_revision, kv.lease) for kv in kvs]
    keys.sort(key=lambda k: k.token)
    return keys
