"""The values and checks of the permit contract (semaphores and read-write locks).

A permit is a lease of its own, kept in a keyspace apart from locks, addressed like
one by ``(name, owner, token)``: the core gives every permit an owner id made by
:func:`permit_owner`, and a backend's lease operations (``renew``, ``renew_many``,
``release``, ...) tell permits from locks by :func:`is_permit_owner`. See
``docs/internals/semaphores.md`` for the rules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._exceptions import InvalidArgument
from ._records import HolderInfo

__all__ = [
    "MAX_LIMIT",
    "PERMIT_PREFIX",
    "RW_LIMIT",
    "PermitHolders",
    "PermitRequest",
    "check_limit",
    "check_weight",
    "is_permit_owner",
    "permit_owner",
]

#: What every permit's owner id starts with (a lock's owner id never does).
PERMIT_PREFIX = "permit:"
#: The limit of every read-write lock: a reader weighs 1, a writer all of it.
RW_LIMIT = 2**31 - 1
#: The largest limit of a semaphore (below :data:`RW_LIMIT`, so that a semaphore and
#: a read-write lock of one name disagree about the limit instead of mixing).
MAX_LIMIT = 10**6


def permit_owner() -> str:
    """A new owner id for one permit request: :data:`PERMIT_PREFIX` and 32 random hex digits."""
    return PERMIT_PREFIX + os.urandom(16).hex()


def is_permit_owner(owner: str) -> bool:
    """Whether ``owner`` is a permit's owner id (else a lock's)."""
    return owner.startswith(PERMIT_PREFIX)


def check_limit(limit: object, *, at_most: int = RW_LIMIT) -> int:
    """:raises InvalidArgument: unless ``limit`` is an int (not a bool) in [1, ``at_most``]"""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= at_most:
        raise InvalidArgument(f"limit must be an int from 1 to {at_most}, got {limit!r}")
    return limit


def check_weight(weight: object, limit: int) -> int:
    """:raises InvalidArgument: unless ``weight`` is an int (not a bool) in [1, ``limit``]"""
    if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= limit:
        raise InvalidArgument(f"weight must be an int from 1 to the limit {limit}, got {weight!r}")
    return weight


@dataclass(frozen=True, slots=True)
class PermitRequest:
    """What a permit acquire asks for: ``weight`` of a name's ``limit``."""

    limit: int
    weight: int


@dataclass(frozen=True, slots=True)
class PermitHolders:
    """What a backend reports about the permits of a name
    (:meth:`~aiolease.abc.Backend.read_permits`).

    :param name: the name
    :param limit: the limit the live permits and queue entries were asked with
    :param holders: the live permits, each with its remaining ttl, oldest grant first
    :param weights: each holder's weight, in the order of ``holders``
    :param waiting: how many requests are queued (live queue entries)
    """

    name: str
    limit: int
    holders: tuple[HolderInfo, ...]
    weights: tuple[int, ...]
    waiting: int = 0

    @property
    def used(self) -> int:
        """The weight the live permits hold."""
        return sum(self.weights)
