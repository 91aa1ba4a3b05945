"""The etcd wire's limit on requests in flight (:class:`Limiter`): places go to
waiters in arrival order, and a cancelled waiter never takes a place with it.

The limiter lives on the backend's asyncio loop (the etcd backend requires asyncio;
under trio it runs on trio-asyncio's): these tests drive it on a loop of their own.
"""

from __future__ import annotations

import asyncio

from aiolease.backends.etcd._wire import Limiter


def _run(scenario: object) -> None:
    asyncio.run(scenario)  # type: ignore[arg-type]


async def _waiting(limiter: Limiter, order: list[int], i: int) -> None:
    if not limiter.take():
        await limiter.wait()
    order.append(i)


def test_places_go_to_waiters_in_arrival_order() -> None:
    async def scenario() -> None:
        limiter = Limiter(2)
        assert limiter.take() and limiter.take() and not limiter.take()
        order: list[int] = []
        tasks = [asyncio.ensure_future(_waiting(limiter, order, i)) for i in range(3)]
        await asyncio.sleep(0)
        assert order == [] and len(limiter.waiters) == 3
        for _ in range(3):
            limiter.give_back()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2]
        assert limiter.free == 0  # each place went to a waiter, none to the free ones
        limiter.give_back()
        assert limiter.free == 1

    _run(scenario())


def test_a_cancelled_waiter_takes_no_place() -> None:
    async def scenario() -> None:
        limiter = Limiter(1)
        assert limiter.take()
        order: list[int] = []
        cancelled = asyncio.ensure_future(_waiting(limiter, order, 0))
        second = asyncio.ensure_future(_waiting(limiter, order, 1))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        assert cancelled.cancelled() and len(limiter.waiters) == 1
        limiter.give_back()
        await second
        assert order == [1]

    _run(scenario())


def test_a_waiter_cancelled_as_its_place_comes_passes_it_on() -> None:
    async def scenario() -> None:
        limiter = Limiter(1)
        assert limiter.take()
        order: list[int] = []
        first = asyncio.ensure_future(_waiting(limiter, order, 0))
        second = asyncio.ensure_future(_waiting(limiter, order, 1))
        await asyncio.sleep(0)
        limiter.give_back()  # to the first waiter...
        first.cancel()  # ...cancelled before it runs: the place goes on to the second
        await second
        assert first.cancelled() and order == [1] and limiter.free == 0

    _run(scenario())


def test_a_waiter_cancelled_then_skipped_by_a_give_back_leaves_cleanly() -> None:
    """A waiter cancelled in the same loop turn as a place is given back: the place
    skips it, and its own clean-up finds it gone from the queue."""

    async def scenario() -> None:
        limiter = Limiter(1)
        assert limiter.take()
        order: list[int] = []
        waiter = asyncio.ensure_future(_waiting(limiter, order, 0))
        await asyncio.sleep(0)
        waiter.cancel()  # its future is cancelled now, its task runs later
        limiter.give_back()
        await asyncio.sleep(0)
        assert waiter.cancelled() and order == []
        assert limiter.free == 1 and not limiter.waiters
        assert limiter.take()

    _run(scenario())
