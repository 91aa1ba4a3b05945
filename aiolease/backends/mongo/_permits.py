"""Permits (semaphores, read-write locks) on MongoDB: one document per name, changed
only by update pipelines that decide on the server with ``$$NOW``.

The permits of lease collection ``C`` live in collection ``C_permits``, one document
per name (never deleted, no TTL index: its token counter never restarts)::

    {_id: name, token: <last token>, seq: <last arrival>, freed: <latest release's stamp>,
     entries: [{owner, weight, limit, granted, seq, token, identity, metadata,
                expires}]}

An entry is a held permit (``granted``) or a queue entry. The acquires' pipelines
are in :mod:`._permit_acquire`; the document's checks, reads, releases and renewals
here. A release sets ``freed`` to a stamp new with each release (its change event is what
wakes the waiters of other backend objects); nothing else does. Every read projects
the server's ``$$NOW`` and each entry's milliseconds left, so expiry is judged on the
server's clock only. No driver is imported here.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from ..._permits import PERMIT_PREFIX, RW_LIMIT, is_permit_owner
from ..sql._permits import PermitRow
from ._docs import foreign

__all__ = [
    "FREED",
    "READ",
    "RELEASED_AFTER",
    "freed_flags",
    "granted_in",
    "live_expr",
    "parse",
    "release_filter",
    "release_many_filter",
    "release_pipeline",
    "release_update",
    "renew_update",
]

Doc = dict[str, Any]
NOW = "$$NOW"
#: The field each release sets to the releasing backend's next stamp.
FREED = "freed"
#: The fields of a permits document (a read's projection adds ``_now``, ``_lefts``,
#: and ``_extra``: the names of any other fields).
FIELDS = ("_id", "token", "seq", "entries", FREED)
_MAX = 2**63 - 1


def _type(path: str) -> Doc:
    return {"$type": path}


def _is(path: str, *types: str) -> Doc:
    return {"$in": [_type(path), list(types)]}


def _integer(path: str, low: int, high: Any = _MAX) -> Doc:
    """``path`` is an int or a long in ``[low, high]`` (``high`` may be an expression)."""
    return {"$and": [_is(path, "int", "long"), {"$gte": [path, low]}, {"$lte": [path, high]}]}


#: The names of the document's fields that aiolease does not write.
_EXTRA: Doc = {
    "$setDifference": [
        {"$map": {"input": {"$objectToArray": "$$ROOT"}, "in": "$$this.k"}},
        list(FIELDS),
    ]
}

#: Whether ``$$this`` is an entry aiolease would have written (what :func:`_entry_problem`
#: checks on the client: the server never changes a document the client would refuse).
_ENTRY_VALID: Doc = {
    "$and": [
        _is("$$this", "object"),
        _is("$$this.owner", "string"),
        {"$eq": [{"$substrBytes": ["$$this.owner", 0, len(PERMIT_PREFIX)]}, PERMIT_PREFIX]},
        _integer("$$this.limit", 1, RW_LIMIT),
        _integer("$$this.weight", 1, "$$this.limit"),
        _is("$$this.granted", "bool"),
        _integer("$$this.seq", 0),
        {"$or": [{"$not": ["$$this.granted"]}, _integer("$$this.token", 1)]},
        _is("$$this.identity", "string"),
        _is("$$this.metadata", "object"),
        {
            "$allElementsTrue": [
                {
                    "$map": {
                        "input": {"$objectToArray": "$$this.metadata"},
                        "as": "kv",
                        "in": _is("$$kv.v", "string"),
                    }
                }
            ]
        },
        _is("$$this.expires", "date"),
    ]
}

#: Whether the document is one aiolease wrote (or ``{_id}`` alone: a first upsert).
VALID: Doc = {
    "$or": [
        {"$eq": [{"$size": {"$objectToArray": "$$ROOT"}}, 1]},
        {
            "$and": [
                {"$eq": [{"$size": _EXTRA}, 0]},
                _integer("$token", 0),
                _integer("$seq", 0),
                _is("$" + FREED, "missing", "string"),
                _is("$entries", "array"),
                {"$allElementsTrue": [{"$map": {"input": "$entries", "in": _ENTRY_VALID}}]},
            ]
        },
    ]
}

#: The milliseconds left of each entry, on the server's clock.
_LEFTS: Doc = {
    "$cond": [
        {"$isArray": "$entries"},
        {
            "$map": {
                "input": "$entries",
                "in": {
                    "$cond": [
                        {"$eq": [_type("$$this.expires"), "date"]},
                        {"$subtract": ["$$this.expires", NOW]},
                        None,
                    ]
                },
            }
        },
        None,
    ]
}

#: What every read of a permits document shows: its fields, the server's now, the
#: milliseconds left of each entry, and the names of foreign fields.
READ: Doc = {
    "token": 1,
    "seq": 1,
    "entries": 1,
    FREED: 1,
    "_now": NOW,
    "_extra": _EXTRA,
    "_lefts": _LEFTS,
}


def _long(value: Any) -> Doc:
    return {"$toLong": value}


def _int(value: object, low: int, high: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value <= high


def parse(where: str, name: str, doc: Mapping[str, Any] | None) -> list[PermitRow]:
    """The live entries of ``doc`` (read with :data:`READ`) in arrival order.

    :raises ForeignDataError: ``doc`` is not one aiolease wrote
    """
    if doc is None:
        return []
    problem = _problem(doc)
    if problem is not None:
        raise foreign(where, name, problem)
    rows: list[PermitRow] = []
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
    rows.sort(key=lambda row: row.seq)
    return rows


def _problem(doc: Mapping[str, Any]) -> str | None:
    """What makes ``doc`` one aiolease would not have written, or ``None`` (the same
    checks as :data:`VALID`, which keeps the server from changing such a document)."""
    if doc.get("_extra"):
        return f"it has fields {sorted(doc['_extra'])!r}"[:200]
    for field in ("token", "seq"):
        if not _int(doc.get(field), 0, _MAX):
            return f"its {field} is {doc.get(field)!r}, not an integer >= 0"[:200]
    if FREED in doc and not isinstance(doc[FREED], str):
        return f"its {FREED} is {doc[FREED]!r}"[:200]
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
    if not _int(entry.get("seq"), 0, _MAX):
        return f"has the sequence number {entry.get('seq')!r}"
    if entry["granted"] and not _int(entry.get("token"), 1, _MAX):
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


def _held_by(pairs: list[tuple[str, int]]) -> Doc:
    """Whether ``$$this`` is a live permit of one of ``pairs`` (owner, token). Found by
    its token (an integer: ``$indexOfArray`` compares scalars), then its owner checked at
    that place: ``$in`` of an ``{owner, token}`` document compared documents, and over
    1,000 permits renewing them all took some 90 ms of the server's time per write, long
    enough for the name's acquires to conflict with it again and again."""
    tokens = {"$literal": [token for _, token in pairs]}
    owners = {"$literal": [owner for owner, _ in pairs]}
    place = {"$indexOfArray": [tokens, "$$this.token"]}
    return {
        "$and": [
            {"$eq": ["$$this.granted", True]},
            {"$gt": ["$$this.expires", NOW]},
            {
                "$let": {
                    "vars": {"at": place},
                    "in": {
                        "$and": [
                            {"$gte": ["$$at", 0]},
                            {"$eq": [{"$arrayElemAt": [owners, "$$at"]}, "$$this.owner"]},
                        ]
                    },
                }
            },
        ]
    }


