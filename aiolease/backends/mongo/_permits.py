"""Permits (semaphores, read-write locks) on MongoDB: one document per name.

The permits of lease collection ``C`` live in collection ``C_permits``, one document
per name (never deleted, no TTL index: its token counter never restarts)::

    {_id: name, token: <last token>, seq: <last arrival>, v: <version: new random hex>,
     entries: [{owner, weight, limit, granted, seq, token, identity, metadata,
                expires}]}

An entry is a held permit (``granted``) or a queue entry. Every read projects the
server's ``$$NOW`` and each entry's milliseconds left, so expiry is judged on the
server's clock only. An acquire reads the document and writes the next state back
on the condition that ``v`` is unchanged (compare and set: two round trips; a lost
race reads again); renewals and releases are single updates that also bump ``v``.
No driver is imported here.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ..._permits import RW_LIMIT, is_permit_owner
from ..sql._permits import Action, PermitRow
from ._docs import foreign

__all__ = [
    "READ",
    "entry_of",
    "live_expr",
    "parse",
    "release_update",
    "renew_update",
]

Doc = dict[str, Any]
NOW = "$$NOW"
_FIELDS = {"_id", "token", "seq", "v", "entries", "_now", "_lefts"}

#: What every read of a permits document shows: its fields, the server's now, and
#: the milliseconds left of each entry.
READ: Doc = {
    "token": 1,
    "seq": 1,
    "v": 1,
    "entries": 1,
    "_now": NOW,
    "_lefts": {
        "$cond": [
            {"$isArray": "$entries"},
            {
                "$map": {
                    "input": "$entries",
                    "in": {
                        "$cond": [
                            {"$eq": [{"$type": "$$this.expires"}, "date"]},
                            {"$subtract": ["$$this.expires", NOW]},
                            None,
                        ]
                    },
                }
            },
            None,
        ]
    },
}


def version() -> str:
    """A new version of a permits document (every write sets one)."""
    return uuid.uuid4().hex


def _int(value: object, low: int, high: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value <= high


def parse(
    where: str, name: str, doc: Mapping[str, Any] | None
) -> tuple[list[PermitRow], list[Doc], int, int, str | None, datetime.datetime | None]:
    """The live rows of ``doc`` in arrival order, its live entries as stored, its token
    counter, its arrival counter, its version (``None``: no document; else a random
    string that each write replaces, so that no state, even one rolled back in a
    failover, is ever mistaken for another) and the server's
    now.

    :raises ForeignDataError: ``doc`` is not one aiolease wrote
    """
    if doc is None:
        return [], [], 0, 0, None, None
    problem = _problem(doc)
    if problem is not None:
        raise foreign(where, name, problem)
    rows: list[PermitRow] = []
    kept: list[Doc] = []
    for entry, left in zip(doc["entries"], doc["_lefts"], strict=True):
        if left > 0:
            rows.append(
                PermitRow(
                    entry["owner"],
                    entry["weight"],
                    entry["limit"],
                    entry["granted"],
                    entry["seq"],
                    entry["token"] if entry["granted"] else 0,
                    entry["identity"],
                    dict(entry["metadata"]),
                    left / 1000.0,
                )
            )
            kept.append(dict(entry))
    rows.sort(key=lambda row: row.seq)
    kept.sort(key=lambda entry: int(entry["seq"]))
    return rows, kept, doc["token"], doc["seq"], doc["v"], doc["_now"]


def _problem(doc: Mapping[str, Any]) -> str | None:
    """What makes ``doc`` one aiolease would not have written, or ``None``."""
    extra = set(doc) - _FIELDS
    if extra:
        return f"it has fields {sorted(extra)!r}"[:200]
    for field in ("token", "seq"):
        if not _int(doc.get(field), 0, 2**63 - 1):
            return f"its {field} is {doc.get(field)!r}, not an integer >= 0"[:200]
    if not isinstance(doc.get("v"), str):
        return f"its version is {doc.get('v')!r}"[:200]
    entries = doc.get("entries")
    if not isinstance(entries, list) or not isinstance(doc.get("_lefts"), list):
        return f"its entries are not an array: {entries!r}"[:200]
    for entry in entries:
        problem = _entry_problem(entry)
        if problem is not None:
            return f"a permit entry {problem}"[:200]
    if not isinstance(doc.get("_now"), datetime.datetime):
        return "the server's time is missing"  # pragma: no cover - projected by the server
    return None


def _entry_problem(entry: object) -> str | None:
    if not isinstance(entry, Mapping):
        return f"is {entry!r}"
    owner = entry.get("owner")
    if not isinstance(owner, str) or not is_permit_owner(owner):
        return f"has the owner {owner!r}"
    limit = entry.get("limit")
    if not _int(limit, 1, RW_LIMIT):
        return f"has the limit {limit!r}"
    if not _int(entry.get("weight"), 1, limit):  # type: ignore[arg-type]
        return f"has the weight {entry.get('weight')!r}"
    if not isinstance(entry.get("granted"), bool):
        return "has no granted flag"
    if not _int(entry.get("seq"), 0, 2**63 - 1):
        return f"has the sequence number {entry.get('seq')!r}"
    if entry["granted"] and not _int(entry.get("token"), 1, 2**63 - 1):
        return f"has the token {entry.get('token')!r}"
    if not isinstance(entry.get("identity"), str):
        return f"has the identity {entry.get('identity')!r}"
    metadata = entry.get("metadata")
    if not isinstance(metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        return "has metadata that is not an object of strings"
    if not isinstance(entry.get("expires"), datetime.datetime):
        return "has no expiry"
    return None


def entry_of(
    owner: str,
    weight: int,
    limit: int,
    granted: bool,
    seq: int,
    token: int,
    identity: str,
    metadata: Mapping[str, str],
    expires: datetime.datetime,
) -> Doc:
    """A stored entry."""
    return {
        "owner": owner,
        "weight": weight,
        "limit": limit,
        "granted": granted,
        "seq": seq,
        "token": token,
        "identity": identity,
        "metadata": dict(metadata),
        "expires": expires,
    }


def next_entries(
    kept: Sequence[Doc],
    action: Action,
    owner: str,
    weight: int,
    limit: int,
    identity: str,
    metadata: Mapping[str, str],
    expires: datetime.datetime,
    token: int,
    seq: int,
) -> list[Doc]:
    """The live entries ``kept`` after ``action`` by ``owner`` (``token``: the token of
    a grant; ``seq``: the arrival of a new queue entry)."""
    out: list[Doc] = []
    for entry in kept:
        if entry["owner"] != owner:
            out.append(entry)
        elif action is Action.GRANT:
            pass  # the queue entry becomes the permit, appended below
        else:  # RENEW or REFRESH: the expiry only
            out.append({**entry, "expires": expires})
    if action is Action.GRANT:
        out.append(entry_of(owner, weight, limit, True, seq, token, identity, metadata, expires))
    elif action is Action.QUEUE:
        out.append(entry_of(owner, weight, limit, False, seq, 0, identity, metadata, expires))
    return out


def _match(owner: str, token: int | None, live: bool) -> Doc:
    """Whether ``$$this`` is ``owner``'s entry (of ``token``, if given; live, if asked)."""
    terms: list[Any] = [{"$eq": ["$$this.owner", {"$literal": owner}]}]
    if token is not None:
        terms += [{"$eq": ["$$this.granted", True]}, {"$eq": ["$$this.token", token]}]
    if live:
        terms.append({"$gt": ["$$this.expires", NOW]})
    return {"$and": terms}


