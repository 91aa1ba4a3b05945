"""The PL/pgSQL functions that the PostgreSQL backend's setup installs for permits
(the SQL text only, no driver): the acquire, the release, and the batch that calls
both for several operations of a name in one transaction. See
:class:`~aiolease.backends.postgres._statements.PermitSql` for how each is called."""

from __future__ import annotations

from ..._permits import PERMIT_PREFIX, RW_LIMIT

__all__ = ["acquire_function", "batch_function", "release_function"]

#: Greater than every ``seq``.
_LAST = "9223372036854775807"

#: Each function reads a name's rows by the primary key's index alone (routine version
#: 9). A permit row is written once per request (a new owner each time) and deleted at
#: its release, so a name under contention leaves thousands of dead rows a second. A
#: plain index scan marks the dead entries it meets (they are skipped afterwards, and
#: dropped when their page fills), where a bitmap scan, the planner's choice for
#: ``name = $1``, visits every dead row of the name again on every read until a
#: vacuum: without autovacuum (or between its rounds) each acquire and release of a
#: busy name cost more and more (0.66 ms per statement at first, 2.1 ms eight seconds
#: later, 16 tasks on a semaphore of 4). A sequential scan, which a plan made while the
#: table was small would keep, grows with the whole table.
_INDEX_ONLY = "SET enable_bitmapscan = off SET enable_seqscan = off"