def renew_all_filter(name: str, pairs: list[tuple[str, int]]) -> Doc:
    """The permits document of ``name`` if every permit of ``pairs`` (owner, token,
    each once) is live in it."""
    found = {"$filter": {"input": "$entries", "cond": _held_by(pairs)}}
    return {
        "_id": name,
        "$expr": {"$and": [{"$isArray": "$entries"}, {"$eq": [{"$size": found}, len(pairs)]}]},
    }


def _renewed_where(condition: Doc, ttl_ms: int) -> list[Doc]:
    """Reset the expiry of every entry that ``condition`` holds for to now + ttl: one
    write of the document (a write per permit rewrites the whole document, with every
    entry, each time)."""
    renewed = {"$mergeObjects": ["$$this", {"expires": {"$add": [NOW, ttl_ms]}}]}
    entries = {"$map": {"input": "$entries", "in": {"$cond": [condition, renewed, "$$this"]}}}
    return [{"$set": {"entries": entries}}]


def renew_all_update(pairs: list[tuple[str, int]], ttl_ms: int) -> list[Doc]:
    """Reset the expiry of every live permit of ``pairs`` to now + ttl, all in one write."""
    return _renewed_where(_held_by(pairs), ttl_ms)


def renew_update(owner: str, token: int, ttl_ms: int) -> list[Doc]:
    """Reset the expiry of ``owner``'s live permit ``token`` to now + ttl."""
    return _renewed_where(_match(owner, token, True), ttl_ms)


