"""The values the backend contract passes: what a backend reports and returns.

They import nothing from the rest of aiolease, so that :mod:`aiolease._exceptions`
(whose :class:`~aiolease.LeaseHeldError` carries a :class:`HolderInfo`) and
:mod:`aiolease.abc` both can import them. :mod:`aiolease.abc` re-exports them for
backend authors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Grant", "HolderInfo", "Renewal", "SessionClock", "identity_of", "state_of"]


@dataclass(frozen=True, slots=True)
class HolderInfo:
    """What a backend reports about the current holder of a name.

    :param name: the lease name
    :param owner: the opaque owner id of this grant (unique per acquire attempt)
    :param identity: the human-readable identity the holder gave (host, pod, ...)
    :param token: the fencing token of this grant
    :param metadata: small string map the holder published with the grant
    :param remaining: seconds of server-side ttl left when read, if known
    """

    name: str
    owner: str
    identity: str
    token: int
    metadata: Mapping[str, str] = field(default_factory=dict)
    remaining: float | None = None


def identity_of(holder: HolderInfo | None) -> tuple[str, int] | None:
    """What tells one holding of a name from another: its owner and fencing token
    (``None``: nobody holds it). A renewal changes neither; any grant changes the token.
    """
    return None if holder is None else (holder.owner, holder.token)


def state_of(
    holder: HolderInfo | None,
) -> tuple[str, int, tuple[tuple[str, str], ...]] | None:
    """What an observer of a name tells apart: :func:`identity_of` and the metadata,
    which the holder may change in place (:meth:`Backend.update_metadata`)."""
    if holder is None:
        return None
    return (holder.owner, holder.token, tuple(sorted(holder.metadata.items())))


@dataclass(frozen=True, slots=True)
class Grant:
    """A confirmed acquire or renewal.

    :param token: the fencing token of the grant (unchanged by renewals)
    :param ttl: the ttl the server applied, in seconds
    :param sent_at: ``anyio.current_time()`` at which the confirming request was sent,
        when that is earlier than the core's own call (session backends)
    """

    token: int
    ttl: float
    sent_at: float | None = None


#: One lease to renew, as :meth:`Backend.renew_many` gets it: ``(name, owner, token, ttl)``.
Renewal = tuple[str, str, int, float]


class SessionClock(Protocol):
    """How long a session keeps the grants on it (see :meth:`Backend.hold`).

    Read by the core at any time, from any task: both are plain attributes that the
    backend updates as its keepalives are confirmed or fail.
    """

    @property
    def expires(self) -> float:
        """``anyio.current_time()`` before which the server cannot drop the session:
        the send time of its last confirmed keepalive (or grant) plus its ttl."""
        ...  # pragma: no cover

    @property
    def error(self) -> BaseException | None:
        """Why the latest keepalive failed (an error, or no answer in time), or ``None``
        if it succeeded: a lease whose deadline passes while this is set ends with
        :attr:`LossReason.UNREACHABLE`, else with ``EXPIRED``."""
        ...  # pragma: no cover
