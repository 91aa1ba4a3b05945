"""What the safety harness records, and the JSON-lines files it is recorded in.

Each worker appends one JSON object per line to its own file and flushes every
line, so a worker that is paused or killed loses nothing it already did. Lines
have a ``kind``:

``start``    a body began: ``token``, ``attempt`` (when the acquire began), ``start``,
             ``mode`` (``read`` or ``write`` in the read-write form, else absent)
``write``    a write to the fence: ``token``, ``begin``, ``end``, ``accepted``,
             ``seq`` (the fence's log position when accepted), ``register``,
             ``fenced`` (``false``: a write the fence logs but never refuses)
``stop``     the body stopped: ``token``, ``stop``
``end``      the core ended the lease (``Lease._on_end``): ``token``, ``reason``, ``at``
``outcome``  how ``async with`` finished: ``token``, ``outcome``
             (``released``, ``lost`` or ``error``), ``error``
``acquire_error``  an acquire failed or timed out (not a violation): ``error``

All times are ``time.monotonic()``: on Linux one clock for every process on the host.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Accepted", "Hold", "Pause", "Recorder", "Records", "Write", "read_records"]


@dataclass(frozen=True, slots=True)
class Write:
    """One write to the fence, as the writing process saw it.

    :param pid: the writer
    :param token: the fencing token it wrote with
    :param begin: just before the write was sent
    :param end: just after its answer came back
    :param accepted: whether the fence took it
    :param seq: its position in the fence's log, when accepted
    :param register: the first write of a hold (it registers the token)
    :param fenced: whether the fence could refuse it (a semaphore's permits and a
        read-write lock's readers write unfenced: see :mod:`._fence`)
    """

    pid: int
    token: int
    begin: float
    end: float
    accepted: bool
    seq: int | None = None
    register: bool = False
    fenced: bool = True


@dataclass(frozen=True, slots=True)
class Hold:
    """One protected body: from its start to its stop, with how it ended.

    :param pid: the holder
    :param token: the lease's fencing token
    :param attempt: when the acquire that led to it began
    :param start: when the body started (after the registering write)
    :param stop: when the body stopped, ``None`` if the worker never said
    :param outcome: ``released``, ``lost`` (``LeaseLostError``), ``error``, or ``None``
    :param error: the exception that ended it, for ``lost`` and ``error``
    :param reason: the :class:`~aiolease.LossReason` value the core ended the lease with
    :param ended_at: when the core ended the lease (decided it was lost, or released it)
    :param mode: ``read`` or ``write`` in the read-write form, ``None`` otherwise
    """

    pid: int
    token: int
    attempt: float
    start: float
    stop: float | None = None
    outcome: str | None = None
    error: str | None = None
    reason: str | None = None
    ended_at: float | None = None
    mode: str | None = None


@dataclass(frozen=True, slots=True)
class Pause:
    """A window during which the controller kept one process stopped (``SIGSTOP``)."""

    pid: int
    begin: float
    end: float


@dataclass(frozen=True, slots=True)
class Accepted:
    """One entry of the fence's log of accepted writes (``seq`` gives the true order)."""

    seq: int
    pid: int
    token: int
    at: float
    fenced: bool = True


@dataclass(frozen=True, slots=True)
class Records:
    """Everything the workers of one run recorded.

    :param holds: the bodies, in file order
    :param writes: every fence write
    :param acquire_errors: acquires that failed or timed out
    :param problems: lines that could not be understood
    """

    holds: tuple[Hold, ...]
    writes: tuple[Write, ...]
    acquire_errors: int
    problems: tuple[str, ...]


class Recorder:
    """Appends records to one file, one flushed JSON line each.

    :param path: the file (created or appended to)
    :param pid: stamped on every line
    """

    def __init__(self, path: str | os.PathLike[str], pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self._file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def emit(self, kind: str, **fields: Any) -> None:
        """Write one line now (flushed, so a killed process keeps it)."""
        self._file.write(json.dumps({"kind": kind, "pid": self.pid, **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _lines(paths: Iterable[Path]) -> Iterator[tuple[Path, int, str]]:
    for path in paths:
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield path, number, line


def read_records(paths: Iterable[Path]) -> Records:
    """Read and merge the records of every worker file in ``paths``.

    A body's ``start``, ``stop``, ``end`` and ``outcome`` lines are joined on
    ``(pid, token)``. A truncated last line (a worker killed mid-write) is
    reported in :attr:`Records.problems`, not raised.
    """
    holds: dict[tuple[int, int], dict[str, Any]] = {}
    writes: list[Write] = []
    acquire_errors = 0
    problems: list[str] = []
    later: list[tuple[str, int, str, tuple[int, int], dict[str, Any]]] = []
    for path, number, line in _lines(paths):
        try:
            rec = json.loads(line)
            kind = rec.pop("kind")
            key = (int(rec["pid"]), int(rec.get("token", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{path.name}:{number}: unreadable record ({exc})")
            continue
        if kind == "write":
            writes.append(Write(**rec))
        elif kind == "start":
            holds[key] = dict(rec)
        elif kind in ("stop", "end", "outcome"):
            later.append((path.name, number, kind, key, rec))
        elif kind == "acquire_error":
            acquire_errors += 1
        else:
            problems.append(f"{path.name}:{number}: unknown record kind {kind!r}")
    # Joined once every start is known: a lease may end (its loss callback writes
    # "end") before its body starts, when the holder is paused between the grant and
    # the body; such a lease had no body, and its "end" or "outcome" belongs to none.
    for file, number, kind, key, rec in later:
        if key not in holds:
            if kind == "stop":
                problems.append(f"{file}:{number}: stop of a body that never started")
            continue
        rec.pop("pid")
        rec.pop("token")
        if kind == "end":
            rec = {"reason": rec["reason"], "ended_at": rec["at"]}
        holds[key].update(rec)
    return Records(
        tuple(Hold(**h) for h in holds.values()), tuple(writes), acquire_errors, tuple(problems)
    )