def _mine(owner: str, token: int | None) -> Doc:
    """Whether ``$$this`` is an entry of ``owner`` that its release drops: its queue
    entry whatever ``token`` is (a queue entry has none), its permit only if it is
    ``token`` (any, if ``None``)."""
    terms: list[Any] = [{"$eq": ["$$this.owner", {"$literal": owner}]}]
    if token is not None:
        terms.append({"$or": [{"$ne": ["$$this.granted", True]}, {"$eq": ["$$this.token", token]}]})
    return {"$and": terms}


def release_filter(name: str, owner: str, token: int | None) -> Doc:
    """The permits document of ``name`` with an entry of ``owner`` that its release
    drops (live or not): its queue entry whatever ``token`` is (a request that gave up
    names whatever token it has, or none), its permit only if it is ``token`` (any, if
    ``None``). Only aiolease writes an entry of a permit owner id (random, made per
    request), so this matches no foreign document; the server need not parse
    :data:`VALID` for each release."""
    match: Doc = {"owner": owner}
    if token is not None:
        match["$or"] = [{"granted": {"$ne": True}}, {"token": token}]
    return {"_id": name, "entries": {"$elemMatch": match}}


def release_update(owner: str, token: int | None, stamp: str, first: bool = True) -> list[Doc]:
    """Drop ``owner``'s queue entry, its permit (if it is ``token``, or any if
    ``None``) and expired entries, and set :data:`FREED` to ``stamp`` followed by
    ``/1`` if a live permit of ``owner`` (``token``) was dropped, else ``/0`` (its
    change event wakes the name's waiters). A release after the ``first`` in one
    command appends its ``1`` or ``0`` instead: the reply tells each what it freed."""
    live_mine = {
        "$anyElementTrue": [
            {
                "$map": {
                    "input": "$entries",
                    "in": {
                        "$and": [
                            _mine(owner, token),
                            {"$eq": ["$$this.granted", True]},
                            {"$gt": ["$$this.expires", NOW]},
                        ]
                    },
                }
            }
        ]
    }
    prefix = {"$literal": stamp + "/"} if first else "$" + FREED
    return [
        {
            "$set": {
                FREED: {"$concat": [prefix, {"$cond": [live_mine, "1", "0"]}]},
                "entries": {
                    "$filter": {
                        "input": "$entries",
                        "cond": {
                            "$and": [
                                {"$not": [_mine(owner, token)]},
                                {"$gt": ["$$this.expires", NOW]},
                            ]
                        },
                    }
                },
            }
        }
    ]


def _value(taken: Any, token: Any, out: Any) -> Doc:
    return {"taken": taken, "token": token, "out": out}


