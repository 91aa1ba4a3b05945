"""The grants a release hands to the waiters of its own backend object
(:class:`~aiolease.backends.sql._handed.Handed`): the release's own notification may
come before its answer, and must not make the waiter ask again for a grant that the
answer hands it."""

from __future__ import annotations

from aiolease.abc import Grant
from aiolease.backends.sql._handed import Handed, turn_key


def _handed() -> tuple[Handed, list[str]]:
    woken: list[str] = []
    return Handed(woken.append, lambda: 10.0), woken


def test_a_notification_before_the_release_answers_waits_for_its_answer() -> None:
    handed, woken = _handed()
    handed.asking("n", "permit:w")
    handed.refused("n", "permit:w", 4)
    handed.releasing("n")
    handed.told("n", ["permit:w"])  # the release's own NOTIFY, before its answer
    assert not handed.waiting("n", "permit:w")
    assert woken == []
    handed.granted("n", ["permit:w"], [7], [30.0], 9.5)
    handed.released("n")
    assert woken == [turn_key("n", "permit:w")]
    grant = handed.take("n", "permit:w", 30.0, 4)
    assert isinstance(grant, Grant)
    assert grant.token == 7


def test_a_grant_told_during_a_release_that_did_not_hand_it_is_told_after() -> None:
    handed, woken = _handed()
    handed.asking("n", "permit:w")
    handed.releasing("n")
    handed.releasing("n")
    handed.told("n", ["permit:w"])  # granted by a release elsewhere
    handed.released("n")
    assert not handed.waiting("n", "permit:w")
    handed.released("n")  # the last release here ended, handing nothing
    assert handed.waiting("n", "permit:w")
    assert woken == [turn_key("n", "permit:w")]
    assert handed.take("n", "permit:w", 30.0, 4) is None  # asks again, to confirm it


def test_a_release_that_fails_still_tells_the_grants_it_held_back() -> None:
    handed, _ = _handed()
    handed.asking("n", "permit:w")
    handed.releasing("n")
    handed.told("n", ["permit:w"])
    handed.released("n")  # (called in a ``finally``, whatever the release raised)
    assert handed.waiting("n", "permit:w")


def test_the_requests_queued_here_are_those_refused_and_not_yet_granted_or_released() -> None:
    handed, _ = _handed()
    for owner in ("permit:a", "permit:b", "permit:c"):
        handed.asking("n", owner)
        handed.refused("n", owner, 4)
    handed.refused("m", "permit:x", 4)
    handed.granted("n", ["permit:a"], [7], [30.0], 9.5)
    assert handed.take("n", "permit:a", 30.0, 4) is not None  # taken: not queued
    handed.forget("n", "permit:b")  # released (or granted by its own ask)
    assert handed.queued_here("n") == ["permit:c"]
    assert handed.queued_here("m") == ["permit:x"]
    handed.forget("n", "permit:c")
    assert handed.queued_here("n") == []
