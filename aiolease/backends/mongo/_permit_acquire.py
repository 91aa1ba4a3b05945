"""The acquires of MongoDB permits (see :mod:`._permits` for the document): the
``findAndModify`` upsert pipelines that decide a request on the server.

:func:`acquire` decides one request: it applies rules 2-6 of
``docs/internals/semaphores.md`` to the live entries, writes the next state (expired
entries dropped), and the client reads its outcome from the document after.
:func:`acquire_many` decides several, in order, in one stage. A name whose document
has no entry at all may be taken with the short :func:`take_free` (on
:func:`free_filter`) instead, which only such a document matches. No driver is
imported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._permits import FIELDS, FREED, NOW, VALID, Doc, _long

__all__ = ["TAKEN", "Request", "acquire", "acquire_many", "free_filter", "take_free"]


#: A request's values in the acquire's expressions, by name: ``owner``, ``identity``,
#: ``metadata``, ``limit``, ``weight``, ``ttl`` and ``fresh`` (milliseconds).
Values = Mapping[str, Any]


def _literals(
    owner: str,
    identity: str,
    metadata: Mapping[str, str],
    limit: int,
    weight: int,
    ttl_ms: int,
    fresh_ms: int,
) -> Values:
    """A request's values written into the expressions (one acquire alone)."""
    return {
        "owner": {"$literal": owner},
        "identity": {"$literal": identity},
        "metadata": {"$literal": dict(metadata)},
        "limit": limit,
        "weight": weight,
        "ttl": ttl_ms,
        "fresh": fresh_ms,
    }


def _entry_of(r: Values, granted: bool, seq: Any, token: Any) -> Doc:
    return {
        "owner": r["owner"],
        "weight": r["weight"],
        "limit": r["limit"],
        "granted": granted,
        "seq": seq,
        "token": token,
        "identity": r["identity"],
        "metadata": r["metadata"],
        "expires": {"$add": [NOW, r["ttl"]]},
    }


#: An acquire request as :func:`acquire_many` takes it: (owner, ttl in milliseconds,
#: identity, metadata, limit, weight, fresh in milliseconds), as :func:`acquire`'s
#: arguments.
Request = tuple[str, int, str, Mapping[str, str], int, int, int]


def acquire(
    owner: str,
    ttl_ms: int,
    identity: str,
    metadata: Mapping[str, str],
    limit: int,
    weight: int,
    fresh_ms: int,
) -> list[Doc]:
    """The acquire of ``weight`` out of ``limit`` by ``owner``, decided on the server:

    - another limit on the live entries (rule 2), or a refused request whose queue
      entry still has more than ``fresh_ms`` left: the document as it is (mongod then
      writes nothing); a document aiolease would not have written: the same;
    - ``owner`` holds a live permit: its expiry reset, its token kept (rule 6);
    - ``held + queued_ahead + weight <= limit`` (rule 3): a permit with the next token
      (``owner``'s queue entry, if any, becomes it, keeping its arrival);
    - else ``owner`` queued (the next arrival) or its entry's expiry reset (rule 4).

    Expired entries are dropped by every write (rule 7).
    """
    values = _literals(owner, identity, metadata, limit, weight, ttl_ms, fresh_ms)
    return [{"$replaceWith": {"$cond": [VALID, _decide("$$ROOT", values), "$$ROOT"]}}]


def acquire_many(requests: Sequence[Request]) -> list[Doc]:
    """The acquires of ``requests``, in order, each decided as :func:`acquire` decides
    it alone on the document as the ones before left it: one stage that folds the
    requests (given as one literal array) over the document, so that the server
    parses the decision once per command, not once per request (about 0.55 ms per
    request's 5.6 kB on the test machine, more than evaluating it)."""
    fields = ("owner", "ttl", "identity", "metadata", "limit", "weight", "fresh")
    listed = [
        dict(zip(fields, (o, t, i, dict(m), lim, w, f), strict=True))
        for o, t, i, m, lim, w, f in requests
    ]
    values = {field: f"$$req.{field}" for field in fields}
    fold = {
        "$reduce": {
            "input": {"$literal": listed},
            "initialValue": "$$ROOT",
            "in": {
                "$let": {
                    "vars": {"req": "$$this", "doc": "$$value"},
                    "in": _decide("$$doc", values),
                }
            },
        }
    }
    return [{"$replaceWith": {"$cond": [VALID, fold, "$$ROOT"]}}]


