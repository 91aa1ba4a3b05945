"""The text of the MySQL / MariaDB permit procedures that the backend's setup installs
(see :class:`~aiolease.backends.mysql._statements.PermitSql`, which names them, and
``docs/internals/mysql.md``): the acquire (and the batch's step of it), the release,
the grant of the queue entries that fit, and the batch of a name's operations."""

from __future__ import annotations

from ..._permits import PERMIT_PREFIX, RW_LIMIT

__all__ = ["acquire_procedure", "batch_procedure", "release_procedure"]


def acquire_procedure(f: str, p: str, n: str, step: bool = False) -> str:
    """``CREATE PROCEDURE`` of the acquire (see :class:`PermitSql`): the rules of
    ``docs/internals/semaphores.md`` in one transaction (rolled back, and the error
    raised again, if a statement fails: a deadlock's victim is asked again whole).

    :param step: the same without a transaction of its own (no ``START TRANSACTION``,
        ``COMMIT`` or handler): a step of the batch procedure's transaction, which
        answers nothing before it commits
    """
    begin, commit = _transaction(step)
    live = "name = a_name AND expires_at > t"
    now = "UTC_TIMESTAMP(6)"  # one value per statement: the read's own ``t``
    alive_now = f"expires_at > {now}"
    expiry = "UTC_TIMESTAMP(6) + INTERVAL a_us MICROSECOND"
    columns = "name, owner, weight, lim, granted, seq, token, identity, metadata, ttl, expires_at"
    upsert = (
        f"INSERT INTO {p} ({columns}, waited) VALUES (a_name, a_owner, a_weight, a_lim,"
        f" {{granted}}, {{seq}}, {{token}}, a_identity, {{meta}}, a_ttl, {expiry}, {{waited}})"
        " ON DUPLICATE KEY UPDATE weight = a_weight, lim = a_lim, granted = {granted},"
        " seq = {seq}, token = {token}, identity = a_identity, metadata = {meta}, ttl = a_ttl,"
        f" expires_at = {expiry}, waited = {{waited}}"
    )
    # What aiolease writes (permit_row checks the same, and the text, in Python).
    sane = (
        f"LEFT(owner, {len(PERMIT_PREFIX)}) = '{PERMIT_PREFIX}' AND lim BETWEEN 1 AND {RW_LIMIT}"
        " AND weight BETWEEN 1 AND lim AND (granted = 0 OR IFNULL(token >= 1, FALSE))"
    )
    refresh = (
        f"UPDATE {p} SET ttl = a_ttl, expires_at = {expiry} WHERE name = a_name AND owner = a_owner"
    )
    # A grant marks its permit ``waited`` if requests stay queued behind it.
    grant = upsert.format(
        granted="1", seq="IFNULL(my_seq, 0)", token="got", meta="a_metadata", waited="others > 0"
    )
    # Alone, the name's next token is taken by the statement that locks its row, and
    # given back (the row still locked) unless the request is granted: the uncontended
    # grant is then one write of the name's row, one read of its permits and one write
    # of them. In a batch, whose transaction made the name's row and locked it first,
    # the name's latest token and queue place are the batch's variables (``a_tok``,
    # ``a_seq``, read once), which a grant or a new entry moves; the batch writes them
    # to the name's row once, at its end.
    signature = ""
    if step:
        signature = ", INOUT a_tok BIGINT UNSIGNED, INOUT a_seq BIGINT UNSIGNED"
        take, got, taken = "", "a_tok + 1", "\n   SET a_tok = got;"
        place = "SET a_seq = a_seq + 1;\n   SET got = a_seq, decision = 'queue';"
        give_back_else = ""
    else:
        # A name without any row (every first permit, and the uncontended case) is
        # granted by one statement that writes the permit only if no row of the name
        # exists (routine version 10): nothing to count, mismatch, renew or queue behind
        # (1 <= weight <= limit is checked before the call). Every acquire of the name
        # waits for the one before at the name's row, taken just above.
        free = (
            f"\n INSERT INTO {p} ({columns}, waited) SELECT a_name, a_owner, a_weight, a_lim,"
            f" 1, 0, LAST_INSERT_ID(), a_identity, a_metadata, a_ttl, {expiry}, 0 FROM DUAL"
            f" WHERE NOT EXISTS (SELECT 1 FROM {p} WHERE name = a_name);"
            "\n IF ROW_COUNT() > 0 THEN"
            "\n  COMMIT;"
            "\n  SELECT 'grant' AS act, LAST_INSERT_ID() AS tok;"
            "\n  LEAVE body;"
            "\n END IF;"
        )
        take = (
            f"\n INSERT INTO {n} (name, token, seq) VALUES (a_name, LAST_INSERT_ID(1), 0)"
            "\n  ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1);"
        ) + free
        got, taken = "LAST_INSERT_ID()", ""
        place = (
            f"UPDATE {n} SET token = token - 1, seq = LAST_INSERT_ID(seq + 1) WHERE name = a_name;"
            "\n   SET got = LAST_INSERT_ID(), decision = 'queue';"
        )
        give_back_else = (
            "\n IF decision <> 'queue' THEN"
            f"\n  UPDATE {n} SET token = token - 1 WHERE name = a_name;"
            "\n END IF;"
        )
    return f"""CREATE PROCEDURE {f}(a_name VARBINARY(255), a_owner VARBINARY(255),
 a_weight BIGINT, a_lim BIGINT, a_identity VARBINARY(1024), a_metadata BLOB, a_ttl DOUBLE,
 a_us BIGINT UNSIGNED{signature})
MODIFIES SQL DATA SQL SECURITY INVOKER
body: BEGIN
 DECLARE t DATETIME(6);
 DECLARE all_sane, my_granted INT DEFAULT NULL;
 DECLARE low_lim, high_lim BIGINT DEFAULT NULL;
 DECLARE used, ahead, queued_w, expired, others, unwaited BIGINT DEFAULT 0;
 DECLARE my_seq, my_token, got, first_q BIGINT UNSIGNED DEFAULT NULL;
 DECLARE decision VARCHAR(8) CHARACTER SET ascii DEFAULT NULL;{begin}{take}
 SELECT {now}, {got}, MIN(IF({alive_now}, {sane}, NULL)),
  MIN(IF({alive_now}, lim, NULL)), MAX(IF({alive_now}, lim, NULL)),
  IFNULL(SUM(IF({alive_now} AND granted = 1, weight, 0)), 0),
  MAX(IF({alive_now} AND owner = a_owner, granted, NULL)),
  MAX(IF({alive_now} AND owner = a_owner, seq, NULL)),
  MAX(IF({alive_now} AND owner = a_owner, token, NULL)), IFNULL(SUM(expires_at <= {now}), 0),
  IFNULL(SUM({alive_now} AND granted = 0 AND owner <> a_owner), 0),
  IFNULL(SUM({alive_now} AND granted = 1 AND waited = 0), 0),
  IFNULL(SUM(IF({alive_now} AND granted = 0 AND owner <> a_owner, weight, 0)), 0),
  MIN(IF({alive_now} AND granted = 0 AND owner <> a_owner, seq, NULL))
  INTO t, got, all_sane, low_lim, high_lim, used, my_granted, my_seq, my_token, expired, others,
  unwaited, queued_w, first_q FROM {p} WHERE name = a_name FOR UPDATE;
 IF expired > 0 THEN
  DELETE FROM {p} WHERE name = a_name AND expires_at <= t;
 END IF;
 IF low_lim IS NOT NULL AND (NOT all_sane OR low_lim <> high_lim) THEN
  SET decision = 'foreign';
 ELSEIF low_lim IS NOT NULL AND low_lim <> a_lim THEN
  SET decision = 'mismatch';
 ELSEIF my_granted = 1 THEN
  {refresh};
  SET decision = 'renew';
 ELSE
  IF my_seq IS NULL THEN
   SET ahead = queued_w;
  ELSEIF low_lim IS NOT NULL THEN
   SELECT IFNULL(SUM(weight), 0) INTO ahead FROM {p} WHERE {live} AND granted = 0
    AND owner <> a_owner AND seq < my_seq;
  END IF;
  IF used + ahead + a_weight <= a_lim THEN{taken}
   {grant};{commit}
   SELECT 'grant' AS act, got AS tok;
   LEAVE body;
  ELSEIF my_seq IS NULL THEN
   {place}
   {upsert.format(granted="0", seq="got", token="NULL", meta="a_metadata", waited="0")};
  ELSE
   {refresh};
   SET decision = 'refresh';
  END IF;
  IF unwaited > 0 THEN
   UPDATE {p} SET waited = 1 WHERE name = a_name AND granted = 1 AND waited = 0;
  END IF;
 END IF;
{give_back_else}
 IF decision = 'renew' THEN{commit}
  SELECT decision AS act, my_token AS tok;
 ELSE
  SELECT decision AS act, NULL AS tok, owner, weight, lim, granted, seq, token, identity,
   metadata, TIMESTAMPDIFF(MICROSECOND, t, expires_at) FROM {p} WHERE {live}
   AND (decision NOT IN ('queue', 'refresh') OR granted = 1 OR owner = a_owner OR seq = first_q)
   ORDER BY seq;{commit}
 END IF;
END"""


