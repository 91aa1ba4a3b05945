"""What a :class:`~aiolease.backends.postgres.PostgresBackend` did so far."""

from __future__ import annotations

from dataclasses import dataclass

from ..sql._pool import PoolStatistics

__all__ = ["PostgresStatistics"]


@dataclass(frozen=True, slots=True)
class PostgresStatistics:
    """What one :class:`PostgresBackend` did so far.

    :param renew_statements: renewal statements sent (each renews a whole batch)
    :param renewals_shared: renew calls answered from a statement sent for the batch
    :param listening: whether the listener connection is up now
    :param listener_connects: how many times the listener (re)connected
    :param waiting: tasks blocked in ``wait_changed`` or ``wait_turn`` now
    :param pool: the connections of a backend made from a URL (``None``: the user's)
    :param acquire_statements: acquire statements sent
    :param handoffs_taken: grants handed to a waiter and taken without a statement
    :param permit_statements_combined: statements that carried several permit acquires
        and releases of one name (those that arrived while one of the name's was in
        flight)
    """

    renew_statements: int
    renewals_shared: int
    listening: bool
    listener_connects: int
    waiting: int
    pool: PoolStatistics | None = None
    acquire_statements: int = 0
    handoffs_taken: int = 0
    permit_statements_combined: int = 0
