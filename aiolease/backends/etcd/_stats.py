"""What :meth:`EtcdBackend.statistics` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

__all__ = ["EtcdStatistics"]


@final
@dataclass(frozen=True)
class EtcdStatistics:
    """A snapshot of one :class:`EtcdBackend`'s sessions.

    :param lease_ids: ids of the session leases that may exist on the server
    :param entries: grants and queued attempts riding on them
    :param sessions_granted: session leases granted so far
    :param sessions_lost: sessions lost (expired, revoked by others, unreachable)
    :param keepalives: keepalive round trips sent
    :param keepalive_failures: keepalives that failed (and were retried)
    :param expired_entries: grants dropped because nobody renewed them within their ttl
    :param local_handoffs: fair mode: releases that handed the name to a successor
        waiting on the same backend, which took it without a request
    :param watch_streams: gRPC Watch streams opened so far (a lock's wait opens one;
        takeover watches share one, and so do permit waits)
    :param delete_batches: ``Txn`` requests that carried the deletes of several releases
        (sent while every place for requests in flight was taken)
    """

    lease_ids: tuple[int, ...]
    entries: int
    sessions_granted: int
    sessions_lost: int
    keepalives: int
    keepalive_failures: int
    expired_entries: int
    local_handoffs: int = 0
    watch_streams: int = 0
    delete_batches: int = 0