def _decide(doc: str, r: Values) -> Doc:
    """The document after the acquire of the request ``r`` (its values as expressions)
    on ``doc`` (a variable: ``$$ROOT``, or the fold's document so far); see
    :func:`acquire`."""
    me = r["owner"]
    until = {"$add": [NOW, r["ttl"]]}
    mine_null = {"$eq": ["$$mine", None]}
    token = {"$ifNull": [f"{doc}.token", 0]}
    seq = {"$ifNull": [f"{doc}.seq", 0]}

    def mine_expiry_reset() -> Doc:
        return {
            "$map": {
                "input": "$$live",
                "in": {
                    "$cond": [
                        {"$eq": ["$$this.owner", me]},
                        {"$mergeObjects": ["$$this", {"expires": until}]},
                        "$$this",
                    ]
                },
            }
        }

    # The weight of the live permits and of the queue entries before ``owner``'s.
    counted = {
        "$or": [
            "$$this.granted",
            {
                "$and": [
                    {"$ne": ["$$this.owner", me]},
                    {"$or": [mine_null, {"$lt": ["$$this.seq", "$$mine.seq"]}]},
                ]
            },
        ]
    }
    taken = {"$sum": {"$map": {"input": "$$live", "in": {"$cond": [counted, "$$this.weight", 0]}}}}
    next_token = _long({"$add": [token, 1]})
    granted = {
        "token": next_token,
        "seq": _long({"$cond": [mine_null, {"$add": [seq, 1]}, seq]}),
        "entries": {
            "$concatArrays": [
                {"$filter": {"input": "$$live", "cond": {"$ne": ["$$this.owner", me]}}},
                [
                    _entry_of(
                        r,
                        True,
                        {"$cond": [mine_null, {"$add": [seq, 1]}, "$$mine.seq"]},
                        next_token,
                    )
                ],
            ]
        },
    }
    queued = {
        "seq": _long({"$add": [seq, 1]}),
        "entries": {
            "$concatArrays": ["$$live", [_entry_of(r, False, _long({"$add": [seq, 1]}), 0)]]
        },
    }
    refused = {
        "$cond": [
            mine_null,
            {"$mergeObjects": [doc, queued]},
            {
                "$cond": [
                    {"$gt": [{"$subtract": ["$$mine.expires", NOW]}, r["fresh"]]},
                    doc,  # its place is kept without a write (it asks again in time)
                    {"$mergeObjects": [doc, {"entries": mine_expiry_reset()}]},
                ]
            },
        ]
    }
    decide = {
        "$cond": [
            {
                "$and": [
                    {"$gt": [{"$size": "$$live"}, 0]},
                    {"$ne": [{"$arrayElemAt": ["$$live.limit", 0]}, r["limit"]]},
                ]
            },
            doc,  # another limit: nothing changes (LimitMismatchError)
            {
                "$cond": [
                    {"$eq": ["$$mine.granted", True]},
                    {"$mergeObjects": [doc, {"entries": mine_expiry_reset()}]},
                    {
                        "$cond": [
                            {"$lte": [{"$add": [taken, r["weight"]]}, r["limit"]]},
                            {"$mergeObjects": [doc, granted]},
                            refused,
                        ]
                    },
                ]
            },
        ]
    }
    live = {
        "$filter": {
            "input": {"$ifNull": [f"{doc}.entries", []]},
            "cond": {"$gt": ["$$this.expires", NOW]},
        }
    }
    mine = {
        "$ifNull": [
            {
                "$arrayElemAt": [
                    {"$filter": {"input": "$$live", "cond": {"$eq": ["$$this.owner", me]}}},
                    0,
                ]
            },
            None,
        ]
    }
    return {
        "$let": {"vars": {"live": live}, "in": {"$let": {"vars": {"mine": mine}, "in": decide}}}
    }


#: What the reply of :func:`take_free` shows (the caller's grant: nothing to decide).
TAKEN: Doc = {"token": 1}


def free_filter(name: str) -> Doc:
    """The permits document of ``name`` with no entry at all (no permit held, nobody
    queued, live or expired) and nothing else that :data:`VALID` would refuse:
    counters that are integers >= 0, a release's stamp, and no other field (five
    fields in all). What :func:`acquire` asks of a free name, as a filter; for it, any
    request is granted with the next token (rules 2-6: no limit recorded, nothing
    held or queued). Not an upsert (mongod refuses ``$expr`` in an upsert's filter):
    a document that does not match (held, queued, foreign, or gone) is left to
    :func:`acquire`, which decides every case."""
    return {
        "_id": name,
        "entries": {"$size": 0},
        "token": {"$type": ["int", "long"], "$gte": 0},
        "seq": {"$type": ["int", "long"], "$gte": 0},
        FREED: {"$type": "string"},
        "$expr": {"$eq": [{"$size": {"$objectToArray": "$$ROOT"}}, len(FIELDS)]},
    }


def take_free(
    owner: str,
    ttl_ms: int,
    identity: str,
    metadata: Mapping[str, str],
    limit: int,
    weight: int,
) -> list[Doc]:
    """The grant of a name :func:`free_filter` found free: the next token and arrival,
    and ``owner``'s permit, the only entry (as :func:`acquire` writes it). A short
    pipeline: the server parses every command's pipeline, and :func:`acquire`'s (with
    :data:`VALID` and the :data:`READ` projection, 6 kB) made its command 0.4-0.7 ms
    slower than this one here (``docs/internals/mongo.md``)."""
    token = _long({"$add": ["$token", 1]})
    seq = _long({"$add": ["$seq", 1]})
    mine = _entry_of(
        _literals(owner, identity, metadata, limit, weight, ttl_ms, 0), True, seq, token
    )
    return [{"$set": {"token": token, "seq": seq, "entries": [mine]}}]
