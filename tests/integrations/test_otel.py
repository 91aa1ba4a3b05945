"""OpenTelemetry metrics and spans (:mod:`aiolease.integrations.otel`), read back with
the SDK's in-memory metric reader and span exporter after a scripted scenario: a wait,
a hold, and a loss by each reason (as in ``tests/core/test_events.py``, without a
sleep); on the memory backend, and once on a real Redis server, whose renewals are
batched. And the Prometheus scrape that ``docs/observability.md`` shows, run as written.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import aiolease
from aiolease import AsyncLock, Elector, LeaseLostError, LossReason
from aiolease.backends.memory import MemoryBackend
from aiolease.integrations.otel import Instrumentation, backend_kind, instrument
from aiolease.testing.faults import FaultyBackend
from tests.backends.redis.support import prefix_fixture
from tests.support import Recorder, raises

pytestmark = pytest.mark.anyio

DOCS = Path(__file__).parents[2] / "docs" / "observability.md"


@dataclass
class Otel:
    """An SDK meter provider and tracer provider that keep what they get in memory."""

    reader: InMemoryMetricReader
    spans: InMemorySpanExporter
    meter_provider: MeterProvider
    tracer_provider: TracerProvider

    def metric(self, name: str) -> list[Any]:
        """The data points of metric ``name`` now."""
        data = self.reader.get_metrics_data()
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        return list(metric.data.data_points)
        return []

    def by(self, name: str, key: str) -> dict[object, Any]:
        """Each data point of ``name`` by its attribute ``key``."""
        return {point.attributes.get(key): point for point in self.metric(name)}

    def finished(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans.get_finished_spans() if span.name == name]

    def instrument(self, backend: aiolease.Backend, **options: Any) -> Instrumentation:
        return instrument(
            backend,
            meter_provider=self.meter_provider,
            tracer_provider=self.tracer_provider,
            **options,
        )


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


@pytest.fixture
def otel() -> Iterator[Otel]:
    reader = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Otel(reader, spans, meter_provider, tracer_provider)
    meter_provider.shutdown()
    tracer_provider.shutdown()


async def scenario(backend: FaultyBackend, recorder: Recorder) -> None:
    """Eight grants: a wait, a hold, and one loss by each reason, the last at the close."""
    lock = AsyncLock(backend, "wait", ttl=30)
    first = await lock.acquire()

    async def waiter() -> None:
        await (await lock.acquire()).release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await backend.wait_called("wait_turn")
        await first.release()
    taken: list[aiolease.Lease] = []

    async def take() -> None:  # in a task of its own: the holder's block is cancelled
        taken.append(await AsyncLock(backend, "stolen", ttl=30).acquire())

    async with anyio.create_task_group() as tg:
        with raises(LeaseLostError):  # STOLEN
            async with AsyncLock(backend, "stolen", ttl=30):
                backend.inner.force_release("stolen")  # type: ignore[attr-defined]
                tg.start_soon(take)
                await anyio.sleep_forever()
    await taken[0].release()
    expiring = await AsyncLock(backend, "expired", ttl=0.2).acquire()
    assert await expiring.wait_lost() is LossReason.EXPIRED
    with raises(LeaseLostError):  # UNREACHABLE
        async with AsyncLock(backend, "unreachable", ttl=0.3, renew_interval=0.05):
            await recorder.next("renewed")
            backend.fail("renew")
            await anyio.sleep_forever()
    backend.heal()
    healthy = True
    elector = Elector(backend, "leader", ttl=30, health=lambda: healthy, health_interval=0.02)
    with raises(LeaseLostError):  # UNHEALTHY
        async with elector.leadership():
            healthy = False
            await anyio.sleep_forever()
    with raises(LeaseLostError):  # SHUTDOWN
        async with AsyncLock(backend, "shutdown", ttl=30):
            await backend.aclose()


#: Grants in :func:`scenario`, and its leases that ended otherwise than by a loss.
GRANTS = 8
RELEASED = 3
LOSSES = {"stolen", "expired", "unreachable", "unhealthy", "shutdown"}


async def run_scenario(otel: Otel, **options: Any) -> None:
    backend = FaultyBackend(MemoryBackend())
    recorder = Recorder()
    backend.events.subscribe(recorder)
    otel.instrument(backend, **options)
    await scenario(backend, recorder)


async def test_every_metric_after_a_scenario(anyio_backend: str, otel: Otel) -> None:
    await run_scenario(otel)
    (acquire,) = otel.metric("aiolease.lock.acquire.duration")
    assert acquire.count == GRANTS and acquire.sum > 0
    assert dict(acquire.attributes) == {"aiolease.backend": "memory"}
    holds = otel.by("aiolease.lock.hold.duration", "aiolease.loss.reason")
    assert set(holds) == LOSSES | {"released"}
    assert holds["released"].count == RELEASED
    assert all(holds[reason].count == 1 for reason in LOSSES)
    losses = otel.by("aiolease.lock.losses", "aiolease.loss.reason")
    assert {reason: point.value for reason, point in losses.items()} == dict.fromkeys(LOSSES, 1)
    (renew,) = otel.metric("aiolease.lock.renew.duration")
    assert renew.count >= 1
    (failures,) = otel.metric("aiolease.lock.renew.failures")
    assert failures.value >= 1
    (held,) = otel.metric("aiolease.lock.held")
    assert held.value == 0  # every grant counted in, and out
    (leader,) = otel.metric("aiolease.elector.is_leader")
    assert leader.value == 0 and leader.attributes["aiolease.election.name"] == "leader"
    changes = otel.by("aiolease.elector.transitions", "aiolease.election.change")
    assert {change: point.value for change, point in changes.items()} == {
        "elected": 1,
        "deposed": 1,
    }


async def test_spans_carry_the_name_and_the_token(anyio_backend: str, otel: Otel) -> None:
    await run_scenario(otel)
    acquires = otel.finished("aiolease.acquire")
    assert len(acquires) == GRANTS
    names = [attrs(span)["aiolease.lock.name"] for span in acquires]
    assert names[:3] == ["wait", "wait", "stolen"]
    for span in acquires:
        assert attrs(span)["aiolease.lease.token"] >= 1
        assert span.start_time is not None and span.end_time is not None
        assert span.start_time <= span.end_time
    renews = otel.finished("aiolease.renew")
    assert renews and all(span.parent is None for span in renews)
    assert attrs(renews[0])["aiolease.lease.count"] == 1
    releases = otel.finished("aiolease.release")
    freed = {
        attrs(span)["aiolease.lock.name"]
        for span in releases
        if attrs(span)["aiolease.release.freed"]
    }
    assert {"wait", "stolen"} <= freed


async def test_acquires_without_a_grant_make_failed_spans(anyio_backend: str, otel: Otel) -> None:
    backend = FaultyBackend(MemoryBackend())
    otel.instrument(backend)
    lock = AsyncLock(backend, "busy", ttl=30)
    async with lock:
        with pytest.raises(aiolease.LeaseHeldError):
            await lock.acquire_nowait()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lock.acquire)
            await backend.wait_called("wait_turn")
            tg.cancel_scope.cancel()
    failed = [s for s in otel.finished("aiolease.acquire") if not s.status.is_ok]
    assert [attrs(span)["error.type"] for span in failed] == ["LeaseHeldError", "cancelled"]
    assert all(span.status.status_code is StatusCode.ERROR for span in failed)
    (granted,) = otel.metric("aiolease.lock.acquire.duration")
    assert granted.count == 1  # the histogram counts grants only


async def test_lock_names_only_by_option(anyio_backend: str, otel: Otel) -> None:
    backend = MemoryBackend()
    otel.instrument(backend, lock_names=lambda name: name.split("/")[0])
    async with AsyncLock(backend, "invoices/42", ttl=30):
        pass
    (point,) = otel.metric("aiolease.lock.acquire.duration")
    assert point.attributes["aiolease.lock.name"] == "invoices"
    with pytest.raises(aiolease.InvalidArgument):
        otel.instrument(backend, lock_names="yes")
    with pytest.raises(aiolease.InvalidArgument):
        instrument("memory://")  # type: ignore[arg-type]


async def test_uninstrument_and_every_backend(anyio_backend: str, otel: Otel) -> None:
    instrumentation = instrument(
        meter_provider=otel.meter_provider, tracer_provider=otel.tracer_provider
    )
    try:
        async with AsyncLock(MemoryBackend(), "a", ttl=30):
            pass
    finally:
        instrumentation.uninstrument()
    async with AsyncLock(MemoryBackend(), "a", ttl=30):
        pass
    (point,) = otel.metric("aiolease.lock.acquire.duration")
    assert point.count == 1
    assert backend_kind(FaultyBackend(MemoryBackend())) == "memory"


# -- a real server: renewals batched by the backend --------------------------------------

prefix = prefix_fixture("otel")


async def test_batched_renewals_on_redis(
    anyio_backend: str, otel: Otel, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix) as opened:
        backend = FaultyBackend(opened)
        assert backend.renews_many
        recorder = Recorder()
        backend.events.subscribe(recorder)
        otel.instrument(backend)
        async with (
            AsyncLock(backend, "a", ttl=5, renew_interval=0.1),
            AsyncLock(backend, "b", ttl=5, renew_interval=0.1),
        ):
            while not any(e[0] == "renewed" and len(e[1]) == 2 for e in recorder.log):
                await recorder.next("renewed")
            backend.fail("renew", times=1)
            await recorder.next("renew_failed")
            await recorder.next("renewed")
    (renew,) = otel.metric("aiolease.lock.renew.duration")
    assert renew.attributes["aiolease.backend"] == "redis" and renew.count >= 2
    (failures,) = otel.metric("aiolease.lock.renew.failures")
    assert failures.value == 2  # both leases of the batch that failed
    counts = [attrs(span)["aiolease.lease.count"] for span in otel.finished("aiolease.renew")]
    assert 2 in counts


# -- the Prometheus scrape of docs/observability.md ---------------------------------------


def prometheus_example() -> str:
    """The code block of docs/observability.md that scrapes Prometheus text."""
    text = DOCS.read_text()
    (block,) = re.findall(r"<!-- prometheus-example -->\n```python\n(.*?)```", text, re.S)
    return str(block)


def test_the_prometheus_scrape_in_the_docs() -> None:
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(compile(prometheus_example(), str(DOCS), "exec"), namespace)
    scraped = namespace["scraped"]
    for name in (
        "aiolease_lock_acquire_duration_seconds_bucket",
        "aiolease_lock_hold_duration_seconds_count",
        "aiolease_lock_held",
        'aiolease_backend="memory"',
    ):
        assert name in scraped, name


def test_the_core_never_imports_opentelemetry() -> None:
    script = (
        "import sys, anyio, aiolease\n"
        "from aiolease.backends.memory import MemoryBackend\n"
        "async def main():\n"
        "    backend = MemoryBackend()\n"
        "    backend.events.subscribe(aiolease.Observer())\n"
        "    async with aiolease.Elector(backend, 'e', ttl=5).leadership():\n"
        "        async with aiolease.AsyncLock(backend, 'a', ttl=5): pass\n"
        "anyio.run(main)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=DOCS.parents[1],  # this tree's aiolease first
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert done.stdout.strip() == "[]"
