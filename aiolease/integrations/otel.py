"""OpenTelemetry metrics and spans for aiolease (``pip install 'aiolease[otel]'``).

:func:`instrument` subscribes an :class:`Instrumentation` (an
:class:`~aiolease.Observer`) to one backend object, or to every one. It records these
metrics on the meter provider given (default: the global one), with the attribute
``aiolease.backend`` (the backend's kind, :func:`backend_kind`) and, only when
``lock_names`` asks for it, ``aiolease.lock.name``:

* ``aiolease.lock.acquire.duration``, ``aiolease.lock.hold.duration`` (with
  ``aiolease.loss.reason``) and ``aiolease.lock.renew.duration``: histograms, in
  seconds;
* ``aiolease.lock.renew.failures`` and ``aiolease.lock.losses`` (with
  ``aiolease.loss.reason``): counters;
* ``aiolease.lock.held``: an up-down counter of the leases held now;
* ``aiolease.elector.is_leader`` (an up-down counter) and
  ``aiolease.elector.transitions`` (a counter, with ``aiolease.election.change``),
  both with ``aiolease.election.name``.

And the spans ``aiolease.acquire`` (with an error status when no grant came),
``aiolease.renew`` (one per renewal round trip: per batch where the backend batches)
and ``aiolease.release`` on the tracer provider given (default: the global one), with
the name and the fencing token.
``docs/observability.md`` has the tables. The core never imports this module, nor
OpenTelemetry.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from .. import __version__
from .._events import Events, Observer, subscribe_all
from .._exceptions import InvalidArgument, LossReason
from .._lease import Lease
from ..abc import Backend, WrappingBackend

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = ["BUCKETS", "Instrumentation", "backend_kind", "instrument"]

#: Histogram bucket boundaries in seconds (OpenTelemetry's advice for durations).
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)

_SCOPE = "aiolease"
_kinds: dict[type[Backend], str] = {}


def backend_kind(backend: Backend) -> str:
    """The kind of ``backend`` for the ``aiolease.backend`` attribute: the package under
    ``aiolease.backends`` (``"redis"``, ``"memory"``...), else the class name in lower
    case without a ``Backend`` suffix; through wrappers, the wrapped backend's."""
    while isinstance(backend, WrappingBackend):
        backend = backend.inner
    cls = type(backend)
    kind = _kinds.get(cls)
    if kind is None:
        parts = cls.__module__.split(".")
        if parts[:2] == ["aiolease", "backends"] and len(parts) > 2:
            kind = parts[2]
        else:
            kind = cls.__name__.lower().removesuffix("backend") or cls.__name__.lower()
        _kinds[cls] = kind
    return kind


def _error_type(error: BaseException) -> str:
    """The ``error.type`` of a failed acquire: the exception's class name, or
    ``cancelled`` for a cancellation (a timeout, or the caller's cancel scope)."""
    try:
        cancelled = isinstance(error, anyio.get_cancelled_exc_class())
    except Exception:  # no async library running: not a cancellation of one
        cancelled = False
    return "cancelled" if cancelled else type(error).__name__


def _import_otel() -> Any:
    try:
        from opentelemetry import context, metrics, trace
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise ImportError(
            "aiolease.integrations.otel needs OpenTelemetry: pip install 'aiolease[otel]'"
        ) from None
    return context, metrics, trace


