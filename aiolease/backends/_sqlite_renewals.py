"""The SQLite backend's renewal batches: every lease due, renewed in one statement
(one for the locks, one for the permits), the batch passed as JSON."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from .._permits import is_permit_owner
from ..abc import Renewal

__all__ = ["Encoded", "encode_batches", "renew_batch"]

#: A renewal batch (JSON ``[[name, owner, token, ttl], ...]`` in ``:batch``) as rows.
_BATCH = (
    "SELECT json_extract(value, '$[0]') AS n, json_extract(value, '$[1]') AS o,"
    " json_extract(value, '$[2]') AS k, json_extract(value, '$[3]') AS vttl"
    " FROM json_each(:batch)"
)
#: A batch whose leases all ask one ttl (``:ttl``): ``[[name, owner, token], ...]``, one
#: value fewer to extract per lease.
_BATCH_ONE_TTL = (
    "SELECT json_extract(value, '$[0]') AS n, json_extract(value, '$[1]') AS o,"
    " json_extract(value, '$[2]') AS k, :ttl AS vttl FROM json_each(:batch)"
)
#: The usual batch (locks of distinct names, one ttl) as its rows' condition: a JSON
#: object ``{name: "owner:token", ...}`` whose keys and values ``json_each`` reads
#: without a ``json_extract`` per value (about 40 % less CPU per lease than the arrays).
#: A token is an integer, so ``owner || ':' || token`` is one grant's and no other's.
_KEYED = "json_each(:batch) AS v WHERE name = v.key AND v.value = owner || ':' || token"


@dataclass(frozen=True)
class Encoded:
    """A renewal batch as its statement takes it: the JSON, the one ttl all its leases
    ask (else ``None``: each its own, in the JSON), how many, and whether the JSON is
    :data:`_KEYED`'s object (else an array of arrays)."""

    json: str
    ttl: float | None
    size: int
    keyed: bool = False


def _encode_batch(renewals: Sequence[Renewal], *, permits: bool = False) -> Encoded:
    ttls = {ttl for _, _, _, ttl in renewals}
    if len(ttls) == 1:
        ttl = float(ttls.pop())
        if not permits:  # a permit's name is not its row's key
            keyed = {n: f"{o}:{t}" for n, o, t, _ in renewals}
            if len(keyed) == len(renewals):  # else a name twice (an old grant and a new)
                return Encoded(json.dumps(keyed), ttl, len(renewals), keyed=True)
        return Encoded(json.dumps([[n, o, t] for n, o, t, _ in renewals]), ttl, len(renewals))
    batch = json.dumps([[n, o, t, float(ttl)] for n, o, t, ttl in renewals])
    return Encoded(batch, None, len(renewals))


def encode_batches(renewals: Sequence[Renewal]) -> tuple[Encoded | None, Encoded | None]:
    """The batches of the locks and of the permits among ``renewals`` (``None``: none)."""
    permits = [r for r in renewals if is_permit_owner(r[1])]
    if not permits:
        return _encode_batch(renewals), None
    locks = [r for r in renewals if not is_permit_owner(r[1])]
    return (
        _encode_batch(locks) if locks else None,
        _encode_batch(permits, permits=True),
    )


def renew_batch(
    conn: sqlite3.Connection, batch: Encoded, table: str, live: str, now: float, boot: str
) -> set[tuple[str, str, int]] | None:
    """Renew every lease of ``batch`` in ``table`` (a row counts if ``live``, a
    condition on ``:now`` and ``:boot``) in one statement; which were renewed
    (``None``: all; one more statement tells which, only when some were not)."""
    if batch.keyed:
        source = _KEYED
    else:
        rows = _BATCH if batch.ttl is None else _BATCH_ONE_TTL
        source = f"({rows}) AS v WHERE name = v.n AND owner = v.o AND token = v.k"
    vttl = ":ttl" if batch.keyed else "v.vttl"
    params = {"batch": batch.json, "ttl": batch.ttl, "now": now, "boot": boot}
    conn.execute("BEGIN IMMEDIATE")
    try:
        changed = conn.execute(
            f"UPDATE {table} SET expires_at = :now + {vttl}, ttl = {vttl} FROM {source} AND {live}",
            params,
        ).rowcount
        renewed: set[tuple[str, str, int]] | None = None
        if changed != batch.size:
            renewed = set(
                conn.execute(
                    f"SELECT name, owner, token FROM {table}, {source} AND {live}",
                    params,
                ).fetchall()
            )
        conn.execute("COMMIT")
    except BaseException:
        conn.rollback()
        raise
    return renewed
