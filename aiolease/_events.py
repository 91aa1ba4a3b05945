"""Event hooks: what happens to the leases of one backend object, told to observers.

Each backend object has one :class:`Events` registry
(:attr:`~aiolease.abc.Backend.events`, shared with the wrappers around it: the trio bridge,
:class:`~aiolease.testing.faults.FaultyBackend`), so events are counted per backend,
not per :class:`~aiolease.AsyncLock` (which an application may make per request).
:func:`subscribe_all` adds an observer to every backend object, open now or later.

The core checks :attr:`Events.observers` (an empty tuple when nobody listens) before
it works out anything an event carries: with no observer an event costs that one
attribute check. An observer that raises is logged (``aiolease.events``) and never
breaks locking.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ._exceptions import LossReason

if TYPE_CHECKING:
    from ._lease import Lease

__all__ = ["Events", "Observer", "subscribe_all"]

logger = logging.getLogger("aiolease.events")

#: The observers of every backend object (:func:`subscribe_all`).
_everywhere: tuple[Observer, ...] = ()
#: Every registry made so far and still alive, to add a global observer to.
_registries: weakref.WeakSet[Events] = weakref.WeakSet()


class Observer:
    """What happens to the leases of a backend: subclass it and override the methods
    you need (each does nothing here), then :meth:`Events.subscribe` an instance.

    Methods are plain synchronous calls made from the task where it happened (the
    acquiring task, the renewal scheduler's task, the task that released...). They
    must be quick and must not block; an exception is logged and otherwise ignored.
    Times are seconds on the core's monotonic clock (``anyio.current_time()``).
    """

    def acquired(self, lease: Lease, wait: float) -> None:
        """``lease`` was granted, ``wait`` seconds after the acquire sent its first request."""

    def acquire_failed(self, name: str, wait: float, error: BaseException) -> None:
        """An acquire of ``name`` ended without a grant, ``wait`` seconds after its first
        request, with ``error``: :class:`~aiolease.LeaseHeldError` (a try that found it
        held), a :class:`~aiolease.BackendError`, or the cancellation that a timeout or
        the caller's cancel scope delivered (``TimeoutError`` is raised from it later)."""

    def released(self, lease: Lease, held: float) -> None:
        """``lease`` was given up by its holder (the release is being sent), ``held``
        seconds after its grant's request was sent."""

    def lost(self, lease: Lease, reason: LossReason, held: float) -> None:
        """``lease`` ended for ``reason`` (anything but :attr:`LossReason.RELEASED`)
        ``held`` seconds after its grant's request was sent; its work is cancelled."""

    def renewed(self, leases: Sequence[Lease], latency: float) -> None:
        """One renewal round trip confirmed ``leases`` (several when the backend renews
        a batch in one call), ``latency`` seconds after it was sent."""

    def renew_failed(self, lease: Lease, error: BaseException) -> None:
        """A renewal of ``lease`` failed with ``error`` (a backend error or a timeout);
        it is retried until the lease's deadline. A "not owner" answer is a loss
        (:meth:`lost`, :attr:`LossReason.STOLEN`), not a failure."""

    def release_finished(self, name: str, token: int | None, duration: float, freed: bool) -> None:
        """The release of the grant ``token`` of ``name`` came back after ``duration``
        seconds; ``freed``: whether it freed the name. ``token`` is ``None`` for the
        compensating release of an acquire cancelled before its grant was seen."""

    def elected(self, lease: Lease) -> None:
        """An :class:`~aiolease.Elector` of this process started a term (``lease``)."""

    def deposed(self, lease: Lease, reason: LossReason) -> None:
        """The term ``lease`` ended: :attr:`LossReason.RELEASED` when the elector resigned
        or its work returned, else why it was lost."""


class Events:
    """The observers of one backend object's leases: its
    :attr:`~aiolease.abc.Backend.events`. Made by the backend; subscribe to it."""

    __slots__ = ("__weakref__", "_own", "observers")

    def __init__(self) -> None:
        self._own: tuple[Observer, ...] = ()
        #: Who listens now: this backend's observers and :func:`subscribe_all`'s.
        self.observers: tuple[Observer, ...] = _everywhere
        _registries.add(self)

    def __repr__(self) -> str:
        return f"<Events observers={len(self.observers)}>"

    def subscribe(self, observer: Observer) -> Callable[[], None]:
        """Tell ``observer`` what happens to the leases of this backend from now on.

        :returns: a function that unsubscribes it
        :raises InvalidArgument: ``observer`` is not an :class:`Observer`
        """
        _check(observer)
        if observer not in self._own:
            self._own += (observer,)
            self._update()
        return lambda: self.unsubscribe(observer)

    def unsubscribe(self, observer: Observer) -> None:
        """Stop telling ``observer`` (nothing happens if it was not subscribed)."""
        self._own = tuple(o for o in self._own if o is not observer)
        self._update()

    def _update(self) -> None:
        own = tuple(o for o in self._own if o not in _everywhere)
        self.observers = _everywhere + own

    def _emit(self, method: str, *args: object) -> None:
        """Call ``method`` of every observer with ``args``; log what raises."""
        for observer in self.observers:
            try:
                getattr(observer, method)(*args)
            except Exception:  # an observer's bug must not break locking
                logger.exception("observer %r failed in %s()", observer, method)


def _check(observer: object) -> None:
    if not isinstance(observer, Observer):
        from ._exceptions import InvalidArgument

        raise InvalidArgument(
            f"an observer must be an aiolease.Observer, not {type(observer).__name__}"
        )


def subscribe_all(observer: Observer) -> Callable[[], None]:
    """Tell ``observer`` what happens to the leases of every backend object of this
    process, those open now and those opened later.

    :returns: a function that unsubscribes it everywhere
    :raises InvalidArgument: ``observer`` is not an :class:`Observer`
    """
    global _everywhere
    _check(observer)
    if observer not in _everywhere:
        _everywhere += (observer,)
        for events in list(_registries):
            events._update()

    def unsubscribe() -> None:
        global _everywhere
        _everywhere = tuple(o for o in _everywhere if o is not observer)
        for events in list(_registries):
            events._update()

    return unsubscribe
