"""The result of a safety run, and its one-line summary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ._check import Findings
from ._faults import Fault

__all__ = ["SafetyReport", "assert_safe"]


@dataclass(frozen=True)
class SafetyReport:
    """What the harness found for one backend and one fault, over one or more runs.

    :param backend: the backend's label (``sqlite``, ``memory``, a factory's name, ...)
    :param fault: the fault injected
    :param applicable: ``False`` when the fault means nothing for this backend (then
        :attr:`reason` says why, and nothing ran)
    :param reason: why the fault does not apply
    :param runs: how many runs were made
    :param acquisitions: protected bodies that ran
    :param losses: of those, how many lost their lease (the core ended it, not a release)
    :param faults: faults actually injected
    :param overlaps: pairs of bodies of different grants that overlapped, with no
        pause to explain them
    :param paused_overlaps: overlaps involving a holder that was stopped (``SIGSTOP``)
        meanwhile: allowed, and what the fence is for
    :param stale_accepted: writes the fence accepted although a higher token had
        been accepted or registered before (must be 0)
    :param stale_rejected: writes the fence rejected
    :param token_order: bodies whose token did not exceed every earlier body's (must be 0)
    :param bad_stops: bodies that did not stop with ``LeaseLostError`` after a loss
    :param worst_stop_latency: longest time from a loss to its body stopping, seconds
    :param acquire_errors: acquires that failed or timed out (not violations)
    :param errors: what went wrong with the run itself (a worker crashed, records
        disagree with the fence, nothing was acquired, no fault could be injected)
    """

    backend: str
    fault: Fault
    applicable: bool = True
    reason: str = ""
    runs: int = 0
    acquisitions: int = 0
    losses: int = 0
    faults: int = 0
    overlaps: int = 0
    paused_overlaps: int = 0
    stale_accepted: int = 0
    stale_rejected: int = 0
    token_order: int = 0
    bad_stops: int = 0
    worst_stop_latency: float | None = None
    acquire_errors: int = 0
    errors: tuple[str, ...] = field(default=())

    @classmethod
    def not_applicable(cls, backend: str, fault: Fault, reason: str) -> SafetyReport:
        """The report of a fault that means nothing for ``backend``."""
        return cls(backend, fault, applicable=False, reason=reason)

    @classmethod
    def of_run(
        cls,
        backend: str,
        fault: Fault,
        findings: Findings,
        faults: int,
        acquire_errors: int,
        errors: Sequence[str] = (),
    ) -> SafetyReport:
        """The report of one run."""
        return cls(
            backend,
            fault,
            runs=1,
            acquisitions=findings.acquisitions,
            losses=findings.losses,
            faults=faults,
            overlaps=findings.overlaps,
            paused_overlaps=findings.paused_overlaps,
            stale_accepted=findings.stale_accepted,
            stale_rejected=findings.stale_rejected,
            token_order=findings.token_order,
            bad_stops=findings.bad_stops,
            worst_stop_latency=findings.worst_stop_latency,
            acquire_errors=acquire_errors,
            errors=(*findings.problems, *errors),
        )

    @property
    def violations(self) -> int:
        """Overlaps, stale writes accepted, token-order violations and bad stops."""
        return self.overlaps + self.stale_accepted + self.token_order + self.bad_stops

    @property
    def ok(self) -> bool:
        """No violation and no error (a fault that does not apply is ok: it says n/a)."""
        return self.violations == 0 and not self.errors

    def __add__(self, other: SafetyReport) -> SafetyReport:
        """The report of both runs together (same backend and fault)."""
        if (self.backend, self.fault) != (other.backend, other.fault):
            raise ValueError("only reports of the same backend and fault add up")
        latencies = [
            x for x in (self.worst_stop_latency, other.worst_stop_latency) if x is not None
        ]
        return replace(
            self,
            applicable=self.applicable and other.applicable,
            reason=self.reason or other.reason,
            runs=self.runs + other.runs,
            acquisitions=self.acquisitions + other.acquisitions,
            losses=self.losses + other.losses,
            faults=self.faults + other.faults,
            overlaps=self.overlaps + other.overlaps,
            paused_overlaps=self.paused_overlaps + other.paused_overlaps,
            stale_accepted=self.stale_accepted + other.stale_accepted,
            stale_rejected=self.stale_rejected + other.stale_rejected,
            token_order=self.token_order + other.token_order,
            bad_stops=self.bad_stops + other.bad_stops,
            worst_stop_latency=max(latencies, default=None),
            acquire_errors=self.acquire_errors + other.acquire_errors,
            errors=self.errors + other.errors,
        )

    def line(self) -> str:
        """The one-line summary, e.g. ``safety sqlite  sigstop  runs=1 acquisitions=57 ...``."""
        head = f"safety {self.backend:<7} {self.fault.value:<16}"
        if not self.applicable:
            return f"{head} n/a ({self.reason})"
        latency = (
            "-" if self.worst_stop_latency is None else f"{self.worst_stop_latency * 1000:.2f}ms"
        )
        line = (
            f"{head} runs={self.runs} acquisitions={self.acquisitions} losses={self.losses}"
            f" faults={self.faults}"
            f" overlaps={self.overlaps} paused_overlaps={self.paused_overlaps}"
            f" stale_accepted={self.stale_accepted} stale_rejected={self.stale_rejected}"
            f" token_order={self.token_order} bad_stops={self.bad_stops}"
            f" worst_stop_latency={latency}"
        )
        if self.errors:
            line += f" errors={len(self.errors)}"
        return line


def assert_safe(report: SafetyReport, *, min_acquisitions: int = 2) -> None:
    """Assert 0 violations, and that the run proved something: bodies ran, and the
    fault (unless ``none``) was injected. For backend authors' tests.

    :raises AssertionError: with the summary line
    """
    line = report.line()
    assert report.ok and report.applicable, (line, report.errors)
    assert report.overlaps == report.stale_accepted == 0, line
    assert report.token_order == report.bad_stops == 0, line
    assert report.acquisitions >= min_acquisitions, line
    if report.fault is Fault.NONE:
        assert report.faults == 0, line
    else:
        assert report.faults >= 1, line
