"""``Takers`` (``aiolease.backends._takers``): held leases that a takeover notification
ends, shared by the PostgreSQL and MongoDB backends; tested once, without a server."""

from __future__ import annotations

from aiolease import LossReason
from aiolease.backends._takers import Takers


def test_takers_trust_only_notifications_newer_than_the_grant() -> None:
    takers = Takers()
    ended: list[LossReason] = []
    cancel = takers.add("n", "me", 7, ended.append)
    takers.notified("n", None, 6)  # a release from before our grant, delivered late
    takers.notified("n", "earlier", 6)  # a grant from before ours
    takers.notified("n", "me", 7)  # our own grant
    takers.notified("n", None, None)  # a notification of an unknown token
    takers.notified("other", "thief", 8)  # another name
    assert ended == []
    takers.notified("n", "thief", 8)
    assert ended == [LossReason.STOLEN]
    takers.notified("n", None, 8)  # reported once
    assert ended == [LossReason.STOLEN]
    cancel()  # after it fired: harmless
    assert len(takers) == 0


def test_takers_end_on_a_release_of_their_token_by_somebody_else() -> None:
    takers = Takers()
    ended: list[str] = []
    takers.add("a", "me", 3, lambda _: ended.append("a"))
    cancel_b = takers.add("b", "me", 3, lambda _: ended.append("b"))
    takers.notified("a", None, 3)  # released in our name (our own release unsubscribes first)
    takers.notified("b", None, 2)  # an older token's release
    assert ended == ["a"]
    cancel_b()
    takers.notified("b", "thief", 4)  # unsubscribed
    assert ended == ["a"]
    assert len(takers) == 0