def acquire_function(f: str, p: str, n: str) -> str:
    """``CREATE FUNCTION`` of the acquire (see :class:`PermitSql`): the rules of
    ``docs/internals/semaphores.md``, as :mod:`aiolease.backends.sql._permits` states them,
    in one transaction that locks the name's row first (made if missing: every acquire
    of the name waits for the one before to commit)."""
    columns = "name, owner, weight, lim, granted, seq, token, identity, metadata, ttl, expires_at"
    expiry = "clock_timestamp() + make_interval(secs => a_ttl)"
    live = "x.name = a_name AND x.expires_at > t"
    upsert = (
        f"INSERT INTO {p} AS x ({columns}) VALUES"
        " (a_name, a_owner, a_weight, a_lim, {granted}, {seq}, {token}, a_identity, {meta},"
        f" a_ttl, {expiry}) ON CONFLICT (name, owner) DO UPDATE SET weight = excluded.weight,"
        " lim = excluded.lim, granted = excluded.granted, seq = excluded.seq,"
        " token = excluded.token, identity = excluded.identity,"
        " metadata = excluded.metadata, ttl = excluded.ttl, expires_at = excluded.expires_at"
    )
    # What aiolease writes (permit_row checks the same, and the metadata, in Python).
    sane = (
        f"left(x.owner, {len(PERMIT_PREFIX)}) = '{PERMIT_PREFIX}'"
        f" AND x.lim BETWEEN 1 AND {RW_LIMIT} AND x.weight BETWEEN 1 AND x.lim"
        " AND x.seq >= 0 AND (NOT x.granted OR coalesce(x.token >= 1, false))"
    )
    nothing = "NULL::text, NULL::int8, NULL::int8, NULL::bool, NULL::int8, NULL::int8"
    grant = upsert.format(
        granted="true", seq="coalesce(my_seq, 0)", token="last_token + 1", meta="a_metadata"
    )
    report = (
        "x.owner, x.weight, x.lim, x.granted, x.seq, x.token, x.identity, x.metadata,"
        " extract(epoch FROM x.expires_at - t)::float8"
    )
    return f"""CREATE OR REPLACE FUNCTION {f}(a_name text, a_owner text, a_weight int8,
 a_lim int8, a_identity text, a_metadata text, a_ttl float8)
RETURNS TABLE (act text, tok int8, owner text, weight int8, lim int8, granted bool, seq int8,
 token int8, identity text, metadata text, remaining float8)
LANGUAGE plpgsql VOLATILE {_INDEX_ONLY} AS $aiolease$
#variable_conflict use_column
DECLARE
 t timestamptz;
 first_lim int8;
 all_sane bool;
 used int8;
 ahead int8;
 my_granted bool;
 my_seq int8;
 my_token int8;
 last_token int8;
 last_seq int8;
 expired int8;
 rows_now int8;
 decision text;
BEGIN
 -- Locks the name's row (made if missing), writing it only for what it changes: a
 -- grant's token or a new queue entry's place.
 SELECT x.token, x.seq INTO last_token, last_seq FROM {n} x WHERE x.name = a_name
  FOR NO KEY UPDATE;
 IF NOT FOUND THEN
  INSERT INTO {n} AS x (name, token, seq) VALUES (a_name, 0, 0)
   ON CONFLICT (name) DO UPDATE SET token = x.token RETURNING x.token, x.seq
   INTO last_token, last_seq;
 END IF;
 LOOP
  t := clock_timestamp();
  -- One read of the name's rows, the caller's own among them (one snapshot). Only a
  -- plain release (no lock on the name's row) may delete one meanwhile, which only
  -- frees weight: a refusal may be stale, never a grant over the limit (grants all
  -- lock the name's row). The row lock taken above makes every other acquire of the
  -- name wait, and this read sees every commit before it.
  SELECT count(*), (array_agg(x.lim ORDER BY x.seq) FILTER (WHERE x.expires_at > t))[1],
   coalesce(bool_and({sane}) FILTER (WHERE x.expires_at > t), true),
   coalesce(sum(x.weight) FILTER (WHERE x.granted AND x.expires_at > t), 0)::int8,
   coalesce(sum(x.weight) FILTER (WHERE x.expires_at > t AND NOT x.granted
    AND x.owner <> a_owner AND x.seq < coalesce((SELECT r.seq FROM {p} r
     WHERE r.name = a_name AND r.owner = a_owner AND r.expires_at > t), {_LAST})), 0)::int8,
   bool_or(x.granted) FILTER (WHERE x.owner = a_owner AND x.expires_at > t),
   max(x.seq) FILTER (WHERE x.owner = a_owner AND x.expires_at > t),
   max(x.token) FILTER (WHERE x.owner = a_owner AND x.expires_at > t),
   count(*) FILTER (WHERE x.expires_at <= t)
   INTO rows_now, first_lim, all_sane, used, ahead, my_granted, my_seq, my_token, expired
   FROM {p} x WHERE x.name = a_name;
  -- No row of the name at all (the uncontended case, and every first permit): nothing
  -- to count, mismatch, renew or queue behind (the weight fits: 1 <= weight <= limit
  -- is checked before the call), so grant at once.
  IF rows_now = 0 THEN
   INSERT INTO {p} ({columns}) VALUES (a_name, a_owner, a_weight, a_lim, true, 0,
    last_token + 1, a_identity, a_metadata, a_ttl, {expiry});
   UPDATE {n} x SET token = last_token + 1 WHERE x.name = a_name;
   RETURN QUERY SELECT 'grant'::text, last_token + 1, {nothing}, NULL::text, NULL::text,
    NULL::float8;
   RETURN;
  END IF;
  IF expired > 0 THEN
   DELETE FROM {p} x WHERE x.name = a_name AND x.expires_at <= t;
  END IF;
  IF first_lim IS NOT NULL AND NOT all_sane THEN
   decision := 'foreign';
  ELSIF first_lim IS NOT NULL AND first_lim <> a_lim THEN
   decision := 'mismatch';
  ELSIF my_granted THEN
   UPDATE {p} x SET ttl = a_ttl, expires_at = {expiry} WHERE x.name = a_name AND x.owner = a_owner;
   RETURN QUERY SELECT 'renew'::text, my_token, {nothing}, NULL::text, NULL::text, NULL::float8;
   RETURN;
  ELSIF used + ahead + a_weight <= a_lim THEN
   {grant};
   UPDATE {n} x SET token = last_token + 1 WHERE x.name = a_name;
   RETURN QUERY SELECT 'grant'::text, last_token + 1, {nothing}, NULL::text, NULL::text,
    NULL::float8;
   RETURN;
  ELSE
   decision := CASE WHEN my_seq IS NULL THEN 'queue' ELSE 'refresh' END;
  END IF;
  -- Granted nothing. Reported: every live row if one is foreign; the first (whose
  -- limit the name has) on a mismatch; else the blocker only, the live permit that
  -- expires first or, if none, the first queue entry of another owner (the client
  -- reads no more). Read anew: a plain release may have deleted it since (then decide
  -- again, on what is left).
  IF decision = 'foreign' THEN
   RETURN QUERY SELECT decision, NULL::int8, {report} FROM {p} x WHERE {live} ORDER BY x.seq;
  ELSIF decision = 'mismatch' THEN
   RETURN QUERY SELECT decision, NULL::int8, {report} FROM {p} x WHERE {live} ORDER BY x.seq
    LIMIT 1;
  ELSE
   RETURN QUERY SELECT decision, NULL::int8, {report} FROM {p} x WHERE {live}
    AND x.owner <> a_owner ORDER BY x.granted DESC,
    CASE WHEN x.granted THEN x.expires_at END, x.seq LIMIT 1;
  END IF;
  EXIT WHEN FOUND;
 END LOOP;
 -- A queue entry (or nothing) lost in a crash is written again by its waiter's next
 -- ask, so this commit need not wait for the WAL flush (and holds the name's row that
 -- much shorter); a later grant's commit flushes it.
 PERFORM set_config('synchronous_commit', 'off', true);
 IF decision = 'queue' THEN
  UPDATE {n} x SET seq = last_seq + 1 WHERE x.name = a_name;
  {upsert.format(granted="false", seq="last_seq + 1", token="NULL", meta="a_metadata")};
 ELSIF decision = 'refresh' THEN
  UPDATE {p} x SET ttl = a_ttl, expires_at = {expiry} WHERE x.name = a_name AND x.owner = a_owner;
 END IF;
END
$aiolease$"""


