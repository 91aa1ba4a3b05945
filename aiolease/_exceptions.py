"""The exception hierarchy of aiolease.

::

    AioleaseError
     +-- InvalidArgument (ValueError)        bad input, rejected before anything is sent
     +-- BackendNotFound (LookupError)       no backend for a URL scheme, or its extra is missing
     +-- UnsupportedCapability               a required capability is missing
     +-- BackendError                        the backend failed; nothing was granted
     |    +-- BackendUnavailable             connection refused, reset, server down
     |    +-- BackendTimeout                 the backend did not answer in time
     |    +-- ForeignDataError               a lease's record holds data aiolease did not write
     +-- LeaseError                          about one lease (``.name``)
          +-- LeaseHeldError                 somebody else holds it (``.holder``)
          +-- LimitMismatchError             clients disagree about a semaphore's limit
          +-- NotOwnerError                  the caller does not own it (any more)
          +-- ReentrantAcquireError (RuntimeError)  the task holds it in a block already
          +-- LeaseLostError                 a held lease was lost (``.reason``)
               +-- LeaseExpiredError         ... because it was not renewed in time (``EXPIRED``)

Driver exceptions never escape a backend: they are mapped to :class:`BackendError`
subclasses at the backend boundary, with the original as ``__cause__``.
"""

from __future__ import annotations

import enum

from ._records import HolderInfo

__all__ = [
    "AioleaseError",
    "BackendError",
    "BackendNotFound",
    "BackendTimeout",
    "BackendUnavailable",
    "ForeignDataError",
    "InvalidArgument",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseHeldError",
    "LeaseLostError",
    "LimitMismatchError",
    "LossReason",
    "NotOwnerError",
    "ReentrantAcquireError",
    "UnsupportedCapability",
    "lost_error",
]


class LossReason(str, enum.Enum):
    """Why a lease ended (the table in ``docs/concepts.md`` lists what produces each)."""

    #: The local safe deadline passed and no renewal had been sent since the last
    #: confirmed one: the holder did not renew in time (a paused process, a blocked
    #: event loop, a lease from ``acquire()`` nobody renewed); the backend was not at fault.
    EXPIRED = "expired"
    #: The backend answered that this owner no longer holds the name: taken over by
    #: another holder, deleted, or already expired on the server.
    STOLEN = "stolen"
    #: The local safe deadline passed while renewals were being sent and none was
    #: confirmed: each failed (refused, reset, an error, a timeout) or went unanswered
    #: (a blackholed or hung server). For a session backend: its keepalives failed.
    UNREACHABLE = "unreachable"
    #: The health probe failed too many times in a row; the holder stepped down.
    UNHEALTHY = "unhealthy"
    #: The holder released it (explicit release or resignation).
    RELEASED = "released"
    #: The backend or elector was closed while the lease was held.
    SHUTDOWN = "shutdown"
    #: The lease was held for its ``max_hold`` seconds: the holder stopped renewing it,
    #: cancelled the work and released it (not a fault: the limit it was given).
    MAX_HOLD = "max_hold"


class AioleaseError(Exception):
    """Base class of every exception aiolease raises on purpose."""


class InvalidArgument(AioleaseError, ValueError):
    """An argument was rejected at the boundary; nothing was sent or changed."""


class BackendNotFound(AioleaseError, LookupError):
    """No backend is registered for a URL scheme, or its driver is not installed."""


class UnsupportedCapability(AioleaseError):
    """A backend lacks a capability that the caller required."""


class BackendError(AioleaseError):
    """The backend failed. A failed operation never counts as granted."""


class BackendUnavailable(BackendError):
    """The backend could not be reached or refused the request."""


class BackendTimeout(BackendError):
    """The backend did not answer in time; the outcome of the request is unknown."""


class ForeignDataError(BackendError):
    """A lease's record (a key, a row) holds something aiolease did not write, or a
    damaged value; it was left unchanged, and nothing was granted over it.

    Another program writes where aiolease keeps its leases: give aiolease a key
    prefix or table of its own.

    :ivar name: the lease name whose record is affected
    """

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


class LeaseError(AioleaseError):
    """An error about one named lease.

    :param name: the lease name
    """

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


class LeaseHeldError(LeaseError):
    """The lease is held by somebody else.

    :ivar holder: what the backend reported about the current holder, if anything
    """

    def __init__(self, name: str, holder: HolderInfo | None) -> None:
        who = f"{holder.identity!r} (token {holder.token})" if holder else "another owner"
        super().__init__(f"lease {name!r} is held by {who}", name=name)
        self.holder = holder


class LimitMismatchError(LeaseError):
    """A permit was asked for with another limit than the permits of the name that are
    held or queued: clients disagree about the semaphore's limit (or use one name for a
    semaphore and a read-write lock). Nothing was granted or queued.

    :ivar limit: the limit this request gave
    :ivar held_limit: the limit the name's live permits were granted with
    """

    def __init__(self, name: str, limit: int, held_limit: int) -> None:
        from ._permits import RW_LIMIT  # (it imports this module)

        if held_limit == RW_LIMIT:
            message = f"{name!r} is a read-write lock, not a semaphore of limit {limit}"
        elif limit == RW_LIMIT:
            message = f"{name!r} is a semaphore of limit {held_limit}, not a read-write lock"
        else:
            message = (
                f"permits of {name!r} are held with limit {held_limit}, not {limit}: every"
                " client of one name must give the same limit"
            )
        super().__init__(message, name=name)
        self.limit = limit
        self.held_limit = held_limit


class NotOwnerError(LeaseError):
    """The caller does not hold the lease (any more)."""

    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(message or f"lease {name!r} is not held by this owner", name=name)


class ReentrantAcquireError(LeaseError, RuntimeError):
    """The running task asked for a name that it already holds in an ``async with``
    block (a lock's or an elector's term) through the same backend object.

    Locks are not reentrant: the acquire would wait for the task's own lease, which
    is renewed while the task waits, so it would never end. Raised at once, before
    anything is sent. A programming error, so not a :class:`LeaseHeldError` (code
    that retries on those would retry forever).
    """

    def __init__(self, name: str) -> None:
        super().__init__(
            f"lease {name!r} is already held by this task through this backend: "
            "locks are not reentrant",
            name=name,
        )


class LeaseLostError(LeaseError):
    """A lease was lost while the protected work ran; the work was cancelled.

    The work may have overlapped with the next holder's: protect the resource with
    the lease's fencing token.

    :ivar reason: a :class:`LossReason`
    """

    def __init__(self, name: str, reason: LossReason) -> None:
        super().__init__(f"lease {name!r} was lost: {reason.value}", name=name)
        self.reason = reason


class LeaseExpiredError(LeaseLostError):
    """The lease was lost with :attr:`LossReason.EXPIRED`: its local safe deadline
    passed and no renewal had been sent in time."""

    def __init__(self, name: str) -> None:
        super().__init__(name, LossReason.EXPIRED)


def lost_error(name: str, reason: LossReason) -> LeaseLostError:
    """The most specific :class:`LeaseLostError` for ``reason``."""
    if reason is LossReason.EXPIRED:
        return LeaseExpiredError(name)
    return LeaseLostError(name, reason)
