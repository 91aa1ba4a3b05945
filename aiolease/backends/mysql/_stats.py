"""What a :class:`~aiolease.backends.mysql.MySQLBackend` did so far."""

from __future__ import annotations

from dataclasses import dataclass

from ..sql._pool import PoolStatistics

__all__ = ["MySQLStatistics"]


@dataclass(frozen=True, slots=True)
class MySQLStatistics:
    """What one :class:`MySQLBackend` did so far.

    :param renew_statements: renewal statements sent (each renews a whole batch)
    :param renewals_shared: renew calls answered from a statement sent for the batch
    :param hand_offs: releases that granted the name to a waiter in the same statement
    :param waiting: tasks blocked in ``wait_changed`` or ``wait_turn`` now
    :param pool: the connections of a backend made from a URL (``None``: the user's)
    :param polls: acquire statements sent by waiters polling for their turn
    :param queue_writes: statements that wrote waiters' entries (join, refresh, leave,
        sweep)
    :param bell_waits: waits sent on the bell of the entry ahead (:mod:`._bell`)
    :param rings: those that returned because the bell was let go (or was free)
    :param deadlocks: statements the server chose as a deadlock's victim, sent again
    :param permit_statements_combined: statements that carried several permit acquires
        and releases of one name (the batch procedure: one transaction)
    """

    renew_statements: int
    renewals_shared: int
    hand_offs: int
    waiting: int
    pool: PoolStatistics | None = None
    polls: int = 0
    queue_writes: int = 0
    bell_waits: int = 0
    rings: int = 0
    deadlocks: int = 0
    permit_statements_combined: int = 0
