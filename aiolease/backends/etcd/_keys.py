"""Where leases live in etcd's key space, and the requests that read and change them.

Every attempt to take a name has a key of its own::

    <prefix><name, with % and / escaped>/<slot>  ->  {"identity": ..., "metadata": {...}}

attached to the session lease of the backend that wrote it. In fair mode the
**slot** is the owner id of the attempt. In non-fair mode it is an id of the backend
object that wrote it (``<random>.<n>``), which that backend reuses for later attempts
once it has seen the key deleted, and the value names the owner (``"owner": ...``):
etcd keeps every deleted key in its index until the history is compacted, and the
acquire transaction ranges over all of a name's keys, deleted ones included, so a
fresh key per attempt would make every acquire slower. The **holder** of a name
is the key with the lowest create revision under ``<prefix><name>/``, and the
**token** is that create revision: etcd's revision counter never goes back, so each
grant's token is greater than every earlier grant's of any name (and it survives a
restart of the server). Escaping ``/`` keeps ``a`` and ``a/b`` apart; the slot in
the key is what makes a retry after a lost reply find its own key.

Permits (semaphores, read-write locks) live apart, under
``<prefix>%permits/<escaped name>/`` (:meth:`Layout.permit_start`), for the same
reason in slots of the backend object too (``permit:<random>.<n>``, whatever the
mode): a request's permit key is ``<slot>`` and its queue key ``permit:q<slot>``
(:func:`queue_slot`: ``permit:qpermit:<random>.<n>``), and the value names the owner. Keys
written before (by an older version) have the owner id as the slot and no owner
in the value; they are read as such (:mod:`._permit_values`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard, TypeVar

from aetcd import rpc

from ..._exceptions import ForeignDataError
from ..._permits import PERMIT_PREFIX
from ...abc import HolderInfo
from . import _encoded as encoded

__all__ = [
    "DEFAULT_PREFIX",
    "QUEUE_SLOT",
    "Layout",
    "decode_value",
    "encode_value",
    "permit_slot",
    "queue_slot",
    "with_owner",
]

#: The key prefix used when none is given.
DEFAULT_PREFIX = "aiolease/"
#: What the permits' keys start with after the prefix: ``%`` never begins an escaped
#: name (it is escaped itself), so no lock's key range holds a permit's key.
PERMITS = b"%permits/"
#: A queued permit request's slot is this and the slot of its permit key (``q`` is not
#: a hex digit, so neither an owner id nor a backend's slot starts so).
QUEUE_SLOT = PERMIT_PREFIX + "q"
#: How many names' request templates a :class:`Layout` keeps.
CACHED_NAMES = 1024
#: How many serialized pieces of hand-offs a :class:`Layout` keeps (a few per waiter).
CACHED_PIECES = 4096

T = TypeVar("T")


def queue_slot(slot: str) -> str:
    """The slot of the queue key of the permit request whose permit key is in ``slot``."""
    return QUEUE_SLOT + slot


def permit_slot(slot: str) -> str:
    """The slot of the permit key of the request whose queue key is in ``slot`` (``slot``
    itself when it is a permit key's): the undo of :func:`queue_slot`."""
    return slot[len(QUEUE_SLOT) :] if slot.startswith(QUEUE_SLOT) else slot


def _escape(name: str) -> str:
    return name.replace("%", "%25").replace("/", "%2F")


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of everything that starts with ``prefix``."""
    body = prefix.rstrip(b"\xff")
    return body[:-1] + bytes([body[-1] + 1]) if body else b"\x00"


#: Values without metadata, by identity (most leases have none).
_PLAIN: dict[str, bytes] = {}


def encode_value(identity: str, metadata: Mapping[str, str], owner: str | None = None) -> bytes:
    """The value of a lease key: identity and metadata as compact JSON, and the owner
    id when it is not the key's slot."""
    plain = not metadata and owner is None
    if plain and (value := _PLAIN.get(identity)) is not None:
        return value
    document: dict[str, object] = {"identity": identity, "metadata": dict(metadata)}
    if owner is not None:
        document["owner"] = owner
    value = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
    if plain:
        if len(_PLAIN) >= CACHED_NAMES:
            _PLAIN.clear()
        _PLAIN[identity] = value
    return value


def with_owner(value: bytes, owner: str) -> bytes:
    """``value`` (from :func:`encode_value` without an owner) naming ``owner``."""
    if owner.isascii() and owner.isalnum():  # the core's owner ids: nothing to escape
        quoted = b'"' + owner.encode() + b'"'
    else:
        quoted = json.dumps(owner, ensure_ascii=False).encode()
    return b'{"owner":' + quoted + b"," + value[1:]


def _strings(value: object) -> TypeGuard[dict[str, str]]:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _decode(raw: bytes) -> tuple[str, dict[str, str], str | None]:
    """Identity, metadata and owner (``None``: the slot) from a key's value.

    :raises ValueError: a value aiolease did not write (not a JSON object with a text
        ``identity``, a ``metadata`` object of strings, and at most a text ``owner``)
    """
    try:
        document = json.loads(raw)
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    identity, metadata = document.get("identity"), document.get("metadata")
    owner = document.get("owner")
    if not isinstance(identity, str) or not _strings(metadata):
        raise ValueError("no text identity and metadata object of strings")
    if owner is not None and (not isinstance(owner, str) or not owner):
        raise ValueError(f"its owner is {owner!r}")
    return identity, metadata, owner


def decode_value(raw: bytes) -> tuple[str, dict[str, str]]:
    """Identity and metadata from a key's value (empty for a value aiolease did not write)."""
    try:
        identity, metadata, _ = _decode(raw)
    except ValueError:
        return "", {}
    return identity, metadata


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


def _absent(key: bytes) -> Callable[[], bytes]:
    """Makes the serialized compare that ``key`` does not exist."""
    return lambda: encoded.compare(_compare_create(key, 0))


def _range(key: bytes, range_end: bytes = b"", *, limit: int = 0, newest: bool = False) -> Any:
    order = rpc.RangeRequest.DESCEND if newest else rpc.RangeRequest.ASCEND
    return rpc.RangeRequest(
        key=key,
        range_end=range_end,
        limit=limit,
        sort_target=rpc.RangeRequest.CREATE,
        sort_order=order,
    )


def _delete(key: bytes) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def _put(key: bytes, value: bytes, lease_id: int) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease_id))


