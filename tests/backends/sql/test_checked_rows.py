"""``CheckedRows``: the SQL backends' permit rows, checked once per stored value and
given their ``remaining`` each time (a refusal answers the same queue entries again
and again). The rules of a row are ``permit_row``'s; here, that the memory keeps them."""

from __future__ import annotations

import pytest

from aiolease import ForeignDataError
from aiolease.abc import permit_owner
from aiolease.backends.sql._permits import CheckedRows, permit_row

#: A stored row's values but its ``remaining``: owner, weight, limit, granted, seq,
#: token, identity, metadata.
Values = tuple[object, object, object, object, object, object, object, object]


def _values(owner: str, metadata: object = '{"k": "v"}') -> Values:
    return (owner, 1, 4, True, 3, 7, "id", metadata)


def test_a_row_seen_again_is_the_same_row_with_its_new_remaining() -> None:
    rows, owner = CheckedRows('"t"'), permit_owner()
    first = rows.row("n", *_values(owner), 10.0)
    again = rows.row("n", *_values(owner), 4.5)
    assert first == permit_row('"t"', "n", *_values(owner), 10.0)
    assert again == permit_row('"t"', "n", *_values(owner), 4.5)
    assert again.holder("n").metadata == {"k": "v"}
    copy = again.holder("n").metadata
    assert isinstance(copy, dict)
    copy["k"] = "changed"  # a holder's copy, not the row's
    assert rows.row("n", *_values(owner), 1.0).metadata == {"k": "v"}
    assert rows.row("n", *_values(owner), -2.0).remaining == 0.0


@pytest.mark.parametrize(
    ("values", "remaining"),
    [
        (_values("intruder"), 1.0),
        (_values(permit_owner(), "not json"), 1.0),
        (_values(permit_owner(), ["unhashable"]), 1.0),
        (_values(permit_owner()), "soon"),
    ],
)
def test_foreign_values_are_refused_every_time(values: Values, remaining: object) -> None:
    rows = CheckedRows('"t"')
    for _ in range(2):
        with pytest.raises(ForeignDataError, match="not written by aiolease"):
            rows.row("n", *values, remaining)
        with pytest.raises(ForeignDataError, match="not written by aiolease"):
            rows.check("n", *values, remaining)


def test_check_alone_remembers_a_row_as_row_does() -> None:
    """``check`` (SQLite's routines read the values themselves) checks what ``row``
    checks, and a row it has seen is not checked again but for its ``remaining``."""
    rows, owner = CheckedRows('"t"'), permit_owner()
    rows.check("n", *_values(owner), 10.0)
    assert rows.row("n", *_values(owner), 2.0) == permit_row('"t"', "n", *_values(owner), 2.0)
    rows.check("n", *_values(owner), 3.0)
    with pytest.raises(ForeignDataError, match="expiry"):
        rows.check("n", *_values(owner), True)


def test_a_row_seen_with_a_foreign_remaining_is_refused() -> None:
    rows, owner = CheckedRows('"t"'), permit_owner()
    rows.row("n", *_values(owner), 10.0)
    with pytest.raises(ForeignDataError, match="expiry"):
        rows.row("n", *_values(owner), True)
