"""Permits in SQL tables: the rows read back, and what an acquire does with them.

The PostgreSQL and MySQL / MariaDB backends keep, beside the lease table, a permits
table (one row per held permit or queue entry, keyed ``(name, owner)``) and a names
table (per name the token counter and the queue's arrival sequence). An acquire locks
the name's row, reads the live permit rows of the name in arrival order (``seq``), and
grants, queues or refuses, all in one transaction run by a routine installed with the
tables (one round trip: see :func:`acquired` and ``docs/internals/semaphores.md`` for
the rules). Nothing here imports a driver.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from ..._exceptions import LimitMismatchError
from ..._permits import RW_LIMIT, PermitHolders, is_permit_owner
from ...abc import Grant, HolderInfo, Renewal
from ._rows import decode_metadata, foreign

__all__ = [
    "Action",
    "CheckedRows",
    "PermitRow",
    "acquired",
    "blocker",
    "by_kind",
    "decide",
    "permit_holders",
    "permit_routine",
    "permit_row",
    "permit_tables",
]


def by_kind(renewals: Sequence[Renewal]) -> tuple[list[Renewal], list[Renewal]]:
    """The renewals of locks, and those of permits (each renewed by a statement on its
    own table), in the order given."""
    locks: list[Renewal] = []
    permits: list[Renewal] = []
    for renewal in renewals:
        (permits if is_permit_owner(renewal[1]) else locks).append(renewal)
    return locks, permits


def permit_tables(table: str, longest: int) -> tuple[str, str]:
    """The permits table and the permit names table of lease table ``table``:
    ``<table>_permits`` and ``<table>_permit_names``, or, where a name would pass the
    server's ``longest`` identifier, ``aiolease_p`` / ``aiolease_n`` and 16 hex digits
    of a hash of ``table``."""
    digest = hashlib.sha256(table.encode()).hexdigest()[:16]
    return tuple(  # type: ignore[return-value]
        f"{table}{suffix}" if len(table) + len(suffix) <= longest else f"{short}{digest}"
        for suffix, short in (("_permits", "aiolease_p"), ("_permit_names", "aiolease_n"))
    )


#: The version of the routines' bodies and signatures, in their names: a changed
#: routine gets a new name, so that processes of two versions never call each other's.
#: Version 2: a release grants the queue entries that then fit (see
#: ``docs/internals/semaphores.md``), and a queue entry keeps its metadata for that.
#: Version 3: PostgreSQL's acquire commits a refusal without waiting for the WAL
#: flush (``synchronous_commit`` off for that transaction).
#: Version 4: MySQL's acquire answers a grant or a renewal after its ``COMMIT``, in two
#: columns (``act``, ``tok``); the rows of the name only with a refusal.
#: Version 5: PostgreSQL's acquire grants a name that has no row at all without
#: reading its rows for the limit, the held weight and the queue.
#: Version 6 (made on the PostgreSQL helper's branch, installed on the shared test
#: servers under that number): PostgreSQL's acquire locks the name's row without
#: writing it (written only for a grant's token or a new queue entry's place), reads
#: the name's rows without locking them in one statement, and a refusal answers the
#: blocker only; a release does not notify the grants to requests queued through the
#: releasing backend object.
#: Version 7 (6 is taken by a PostgreSQL change made alongside: the merge renames
#: once): MySQL's batch makes and locks the name's row first, reads its token and
#: queue place once and writes them back once (its acquires take them as ``INOUT``
#: parameters: a refusal writes no token, a new entry no place); a new request's weight
#: queued ahead is summed by the read that locks the name's permits; a batch's release
#: of a live permit is one ``DELETE``.
#: Version 8: versions 6 and 7 together (each was installed alone on the shared
#: test servers: routines are made only when missing, so the merge takes a new number).
#: Version 9: PostgreSQL's functions read a name's rows by plain index scans (bitmap
#: and sequential scans off for their bodies: see ``_permit_functions._INDEX_ONLY``).
#: Version 10: MySQL's acquire grants a name without any row by one statement (the
#: permit written only if no row of the name exists), without reading the name's rows.
ROUTINE_VERSION = 10


def permit_routine(table: str, longest: int, kind: str = "acquire") -> str:
    """The server-side routine of ``kind`` (``"acquire"`` or ``"release"``) of the
    permits of lease table ``table`` (installed by the backend's setup):
    ``<table>_permit_<kind>_v<N>``, or, where that would pass the server's ``longest``
    identifier, ``aiolease_<k><N>_`` (``k``: the kind's first letter) and 16 hex digits
    of a hash of ``table``."""
    full = f"{table}_permit_{kind}_v{ROUTINE_VERSION}"
    if len(full) <= longest:
        return full
    digest = hashlib.sha256(table.encode()).hexdigest()[:16]
    return f"aiolease_{kind[0]}{ROUTINE_VERSION}_{digest}"


@dataclass(frozen=True, slots=True)
class PermitRow:
    """A live row of a permits table: a held permit (``granted``) or a queue entry."""

    owner: str
    weight: int
    limit: int
    granted: bool
    seq: int
    token: int  # 0 for a queue entry
    identity: str
    metadata: dict[str, str]
    remaining: float

    def holder(self, name: str) -> HolderInfo:
        return HolderInfo(
            name, self.owner, self.identity, self.token, dict(self.metadata), self.remaining
        )


def _int(what: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"its {what} is {value!r}, not an integer from {low} to {high}")
    return value


def _text(what: str, value: object) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"its {what} is not UTF-8") from None
    if not isinstance(value, str):
        raise ValueError(f"its {what} is {value!r}")
    return value


def permit_row(
    table: str,
    name: str,
    owner: object,
    weight: object,
    limit: object,
    granted: object,
    seq: object,
    token: object,
    identity: object,
    metadata: object,
    remaining: object,
) -> PermitRow:
    """The permit row of these values.

    :param table: the table, as messages name it
    :raises ForeignDataError: a value aiolease would not have written (an owner id
        that is not a permit's, a weight outside ``[1, limit]``, a held permit without
        a token, metadata that is not a JSON object of strings, ...)
    """
    try:
        who = _text("owner", owner)
        if not is_permit_owner(who):
            raise ValueError(f"its owner {who[:80]!r} is not a permit's owner id")
        lim = _int("limit", limit, 1, RW_LIMIT)
        held = bool(granted)
        if isinstance(remaining, bool) or not isinstance(remaining, (int, float)):
            raise ValueError(f"its expiry is {remaining!r}")
        return PermitRow(
            who,
            _int("weight", weight, 1, lim),
            lim,
            held,
            _int("sequence number", seq, 0, 2**63 - 1),
            _int("token", token, 1, 2**63 - 1) if held else 0,
            "" if identity is None else _text("identity", identity),
            decode_metadata(metadata),
            max(float(remaining), 0.0),
        )
    except ValueError as exc:
        raise foreign(table, name, f"a permit row: {exc}") from None


#: The most rows :class:`CheckedRows` remembers (then it forgets them all).
_MOST_CHECKED = 4096


class CheckedRows:
    """:func:`permit_row` with a memory: the rows checked lately, by their stored values
    (a refusal answers the name's queue entries, mostly the same as the last refusal's,
    and each check decodes the row's metadata), so that a row seen before is only
    given its ``remaining``.

    :param table: the table, as messages name it
    """

    def __init__(self, table: str) -> None:
        self._table = table
        self._seen: dict[tuple[object, ...], PermitRow] = {}

    def row(
        self,
        name: str,
        owner: object,
        weight: object,
        limit: object,
        granted: object,
        seq: object,
        token: object,
        identity: object,
        metadata: object,
        remaining: object,
    ) -> PermitRow:
        """:func:`permit_row` of these values.

        :raises ForeignDataError: as :func:`permit_row`
        """
        key = (name, owner, weight, limit, granted, seq, token, identity, metadata)
        try:
            seen = self._seen.get(key)
        except TypeError:  # a value that is not hashable: checked afresh, never kept
            return permit_row(self._table, *key, remaining)
        if seen is None or isinstance(remaining, bool) or not isinstance(remaining, (int, float)):
            row = permit_row(self._table, *key, remaining)
            if len(self._seen) >= _MOST_CHECKED:
                self._seen.clear()
            self._seen[key] = row
            return row
        return PermitRow(
            seen.owner,
            seen.weight,
            seen.limit,
            seen.granted,
            seen.seq,
            seen.token,
            seen.identity,
            seen.metadata,
            max(float(remaining), 0.0),
        )

    def seen(self, key: tuple[object, ...]) -> bool:
        """Whether the row of these stored values (``(name, owner, weight, limit,
        granted, seq, token, identity, metadata)``, as :meth:`row` keys them) passed
        its checks lately: only its expiry is then left to check."""
        try:
            return key in self._seen
        except TypeError:  # a value that is not hashable: never kept
            return False

    def check(
        self,
        name: str,
        owner: object,
        weight: object,
        limit: object,
        granted: object,
        seq: object,
        token: object,
        identity: object,
        metadata: object,
        remaining: object,
    ) -> None:
        """:meth:`row`'s checks alone, for a caller that reads the values themselves
        (SQLite's routines, in Python): a row seen before costs a lookup, not a
        :class:`PermitRow`.

        :raises ForeignDataError: as :func:`permit_row`
        """
        key = (name, owner, weight, limit, granted, seq, token, identity, metadata)
        try:
            seen = key in self._seen
        except TypeError:
            seen = False
        if not seen or isinstance(remaining, bool) or not isinstance(remaining, (int, float)):
            self.row(name, *key[1:], remaining)


def acquired(
    where: str,
    name: str,
    owner: str,
    ttl: float,
    limit: int,
    act: object,
    token: object,
    rows: Sequence[PermitRow],
) -> Grant | HolderInfo:
    """What the acquire routine's answer means (its ``act``, the ``token`` of a grant, the
    live ``rows`` it reported, already checked by :func:`permit_row`).

    The routine, in one transaction that locks the name's row first: drops the name's
    expired rows; reports the live ones, writing nothing, when one of them is not
    aiolease's (``"foreign"``) or was asked with another limit (``"mismatch"``);
    renews the caller's live permit (``"renew"``: same token); grants if the held
    weight, the weight queued ahead of the caller and its weight fit the limit
    (``"grant"``: the name's next token, the caller's queue entry becoming the
    permit); else writes the caller's queue entry (``"queue"``: the next place) or
    refreshes it (``"refresh"``: its place kept), and reports the live rows (MySQL's
    routine: only the live permits, the caller's entry and the first entry of another,
    which is all that :func:`blocker` and the caller's bell read; PostgreSQL's: the
    blocker's only, which :func:`blocker` picks again).

    :param where: the permits table, as messages name it
    :raises LimitMismatchError: ``"mismatch"``
    :raises ForeignDataError: ``"foreign"``, or an answer aiolease's routine never gives
    """
    if act in ("grant", "renew") and isinstance(token, int) and token > 0:
        return Grant(token, ttl)
    if act == "mismatch" and rows:
        raise LimitMismatchError(name, limit, rows[0].limit)
    if act in ("queue", "refresh") and any(row.owner != owner for row in rows):
        return blocker(name, rows, owner)
    raise foreign(where, name, f"the acquire routine answered {act!r} over its rows")


class Action(Enum):
    """What an acquire writes (see :func:`decide`)."""

    #: the caller holds a live permit already: its expiry is reset, its token kept
    RENEW = "renew"
    #: a new permit, with the next token (the caller's queue entry, if any, becomes it)
    GRANT = "grant"
    #: refused, the caller not queued yet: a queue entry with the next sequence number
    QUEUE = "queue"
    #: refused, the caller queued already: its entry's expiry is reset (its place kept)
    REFRESH = "refresh"


def decide(
    name: str, rows: Sequence[PermitRow], owner: str, limit: int, weight: int
) -> tuple[Action, PermitRow | None]:
    """What a request of ``weight`` out of ``limit`` by ``owner`` does, given the live
    rows of ``name`` in arrival order, and the caller's own row if it has one (the
    rules that the SQL backends' acquire routines run on the server, for a backend
    that decides in Python: MongoDB's).

    :raises LimitMismatchError: the live rows were asked with another limit
    """
    if rows and rows[0].limit != limit:
        raise LimitMismatchError(name, limit, rows[0].limit)
    mine = next((row for row in rows if row.owner == owner), None)
    if mine is not None and mine.granted:
        return Action.RENEW, mine
    used = sum(row.weight for row in rows if row.granted)
    ahead = sum(
        row.weight
        for row in rows
        if not row.granted and row.owner != owner and (mine is None or row.seq < mine.seq)
    )
    if used + ahead + weight <= limit:
        return Action.GRANT, mine
    return (Action.QUEUE if mine is None else Action.REFRESH), mine


def blocker(name: str, rows: Sequence[PermitRow], owner: str) -> HolderInfo:
    """What a refusal reports: the live permit that expires first, or, when only the
    queue blocks, the first entry ahead of ``owner`` (token 0)."""
    held = [row for row in rows if row.granted]
    if held:
        return min(held, key=lambda row: row.remaining).holder(name)
    return next(row for row in rows if row.owner != owner).holder(name)


def permit_holders(name: str, rows: Sequence[PermitRow]) -> PermitHolders | None:
    """:meth:`~aiolease.abc.Backend.read_permits`' answer for these live rows."""
    if not rows:
        return None
    held = sorted((row for row in rows if row.granted), key=lambda row: row.token)
    return PermitHolders(
        name,
        rows[0].limit,
        tuple(row.holder(name) for row in held),
        tuple(row.weight for row in held),
        sum(1 for row in rows if not row.granted),
    )
