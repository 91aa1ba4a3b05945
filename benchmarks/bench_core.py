"""The core's own cost: aiolease on ``memory://`` (no I/O) against a bare in-process lock.

Prints, per event loop (asyncio, and trio for reference):

* uncontended cycle, median microseconds of wall time and mean microseconds of CPU:
  ``async with lock`` (a held lease: registered with the renewer, watched, released),
  ``acquire_nowait()`` + ``release()`` (no holding), and a bare ``asyncio.Lock`` /
  ``trio.Lock``; under asyncio also event-loop passes per cycle;
* hand-offs per second among 8 tasks on one name, each holding 1 ms, and the CPU
  each hand-off costs (process CPU time / hand-offs), for ``async with lock`` and
  for the bare lock;
* what observing costs (docs/observability.md): the uncontended ``async with lock``
  cycle on three memory backends, one with no observer, one with an
  :class:`aiolease.Observer` whose methods do nothing, and two instrumented with
  OpenTelemetry (:func:`aiolease.integrations.otel.instrument`, the SDK's meter
  provider with an in-memory reader; with a no-op tracer provider, then with the
  SDK's tracer provider with no span processor: spans made and dropped); measured in
  alternating rounds (the median of their medians), with the ratios to the first.

Usage: ``python benchmarks/bench_core.py [--cycles N] [--seconds S] [--loop asyncio|trio]``.
Quote ratios from one run; absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import sniffio
from _common import record

from aiolease import AsyncLock, Observer
from aiolease.backends.memory import MemoryBackend

Cycle = Callable[[], Awaitable[object]]
LockFactory = Callable[[], AbstractAsyncContextManager[object]]


@dataclass(frozen=True)
class Uncontended:
    wall_us: float
    cpu_us: float
    passes: float | None


@contextmanager
def loop_passes() -> Iterator[list[int]]:
    """Count asyncio event-loop iterations (``[count]``); ``[-1]`` under trio."""
    counter = [-1]
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        yield counter
        return
    original = loop._run_once  # type: ignore[attr-defined]
    counter[0] = 0

    def run_once() -> None:
        counter[0] += 1
        original()

    loop._run_once = run_once  # type: ignore[attr-defined]
    try:
        yield counter
    finally:
        loop._run_once = original  # type: ignore[attr-defined]


async def uncontended(cycle: Cycle, cycles: int) -> Uncontended:
    for _ in range(min(cycles // 10, 200)):
        await cycle()
    samples = []
    cpu = time.process_time()
    with loop_passes() as passes:
        for _ in range(cycles):
            start = time.perf_counter()
            await cycle()
            samples.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    return Uncontended(
        statistics.median(samples) * 1e6,
        cpu / cycles * 1e6,
        None if passes[0] < 0 else passes[0] / cycles,
    )


async def handoffs(factory: LockFactory, seconds: float) -> tuple[float, float]:
    """Hand-offs per second among 8 tasks holding 1 ms each, and CPU microseconds each."""
    counts = [0] * 8

    async def worker(i: int) -> None:
        while True:
            async with factory():
                counts[i] += 1
                await anyio.sleep(0.001)
            await anyio.lowlevel.checkpoint()

    cpu = time.process_time()
    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(worker, i)
    cpu = time.process_time() - cpu
    total = max(sum(counts), 1)
    return total / seconds, cpu / total * 1e6


def bare_lock() -> AbstractAsyncContextManager[object]:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        import trio

        return trio.Lock()
    return asyncio.Lock()


async def main(cycles: int, seconds: float) -> None:
    backend = MemoryBackend()
    lock = AsyncLock(backend, "bench", ttl=10)
    bare = bare_lock()

    async def with_cycle() -> None:
        async with lock:
            pass

    async def nowait_cycle() -> None:
        lease = await lock.acquire_nowait()
        await lease.release()

    async def bare_cycle() -> None:
        async with bare:
            pass

    rows = [
        ("async with lock", await uncontended(with_cycle, cycles)),
        ("acquire_nowait + release", await uncontended(nowait_cycle, cycles)),
        ("bare lock", await uncontended(bare_cycle, cycles)),
    ]
    loop = sniffio.current_async_library()
    print(f"-- {loop}: uncontended cycle")
    print(f"{'contender':<28} {'wall us':>9} {'cpu us':>9} {'passes':>7}")
    for label, row in rows:
        passes = "-" if row.passes is None else f"{row.passes:.1f}"
        print(f"{label:<28} {row.wall_us:>9.1f} {row.cpu_us:>9.1f} {passes:>7}")
        record(f"core ({loop})", "uncontended cycle, memory backend", label, row.wall_us, "us")
    handoff_lock = AsyncLock(backend, "handoff", ttl=10)
    shared_bare = bare_lock()
    print(f"-- {loop}: 8 tasks, 1 ms hold")
    print(f"{'contender':<28} {'hand-offs/s':>12} {'cpu us each':>12}")
    for label, factory in (
        ("aiolease async with", lambda: handoff_lock),
        ("bare lock", lambda: shared_bare),
    ):
        rate, cpu_each = await handoffs(factory, seconds)
        print(f"{label:<28} {rate:>12.0f} {cpu_each:>12.0f}")
        record(f"core ({loop})", "hand-offs, 8 tasks, 1 ms hold", label, rate, "/s")
    await observing(cycles)


def instrumented(backend: MemoryBackend, *, spans: bool) -> bool:
    """Instrument ``backend`` with OpenTelemetry's SDK (its spans made and dropped, or
    not made: a no-op tracer); ``False`` if the SDK is not installed."""
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace import NoOpTracerProvider
    except ImportError:
        return False
    from aiolease.integrations.otel import instrument

    meters = MeterProvider(metric_readers=[InMemoryMetricReader()])
    tracers = TracerProvider() if spans else NoOpTracerProvider()
    instrument(backend, meter_provider=meters, tracer_provider=tracers)
    return True


async def observing(cycles: int, rounds: int = 5) -> None:
    """The uncontended ``async with lock`` cycle with no observer, a no-op observer, and
    OpenTelemetry: alternating rounds, the median of their medians."""
    contenders: dict[str, MemoryBackend] = {"no observer": MemoryBackend()}
    contenders["no-op Observer"] = noop = MemoryBackend()
    noop.events.subscribe(Observer())
    metrics, both = MemoryBackend(), MemoryBackend()
    if instrumented(metrics, spans=False) and instrumented(both, spans=True):
        contenders["OpenTelemetry metrics"] = metrics
        contenders["OpenTelemetry metrics+spans"] = both
    samples: dict[str, list[float]] = {label: [] for label in contenders}
    for _ in range(rounds):
        for label, backend in contenders.items():
            lock = AsyncLock(backend, "observed", ttl=10)

            async def cycle(lock: AsyncLock = lock) -> None:
                async with lock:
                    pass

            samples[label].append((await uncontended(cycle, max(cycles // rounds, 1))).wall_us)
    loop = sniffio.current_async_library()
    print(f"-- {loop}: observing, uncontended async with lock, memory backend")
    print(f"{'contender':<28} {'wall us':>9} {'ratio':>7}")
    base = statistics.median(samples["no observer"])
    for label, values in samples.items():
        wall = statistics.median(values)
        print(f"{label:<28} {wall:>9.1f} {wall / base:>7.2f}")
        record(f"core ({loop})", "observing, uncontended async with lock", label, wall, "us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--loop", choices=["asyncio", "trio", "both"], default="both")
    args = parser.parse_args()
    for name in ("asyncio", "trio") if args.loop == "both" else (args.loop,):
        anyio.run(main, args.cycles, args.seconds, backend=name)