#: After the releases of one command: the queue entries that then fit are granted, in
#: arrival order (queue entries stay in the array in the order they came), each with
#: the next token: rule 3 (the weight of the permits held, and of the entries queued
#: before each, plus its own, within the limit). Their expiry stays that of the queue
#: entry (set by its latest ask, within its ttl).
GRANT_FITTING: list[Doc] = [
    {
        "$set": {
            "_grants": {
                "$reduce": {
                    "input": "$entries",
                    "initialValue": _value(
                        {
                            "$sum": {
                                "$map": {
                                    "input": "$entries",
                                    "in": {"$cond": ["$$this.granted", "$$this.weight", 0]},
                                }
                            }
                        },
                        "$token",
                        [],
                    ),
                    "in": {
                        "$cond": [
                            "$$this.granted",
                            _value(
                                "$$value.taken",
                                "$$value.token",
                                {"$concatArrays": ["$$value.out", ["$$this"]]},
                            ),
                            {
                                "$cond": [
                                    {
                                        "$lte": [
                                            {"$add": ["$$value.taken", "$$this.weight"]},
                                            "$$this.limit",
                                        ]
                                    },
                                    _value(
                                        {"$add": ["$$value.taken", "$$this.weight"]},
                                        _long({"$add": ["$$value.token", 1]}),
                                        {
                                            "$concatArrays": [
                                                "$$value.out",
                                                [
                                                    {
                                                        "$mergeObjects": [
                                                            "$$this",
                                                            {
                                                                "granted": True,
                                                                "token": _long(
                                                                    {"$add": ["$$value.token", 1]}
                                                                ),
                                                            },
                                                        ]
                                                    }
                                                ],
                                            ]
                                        },
                                    ),
                                    _value(
                                        {"$add": ["$$value.taken", "$$this.weight"]},
                                        "$$value.token",
                                        {"$concatArrays": ["$$value.out", ["$$this"]]},
                                    ),
                                ]
                            },
                        ]
                    },
                }
            }
        }
    },
    {"$set": {"entries": "$_grants.out", "token": "$_grants.token"}},
    {"$unset": "_grants"},
]

#: What a release's reply shows (the document after it): the entries, the token, the
#: stamp with what each release freed, and the milliseconds left of each entry.
RELEASED_AFTER: Doc = {"entries": 1, "token": 1, FREED: 1, "_lefts": _LEFTS}


def release_pipeline(released: Sequence[tuple[str, int | None]], stamp: str) -> list[Doc]:
    """The releases ``released`` (owner, token), one after the other, then the grants
    of the queue entries that fit (:data:`GRANT_FITTING`)."""
    stages = [
        stage
        for i, (owner, token) in enumerate(released)
        for stage in release_update(owner, token, stamp, first=i == 0)
    ]
    return stages + GRANT_FITTING


def freed_flags(after: Mapping[str, Any] | None) -> str:
    """What each release of a command freed (``1``: a live permit), from the document
    after it: the flags after the stamp's ``/``."""
    if after is None or not isinstance(after.get(FREED), str):
        return ""
    return str(after[FREED]).rpartition("/")[2]


def granted_in(after: Mapping[str, Any]) -> dict[str, tuple[int, int, float]]:
    """owner -> (token, limit, seconds left) of each live permit in the document after
    a release (read with :data:`RELEASED_AFTER`)."""
    entries, lefts = after.get("entries"), after.get("_lefts")
    found: dict[str, tuple[int, int, float]] = {}
    if not isinstance(entries, list) or not isinstance(lefts, list):
        return found
    for entry, left in zip(entries, lefts, strict=False):
        if (
            isinstance(entry, Mapping)
            and entry.get("granted") is True
            and _int(entry.get("token"), 1, _MAX)
            and _int(entry.get("limit"), 1, _MAX)
            and isinstance(left, (int, float))
            and left > 0
        ):
            found[str(entry.get("owner"))] = (entry["token"], entry["limit"], left / 1000.0)
    return found


def release_many_filter(name: str, released: Sequence[tuple[str, int | None]]) -> Doc:
    """The permits document of ``name`` with an entry that one of the releases
    ``released`` (owner, token) drops (see :func:`release_filter`): their updates
    (:func:`release_update`, one after the other in one pipeline) then run in one
    write; each drops nothing but its own entries and expired ones."""
    matches: list[Doc] = []
    for owner, token in released:
        match: Doc = {"owner": owner}
        if token is not None:
            match["$or"] = [{"granted": {"$ne": True}}, {"token": token}]
        matches.append(match)
    return {"_id": name, "entries": {"$elemMatch": {"$or": matches}}}
