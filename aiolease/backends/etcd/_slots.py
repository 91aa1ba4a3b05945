"""Which key an attempt writes: the slots of one etcd backend object (see
:mod:`._keys`).

A lock attempt in non-fair mode, and every permit request, writes its key in a slot
of the backend object's (``<random>.<n>``; a permit request's ``permit:<random>.<n>``,
its queue key ``permit:q`` and that), reused by a later attempt of the same name once
the backend has seen the key (a permit request's: both keys) deleted: etcd keeps every
deleted key in its index until it compacts, and each acquire ranges over the name's
keys, so a fresh key per attempt would make every acquire slower. In fair mode a lock
attempt's slot is its owner id, never reused. An attempt whose request may still
arrive (its reply was lost) is *unsure*: its slot is never reused.
"""

from __future__ import annotations

import itertools
import random

from ..._permits import PERMIT_PREFIX, is_permit_owner
from ._keys import permit_slot
from ._session import SEEN_LIMIT, Entry

__all__ = ["PERMIT_SPARE_SLOTS", "SPARE_SLOTS", "Slots"]

#: Non-fair mode: how many deleted keys' slots are kept per name, to be reused.
SPARE_SLOTS = 4
#: The same for permits (any mode): a name has a slot per request in flight through the
#: backend, held or queued; past this many at once, the slots over it are not kept.
PERMIT_SPARE_SLOTS = 64


class Slots:
    """The slots of one backend object's attempts.

    :param fair: the backend's mode (fair: a lock attempt's slot is its owner id)
    """

    def __init__(self, fair: bool) -> None:
        self._fair = fair
        #: Non-fair mode, and permits: the slot of each attempt made here whose key may
        #: exist, until it is released (a permit request's: the slot of its permit key);
        #: ``""``: the attempt was refused (wrote nothing).
        self._slots: dict[tuple[str, str], str] = {}
        #: Slots of each name (and whether of its permits) whose keys are known to be
        #: deleted, to reuse.
        self._spare: dict[tuple[str, bool], list[str]] = {}
        #: New slots are ``<this>.<n>`` (``permit:<this>.<n>``), apart from any other
        #: backend's (and from owner ids).
        self._base = f"{random.getrandbits(64):016x}."
        self._ids = itertools.count()
        #: Whether slots are reused (not once an attempt in doubt was forgotten).
        self._reuse = True
        #: Attempts whose request may still arrive.
        self._unsure: dict[tuple[str, str], None] = {}

    def known(self, name: str, owner: str, entry: Entry | None) -> str | None:
        """The slot of ``owner``'s key of ``name`` (a permit request's: of its permit key,
        the slot of its queue key is :func:`._keys.queue_slot` of it), if this backend
        knows it (``""`` or ``None``: it does not); ``entry``: the attempt's, if held or
        queued here."""
        if is_permit_owner(owner):
            return permit_slot(entry.slot) if entry is not None else self._slots.get((name, owner))
        if entry is not None:
            return entry.slot
        if self._fair:
            return owner  # slots are owner ids only: never reused
        return self._slots.get((name, owner))

    def take(self, name: str, owner: str, entry: Entry | None) -> str:
        """The slot for an attempt of ``owner``: the one it has (fair mode: its owner id),
        else a spare one, else a new one; a permit request's (whatever the mode) is
        ``permit:<this>.<n>``, the slot of its permit key.

        Slots are this backend's own (never an owner id, which another attempt could use
        as well), and each is ``owner``'s alone from here until the backend's release sees
        its key deleted (a permit request's keys, both): only then may another attempt
        write it."""
        known = self.known(name, owner, entry)
        if known:
            return known
        permit = is_permit_owner(owner)
        spare = self._spare.get((name, permit))
        if spare and (name, owner) not in self._unsure:
            slot = spare.pop()
        else:
            slot = f"{PERMIT_PREFIX if permit else ''}{self._base}{next(self._ids)}"
        if len(self._slots) >= SEEN_LIMIT:
            del self._slots[next(iter(self._slots))]
        self._slots[(name, owner)] = slot
        return slot

    def refused(self, name: str, owner: str, held: bool) -> None:
        """Non-fair mode: ``owner``'s attempt was refused, and wrote nothing: its slot is
        free again (unless ``held``: an entry of it lives here)."""
        if (name, owner) in self._unsure or held:
            return
        slot = self._slots.get((name, owner))
        if slot:
            self.spare(name, slot)
            self._slots[(name, owner)] = ""

    def released(self, name: str, owner: str, slot: str) -> None:
        """``owner``'s key of ``name`` in ``slot`` is deleted, and no request of the
        attempt can still arrive: another attempt may write it."""
        self._slots.pop((name, owner), None)
        self.spare(name, slot)

    def spare(self, name: str, slot: str) -> None:
        """``slot``'s key of ``name`` (a permit request's: both its keys) is deleted, and
        nothing can write it any more."""
        if not self._reuse:
            return
        permit = is_permit_owner(slot)  # (a permit's slot starts as its owner ids do)
        spare = self._spare.get((name, permit))
        if spare is None:
            if len(self._spare) >= SEEN_LIMIT:
                del self._spare[next(iter(self._spare))]
            spare = self._spare[(name, permit)] = []
        if len(spare) < (PERMIT_SPARE_SLOTS if permit else SPARE_SLOTS) and slot not in spare:
            spare.append(slot)

    def unsure(self, name: str, owner: str) -> None:
        """A request for ``owner``'s key of ``name`` may still arrive: its slot is never
        reused."""
        if len(self._unsure) >= SEEN_LIMIT:
            del self._unsure[next(iter(self._unsure))]
            self._reuse = False  # that attempt's slot could be reused: reuse none from now on
        self._unsure[(name, owner)] = None

    def settle(self, name: str, owner: str) -> bool:
        """Whether ``owner``'s attempt at ``name`` was unsure (it is not any more: the
        caller deletes its key once more, later)."""
        return self._unsure.pop((name, owner), False) is None
