"""What :meth:`ZooKeeperBackend.statistics` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

__all__ = ["ZooKeeperStatistics"]


@final
@dataclass(frozen=True)
class ZooKeeperStatistics:
    """A snapshot of one :class:`ZooKeeperBackend`.

    :param session_id: the session the backend's nodes ride on (0: none yet)
    :param negotiated_timeout: its timeout as the server granted it, in seconds
    :param entries: grants and queued attempts on it
    :param requests: requests sent so far (pings included)
    :param pings: pings sent so far
    :param ping_failures: pings that failed (and were retried)
    :param lost_sessions: sessions the server expired under the backend
    :param expired_entries: nodes deleted because nobody renewed them within their ttl
    :param hand_offs: grants made without listing the queue: the node just ahead, held
        through this backend, was released
    :param local_refusals: attempts refused without a request: the name was held
        through this backend (or being handed to a waiter of it)
    :param permit_hand_offs: permits granted by a release of this backend, in the
        release's own write (its ``Multi``): their retry sent no request
    """

    session_id: int
    negotiated_timeout: float
    entries: int
    requests: int
    pings: int
    ping_failures: int
    lost_sessions: int
    expired_entries: int
    hand_offs: int
    local_refusals: int
    permit_hand_offs: int
