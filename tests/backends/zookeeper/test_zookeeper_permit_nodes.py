"""Permit node names (``_permit_nodes``): what a child of a name's permits node stands
for, parsed once per node and then answered from memory; a node aiolease would not
create is refused every time. (The real server's listings: test_zookeeper_permits.py.)"""

from __future__ import annotations

import pytest

from aiolease import ForeignDataError
from aiolease.backends.zookeeper._permit_nodes import PermitLayout, PermitNode

OURS = "_c_permit%3Aab-p3x1-0000000007"


def test_a_node_parsed_again_is_the_same_and_the_queue_is_in_sequence_order() -> None:
    layout = PermitLayout("/aiolease")
    first = layout.parse("n", OURS)
    assert first == PermitNode(7, OURS, "permit:ab", 3, 1)
    assert layout.parse("other", OURS) is first  # the name only goes into errors
    later, earlier = "_c_permit%3Acd-p3x2-0000000010", "_c_permit%3Aef-p3x1-0000000002"
    assert [node.sequence for node in layout.queue("n", [later, OURS, earlier])] == [2, 7, 10]


@pytest.mark.parametrize(
    "node",
    [
        "not-ours",
        "_c_permit%3Aab-p3x0-0000000007",  # weight 0
        "_c_permit%3Aab-p3x1-7",  # not ten digits
        "_c_permit:ab-p3x1-0000000007",  # not quoted as aiolease quotes
    ],
)
def test_a_node_aiolease_would_not_create_is_refused_every_time(node: str) -> None:
    layout = PermitLayout("/aiolease")
    for _ in range(2):
        with pytest.raises(ForeignDataError, match="not one aiolease gives"):
            layout.parse("n", node)
        with pytest.raises(ForeignDataError):
            layout.queue("n", [OURS, node])
