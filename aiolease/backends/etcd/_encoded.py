"""Txn requests composed from serialized pieces: the permit hand-off's cascade
(``docs/internals/etcd.md#permits``).

A release's hand-off is a ``TxnRequest`` of up to :data:`._permit_ops.HANDOFF_BRANCHES`
branches, each nested in the failure of the one before it. Building it as protobuf
messages took about half a millisecond of the client's CPU per release (16 tasks on a
semaphore of 4: about a fifth of an acquisition's), most of it creating the same
compares and operations for the same waiters again and again, and copying each nested
branch into its parent, once per level. Its serialized form is only a concatenation:
a message's fields in the order of their numbers, each length-delimited field a tag,
a length and its bytes. So the branches are composed here from the serialized compares
and operations (each built once, and remembered by :class:`._keys.Layout`), nested by
wrapping bytes, and sent as they are (:meth:`._wire.Wire.txn` takes ``bytes``); a
test checks that they parse back to the messages they stand for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["cascade", "compare", "success"]

#: The tags of the ``TxnRequest`` fields ``compare``, ``success`` and ``failure``, and of
#: ``RequestOp.request_txn`` (field number << 3 | 2: length-delimited).
_COMPARE, _SUCCESS, _FAILURE, _REQUEST_TXN = b"\x0a", b"\x12", b"\x1a", b"\x22"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """The length-delimited field of ``tag`` holding ``payload``."""
    size = len(payload)
    return tag + (bytes((size,)) if size < 0x80 else _varint(size)) + payload


def compare(message: Any) -> bytes:
    """A ``TxnRequest``'s ``compare`` field holding the ``Compare`` ``message``."""
    return _field(_COMPARE, message.SerializeToString())


def success(op: Any) -> bytes:
    """A ``TxnRequest``'s ``success`` field holding the ``RequestOp`` ``op``."""
    return _field(_SUCCESS, op.SerializeToString())


def cascade(branches: Sequence[bytes]) -> bytes:
    """The serialized ``TxnRequest``: ``branches[0]`` (its compares, then its success
    operations), whose failure is ``branches[1]`` nested, whose failure is
    ``branches[2]``, and so on."""
    data = branches[-1]
    for branch in reversed(branches[:-1]):
        data = branch + _field(_FAILURE, _field(_REQUEST_TXN, data))
    return data