class Instrumentation(Observer):
    """Records aiolease's metrics and spans with OpenTelemetry (see the module docstring).

    :param meter_provider: where the metrics go (default: the global provider)
    :param tracer_provider: where the spans go (default: the global provider)
    :param lock_names: add ``aiolease.lock.name`` to the lock metrics: ``True`` for the
        name itself, or a function from the name to a label (a name the function maps to
        ``None`` gets no attribute). Off by default: a name per request would make a
        time series per request. Spans carry the name either way.
    :raises InvalidArgument: ``lock_names`` is neither a bool nor callable
    """

    def __init__(
        self,
        *,
        meter_provider: MeterProvider | None = None,
        tracer_provider: TracerProvider | None = None,
        lock_names: bool | Callable[[str], str | None] = False,
    ) -> None:
        context, metrics, trace = _import_otel()
        if not isinstance(lock_names, bool) and not callable(lock_names):
            raise InvalidArgument("lock_names must be a bool or a function of the name")
        self._label = (lambda name: name) if lock_names is True else (lock_names or None)
        self._context = context
        self._status = trace.Status
        self._error_code = trace.StatusCode.ERROR
        self._unsubscribe: list[Callable[[], None]] = []
        meter = metrics.get_meter(_SCOPE, __version__, meter_provider=meter_provider)
        self._tracer = trace.get_tracer(_SCOPE, __version__, tracer_provider=tracer_provider)

        def histogram(name: str, description: str) -> Any:
            return meter.create_histogram(
                name, unit="s", description=description, explicit_bucket_boundaries_advisory=BUCKETS
            )

        self._acquire = histogram(
            "aiolease.lock.acquire.duration", "Time from an acquire's first request to its grant"
        )
        self._hold = histogram(
            "aiolease.lock.hold.duration", "Time a lease was held, from its grant's request"
        )
        self._renew = histogram(
            "aiolease.lock.renew.duration", "Round trip of one renewal (of one lease or a batch)"
        )
        self._renew_failures = meter.create_counter(
            "aiolease.lock.renew.failures", unit="{failure}", description="Failed renewals"
        )
        self._losses = meter.create_counter(
            "aiolease.lock.losses", unit="{lease}", description="Leases lost, by reason"
        )
        self._held = meter.create_up_down_counter(
            "aiolease.lock.held", unit="{lease}", description="Leases held now"
        )
        self._leader = meter.create_up_down_counter(
            "aiolease.elector.is_leader", unit="{leader}", description="1 while leading"
        )
        self._transitions = meter.create_counter(
            "aiolease.elector.transitions",
            unit="{change}",
            description="Terms started (elected) and ended (deposed)",
        )
        # Leases counted in aiolease.lock.held (with their attributes) and is_leader: an
        # end is counted only for a start that was (an observer subscribed mid-lease
        # sees only the end).
        self._holding: weakref.WeakKeyDictionary[Lease, dict[str, str]] = (
            weakref.WeakKeyDictionary()
        )
        self._leading: weakref.WeakSet[Lease] = weakref.WeakSet()

    def _attributes(self, lease: Lease) -> dict[str, str]:
        attributes = {"aiolease.backend": backend_kind(lease.backend)}
        if self._label is not None:
            label = self._label(lease.name)
            if label is not None:
                attributes["aiolease.lock.name"] = label
        return attributes

    def _span(
        self,
        name: str,
        duration: float,
        attributes: dict[str, Any],
        *,
        root: bool = False,
        error: BaseException | None = None,
    ) -> None:
        """A span that ended now and lasted ``duration`` seconds (``root``: of a trace
        of its own, not the current one; ``error``: it failed with that)."""
        end = time.time_ns()
        span = self._tracer.start_span(
            name,
            context=self._context.Context() if root else None,
            attributes=attributes,
            start_time=end - int(duration * 1e9),
        )
        if error is not None:
            span.set_status(self._status(self._error_code, repr(error)))
        span.end(end_time=end)

    @staticmethod
    def _lease_attributes(lease: Lease) -> dict[str, Any]:
        return {
            "aiolease.lock.name": lease.name,
            "aiolease.lease.token": lease.token,
            "aiolease.backend": backend_kind(lease.backend),
        }

    # -- the events -------------------------------------------------------------------

    def acquired(self, lease: Lease, wait: float) -> None:
        attributes = self._attributes(lease)
        self._acquire.record(wait, attributes)
        self._held.add(1, attributes)
        self._holding[lease] = attributes
        self._span("aiolease.acquire", wait, self._lease_attributes(lease))

    def acquire_failed(self, name: str, wait: float, error: BaseException) -> None:
        self._span(
            "aiolease.acquire",
            wait,
            {"aiolease.lock.name": name, "error.type": _error_type(error)},
            error=error,
        )

    def released(self, lease: Lease, held: float) -> None:
        self._ended(lease, LossReason.RELEASED, held)

    def lost(self, lease: Lease, reason: LossReason, held: float) -> None:
        self._losses.add(1, self._ended(lease, reason, held))

    def _ended(self, lease: Lease, reason: LossReason, held: float) -> dict[str, str]:
        """Record the end of ``lease``; return its attributes with the reason."""
        attributes = self._holding.pop(lease, None)
        if attributes is None:
            attributes = self._attributes(lease)
        else:
            self._held.add(-1, attributes)
        ended = {**attributes, "aiolease.loss.reason": reason.value}
        self._hold.record(held, ended)
        return ended

    def renewed(self, leases: Sequence[Lease], latency: float) -> None:
        first = leases[0]
        kind = backend_kind(first.backend)
        self._renew.record(latency, {"aiolease.backend": kind})
        attributes: dict[str, Any] = (
            self._lease_attributes(first) if len(leases) == 1 else {"aiolease.backend": kind}
        )
        attributes["aiolease.lease.count"] = len(leases)
        self._span("aiolease.renew", latency, attributes, root=True)

    def renew_failed(self, lease: Lease, error: BaseException) -> None:
        self._renew_failures.add(1, self._attributes(lease))

    def release_finished(self, name: str, token: int | None, duration: float, freed: bool) -> None:
        attributes: dict[str, Any] = {"aiolease.lock.name": name, "aiolease.release.freed": freed}
        if token is not None:
            attributes["aiolease.lease.token"] = token
        self._span("aiolease.release", duration, attributes)

    def elected(self, lease: Lease) -> None:
        self._leading.add(lease)
        self._leader.add(1, self._election(lease))
        self._transitions.add(1, {**self._election(lease), "aiolease.election.change": "elected"})

    def deposed(self, lease: Lease, reason: LossReason) -> None:
        if lease in self._leading:
            self._leading.discard(lease)
            self._leader.add(-1, self._election(lease))
        self._transitions.add(1, {**self._election(lease), "aiolease.election.change": "deposed"})

    @staticmethod
    def _election(lease: Lease) -> dict[str, str]:
        return {
            "aiolease.backend": backend_kind(lease.backend),
            "aiolease.election.name": lease.name,
        }

    # -- installing -------------------------------------------------------------------

    def uninstrument(self) -> None:
        """Stop recording (unsubscribe from every backend :func:`instrument` added it to)."""
        unsubscribe, self._unsubscribe = self._unsubscribe, []
        for undo in unsubscribe:
            undo()


def instrument(
    backend: Backend | None = None,
    *,
    meter_provider: MeterProvider | None = None,
    tracer_provider: TracerProvider | None = None,
    lock_names: bool | Callable[[str], str | None] = False,
) -> Instrumentation:
    """Record the metrics and spans of ``backend``'s leases (``None``: of every backend
    object of this process, open now or later) with OpenTelemetry.

    :returns: the :class:`Instrumentation`; call its :meth:`~Instrumentation.uninstrument`
        to stop
    :raises InvalidArgument: ``backend`` is not a :class:`~aiolease.Backend`, or a bad
        ``lock_names``
    """
    if backend is not None and not isinstance(backend, Backend):
        raise InvalidArgument(f"backend must be an aiolease Backend, not {type(backend).__name__}")
    instrumentation = Instrumentation(
        meter_provider=meter_provider, tracer_provider=tracer_provider, lock_names=lock_names
    )
    events: Events | None = None if backend is None else backend.events
    undo = subscribe_all(instrumentation) if events is None else events.subscribe(instrumentation)
    instrumentation._unsubscribe.append(undo)
    return instrumentation