def release_function(r: str, p: str, n: str) -> str:
    """``CREATE FUNCTION`` of the release (see :class:`PermitSql`): in one transaction
    that locks the name's row first (as an acquire does, so that neither waits for the
    other while holding what the other needs), delete the caller's permit (of that
    token) or queue entry; then, if live queue entries are left, grant those that fit
    in arrival order (rule 3: the first entries whose weights, with the held weight,
    fit the limit; the first that does not fit stops it), each with the name's next
    token and an expiry of its own ttl from now, and ``NOTIFY`` their owners but those
    of ``a_local`` (waiting through the caller's backend object, which hands them their
    grants from the answer) (``'q'`` + the length of the owners joined by ``","`` +
    ``':'`` + owners + name, several notifications if they would pass the payload's
    limit). A grant is the
    queue entry's own: the identity and metadata of its request, kept for that."""
    sane = (
        f"left(x.owner, {len(PERMIT_PREFIX)}) = '{PERMIT_PREFIX}'"
        f" AND x.lim BETWEEN 1 AND {RW_LIMIT} AND x.weight BETWEEN 1 AND x.lim"
        " AND x.seq >= 0 AND (NOT x.granted OR coalesce(x.token >= 1, false))"
    )
    return f"""CREATE OR REPLACE FUNCTION {r}(a_name text, a_owner text, a_token int8,
 a_channel text, a_local text[])
RETURNS TABLE (freed bool, deleted bool, still_queued int8, owners text[], tokens int8[],
 ttls float8[])
LANGUAGE plpgsql VOLATILE {_INDEX_ONLY} AS $aiolease$
#variable_conflict use_column
DECLARE
 t timestamptz;
 tok int8;
 was_live bool;
 low_lim int8;
 high_lim int8;
 all_sane bool;
 used int8;
 queued int8;
 g_owners text[];
 g_tokens int8[];
 g_ttls float8[];
 joined text := '';
 o text;
BEGIN
 SELECT x.token INTO tok FROM {n} x WHERE x.name = a_name FOR NO KEY UPDATE;
 DELETE FROM {p} x WHERE x.name = a_name AND x.owner = a_owner
  AND (NOT x.granted OR a_token IS NULL OR x.token = a_token)
  RETURNING x.granted AND x.expires_at > clock_timestamp() INTO was_live;
 IF NOT FOUND THEN
  PERFORM set_config('synchronous_commit', 'off', true);  -- wrote nothing
  RETURN QUERY SELECT false, false, 0::int8, NULL::text[], NULL::int8[], NULL::float8[];
  RETURN;
 END IF;
 t := clock_timestamp();
 SELECT min(x.lim), max(x.lim), coalesce(bool_and({sane}), true),
  coalesce(sum(x.weight) FILTER (WHERE x.granted), 0)::int8, count(*) FILTER (WHERE NOT x.granted)
  INTO low_lim, high_lim, all_sane, used, queued
  FROM {p} x WHERE x.name = a_name AND x.expires_at > t;
 IF queued > 0 AND tok IS NOT NULL AND all_sane AND low_lim = high_lim AND used < low_lim THEN
  WITH q AS (SELECT x.owner, sum(x.weight) OVER w AS run, row_number() OVER w AS k
    FROM {p} x WHERE x.name = a_name AND NOT x.granted AND x.expires_at > t
    WINDOW w AS (ORDER BY x.seq ROWS UNBOUNDED PRECEDING)),
   g AS (UPDATE {p} x SET granted = true, token = tok + q.k,
    metadata = coalesce(x.metadata, '{{}}'), expires_at = t + make_interval(secs => x.ttl)
    FROM q WHERE x.name = a_name AND x.owner = q.owner AND used + q.run <= low_lim
    RETURNING x.owner, x.token, x.ttl)
  SELECT array_agg(g.owner ORDER BY g.token), array_agg(g.token ORDER BY g.token),
   array_agg(g.ttl ORDER BY g.token) INTO g_owners, g_tokens, g_ttls FROM g;
  IF g_owners IS NOT NULL THEN
   UPDATE {n} x SET token = tok + cardinality(g_owners) WHERE x.name = a_name;
   FOREACH o IN ARRAY g_owners LOOP
    CONTINUE WHEN o = ANY(a_local);
    IF joined <> '' AND octet_length(joined) + octet_length(o) + octet_length(a_name) > 7000 THEN
     PERFORM pg_notify(a_channel, 'q' || length(joined) || ':' || joined || a_name);
     joined := '';
    END IF;
    joined := CASE WHEN joined = '' THEN o ELSE joined || ',' || o END;
   END LOOP;
   IF joined <> '' THEN
    PERFORM pg_notify(a_channel, 'q' || length(joined) || ':' || joined || a_name);
   END IF;
  END IF;
 END IF;
 RETURN QUERY SELECT coalesce(was_live, false), true, queued - coalesce(cardinality(g_owners), 0),
  g_owners, g_tokens, g_ttls;
END
$aiolease$"""