def release_procedure(r: str, p: str, n: str) -> str:
    """``CREATE PROCEDURE`` of the release (see :class:`PermitSql`), in one transaction
    that locks the name's row first, as an acquire does: delete the caller's permit (of
    that token) or queue entry; then, if live queue entries are left, grant those that
    fit (see ``_grant_queued``). One result set: a row per grant (``freed``,
    ``deleted``, the entries left queued, owner, token, ttl), or one row without a
    grant (owner, token and ttl NULL)."""
    return f"""CREATE PROCEDURE {r}(a_name VARBINARY(255), a_owner VARBINARY(255),
 a_token BIGINT UNSIGNED)
MODIFIES SQL DATA SQL SECURITY INVOKER
body: BEGIN
 DECLARE t DATETIME(6);
 DECLARE tok BIGINT UNSIGNED DEFAULT NULL;
 DECLARE was_live, gone, all_sane INT DEFAULT NULL;
 DECLARE low_lim, high_lim BIGINT DEFAULT NULL;
 DECLARE used, queued, granted_now BIGINT DEFAULT 0;
 DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
 START TRANSACTION;
 SELECT MAX(token), UTC_TIMESTAMP(6) INTO tok, t FROM {n} WHERE name = a_name FOR UPDATE;
 SELECT MAX(granted = 1 AND expires_at > t), COUNT(*) INTO was_live, gone
  FROM {p} WHERE {_MINE_PERMIT} FOR UPDATE;
 IF gone = 0 THEN
  COMMIT;
  SELECT 0 AS freed, 0 AS deleted, NULL AS queued, NULL AS owner, NULL AS token, NULL AS ttl;
  LEAVE body;
 END IF;
 DELETE FROM {p} WHERE {_MINE_PERMIT};{_grant_queued(p, n)}
 IF granted_now > 0 THEN
  SELECT IFNULL(was_live, 0) AS freed, 1 AS deleted, queued - granted_now AS queued, owner,
   token, ttl FROM {p} WHERE name = a_name AND granted = 1 AND token > tok ORDER BY token;
 ELSE
  SELECT IFNULL(was_live, 0) AS freed, 1 AS deleted, queued, NULL AS owner, NULL AS token,
   NULL AS ttl;
 END IF;
 COMMIT;
END"""


