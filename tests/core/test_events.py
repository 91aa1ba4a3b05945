"""Event hooks (:class:`aiolease.Observer` on ``backend.events``) and the fields of
aiolease's log records, on the memory backend (the faults through
:class:`FaultyBackend`), under asyncio and trio.

Every loss reason is provoked without a sleep: a release, a takeover (a record dropped
as an operator would, then granted to another), a deadline that passes with no
renewal sent, one that passes with the renewals unanswered, a failing health probe,
and the backend's close.
"""

from __future__ import annotations

import logging

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, Elector, Lease, LeaseLostError, LossReason, Observer
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.faults import FaultyBackend
from tests.support import Recorder, raises

pytestmark = pytest.mark.anyio


def lost_reasons(recorder: Recorder) -> list[LossReason]:
    return [event[2] for event in recorder.log if event[0] == "lost"]


async def test_a_wait_a_hold_and_a_release(anyio_backend: str) -> None:
    backend = FaultyBackend(MemoryBackend())
    recorder = Recorder()
    backend.events.subscribe(recorder)
    lock = AsyncLock(backend, "jobs/1", ttl=30)
    first = await lock.acquire()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lock.acquire)
        await backend.wait_called("wait_turn")  # refused, the waiter waits now
        await first.release()
    kinds = recorder.kinds()
    assert kinds == ["acquired", "released", "release_finished", "acquired"]
    _, lease, wait = recorder.log[0]
    assert lease is first and wait >= 0
    assert recorder.log[1][1] is first and recorder.log[1][2] > 0
    assert recorder.log[2][1:] == ("jobs/1", first.token, recorder.log[2][3], True)
    second, waited = recorder.log[3][1], recorder.log[3][2]
    assert second.token > first.token
    # The second acquire waited for the first lease: its wait covers the release.
    assert waited > 0


async def test_acquires_that_end_without_a_grant(anyio_backend: str) -> None:
    backend = FaultyBackend(MemoryBackend())
    recorder = Recorder()
    backend.events.subscribe(recorder)
    lock = AsyncLock(backend, "busy", ttl=30)
    async with lock:
        with pytest.raises(aiolease.LeaseHeldError):
            await AsyncLock(backend, "busy", ttl=30).acquire_nowait()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lock.acquire)
            await backend.wait_called("wait_turn")
            tg.cancel_scope.cancel()
    failed = [e for e in recorder.log if e[0] == "acquire_failed"]
    assert [(e[1], type(e[3])) for e in failed] == [
        ("busy", aiolease.LeaseHeldError),
        ("busy", anyio.get_cancelled_exc_class()),
    ]
    assert all(e[2] >= 0 for e in failed)


async def test_no_observer_no_event_and_unsubscribe(anyio_backend: str) -> None:
    backend = MemoryBackend()
    assert backend.events.observers == ()
    recorder = Recorder()
    unsubscribe = backend.events.subscribe(recorder)
    backend.events.subscribe(recorder)  # twice: told once
    async with AsyncLock(backend, "a", ttl=30):
        pass
    unsubscribe()
    assert backend.events.observers == ()
    async with AsyncLock(backend, "a", ttl=30):
        pass
    assert recorder.kinds() == ["acquired", "released", "release_finished"]


async def test_wrappers_share_the_events_of_the_backend_they_wrap(anyio_backend: str) -> None:
    inner = MemoryBackend()
    faulty = FaultyBackend(inner)
    assert faulty.events is inner.events
    recorder = Recorder()
    faulty.events.subscribe(recorder)
    async with AsyncLock(inner, "a", ttl=30), AsyncLock(faulty, "b", ttl=30):
        pass
    assert [e[1].name for e in recorder.log if e[0] == "acquired"] == ["a", "b"]


async def test_subscribe_all_reaches_every_backend(anyio_backend: str) -> None:
    recorder = Recorder()
    before = MemoryBackend()
    _ = before.events  # made before the global subscription
    unsubscribe = aiolease.subscribe_all(recorder)
    try:
        after = MemoryBackend()
        async with AsyncLock(before, "a", ttl=30), AsyncLock(after, "b", ttl=30):
            pass
    finally:
        unsubscribe()
    assert before.events.observers == () and after.events.observers == ()
    assert sorted(e[1].name for e in recorder.log if e[0] == "released") == ["a", "b"]