def batch_function(b: str, f: str, r: str) -> str:
    """``CREATE FUNCTION`` of a batch (see :class:`PermitSql`): the acquire function
    ``f`` and the release function ``r`` called for each operation in order, in one
    transaction, each answer tagged with its operation's place. The commit waits for
    the WAL flush if any operation granted, renewed or deleted (as theirs would), and
    not otherwise (theirs would not either: each says so, the last one would win)."""
    nulls = ", ".join(["NULL::text, NULL::int8"] + [f"NULL::{t}" for t in _ROW_TYPES])
    return f"""CREATE OR REPLACE FUNCTION {b}(a_name text, a_kinds text, a_owners text[],
 a_tokens int8[], a_weights int8[], a_lims int8[], a_identities text[], a_metas text[],
 a_ttls float8[], a_channel text, a_local text[])
RETURNS TABLE (i int4, act text, tok int8, owner text, weight int8, lim int8, granted bool,
 seq int8, token int8, identity text, metadata text, remaining float8, freed bool,
 deleted bool, still_queued int8, owners text[], tokens int8[], ttls float8[])
LANGUAGE plpgsql VOLATILE {_INDEX_ONLY} AS $aiolease$
#variable_conflict use_column
DECLARE
 k int4;
 durable bool := false;
 keep text := current_setting('synchronous_commit');
 x record;
BEGIN
 FOR k IN 1 .. cardinality(a_owners) LOOP
  IF substr(a_kinds, k, 1) = 'a' THEN
   FOR x IN SELECT * FROM {f}(a_name, a_owners[k], a_weights[k], a_lims[k], a_identities[k],
     a_metas[k], a_ttls[k]) LOOP
    durable := durable OR x.act IN ('grant', 'renew');
    RETURN QUERY SELECT k, x.act, x.tok, x.owner, x.weight, x.lim, x.granted, x.seq, x.token,
     x.identity, x.metadata, x.remaining, NULL::bool, NULL::bool, NULL::int8, NULL::text[],
     NULL::int8[], NULL::float8[];
   END LOOP;
  ELSE
   FOR x IN SELECT * FROM {r}(a_name, a_owners[k], a_tokens[k], a_channel, a_local) LOOP
    durable := durable OR x.deleted;
    RETURN QUERY SELECT k, {nulls}, x.freed, x.deleted, x.still_queued, x.owners, x.tokens,
     x.ttls;
   END LOOP;
  END IF;
 END LOOP;
 PERFORM set_config('synchronous_commit', CASE WHEN durable THEN keep ELSE 'off' END, true);
END
$aiolease$"""


#: The types of the permit columns after ``act`` and ``tok`` (``PERMIT_COLUMNS``).
_ROW_TYPES = ("text", "int8", "int8", "bool", "int8", "int8", "text", "text", "float8")
