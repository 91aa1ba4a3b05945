"""Per-name events that wake the tasks of one backend waiting for a change."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Wakeups"]


@dataclass
class _Waiters:
    event: asyncio.Event = field(default_factory=asyncio.Event)
    count: int = 0


class Wakeups:
    """Per-name events that wake the tasks waiting in ``wait_changed`` of one backend."""

    def __init__(self) -> None:
        self._waiters: dict[str, _Waiters] = {}

    @contextmanager
    def watching(self, name: str) -> Iterator[asyncio.Event]:
        """An event set by the next :meth:`wake` of ``name`` (or :meth:`wake_all`)."""
        entry = self._waiters.get(name)
        if entry is None:
            entry = self._waiters[name] = _Waiters()
        entry.count += 1
        try:
            yield entry.event
        finally:
            entry.count -= 1
            if entry.count == 0 and self._waiters.get(name) is entry:
                del self._waiters[name]

    def wake(self, name: str) -> None:
        """Wake every task watching ``name``."""
        entry = self._waiters.pop(name, None)
        if entry is not None:
            entry.event.set()

    def wake_all(self) -> None:
        """Wake every watching task (after missed notifications, or on close)."""
        entries, self._waiters = self._waiters, {}
        for entry in entries.values():
            entry.event.set()
