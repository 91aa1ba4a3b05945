"""The update pipelines of the MongoDB backend: every decision made on the server.

Each operation is one command on one document, so it is atomic. Time is only ever
``$$NOW`` (the server's clock, read once per command); the client's clock is never
sent. User values (owner, identity, metadata) travel inside ``$literal``, so a
string that starts with ``$`` is never read as a field path. Temporary fields
(``_v``, ``_live``, ...) are computed in the first stages and unset in the last: a
refusal leaves the document exactly as it was, which mongod then does not write at
all (no oplog entry, no change event).

``_v`` ("valid") guards everything: a document aiolease would not have written
(a token that is not an integer >= 1, a holder without an expiry, metadata that is
not an object of strings, a queue that is not an array, or other fields on a
document without a token) is never changed; the caller reads it back and raises
:class:`~aiolease.ForeignDataError` (see :mod:`aiolease.backends.mongo._docs`).
No driver is imported here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ._docs import LEFT

__all__ = [
    "BY",
    "PROCLAIMED",
    "RELEASED",
    "RELEASE_REPLY",
    "REPLY",
    "TAKEN",
    "free_filter",
    "grant",
    "live_filter",
    "millis",
    "release",
    "release_alone",
    "release_alone_filter",
    "release_filter",
    "renew",
    "take_free",
    "update_metadata",
]

Doc = dict[str, Any]
NOW = "$$NOW"
#: The field a release sets to the token it released: its change event then says which
#: grant ended (see :mod:`aiolease.backends.mongo._stream`).
RELEASED = "released"
#: The field each grant and release sets to the writing backend object's id and a
#: count of its writes (new with every write, so that its change event always shows
#: it): a backend's change stream leaves out its own writes, which it knows already.
BY = "by"
#: The field a holder's metadata update sets to a value new with every update (the
#: writing backend's next ``by`` stamp): its change event then shows it, where the
#: change of ``metadata`` alone may be reported field by field.
PROCLAIMED = "proclaimed"
_TEMPORARY = ["_v", "_live", "_mine", "_q", "_grant", "_rel", "_hand", "_nq"]


def _type(field: str) -> Doc:
    return {"$type": f"${field}"}


def _is(field: str, *types: str) -> Doc:
    return {"$in": [_type(field), list(types)]}


#: Whether the document is one aiolease wrote (see the module).
VALID: Doc = {
    "$cond": [
        _is("token", "missing"),
        # A document that does not exist yet: the upsert starts from ``{_id}`` alone.
        {"$eq": [{"$size": {"$objectToArray": "$$ROOT"}}, 1]},
        {
            "$and": [
                _is("token", "int", "long"),
                {"$gte": ["$token", 1]},
                _is("queue", "missing", "array"),
                {
                    "$or": [
                        _is("owner", "missing", "null"),
                        {
                            "$and": [
                                _is("owner", "string"),
                                {"$gt": [{"$strLenBytes": "$owner"}, 0]},
                                _is("identity", "string"),
                                _is("metadata", "object"),
                                _is("expires", "date"),
                                {
                                    "$allElementsTrue": [
                                        {
                                            "$map": {
                                                "input": {"$objectToArray": "$metadata"},
                                                "in": {"$eq": [{"$type": "$$this.v"}, "string"]},
                                            }
                                        }
                                    ]
                                },
                            ]
                        },
                    ]
                },
            ]
        },
    ]
}

#: Whether the valid document is held now.
LIVE: Doc = {"$and": ["$_v", _is("owner", "string"), {"$gt": ["$expires", NOW]}]}

#: What a reply shows: the record, and the server's milliseconds left on it.
REPLY: Doc = {
    "token": 1,
    "owner": 1,
    "identity": 1,
    "metadata": 1,
    "queue": 1,
    LEFT: {"$cond": [_is("expires", "date"), {"$subtract": ["$expires", NOW]}, None]},
}

#: What the queue-aware release's reply shows: also the milliseconds left of each queue
#: entry (the first live one is where the lease went).
RELEASE_REPLY: Doc = {
    **REPLY,
    "_qleft": {
        "$cond": [
            {"$isArray": "$queue"},
            {
                "$map": {
                    "input": "$queue",
                    "in": {
                        "$cond": [
                            {"$eq": [{"$type": "$$this.expires"}, "date"]},
                            {"$subtract": ["$$this.expires", NOW]},
                            0,
                        ]
                    },
                }
            },
            None,
        ]
    },
}


def millis(ttl: float) -> int:
    """A ttl in whole milliseconds, rounded up (the server never grants less)."""
    return max(1, math.ceil(ttl * 1000))


def _live_queue(owner: str | None) -> Doc:
    """The queue's live entries (and not ``owner``'s), in order."""
    cond: Doc = {"$gt": ["$$this.expires", NOW]}
    if owner is not None:
        cond = {"$and": [cond, {"$ne": ["$$this.owner", {"$literal": owner}]}]}
    return {"$filter": {"input": {"$ifNull": ["$queue", []]}, "cond": cond}}


def _kept_queue() -> Doc:
    """The new queue ``_nq`` of a valid document (removed when empty); else unchanged."""
    return {
        "$cond": [
            {"$not": ["$_v"]},
            "$queue",
            {"$cond": [{"$gt": [{"$size": "$_nq"}, 0]}, "$_nq", "$$REMOVE"]},
        ]
    }


def _let(variables: Doc, body: Any) -> Doc:
    return {"$let": {"vars": variables, "in": body}}


def grant(
    owner: str, ttl: float, identity: str, metadata: Mapping[str, str], fair: bool, stamp: str
) -> list[Doc]:
    """The acquire: grant if free or expired (and, when ``fair``, nobody live is queued
    before ``owner``), or renew if already ``owner``'s (keeping its token, identity and
    metadata); else leave the grant alone and, when ``fair``, queue ``owner`` (or keep
    its place, refreshed for ``ttl``). A new grant increments the token.

    One ``$replaceWith`` stage whose ``$let`` decides once: the document itself when
    refused (mongod then writes nothing), else the document merged with what changes.
    """
    me = {"$literal": owner}
    until = {"$add": [NOW, millis(ttl)]}
    granted: Doc = {
        "token": {"$toLong": {"$add": [{"$ifNull": ["$token", 0]}, 1]}},
        "owner": me,
        "identity": {"$literal": identity},
        "metadata": {"$literal": dict(metadata)},
        "acquired": NOW,
        "expires": until,
        BY: {"$literal": stamp},
    }
    renewed: Doc = {"expires": until}
    free: Any = {"$not": ["$$live"]}
    refused: Any = "$$ROOT"
    grant_merge: list[Any] = ["$$ROOT", granted]
    if fair:
        free = {
            "$and": [
                free,
                {
                    "$or": [
                        {"$eq": [{"$size": "$$q"}, 0]},
                        {"$eq": [{"$arrayElemAt": ["$$q.owner", 0]}, me]},
                    ]
                },
            ]
        }
        entry = {
            "owner": me,
            "identity": {"$literal": identity},
            "metadata": {"$literal": dict(metadata)},
            "ttl": float(ttl),
            "expires": until,
        }
        queued = {
            "$cond": [
                {"$in": [me, "$$q.owner"]},
                {
                    "$map": {
                        "input": "$$q",
                        "in": {
                            "$cond": [
                                {"$eq": ["$$this.owner", me]},
                                {
                                    "$mergeObjects": [
                                        "$$this",
                                        {"ttl": float(ttl), "expires": until},
                                    ]
                                },
                                "$$this",
                            ]
                        },
                    }
                },
                {"$concatArrays": ["$$q", [entry]]},
            ]
        }
        refused = {"$mergeObjects": ["$$ROOT", {"queue": queued}]}
        not_me = {"$filter": {"input": "$$q", "cond": {"$ne": ["$$this.owner", me]}}}
        grant_merge.append({"$cond": [{"$isArray": "$queue"}, {"queue": not_me}, {}]})
    decide = _let(
        {"mine": {"$and": ["$$live", {"$eq": ["$owner", me]}]}},
        {
            "$cond": [
                "$$mine",
                {"$mergeObjects": ["$$ROOT", renewed]},
                {"$cond": [free, {"$mergeObjects": grant_merge}, refused]},
            ]
        },
    )
    live = {"$and": [_is("owner", "string"), {"$gt": ["$expires", NOW]}]}
    variables: Doc = {"live": live}
    if fair:
        variables["q"] = _live_queue(None)
    body = {"$cond": [VALID, _let(variables, decide), "$$ROOT"]}
    return [{"$replaceWith": body}]


#: What the reply of :func:`take_free` shows (the caller's grant: nothing to compute).
TAKEN: Doc = {"token": 1, "owner": 1}


def free_filter(name: str, fair: bool) -> Doc:
    """``name``'s document while it is free (released, or never held: no owner) and
    one aiolease wrote (a token that is an integer >= 1; when ``fair``, an empty or
    missing queue): what :data:`VALID` and the grant ask of a free name, as a query.

    An upsert of it that finds the document held (or foreign) fails with a duplicate
    key: the caller then asks with :func:`grant`, which decides every other case.
    """
    found: Doc = {"_id": name, "owner": None, "token": {"$type": ["int", "long"], "$gte": 1}}
    if fair:
        found["queue"] = {"$in": [None, []]}
    return found


def take_free(
    owner: str, ttl: float, identity: str, metadata: Mapping[str, str], stamp: str
) -> list[Doc]:
    """The grant of a name :func:`free_filter` found free (or that has no document
    any more): the next token, ``owner``'s fields, expiry ``$$NOW`` + ttl. A short
    pipeline (the server parses a command on each call) for the common case: a name
    that this backend saw released takes it again."""
    return [
        {
            "$set": {
                "token": {"$toLong": {"$add": [{"$ifNull": ["$token", 0]}, 1]}},
                "owner": {"$literal": owner},
                "identity": {"$literal": identity},
                "metadata": {"$literal": dict(metadata)},
                "acquired": NOW,
                "expires": {"$add": [NOW, millis(ttl)]},
                BY: {"$literal": stamp},
            }
        }
    ]


def release(owner: str, token: int | None, fair: bool, stamp: str) -> list[Doc]:
    """The release: free ``owner``'s live grant (of ``token``, if given), keeping the
    document and its token; when ``fair``, hand it to the oldest live waiter instead
    (token + 1, the waiter's identity, metadata and ttl), and drop ``owner``'s own
    queue entry (a waiter that stops waiting releases). Sets :data:`RELEASED` to the
    token released."""
    me = {"$literal": owner}
    ours: list[Any] = ["$_live", {"$eq": ["$owner", me]}]
    if token is not None:
        ours.append({"$eq": ["$token", token]})

    def keep(field: str) -> Doc:
        return {"$cond": ["$_rel", "$$REMOVE", f"${field}"]}

    fields: Doc = {
        "owner": keep("owner"),
        "identity": keep("identity"),
        "metadata": keep("metadata"),
        "acquired": keep("acquired"),
        "expires": keep("expires"),
        RELEASED: {"$cond": ["$_rel", "$token", f"${RELEASED}"]},
        BY: {"$cond": ["$_rel", {"$literal": stamp}, f"${BY}"]},
    }
    stages: list[Doc] = [
        {"$set": {"_v": VALID}},
        {"$set": {"_live": LIVE}},
        {"$set": {"_rel": {"$and": ours}}},
    ]
    if fair:
        stages.append({"$set": {"_q": {"$cond": ["$_v", _live_queue(owner), []]}}})
        stages.append({"$set": {"_hand": {"$and": ["$_rel", {"$gt": [{"$size": "$_q"}, 0]}]}}})
        head = {"$arrayElemAt": ["$_q", 0]}

        def handed(value: Any, field: str) -> Doc:
            return {"$cond": ["$_hand", value, keep(field)]}

        fields = {
            "token": {"$cond": ["$_hand", {"$toLong": {"$add": ["$token", 1]}}, "$token"]},
            "owner": handed({"$getField": {"field": "owner", "input": head}}, "owner"),
            "identity": handed({"$getField": {"field": "identity", "input": head}}, "identity"),
            "metadata": handed({"$getField": {"field": "metadata", "input": head}}, "metadata"),
            "acquired": handed(NOW, "acquired"),
            "expires": handed(
                {
                    "$add": [
                        NOW,
                        {
                            "$ceil": {
                                "$multiply": [{"$getField": {"field": "ttl", "input": head}}, 1000]
                            }
                        },
                    ]
                },
                "expires",
            ),
            RELEASED: fields[RELEASED],
            BY: fields[BY],
            "_nq": {
                "$cond": [
                    {"$not": ["$_v"]},
                    [],
                    {
                        "$cond": [
                            "$_hand",
                            {"$slice": ["$_q", 1, {"$max": [{"$size": "$_q"}, 1]}]},
                            "$_q",
                        ]
                    },
                ]
            },
        }
        stages.append({"$set": fields})
        stages.append({"$set": {"queue": _kept_queue()}})
    else:
        stages.append({"$set": fields})
    stages.append({"$unset": _TEMPORARY})
    return stages


def release_alone_filter(name: str, owner: str, token: int | None, fair: bool) -> Doc:
    """``owner``'s live grant (``token``, if given) of ``name``; when ``fair``, only if
    nobody is queued (an empty or missing queue): the release that hands nothing on."""
    found = live_filter(name, owner, token)
    if fair:
        found["queue"] = {"$in": [None, []]}
    return found


#: The fields of a holder, which a release unsets.
_HOLDER_FIELDS = ("owner", "identity", "metadata", "acquired", "expires")


def release_alone(token: int | None, stamp: str) -> Doc | list[Doc]:
    """Free the grant, keeping the document and its token; :data:`RELEASED` says which
    (a plain update when the token is known, which mongod applies a little faster)."""
    if token is not None:
        return {"$unset": dict.fromkeys(_HOLDER_FIELDS, ""), "$set": {RELEASED: token, BY: stamp}}
    return [
        {"$set": {RELEASED: "$token", BY: {"$literal": stamp}}},
        {"$unset": list(_HOLDER_FIELDS)},
    ]


def release_filter(name: str, owner: str, fair: bool) -> Doc:
    """The documents a release may change: ``owner``'s grant, or (``fair``) its queue entry."""
    if fair:
        return {"_id": name, "$or": [{"owner": owner}, {"queue.owner": owner}]}
    return {"_id": name, "owner": owner}


def live_filter(name: str, owner: str, token: int | None) -> Doc:
    """``owner``'s live grant ``token`` (any, if ``None``) of ``name``: not expired."""
    found: Doc = {"_id": name, "owner": owner}
    if token is not None:
        found["token"] = token
    found["$expr"] = {"$and": [{"$eq": [_type("expires"), "date"]}, {"$gt": ["$expires", NOW]}]}
    return found


def update_metadata(metadata: Mapping[str, str], stamp: str) -> list[Doc]:
    """Replace the holder's metadata (a ``$literal``: any key), and mark the change."""
    return [{"$set": {"metadata": {"$literal": dict(metadata)}, PROCLAIMED: {"$literal": stamp}}}]


def renew(ttl: float) -> list[Doc]:
    """Reset the expiry to now + ``ttl`` (resets, never adds)."""
    return [{"$set": {"expires": {"$add": [NOW, millis(ttl)]}}}]
