"""One statement's exchange on an asyncmy connection of the MySQL / MariaDB backend,
and how its connections are opened and judged (no driver import)."""

from __future__ import annotations

import inspect
from typing import Any

from ._statements import ID, ROWS, SETS, Prepared, Rendered

__all__ = ["PS_MULTI_RESULTS", "STATEMENT_CACHE", "exchange", "statement_cache", "usable"]


async def exchange(
    conn: Any, sql: Prepared | Rendered | str, params: Any, want: str, then: Prepared | None
) -> Any:
    """Run ``sql`` (and ``then``) on ``conn``; what ``want`` asks for (``ID``: the insert
    id, ``ROWS``: the rows, ``SETS``: the rows of every result set, read to the end of
    the statement's answer, else the affected row count).

    A :class:`~aiolease.backends.mysql._statements.Prepared` statement takes its parameters from
    the mapping ``params``; a plain one (a batch, whose text differs with its size, so
    preparing it would cost a round trip per new size) goes as text.
    """
    async with conn.cursor() as cur:
        if isinstance(sql, Prepared):
            count = await cur.execute(sql.sql, [params[name] for name in sql.names])
        elif isinstance(sql, Rendered):
            count = await cur.execute(sql.text(cur, conn))
        else:
            count = await cur.execute(cur.mogrify(sql, params))
        if want == SETS:
            result: Any = []
            while True:
                if cur.description is not None:
                    result.append(await cur.fetchall())
                if not await cur.nextset():
                    break
        elif want == ID:
            result = cur.lastrowid
        else:
            result = await cur.fetchall() if want == ROWS else count
        if then is not None and not result:
            await cur.execute(then.sql, [params[name] for name in then.names])
            result = await cur.fetchall()
    if not conn.get_autocommit():
        await conn.commit()
    return result


#: Prepared statements kept per connection (of a backend made from a URL): acquire,
#: take-over, holder, reserved, peek, the two releases, hand-off, mark, wait, leave, and
#: the permits' free and acquire.
STATEMENT_CACHE = 14
#: The client capability that lets a prepared ``CALL`` answer result sets (MySQL's and
#: MariaDB's ``CLIENT_PS_MULTI_RESULTS``).
PS_MULTI_RESULTS = 1 << 18


def statement_cache(asyncmy: Any) -> bool:
    """Whether this asyncmy prepares positional statements (``stmt_cache_size``)."""
    try:
        return "stmt_cache_size" in inspect.signature(asyncmy.connect).parameters
    except (TypeError, ValueError):  # a signature it does not expose: do without
        return False


def usable(conn: Any) -> bool:
    """Whether an idle asyncmy connection is still open (the server may have closed it)."""
    return bool(conn.connected) and not getattr(conn, "_stream_broken", False)
