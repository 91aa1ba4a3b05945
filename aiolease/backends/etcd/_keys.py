"""Where leases live in etcd's key space, and the requests that read and change them.

Every attempt to take a name has a key of its own::

    <prefix><name, with % and / escaped>/<owner id>  ->  {"identity": ..., "metadata": {...}}

attached to the session lease of the backend that wrote it. The **holder** of a
name is the key with the lowest create revision under ``<prefix><name>/``, and the
**token** is that create revision: etcd's revision counter never goes back, so each
grant's token is greater than every earlier grant's of any name (and it survives a
restart of the server). Escaping ``/`` keeps ``a`` and ``a/b`` apart; the owner id
in the key is what makes a retry after a lost reply find its own key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aetcd import rpc

from ...abc import HolderInfo

__all__ = ["DEFAULT_PREFIX", "Layout", "decode_value", "encode_value"]

#: The key prefix used when none is given.
DEFAULT_PREFIX = "aiolease/"


def _escape(name: str) -> str:
    return name.replace("%", "%25").replace("/", "%2F")


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of everything that starts with ``prefix``."""
    body = prefix.rstrip(b"\xff")
    return body[:-1] + bytes([body[-1] + 1]) if body else b"\x00"


def encode_value(identity: str, metadata: Mapping[str, str]) -> bytes:
    """The value of a lease key: identity and metadata as compact JSON."""
    document = {"identity": identity, "metadata": dict(metadata)}
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()


def decode_value(raw: bytes) -> tuple[str, dict[str, str]]:
    """Identity and metadata from a key's value (empty for a value aiolease did not write)."""
    try:
        document = json.loads(raw)
        identity = document["identity"]
        metadata = {str(k): str(v) for k, v in dict(document["metadata"]).items()}
    except (ValueError, TypeError, KeyError):
        return "", {}
    return str(identity), metadata


def _compare_create(key: bytes, revision: int, range_end: bytes = b"") -> Any:
    compare = rpc.Compare(
        key=key,
        target=rpc.Compare.CREATE,
        result=rpc.Compare.EQUAL,
        create_revision=revision,
    )
    if range_end:
        compare.range_end = range_end
    return compare


def _range(key: bytes, range_end: bytes = b"", *, limit: int = 0, newest: bool = False) -> Any:
    order = rpc.RangeRequest.DESCEND if newest else rpc.RangeRequest.ASCEND
    return rpc.RangeRequest(
        key=key,
        range_end=range_end,
        limit=limit,
        sort_target=rpc.RangeRequest.CREATE,
        sort_order=order,
    )


def _put(key: bytes, value: bytes, lease_id: int) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease_id))


@dataclass(frozen=True)
class Layout:
    """The keys of one backend (one prefix)."""

    prefix: bytes

    def start(self, name: str) -> bytes:
        """``<prefix><escaped name>/``: every key of ``name`` starts with it."""
        return self.prefix + _escape(name).encode() + b"/"

    def key(self, name: str, owner: str) -> bytes:
        """The key of ``owner``'s attempt at ``name``."""
        return self.start(name) + owner.encode()

    def holder(self, name: str, kv: Any) -> HolderInfo:
        """The :class:`HolderInfo` that the key-value ``kv`` of ``name`` stands for."""
        identity, metadata = decode_value(kv.value)
        owner = bytes(kv.key)[len(self.start(name)) :].decode(errors="replace")
        return HolderInfo(name, owner, identity, int(kv.create_revision), metadata, None)

    # -- requests -------------------------------------------------------------------

    def first(self, name: str) -> Any:
        """Range: the key of ``name`` created first (the holder)."""
        start = self.start(name)
        return _range(start, prefix_end(start), limit=1)

    def acquire(self, name: str, owner: str, value: bytes, lease_id: int, queue: bool) -> Any:
        """Txn: if ``name`` has no key at all, put ``owner``'s; else read the first key,
        and if ``queue`` (fair mode), :meth:`enqueue` ``owner``'s key first (nested)."""
        start = self.start(name)
        failure = [rpc.RequestOp(request_range=self.first(name))]
        if queue:
            nested = self.enqueue(name, owner, value, lease_id)
            failure.insert(0, rpc.RequestOp(request_txn=nested))
        return rpc.TxnRequest(
            compare=[_compare_create(start, 0, prefix_end(start))],
            success=[_put(self.key(name, owner), value, lease_id)],
            failure=failure,
        )

    def enqueue(self, name: str, owner: str, value: bytes, lease_id: int) -> Any:
        """Txn: put ``owner``'s key unless it exists, and read the two newest keys
        (``owner``'s and its predecessor's); if it existed, read it."""
        start, key = self.start(name), self.key(name, owner)
        return rpc.TxnRequest(
            compare=[_compare_create(key, 0)],
            success=[
                _put(key, value, lease_id),
                rpc.RequestOp(request_range=_range(start, prefix_end(start), limit=2, newest=True)),
            ],
            failure=[rpc.RequestOp(request_range=_range(key))],
        )

    def predecessor(self, name: str, revision: int) -> Any:
        """Range: the newest key of ``name`` created before ``revision``."""
        start = self.start(name)
        request = _range(start, prefix_end(start), limit=1, newest=True)
        request.max_create_revision = revision - 1
        return request

    def move(self, name: str, owner: str, token: int, lease_id: int) -> Any:
        """Txn: attach ``owner``'s key (if it is still grant ``token``) to ``lease_id``."""
        key = self.key(name, owner)
        put = rpc.PutRequest(key=key, lease=lease_id, ignore_value=True)
        exists = rpc.Compare(
            key=key, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0
        )
        return rpc.TxnRequest(
            compare=[_compare_create(key, token), exists],
            success=[rpc.RequestOp(request_put=put)],
        )

    def delete(self, name: str, owner: str, token: int | None) -> Any:
        """Txn: delete ``owner``'s key of ``name`` (only if it is grant ``token``, if given)."""
        key = self.key(name, owner)
        delete = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))
        if token is None:
            return rpc.TxnRequest(success=[delete])
        return rpc.TxnRequest(compare=[_compare_create(key, token)], success=[delete])

    def watch_delete(self, key: bytes, after: int) -> Any:
        """Watch for the deletion of ``key`` after revision ``after``."""
        return rpc.WatchCreateRequest(
            key=key, start_revision=after + 1, filters=[rpc.WatchCreateRequest.NOPUT]
        )

    def watch_create(self, name: str, after: int) -> Any:
        """Watch for a new key of ``name`` after revision ``after``."""
        start = self.start(name)
        return rpc.WatchCreateRequest(
            key=start,
            range_end=prefix_end(start),
            start_revision=after + 1,
            filters=[rpc.WatchCreateRequest.NODELETE],
        )
