"""The backend's single-document writes as plain ``findAndModify`` and ``update``
commands, each retried once by us after a failover or a dropped connection.

Not pymongo's ``find_one_and_update``/``update_one``: those are retryable writes,
which the server deduplicates through a session transaction record that it writes
with every command (measured here: about 6 % of an uncontended acquire+release with
majority writes, the largest part of what aiolease cost over its floor). Every
command sent through :class:`Writer` is idempotent for its sender instead, so that a
second try after an error that pymongo would have retried gives the same outcome
as one try:

* a grant asked again by its owner id finds the name its own (it renews, same token),
  or decides afresh if the first try did not happen (or lapsed meanwhile);
* a short grant's second try finds the name held, fails with a duplicate key, and the
  full grant decides as above;
* a refused, queued ask refreshes its own queue entry;
* a release is owner-checked: a second try after one that happened finds nothing to
  free, and says so (``False``: the release is then not confirmed, as for a reply
  that was lost);
* a metadata update sets the same metadata again.

An error that is not retried (a timeout, a second failure, anything else) reaches
the core as a :class:`~aiolease.BackendError`: an unknown outcome, which its
compensating release with the same owner id settles, as before. The write concern
(majority by default) is the collection's, in every command; a write-concern error
raises as pymongo's helpers raise it (``WTimeoutError`` for a timeout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._errors import code_of

__all__ = ["RETRYABLE_CODES", "Writer", "retryable"]

#: Server error codes after which pymongo retries a retryable write (its
#: ``helpers_shared._RETRYABLE_ERROR_CODES``, the retryable writes spec): not primary,
#: node recovering or shutting down, host unreachable, socket exceptions.
RETRYABLE_CODES = frozenset(
    {10058, 10107, 13435, 11602, 13436, 189, 91, 11600, 6, 7, 89, 9001, 134}
)


def retryable(exc: BaseException) -> bool:
    """Whether pymongo would have retried a retryable write after ``exc``: a dropped
    connection or a primary that stepped down, not a timeout (an unknown outcome the
    core settles) nor a server that could not be selected in time."""
    import pymongo.errors as errors

    if not isinstance(exc, errors.PyMongoError) or exc.timeout:
        return False
    if isinstance(exc, errors.ServerSelectionTimeoutError):
        return False
    if isinstance(exc, errors.ConnectionFailure):  # NotPrimaryError, AutoReconnect
        return True
    return isinstance(exc, errors.OperationFailure) and code_of(exc) in RETRYABLE_CODES


def _raise_errors(reply: Mapping[str, Any]) -> None:
    """Raise a write error, else a write-concern error, of ``reply`` (as pymongo's
    ``_check_write_command_response``)."""
    import pymongo.errors as errors

    write_errors = reply.get("writeErrors")
    if write_errors:
        error = write_errors[-1]
        failed: type[errors.OperationFailure] = (
            errors.DuplicateKeyError if error.get("code") == 11000 else errors.WriteError
        )
        raise failed(error.get("errmsg"), error.get("code"), error)
    concern = reply.get("writeConcernError")
    if concern:
        timed_out = concern.get("code") == 50 or bool(
            (concern.get("errInfo") or {}).get("wtimeout")
        )
        concern_error: type[errors.OperationFailure] = (
            errors.WTimeoutError if timed_out else errors.WriteConcernError
        )
        raise concern_error(concern.get("errmsg"), concern.get("code"), concern)


class Writer:
    """``findAndModify`` and single updates of one collection, as database commands.

    :param database: the pymongo (or motor) database of the collection
    :param collection: the collection's name
    :param w: the write concern's ``w``
    :param wtimeout_ms: its ``wtimeout`` (``None``: none)
    """

    __slots__ = ("_command", "_concern", "_name")

    def __init__(
        self, database: Any, collection: str, w: int | str, wtimeout_ms: int | None
    ) -> None:
        self._command = database.command
        self._name = collection
        concern: dict[str, Any] = {"w": w}
        if wtimeout_ms is not None:
            concern["wtimeout"] = wtimeout_ms
        self._concern = concern

    async def find_and_modify(
        self,
        query: Mapping[str, Any],
        update: Any,
        *,
        fields: Mapping[str, Any],
        upsert: bool = False,
        new: bool = False,
    ) -> Any:
        """The document before (or, ``new``, after) the update, as ``fields`` projects
        it; ``None`` if nothing matched (and nothing was upserted)."""
        reply = await self._run(
            {
                "findAndModify": self._name,
                "query": query,
                "update": update,
                "fields": fields,
                "upsert": upsert,
                "new": new,
                "writeConcern": self._concern,
            }
        )
        return reply.get("value")

    async def update_one(self, query: Mapping[str, Any], update: Any) -> int:
        """How many documents ``query`` matched (0 or 1)."""
        reply = await self._run(
            {
                "update": self._name,
                "updates": [{"q": query, "u": update}],
                "writeConcern": self._concern,
            }
        )
        return int(reply.get("n", 0))

    async def _run(self, command: dict[str, Any]) -> Mapping[str, Any]:
        try:
            return await self._once(command)
        except Exception as exc:
            if not retryable(exc):
                raise
        return await self._once(command)  # once more, as pymongo's retryable writes

    async def _once(self, command: dict[str, Any]) -> Mapping[str, Any]:
        reply: Mapping[str, Any] = await self._command(command)
        _raise_errors(reply)
        return reply