#: The caller's permit (of ``a_token``) or queue entry, as a release deletes it.
_MINE_PERMIT = (
    "name = a_name AND owner = a_owner AND (granted = 0 OR a_token IS NULL OR token = a_token)"
)


def _grant_queued(p: str, n: str, write_token: bool = True) -> str:
    """A release's grants, the name's row locked (its token in ``tok``, the time in
    ``t``): if live queue entries are left, grant those that fit in arrival order (rule
    3: the first entries whose weights, with the held weight, fit the limit; the first
    that does not fit stops it), each with the name's next token, an expiry of its own
    ttl from now, and its request's identity and metadata; mark the live permits
    ``waited`` while entries stay queued. Sets ``queued`` (the live entries before) and
    ``granted_now``; writes the name's token unless ``write_token`` is false (the batch
    writes it at its end)."""
    written = (
        "\n  IF granted_now > 0 THEN"
        f"\n   UPDATE {n} SET token = tok + granted_now WHERE name = a_name;"
        "\n  END IF;"
        if write_token
        else ""
    )
    sane = (
        f"LEFT(owner, {len(PERMIT_PREFIX)}) = '{PERMIT_PREFIX}' AND lim BETWEEN 1 AND {RW_LIMIT}"
        " AND weight BETWEEN 1 AND lim AND (granted = 0 OR IFNULL(token >= 1, FALSE))"
    )
    return f"""
 SELECT MIN({sane}), MIN(lim), MAX(lim), IFNULL(SUM(IF(granted = 1, weight, 0)), 0),
  IFNULL(SUM(granted = 0), 0) INTO all_sane, low_lim, high_lim, used, queued
  FROM {p} WHERE name = a_name AND expires_at > t FOR UPDATE;
 IF queued > 0 AND tok IS NOT NULL AND all_sane AND low_lim = high_lim AND used < low_lim THEN
  UPDATE {p} x JOIN (SELECT owner,
    SUM(weight) OVER (ORDER BY seq ROWS UNBOUNDED PRECEDING) AS run,
    ROW_NUMBER() OVER (ORDER BY seq) AS k
    FROM {p} WHERE name = a_name AND granted = 0 AND expires_at > t) q
   ON x.name = a_name AND x.owner = q.owner
   SET x.granted = 1, x.token = tok + q.k, x.metadata = IFNULL(x.metadata, '{{}}'),
    x.expires_at = t + INTERVAL ROUND(x.ttl * 1000000) MICROSECOND
   WHERE used + q.run <= low_lim;
  SET granted_now = ROW_COUNT();{written}
  IF granted_now < queued THEN
   UPDATE {p} SET waited = 1 WHERE name = a_name AND granted = 1 AND waited = 0;
  END IF;
 END IF;"""


