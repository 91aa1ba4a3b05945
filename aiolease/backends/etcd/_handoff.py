"""Fair mode: hand-offs between a holder and its successor on one backend, with no request.

A queued key waits for its predecessor's key to go, which a watch reports. When the
predecessor is an entry of the same backend object (another task of the process,
or another lock on the same name), the backend learns of its end first-hand, so the
successor waits on the entry instead: no watch stream, no message.

And when that entry was the holder and this backend deleted its key (a release
whose delete the server confirmed), the successor's key is the first one: keys
are ordered by create revision, the successor's predecessor was the newest key
older than it when it queued, every key created since is newer, and the holder's
was the oldest. The release then *hands* the name to the successor, which takes
its grant without a request (its key rides on its session lease like any grant's).

Any other end of the predecessor (lost with its session, deleted by somebody else,
expired unrenewed, or a release whose outcome is unknown) only wakes the successor,
which asks the server as usual.

A successor whose predecessor is another process's waits on a watch of that key,
and then, as etcd's Mutex does, reads whether any key older than its own is left:
if none is, its key is the first, and it too takes the grant without a transaction
(a read costs etcd no consensus round; the transaction would).
"""

from __future__ import annotations

from ._session import Entry

__all__ = ["Handoffs"]

#: (name, owner, token) of a key.
_Key = tuple[str, str, int]


class Handoffs:
    """The successors waiting on entries of one backend, and the grants handed to them."""

    def __init__(self) -> None:
        self._successors: dict[_Key, tuple[str, int]] = {}
        self._handed: dict[tuple[str, str], int] = {}
        #: Hand-offs made so far.
        self.count = 0

    async def wait(self, predecessor: Entry, owner: str, token: int) -> None:
        """Wait, as ``owner``'s queued key ``token``, until ``predecessor`` ends."""
        key = (predecessor.name, predecessor.owner, predecessor.token)
        me = (owner, token)
        self._successors[key] = me
        try:
            await predecessor.ended.wait()
        finally:
            if self._successors.get(key) == me:
                del self._successors[key]

    def released(self, holder: Entry) -> None:
        """``holder``'s key was deleted by its release while it held the name: hand the
        name to the successor waiting on it, if any."""
        successor = self._successors.pop((holder.name, holder.owner, holder.token), None)
        if successor is not None:
            self._handed[(holder.name, successor[0])] = successor[1]
            self.count += 1

    def hand(self, name: str, owner: str, token: int) -> None:
        """``owner``'s queued key ``token`` was found the first (by a read after its
        predecessor went): its next attempt takes the name without a request."""
        self._handed[(name, owner)] = token

    def take(self, name: str, owner: str) -> int | None:
        """The token of the key handed to ``owner`` (once), or ``None``."""
        return self._handed.pop((name, owner), None) if self._handed else None

    def forget(self, name: str, owner: str) -> None:
        """``owner`` gave up: a hand-off it did not take is void (its key is deleted)."""
        self._handed.pop((name, owner), None)
