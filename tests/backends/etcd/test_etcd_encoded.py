"""The permit hand-off's txn, composed from serialized pieces (``_encoded``): it is the
``TxnRequest`` that protobuf would build, byte for byte, whatever the branches hold; the
hand-off tests in ``test_etcd_permits.py`` send it to a real server."""

from __future__ import annotations

from aetcd import rpc

from aiolease.backends.etcd._encoded import cascade
from aiolease.backends.etcd._keys import Layout, queue_slot

NAME = "n/a%me"
HELD = ("permit:" + "a" * 32, 1_000)
VALUE = b'{"identity":"me","metadata":{},"limit":4,"weight":1,"queued":false}'


def _owner(index: int) -> str:
    return f"permit:{index:032x}"


def _create(key: bytes, revision: int, result: int = rpc.Compare.EQUAL) -> rpc.Compare:
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=result, create_revision=revision)


def _expected(
    layout: Layout,
    owner: str,
    queued: int,
    lease: int,
    ranges: list[tuple[bytes, bytes, bool]],
    gone: list[bytes],
) -> rpc.TxnRequest:
    """The branch as ``Layout.permit_handoff`` built it with protobuf messages."""
    holder = layout.key(NAME, HELD[0])
    waiting, key = layout.key(NAME, queue_slot(owner)), layout.key(NAME, owner)
    first = [
        _create(low, queued - 1, rpc.Compare.GREATER)
        if known
        else rpc.Compare(key=low, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL, version=0)
        for low, high, known in ranges
    ]
    for compare, (_, high, _) in zip(first, ranges, strict=True):
        compare.range_end = high
    return rpc.TxnRequest(
        compare=[
            _create(holder, HELD[1]),
            _create(waiting, queued),
            _create(key, 0),
            *first,
            *(_create(other, 0) for other in gone),
        ],
        success=[
            rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=holder)),
            rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=waiting)),
            rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=VALUE, lease=lease)),
        ],
    )


def test_a_cascade_is_the_nested_txn_protobuf_builds() -> None:
    layout = Layout(b"prefix/")
    passing = [layout.key(NAME, queue_slot(_owner(9)))]
    split = layout.queue_ranges(NAME, passing)
    branches, expected = [], []
    earlier: list[bytes] = []
    for index, ranges in enumerate(
        [
            [],  # the default: every queue key, known to hold a newer one
            [(split[0][0], split[0][1], True), (split[1][0], split[1][1], False)],
            [(low, high, True) for low, high in split],
        ]
    ):
        owner, queued, lease = _owner(index), 2_000 + index, 7 + index
        for _ in range(2):  # the second time from the pieces remembered
            branch = layout.permit_handoff(NAME, HELD, owner, queued, VALUE, lease, ranges, earlier)
        branches.append(branch)
        default = [(*layout.queue_ranges(NAME)[0], True)]
        expected.append(_expected(layout, owner, queued, lease, ranges or default, earlier))
        earlier = [*earlier, layout.key(NAME, queue_slot(owner))]
    for outer, inner in zip(expected[-2::-1], expected[:0:-1], strict=True):
        outer.failure.append(rpc.RequestOp(request_txn=inner))
    assert rpc.TxnRequest.FromString(cascade(branches)) == expected[0]
    assert cascade(branches) == expected[0].SerializeToString(deterministic=True)


def test_one_branch_is_a_txn_of_its_own() -> None:
    layout = Layout(b"p/")
    branch = layout.permit_handoff(NAME, HELD, _owner(1), 5, VALUE, 3)
    default = [(*layout.queue_ranges(NAME)[0], True)]
    assert cascade([branch]) == _expected(layout, _owner(1), 5, 3, default, []).SerializeToString()


def test_long_fields_and_large_numbers_keep_their_lengths() -> None:
    # Values longer than 127 bytes and revisions over 2**28 take multi-byte varints.
    layout = Layout(b"p/" * 100)
    value = b"x" * 70_000
    branch = layout.permit_handoff(
        NAME, ("permit:" + "b" * 32, 2**40), _owner(2), 2**33, value, 2**62
    )
    parsed = rpc.TxnRequest.FromString(cascade([branch, branch]))
    assert parsed.success[2].request_put.value == value
    assert parsed.compare[0].create_revision == 2**40
    assert parsed.failure[0].request_txn.success[2].request_put.lease == 2**62