async def test_a_failing_observer_breaks_nothing(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(Observer):
        def acquired(self, lease: Lease, wait: float) -> None:
            raise RuntimeError("observer bug")

    backend = MemoryBackend()
    backend.events.subscribe(Broken())
    recorder = Recorder()
    backend.events.subscribe(recorder)
    with caplog.at_level(logging.ERROR, logger="aiolease.events"):
        async with AsyncLock(backend, "a", ttl=30) as lease:
            assert lease.lost is None
    assert recorder.kinds() == ["acquired", "released", "release_finished"]
    (record,) = [r for r in caplog.records if r.name == "aiolease.events"]
    assert "acquired" in record.getMessage() and record.exc_info is not None


async def test_only_observers_subscribe(anyio_backend: str) -> None:
    with pytest.raises(aiolease.InvalidArgument):
        MemoryBackend().events.subscribe(print)  # type: ignore[arg-type]
    with pytest.raises(aiolease.InvalidArgument):
        aiolease.subscribe_all(object())  # type: ignore[arg-type]


# -- losses, by reason -----------------------------------------------------------------


async def test_stolen(anyio_backend: str) -> None:
    backend = MemoryBackend()
    recorder = Recorder()
    backend.events.subscribe(recorder)
    with raises(LeaseLostError):
        async with AsyncLock(backend, "a", ttl=30):
            backend.force_release("a")  # as an operator would; then another takes it
            await AsyncLock(backend, "a", ttl=30).acquire()
            await anyio.sleep_forever()
    assert lost_reasons(recorder) == [LossReason.STOLEN]


async def test_expired(anyio_backend: str) -> None:
    backend = MemoryBackend()
    recorder = Recorder()
    backend.events.subscribe(recorder)
    lease = await AsyncLock(backend, "a", ttl=0.2).acquire()  # never renewed
    assert await lease.wait_lost() is LossReason.EXPIRED
    _, lost, reason, held = recorder.log[-1]
    assert (lost, reason) == (lease, LossReason.EXPIRED)
    assert held >= 0.2 - lease.timing.margin


async def test_unreachable_after_failed_renewals(anyio_backend: str) -> None:
    faulty = FaultyBackend(MemoryBackend())
    recorder = Recorder()
    faulty.events.subscribe(recorder)
    lock = AsyncLock(faulty, "a", ttl=0.3, renew_interval=0.05)
    with raises(LeaseLostError):
        async with lock:
            await recorder.next("renewed")  # one renewal goes through
            faulty.fail("renew")
            await anyio.sleep_forever()
    assert lost_reasons(recorder) == [LossReason.UNREACHABLE]
    failures = [e for e in recorder.log if e[0] == "renew_failed"]
    assert failures and all(isinstance(e[2], aiolease.BackendUnavailable) for e in failures)
    assert len(failures) == lock.statistics().renew_failures


async def test_renewal_rounds_carry_every_lease_of_a_batch(anyio_backend: str) -> None:
    backend = MemoryBackend()
    assert backend.renews_many
    recorder = Recorder()
    backend.events.subscribe(recorder)
    async with AsyncLock(backend, "a", ttl=1, renew_interval=0.1) as a:
        async with AsyncLock(backend, "b", ttl=1, renew_interval=0.1) as b:
            while not any(e[0] == "renewed" and len(e[1]) == 2 for e in recorder.log):
                await recorder.next("renewed")
    (leases, latency) = next(e[1:] for e in recorder.log if e[0] == "renewed" and len(e[1]) == 2)
    assert set(leases) == {a, b} and latency >= 0


async def test_unhealthy_and_leader_transitions(anyio_backend: str) -> None:
    backend = MemoryBackend()
    recorder = Recorder()
    backend.events.subscribe(recorder)
    healthy = True
    elector = Elector(
        backend, "leader", ttl=30, health=lambda: healthy, health_interval=0.02, health_failures=1
    )
    with raises(LeaseLostError):
        async with elector.leadership() as lease:
            assert recorder.kinds()[-1] == "elected"
            healthy = False
            await anyio.sleep_forever()
    assert lost_reasons(recorder) == [LossReason.UNHEALTHY]
    assert recorder.log[-1] == ("deposed", lease, LossReason.UNHEALTHY)
    healthy = True
    async with elector.leadership() as second:
        pass
    assert recorder.log[-1] == ("deposed", second, LossReason.RELEASED)
    assert recorder.kinds().count("elected") == 2


async def test_shutdown(anyio_backend: str) -> None:
    backend = MemoryBackend()
    recorder = Recorder()
    backend.events.subscribe(recorder)
    with raises(LeaseLostError):
        async with AsyncLock(backend, "a", ttl=30):
            await backend.aclose()
    assert lost_reasons(recorder) == [LossReason.SHUTDOWN]


# -- log records -----------------------------------------------------------------------


def fields(record: logging.LogRecord) -> tuple[object, object, object]:
    """The ``extra`` fields aiolease puts on its log records about a lease."""
    return tuple(getattr(record, f"aiolease_{key}") for key in ("name", "token", "reason"))


async def test_log_records_carry_name_token_and_reason(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = MemoryBackend()
    with caplog.at_level(logging.INFO, logger="aiolease"), raises(LeaseLostError):
        async with AsyncLock(backend, "jobs/7", ttl=30) as lease:
            backend.force_release("jobs/7")
            await AsyncLock(backend, "jobs/7", ttl=30).acquire()
            await anyio.sleep_forever()
    (record,) = [r for r in caplog.records if "lost" in r.getMessage()]
    assert record.name == "aiolease.lease"
    assert fields(record) == ("jobs/7", lease.token, "stolen")


async def test_renewal_failures_are_logged_with_the_lease(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    faulty = FaultyBackend(MemoryBackend())
    recorder = Recorder()
    faulty.events.subscribe(recorder)
    with caplog.at_level(logging.INFO, logger="aiolease"):
        async with AsyncLock(faulty, "a", ttl=30, renew_interval=0.05) as lease:
            faulty.fail("renew", times=1)
            await recorder.next("renew_failed")
    (record,) = [r for r in caplog.records if r.name == "aiolease.renewer"]
    assert fields(record) == ("a", lease.token, None)