def live_expr(owner: str, token: int | None, live: bool = True) -> Doc:
    """A filter's ``$expr``: the document has ``owner``'s entry (see :func:`_match`)."""
    return {
        "$cond": [
            {"$isArray": "$entries"},
            {
                "$anyElementTrue": [
                    {"$map": {"input": "$entries", "in": _match(owner, token, live)}}
                ]
            },
            False,
        ]
    }


def renew_update(owner: str, token: int, ttl_ms: int) -> list[Doc]:
    """Reset the expiry of ``owner``'s live permit ``token`` to now + ttl."""
    return [
        {
            "$set": {
                "v": {"$literal": version()},
                "entries": {
                    "$map": {
                        "input": "$entries",
                        "in": {
                            "$cond": [
                                _match(owner, token, True),
                                {"$mergeObjects": ["$$this", {"expires": {"$add": [NOW, ttl_ms]}}]},
                                "$$this",
                            ]
                        },
                    }
                },
            }
        }
    ]


def release_update(owner: str) -> list[Doc]:
    """Drop ``owner``'s entries (its permit and its queue entry) and expired ones."""
    return [
        {
            "$set": {
                "v": {"$literal": version()},
                "entries": {
                    "$filter": {
                        "input": "$entries",
                        "cond": {
                            "$and": [
                                {"$ne": ["$$this.owner", {"$literal": owner}]},
                                {"$gt": ["$$this.expires", NOW]},
                            ]
                        },
                    }
                },
            }
        }
    ]
