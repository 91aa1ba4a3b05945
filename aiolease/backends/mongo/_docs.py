"""Lease documents read back: a holder, nobody, or a :class:`ForeignDataError`.

A document aiolease wrote is ``{_id: name, token}`` (a free name: released, or never
held) or that plus ``owner`` (non-empty str), ``identity`` (str), ``metadata`` (an
object of strings), ``acquired`` and ``expires`` (dates), and,
on a fair backend, ``queue`` (an array of waiters). The server-side pipelines
(:mod:`aiolease.backends.mongo._pipelines`) refuse to change any other document;
this module names it. Every reply carries ``_left``: the milliseconds from the
server's ``$$NOW`` to ``expires`` (projected by the server, never the client's clock).
No driver is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._exceptions import ForeignDataError
from ...abc import HolderInfo

__all__ = ["LEFT", "foreign", "holder_of", "owner_of", "token_of"]

#: The projected field with the milliseconds left until ``expires`` (server time).
LEFT = "_left"


def foreign(where: str, name: str, problem: str) -> ForeignDataError:
    """The error for document ``name`` of ``where`` (``database.collection``)."""
    return ForeignDataError(
        f"document {name!r} of collection {where} was not written by aiolease ({problem});"
        " it was left unchanged, and nothing is granted over it: another program seems to"
        " write to this collection; give aiolease a collection of its own",
        name=name,
    )


def _problem(doc: Mapping[str, Any]) -> str | None:
    """What makes ``doc`` one aiolease would not have written, or ``None``."""
    token = doc.get("token")
    owner = doc.get("owner")
    if "token" not in doc:
        return None if len(doc.keys() - {"_id", LEFT, "queue"}) == 0 else "it has no token"
    if isinstance(token, bool) or not isinstance(token, int) or token < 1:
        return f"its token is {token!r}, not an integer >= 1"
    queue = doc.get("queue", [])
    if not isinstance(queue, list) or not all(isinstance(e, Mapping) for e in queue):
        return f"its queue is not an array of waiters: {queue!r}"[:200]
    if owner is None:
        return None
    if not isinstance(owner, str) or not owner:
        return f"its owner is {owner!r}"
    if not isinstance(doc.get("identity"), str):
        return f"its identity is {doc.get('identity')!r}"
    metadata = doc.get("metadata")
    if not isinstance(metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        return f"its metadata is not an object of strings: {metadata!r}"[:200]
    if not isinstance(doc.get(LEFT), (int, float)) or isinstance(doc.get(LEFT), bool):
        return "it is held with no expiry"
    return None


def check(where: str, name: str, doc: Mapping[str, Any] | None) -> None:
    """:raises ForeignDataError: ``doc`` is not one aiolease would have written"""
    if doc is not None:
        problem = _problem(doc)
        if problem is not None:
            raise foreign(where, name, problem)


def holder_of(where: str, name: str, doc: Mapping[str, Any] | None) -> HolderInfo | None:
    """The live holder that ``doc`` stands for (``None``: free, expired or no document).

    :raises ForeignDataError: ``doc`` is not one aiolease would have written
    """
    check(where, name, doc)
    if doc is None or doc.get("owner") is None or doc[LEFT] <= 0:
        return None
    return HolderInfo(
        name,
        doc["owner"],
        doc["identity"],
        int(doc["token"]),
        dict(doc["metadata"]),
        doc[LEFT] / 1000.0,
    )


def owner_of(doc: Mapping[str, Any] | None) -> str | None:
    """The owner of a live grant in ``doc`` (checked already), else ``None``."""
    if doc is None or doc.get("owner") is None or not doc.get(LEFT, 0) > 0:
        return None
    owner: str = doc["owner"]
    return owner


def token_of(doc: Mapping[str, Any] | None) -> int | None:
    """The token of ``doc``, if it has one."""
    token = None if doc is None else doc.get("token")
    return int(token) if isinstance(token, int) and not isinstance(token, bool) else None
