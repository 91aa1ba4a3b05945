"""The SQLite backend's own thread (``_sqlite_thread``): where its calls run in an
asyncio task, when it ends, and what a call's failure does."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

from aiolease._permits import permit_owner
from aiolease.abc import Grant
from aiolease.backends import _sqlite_thread
from aiolease.backends._sqlite_thread import ConnectionThread
from aiolease.backends.sqlite import SQLiteBackend

TTL = 5.0


def _threads(name: str) -> list[threading.Thread]:
    """The live threads named ``name`` (the names here are the tests' own)."""
    return [t for t in threading.enumerate() if t.name == name]


async def _ended(thread: threading.Thread) -> bool:
    """Whether ``thread`` ends within 10 s (a hang guard, not a speed figure)."""
    await anyio.to_thread.run_sync(thread.join, 10.0)
    return not thread.is_alive()


def _spy_on_acquires(backend: SQLiteBackend) -> list[threading.Thread]:
    """The threads that the backend's permit acquires run on, as they run."""
    ran_on: list[threading.Thread] = []
    real = backend._permits.acquire

    def spy(*args: object) -> object:
        ran_on.append(threading.current_thread())
        return real(*args)  # type: ignore[arg-type]

    backend._permits.acquire = spy  # type: ignore[method-assign,assignment]
    return ran_on


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_calls_run_on_the_backends_own_thread_until_it_closes(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with SQLiteBackend(str(tmp_path / "t.db")) as backend:
        ran_on = _spy_on_acquires(backend)
        for owner in (permit_owner(), permit_owner()):
            granted = await backend.try_acquire_permit("p", owner, TTL, "me", {}, 2, 1)
            assert isinstance(granted, Grant)
        first, second = ran_on
        assert first is second and first.name == backend._thread._name
        assert first is not threading.current_thread()
    assert await _ended(first)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_under_trio_anyio_runs_the_calls(anyio_backend: str, tmp_path: Path) -> None:
    async with SQLiteBackend(str(tmp_path / "t.db")) as backend:
        ran_on = _spy_on_acquires(backend)
        granted = await backend.try_acquire_permit("p", permit_owner(), TTL, "me", {}, 2, 1)
        assert isinstance(granted, Grant)
        (thread,) = ran_on
        assert thread.name != backend._thread._name
        assert thread is not threading.current_thread()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_idle_thread_ends_and_the_next_call_starts_another(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_sqlite_thread, "IDLE", 0.01)
    worker = ConnectionThread("aiolease-test-idle")
    assert await worker.run(threading.get_ident) != threading.get_ident()
    (first,) = _threads("aiolease-test-idle")
    assert await _ended(first)
    assert not worker._alive
    assert await worker.run(lambda: 7) == 7
    (second,) = _threads("aiolease-test-idle")
    assert second is not first
    worker.stop()
    assert await _ended(second)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_calls_exception_is_raised_to_its_caller(anyio_backend: str) -> None:
    worker = ConnectionThread("aiolease-test-error")

    def fail() -> None:
        raise LookupError("from the thread")

    with pytest.raises(LookupError, match="from the thread"):
        await worker.run(fail)
    with pytest.raises(RuntimeError, match="StopIteration"):  # a future refuses it as is
        await worker.run(next, iter(()))
    assert await worker.run(lambda: "still serving") == "still serving"
    (thread,) = _threads("aiolease-test-error")
    worker.stop()
    assert await _ended(thread)