def batch_procedure(b: str, take: str, p: str, n: str) -> str:
    """``CREATE PROCEDURE`` of the batch (see :attr:`PermitSql.batch`), in one
    transaction that locks the name's row first (rolled back whole, and the error raised
    again, if a statement fails): each operation of ``a_ops`` in order, an acquire by
    its step procedure (one result set each), a release by deleting the caller's
    permit or queue entry; then, if a release deleted something, the grants that the
    queue entries left then get, once for the batch (see ``_grant_queued``). Last, one
    result set: a row per grant (what each release did, the entries left queued,
    owner, token, ttl), or one row without a grant (owner, token and ttl NULL; the
    entries left queued NULL if no release deleted anything). What the releases did is
    two digits per release, in order: whether it freed a live permit, whether it
    deleted a row (not a result set each: a result set costs the server more)."""

    def arg(i: int) -> str:
        return f"JSON_UNQUOTE(JSON_EXTRACT(op, '$[{i}]'))"

    return f"""CREATE PROCEDURE {b}(a_name VARBINARY(255), a_ops LONGTEXT CHARACTER SET ascii)
MODIFIES SQL DATA SQL SECURITY INVOKER
BEGIN
 DECLARE i, n INT DEFAULT 0;
 DECLARE op LONGTEXT CHARACTER SET ascii;
 DECLARE a_owner VARBINARY(255);
 DECLARE a_token, tok, tok0, sq, sq0 BIGINT UNSIGNED DEFAULT NULL;
 DECLARE t DATETIME(6);
 DECLARE was_live, gone, all_sane INT DEFAULT NULL;
 DECLARE low_lim, high_lim BIGINT DEFAULT NULL;
 DECLARE used, queued, granted_now, dropped BIGINT DEFAULT 0;
 DECLARE released LONGTEXT CHARACTER SET ascii DEFAULT '';
 DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
 SET n = JSON_LENGTH(a_ops);
 START TRANSACTION;
 INSERT INTO {n} (name, token, seq) VALUES (a_name, 0, 0) ON DUPLICATE KEY UPDATE seq = seq;
 SELECT token, seq, token, seq INTO tok, sq, tok0, sq0 FROM {n} WHERE name = a_name FOR UPDATE;
 WHILE i < n DO
  SET op = JSON_EXTRACT(a_ops, CONCAT('$[', i, ']'));
  IF {arg(0)} = 'a' THEN
   CALL {take}(a_name, UNHEX({arg(1)}), {arg(2)}, {arg(3)}, UNHEX({arg(4)}), UNHEX({arg(5)}),
    {arg(6)}, {arg(7)}, tok, sq);
  ELSE
   SET a_owner = UNHEX({arg(1)}), a_token = NULLIF({arg(2)}, 0);
   DELETE FROM {p} WHERE name = a_name AND owner = a_owner AND granted = 1
    AND (a_token IS NULL OR token = a_token) AND expires_at > UTC_TIMESTAMP(6);
   SET was_live = ROW_COUNT();
   SET gone = was_live;
   IF was_live = 0 THEN
    DELETE FROM {p} WHERE {_MINE_PERMIT};
    SET gone = ROW_COUNT();
   END IF;
   IF gone > 0 THEN
    SET dropped = dropped + 1;
   END IF;
   SET released = CONCAT(released, was_live, gone > 0);
  END IF;
  SET i = i + 1;
 END WHILE;
 IF dropped > 0 THEN
  SET t = UTC_TIMESTAMP(6);{_grant_queued(p, n, write_token=False)}
 END IF;
 IF tok + granted_now <> tok0 OR sq <> sq0 THEN
  UPDATE {n} SET token = tok + granted_now, seq = sq WHERE name = a_name;
 END IF;
 IF granted_now > 0 THEN
  SELECT released, queued - granted_now AS queued, owner, token, ttl FROM {p}
   WHERE name = a_name AND granted = 1 AND token > tok ORDER BY token;
 ELSE
  SELECT released, IF(dropped > 0, queued, NULL) AS queued, NULL AS owner, NULL AS token,
   NULL AS ttl;
 END IF;
 COMMIT;
END"""


def _transaction(step: bool) -> tuple[str, str]:
    """What opens a procedure's own transaction (its handler rolls it back and raises
    the error again), and what commits it; nothing for a step of a batch."""
    if step:
        return "", ""
    return (
        "\n DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;"
        "\n START TRANSACTION;",
        "\n COMMIT;",
    )