class _Name:
    """One name's key range, and templates of its most frequent requests."""

    __slots__ = ("acquire", "delete", "permit_start", "start")

    def __init__(self, layout: Layout, start: bytes, permit_start: bytes) -> None:
        self.start = start
        self.permit_start = permit_start
        end = prefix_end(start)
        self.acquire = rpc.TxnRequest(
            compare=[_compare_create(start, 0, end)],
            success=[_put(start, b"", 0)],
            failure=[rpc.RequestOp(request_range=_range(start, end, limit=1))],
        )
        delete = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=start))
        self.delete = rpc.TxnRequest(compare=[_compare_create(start, 1)], success=[delete])


@dataclass(frozen=True)
class Layout:
    """The keys of one backend (one prefix)."""

    prefix: bytes
    _names: dict[str, _Name] = field(default_factory=dict, compare=False, repr=False)
    #: Serialized compares and operations of hand-offs (:meth:`permit_handoff`).
    _pieces: dict[tuple[Any, ...], Any] = field(default_factory=dict, compare=False, repr=False)

    def _name(self, name: str) -> _Name:
        cached = self._names.get(name)
        if cached is None:
            if len(self._names) >= CACHED_NAMES:
                del self._names[next(iter(self._names))]
            escaped = _escape(name).encode() + b"/"
            start, permit_start = self.prefix + escaped, self.prefix + PERMITS + escaped
            cached = self._names[name] = _Name(self, start, permit_start)
        return cached

    def start(self, name: str) -> bytes:
        """``<prefix><escaped name>/``: every key of ``name`` starts with it."""
        return self._name(name).start

    def key(self, name: str, slot: str) -> bytes:
        """The key of the attempt at ``name`` in ``slot``: a permit's (under
        :meth:`permit_start`) when ``slot`` is a permit's (it starts with ``permit:``)."""
        if slot.startswith(PERMIT_PREFIX):
            return self.permit_start(name) + slot.encode()
        return self.start(name) + slot.encode()

    def permit_start(self, name: str) -> bytes:
        """``<prefix>%permits/<escaped name>/``: every permit key of ``name`` starts with it."""
        return self._name(name).permit_start

    def permits(self, name: str) -> Any:
        """Range: every permit key of ``name``, oldest first."""
        start = self.permit_start(name)
        return _range(start, prefix_end(start))

    def permit_put(
        self, name: str, slot: str, value: bytes, lease_id: int, guard: tuple[str, int]
    ) -> Any:
        """Txn: put the key in ``slot`` (a permit key's or a queue key's) unless it
        exists, and unless the ``guard`` fails: ``("newer", read)``: no permit key of
        ``name`` was created after revision ``read``; ``(other_slot, token)``: that key
        is still grant ``token``. On failure, read every permit key of ``name``."""
        start, key = self.permit_start(name), self.key(name, slot)
        end = prefix_end(start)
        kind, revision = guard
        if kind == "newer":
            compare = rpc.Compare(
                key=start,
                range_end=end,
                target=rpc.Compare.CREATE,
                result=rpc.Compare.LESS,
                create_revision=revision + 1,
            )
        else:
            compare = _compare_create(self.key(name, kind), revision)
        return rpc.TxnRequest(
            compare=[_compare_create(key, 0), compare],
            success=[_put(key, value, lease_id)],
            failure=[rpc.RequestOp(request_range=_range(start, end))],
        )

    def permit_enqueue(
        self, name: str, slot: str, value: bytes, lease_id: int, guard: tuple[str, int]
    ) -> Any:
        """Txn: put the queue key of the request in ``slot`` (``value``, on ``lease_id``)
        unless it has a queue key or a permit key already, and unless the key ``guard``
        (slot, create revision) is gone; then, or else, read every permit key of
        ``name`` (the last response either way)."""
        start = self.permit_start(name)
        end = prefix_end(start)
        waiting = self.key(name, queue_slot(slot))
        return rpc.TxnRequest(
            compare=[
                _compare_create(waiting, 0),
                _compare_create(self.key(name, slot), 0),
                _compare_create(self.key(name, guard[0]), guard[1]),
            ],
            success=[
                _put(waiting, value, lease_id),
                rpc.RequestOp(request_range=_range(start, end)),
            ],
            failure=[rpc.RequestOp(request_range=_range(start, end))],
        )

    def permit_grant(self, name: str, slot: str, queued: int, value: bytes, lease_id: int) -> Any:
        """Txn: if the queue key of the request in ``slot`` is ``queued`` and it has no
        permit key yet, delete the queue key and put the permit key (``value``, on
        ``lease_id``): its create revision, the token, is larger than every earlier
        grant's."""
        key, waiting = self.key(name, slot), self.key(name, queue_slot(slot))
        delete = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=waiting))
        return rpc.TxnRequest(
            compare=[_compare_create(waiting, queued), _compare_create(key, 0)],
            success=[delete, _put(key, value, lease_id)],
        )

    def queue_key(self, name: str, slot: str) -> bytes:
        """The queue key of the permit request in ``slot``."""
        return self.key(name, queue_slot(slot))

    def queue_ranges(self, name: str, passing: Sequence[bytes] = ()) -> list[tuple[bytes, bytes]]:
        """The key ranges of ``name``'s queue keys, but the keys ``passing``."""
        queue = self.permit_start(name) + QUEUE_SLOT.encode()
        bounds = [queue]
        for key in sorted(passing):
            bounds += [key, key + b"\0"]
        bounds.append(prefix_end(queue))
        return list(zip(bounds[::2], bounds[1::2], strict=True))

    def permit_handoff(
        self,
        name: str,
        held: tuple[str, int],
        slot: str,
        queued: int,
        value: bytes,
        lease_id: int,
        ranges: Sequence[tuple[bytes, bytes, bool]] = (),
        gone: Sequence[bytes] = (),
    ) -> bytes:
        """A branch of a hand-off's txn (serialized: :func:`._encoded.cascade` nests
        branches): release the permit key ``held`` (its slot and token) and grant its
        place to the queue key of the request in ``slot`` in the same revision: if the held
        key is still that grant, the request's queue key is ``queued`` and no queue key of
        ``name`` is older (the first in line), and the request has no permit key yet,
        delete both keys and put the request's permit key (``value``, on ``lease_id``).

        ``ranges`` (default: every queue key of ``name``) are where the queue keys
        older than ``queued`` must not be: ``(low, high, known)``, where ``known`` says
        that a key newer than them lies in the range. etcd compares an empty range as
        one key of create revision 0, so a range not ``known`` to hold a key must be
        empty instead. The keys ``gone`` must not exist. Its compares and operations
        are serialized once per holder and per waiter, and remembered."""
        holder_compare, holder_delete = self._encoded(
            ("held", name, held),
            lambda: (
                encoded.compare(_compare_create(self.key(name, held[0]), held[1])),
                encoded.success(_delete(self.key(name, held[0]))),
            ),
        )
        mine, default_first, mine_ops = self._encoded(
            ("waiter", name, slot, queued, value, lease_id),
            lambda: self._waiter_pieces(name, slot, queued, value, lease_id),
        )
        first = (
            b"".join(
                encoded.compare(self._older_queued(low, high, known, queued))
                for low, high, known in ranges
            )
            if ranges
            else default_first
        )
        others = b"".join(self._encoded(("gone", other), _absent(other)) for other in gone)
        return holder_compare + mine + first + others + holder_delete + mine_ops

    def _waiter_pieces(
        self, name: str, slot: str, queued: int, value: bytes, lease_id: int
    ) -> tuple[bytes, bytes, bytes]:
        """A hand-off's pieces about the waiter in ``slot``: the compares on its own keys,
        the default compare on the queue keys before it, and its operations."""
        waiting, key = self.queue_key(name, slot), self.key(name, slot)
        return (
            encoded.compare(_compare_create(waiting, queued))
            + encoded.compare(_compare_create(key, 0)),
            encoded.compare(self._older_queued(*self.queue_ranges(name)[0], True, queued)),
            encoded.success(_delete(waiting)) + encoded.success(_put(key, value, lease_id)),
        )

    @staticmethod
    def _older_queued(low: bytes, high: bytes, known: bool, queued: int) -> Any:
        """The compare that no queue key in ``[low, high)`` is older than ``queued``
        (see :meth:`permit_handoff`)."""
        if known:
            return rpc.Compare(
                key=low,
                range_end=high,
                target=rpc.Compare.CREATE,
                result=rpc.Compare.GREATER,
                create_revision=queued - 1,
            )
        return rpc.Compare(
            key=low,
            range_end=high,
            target=rpc.Compare.VERSION,
            result=rpc.Compare.EQUAL,
            version=0,
        )

    def _encoded(self, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        """``make()``, remembered under ``key`` (at most :data:`CACHED_PIECES`)."""
        pieces = self._pieces
        found = pieces.get(key)
        if found is None:
            if len(pieces) >= CACHED_PIECES:
                del pieces[next(iter(pieces))]
            found = pieces[key] = make()
        return found

    def permit_give_up(self, name: str, slot: str) -> Any:
        """Txn: delete the queue key and the permit key of the request in ``slot``,
        whichever exist (the undo of a request given up: a grant may have been handed to
        it)."""
        keys = (self.key(name, queue_slot(slot)), self.key(name, slot))
        return rpc.TxnRequest(success=[_delete(key) for key in keys])

    def watch_permits(self, name: str, after: int) -> Any:
        """Watch the permit keys of ``name`` after revision ``after`` (puts, and deletions
        with the deleted key-value)."""
        start = self.permit_start(name)
        return rpc.WatchCreateRequest(
            key=start, range_end=prefix_end(start), start_revision=after + 1, prev_kv=True
        )

    def slot(self, name: str, kv: Any) -> str:
        """The slot of the key-value ``kv`` of ``name`` (the end of its key), a lock's
        or a permit's."""
        key, start = bytes(kv.key), self.start(name)
        if not key.startswith(start):
            start = self.permit_start(name)
        return key[len(start) :].decode(errors="replace")

    def holder(self, name: str, kv: Any) -> HolderInfo:
        """The :class:`HolderInfo` that the key-value ``kv`` of ``name`` stands for.

        :raises ForeignDataError: its value is not one aiolease writes
        """
        try:
            identity, metadata, owner = _decode(kv.value)
        except ValueError as exc:
            raise ForeignDataError(
                f"etcd key {bytes(kv.key)!r} of lease {name!r} holds a value aiolease did not"
                f" write ({exc}: {bytes(kv.value)[:80]!r}); it was left unchanged, and nothing"
                " is granted over it: another program seems to write under the key prefix"
                f" {self.prefix.decode(errors='replace')!r}; give aiolease another prefix",
                name=name,
            ) from None
        if owner is None:
            owner = self.slot(name, kv)
        return HolderInfo(name, owner, identity, int(kv.create_revision), metadata, None)

    def owner(self, name: str, kv: Any) -> str | None:
        """The owner of the key-value ``kv`` of ``name`` (``None``: not aiolease's)."""
        try:
            return self.holder(name, kv).owner
        except ForeignDataError:
            return None

    # -- requests -------------------------------------------------------------------

    def first(self, name: str) -> Any:
        """Range: the key of ``name`` created first (the holder)."""
        start = self.start(name)
        return _range(start, prefix_end(start), limit=1)

    def every(self, name: str) -> Any:
        """Range: every key of ``name``, oldest first."""
        start = self.start(name)
        return _range(start, prefix_end(start))

    def acquire(self, name: str, slot: str, value: bytes, lease_id: int, queue: bool) -> Any:
        """Txn: if ``name`` has no key at all, put the key of ``slot``; else read the first
        key, and if ``queue`` (fair mode), :meth:`enqueue` ``slot``'s key first (nested)."""
        cached = self._name(name)
        if not queue:
            request = rpc.TxnRequest()
            request.CopyFrom(cached.acquire)
            put = request.success[0].request_put
            put.key, put.value, put.lease = cached.start + slot.encode(), value, lease_id
            return request
        start = cached.start
        failure = [rpc.RequestOp(request_range=self.first(name))]
        if queue:
            nested = self.enqueue(name, slot, value, lease_id)
            failure.insert(0, rpc.RequestOp(request_txn=nested))
        return rpc.TxnRequest(
            compare=[_compare_create(start, 0, prefix_end(start))],
            success=[_put(self.key(name, slot), value, lease_id)],
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

    def move(self, name: str, slot: str, token: int, lease_id: int) -> Any:
        """Txn: attach ``slot``'s key (if it is still grant ``token``) to ``lease_id``."""
        key = self.key(name, slot)
        put = rpc.PutRequest(key=key, lease=lease_id, ignore_value=True)
        exists = rpc.Compare(
            key=key, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0
        )
        return rpc.TxnRequest(
            compare=[_compare_create(key, token), exists],
            success=[rpc.RequestOp(request_put=put)],
        )

    def update(self, name: str, slot: str, token: int, value: bytes) -> Any:
        """Txn: write ``value`` to ``slot``'s key of ``name`` if it is grant ``token`` and
        the first key of ``name`` (the holder), keeping its lease (and so its session)."""
        key, start = self.key(name, slot), self.start(name)
        first = rpc.Compare(
            key=start,
            range_end=prefix_end(start),
            target=rpc.Compare.CREATE,
            result=rpc.Compare.GREATER,
            create_revision=token - 1,
        )
        put = rpc.PutRequest(key=key, value=value, ignore_lease=True)
        return rpc.TxnRequest(
            compare=[_compare_create(key, token), first],
            success=[rpc.RequestOp(request_put=put)],
        )

    def delete_key(self, name: str, slot: str) -> Any:
        """DeleteRange: delete ``slot``'s key of ``name``, whatever grant it is."""
        return rpc.DeleteRangeRequest(key=self.key(name, slot))

    def delete(self, name: str, slot: str, token: int | None) -> Any:
        """Txn: delete ``slot``'s key of ``name`` (only if it is grant ``token``, if given)."""
        key = self.key(name, slot)
        if token is None:
            delete = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))
            return rpc.TxnRequest(success=[delete])
        request = rpc.TxnRequest()
        request.CopyFrom(self._name(name).delete)
        compare = request.compare[0]
        compare.key, compare.create_revision = key, token
        request.success[0].request_delete_range.key = key
        return request

    def watch_delete(self, key: bytes, after: int) -> Any:
        """Watch for the deletion of ``key`` after revision ``after``."""
        return rpc.WatchCreateRequest(
            key=key, start_revision=after + 1, filters=[rpc.WatchCreateRequest.NOPUT]
        )

    def watch_key(self, key: bytes, after: int) -> Any:
        """Watch for any change of ``key`` after revision ``after``: its deletion, or a
        new value (a holder's new metadata)."""
        return rpc.WatchCreateRequest(key=key, start_revision=after + 1)

    def watch_create(self, name: str, after: int) -> Any:
        """Watch for a new key of ``name`` after revision ``after``."""
        start = self.start(name)
        return rpc.WatchCreateRequest(
            key=start,
            range_end=prefix_end(start),
            start_revision=after + 1,
            filters=[rpc.WatchCreateRequest.NODELETE],
        )
