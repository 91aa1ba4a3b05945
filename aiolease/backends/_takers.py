"""Held leases that a notification of a takeover ends (``on_taken``): shared by the
backends whose servers push grants and releases with their tokens (PostgreSQL's
LISTEN/NOTIFY, MongoDB's change stream)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .._exceptions import LossReason

__all__ = ["Takers", "no_watch"]


def no_watch() -> None:
    """Stops nothing: what ``on_taken`` returns when it set up no watch that needs
    stopping, so that the core runs no watch task either (a permit, say: nobody but
    its holder ends one before its expiry, and its renewals see it lost)."""


@dataclass(eq=False, slots=True)
class _Taker:
    owner: str
    token: int
    taken: Callable[[LossReason], object]


class Takers:
    """Held leases of one backend that notifications of a takeover end (``on_taken``).

    Notifications carry the token they grant or release, and tokens only grow, so
    a late one is told from a new one by its token alone (the listener receives
    notifications late and in commit order: one that arrives after the grant
    returned may still be older). A holder of token ``t`` is taken by a grant of a
    greater token, or by a release of ``t`` or greater (its own release unsubscribes
    it first, so that is somebody else's, in its name). A notification whose token is
    unknown ends nothing; nor do notifications missed while no listener was up: the
    holder's renewals still confirm ownership every renew interval, so such a loss
    is noticed by the next renewal instead.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, list[_Taker]] = {}

    def __len__(self) -> int:
        return sum(len(takers) for takers in self._by_name.values())

    def add(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None]:
        """Watch ``owner``'s grant of ``name`` (``token``); call the returned function to stop."""
        taker = _Taker(owner, token, taken)
        self._by_name.setdefault(name, []).append(taker)

        def cancel() -> None:
            takers = self._by_name.get(name)
            if takers is not None and taker in takers:
                takers.remove(taker)
                if not takers:
                    del self._by_name[name]

        return cancel

    def notified(self, name: str, granted_to: str | None, token: int | None) -> None:
        """A notification: ``name``'s ``token`` was granted to ``granted_to`` (``None``:
        released)."""
        takers = self._by_name.get(name)
        if not takers or token is None:
            return
        for taker in list(takers):
            if token > taker.token or (granted_to is None and token == taker.token):
                takers.remove(taker)
                taker.taken(LossReason.STOLEN)
        if not takers and self._by_name.get(name) is takers:
            del self._by_name[name]
