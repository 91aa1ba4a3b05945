"""The permits' combiner (``aiolease.backends._combine``), on its own: what
leaves for the server, in which order, and what each caller gets back. The send
functions here record what they are given and answer when the test says so (the
PostgreSQL permit tests show the same on the server).

Each body is asyncio code, as in a backend; under trio it runs on a trio-asyncio loop
(``on_asyncio``), as the core bridges an asyncio backend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from aiolease import BackendUnavailable
from aiolease.backends._asyncio import Tasks
from aiolease.backends._combine import MOST, Combiner
from tests.support import on_asyncio

pytestmark = pytest.mark.anyio

logger = logging.getLogger("aiolease.test-combine")


class Server:
    """Records each statement (the operations it carried) and answers it when told."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, list[str]]] = []
        self.go: list[asyncio.Event] = []
        self.fail: str | None = None
        self._more = asyncio.Event()

    async def _answer(self, key: str, ops: list[str]) -> list[str]:
        self.statements.append((key, ops))
        self._more.set()
        go = asyncio.Event()
        self.go.append(go)
        await go.wait()
        if self.fail in ops:
            raise LookupError(f"failed: {self.fail}")
        return [f"{key}:{op}" for op in ops]

    async def one(self, key: str, op: str) -> str:
        return (await self._answer(key, [op]))[0]

    async def many(self, key: str, ops: Sequence[str]) -> list[str]:
        return await self._answer(key, list(ops))

    async def sent(self, count: int) -> None:
        """Until ``count`` statements were sent."""
        while len(self.statements) < count:
            self._more.clear()
            await self._more.wait()


async def test_what_arrives_while_a_statement_flies_goes_in_one_next_in_order() -> None:
    async def body() -> None:
        server, tasks = Server(), Tasks(logger)
        combiner: Combiner[str, str] = Combiner(server.one, server.many, tasks)
        first = asyncio.ensure_future(combiner.run("n", "a"))
        await server.sent(1)
        later = [asyncio.ensure_future(combiner.run("n", op)) for op in "bcd"]
        other = asyncio.ensure_future(combiner.run("m", "x"))  # another key: at once
        await server.sent(2)
        assert server.statements == [("n", ["a"]), ("m", ["x"])]
        server.go[0].set()
        assert await first == "n:a"
        await server.sent(3)  # the three that waited, together, in arrival order
        assert server.statements[2] == ("n", ["b", "c", "d"])
        assert combiner.combined == 1
        server.go[2].set()
        assert [await f for f in later] == ["n:b", "n:c", "n:d"]
        server.go[1].set()
        assert await other == "m:x"
        # Idle again: the next goes alone, at once.
        last = asyncio.ensure_future(combiner.run("n", "e"))
        await server.sent(4)
        assert server.statements[3] == ("n", ["e"])
        server.go[3].set()
        assert await last == "n:e"
        await tasks.aclose()

    await on_asyncio(body)


async def test_gathered_operations_of_an_idle_key_asked_in_one_step_go_as_one() -> None:
    # As the waiters that one release granted ask again: without ``gather`` the first
    # would go alone and the others wait for it (two statements, one after the other).
    async def body() -> None:
        server, tasks = Server(), Tasks(logger)
        combiner: Combiner[str, str] = Combiner(server.one, server.many, tasks)
        asked = [asyncio.ensure_future(combiner.run("n", op, gather=True)) for op in "abc"]
        alone = asyncio.ensure_future(combiner.run("m", "x"))  # not gathered: at once
        await server.sent(2)
        assert server.statements == [("m", ["x"]), ("n", ["a", "b", "c"])]
        assert combiner.combined == 1
        server.go[1].set()
        assert [await f for f in asked] == ["n:a", "n:b", "n:c"]
        # One gathered alone still goes (in a statement of its own).
        last = asyncio.ensure_future(combiner.run("n", "d", gather=True))
        await server.sent(3)
        assert server.statements[2] == ("n", ["d"])
        server.go[2].set()
        server.go[0].set()
        assert await last == "n:d"
        assert await alone == "m:x"
        await tasks.aclose()

    await on_asyncio(body)


async def test_a_gathered_operation_of_a_busy_key_waits_for_the_next_statement() -> None:
    async def body() -> None:
        server, tasks = Server(), Tasks(logger)
        combiner: Combiner[str, str] = Combiner(server.one, server.many, tasks)
        first = asyncio.ensure_future(combiner.run("n", "a"))
        await server.sent(1)
        later = [asyncio.ensure_future(combiner.run("n", op, gather=True)) for op in "bc"]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(server.statements) == 1  # nothing of the key goes beside the first
        server.go[0].set()
        assert await first == "n:a"
        await server.sent(2)
        assert server.statements[1] == ("n", ["b", "c"])
        server.go[1].set()
        assert [await f for f in later] == ["n:b", "n:c"]
        await tasks.aclose()

    await on_asyncio(body)


async def test_a_long_wait_goes_in_statements_of_at_most_most() -> None:
    async def body() -> None:
        server, tasks = Server(), Tasks(logger)
        combiner: Combiner[str, str] = Combiner(server.one, server.many, tasks)
        first = asyncio.ensure_future(combiner.run("n", "first"))
        await server.sent(1)
        ops = [str(i) for i in range(MOST + 1)]
        waiting = [asyncio.ensure_future(combiner.run("n", op)) for op in ops]
        server.go[0].set()
        await first
        await server.sent(2)
        assert server.statements[1] == ("n", ops[:MOST])
        server.go[1].set()
        await server.sent(3)
        assert server.statements[2] == ("n", ops[MOST:])  # alone
        server.go[2].set()
        assert [await f for f in waiting] == [f"n:{op}" for op in ops]
        await tasks.aclose()

    await on_asyncio(body)


async def test_a_failed_statement_fails_all_it_carried_and_the_next_goes_on() -> None:
    async def body() -> None:
        server, tasks = Server(), Tasks(logger)
        combiner: Combiner[str, str] = Combiner(server.one, server.many, tasks)
        first = asyncio.ensure_future(combiner.run("n", "a"))
        await server.sent(1)
        failing = [asyncio.ensure_future(combiner.run("n", op)) for op in "bc"]
        server.fail = "c"
        server.go[0].set()
        await first
        await server.sent(2)
        after = asyncio.ensure_future(combiner.run("n", "d"))  # waits for the next
        server.go[1].set()
        for future in failing:
            with pytest.raises(LookupError, match="failed: c"):
                await future
        await server.sent(3)
        assert server.statements[2] == ("n", ["d"])
        server.go[2].set()
        assert await after == "n:d"
        await tasks.aclose()

    await on_asyncio(body)


async def test_a_cancelled_caller_stops_waiting_and_its_operation_still_goes_first() -> None:
    # What it sends next for the key (the core's compensating release) goes after it.
    async def body() -> None:
        server, tasks = Server(), Tasks(logger)
        combiner: Combiner[str, str] = Combiner(server.one, server.many, tasks)
        first = asyncio.ensure_future(combiner.run("n", "a"))
        await server.sent(1)
        cancelled = asyncio.ensure_future(combiner.run("n", "acquire"))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        undo = asyncio.ensure_future(combiner.run("n", "release"))
        server.go[0].set()
        await first
        await server.sent(2)
        assert server.statements[1] == ("n", ["acquire", "release"])
        server.go[1].set()
        assert await undo == "n:release"
        await tasks.aclose()

    await on_asyncio(body)


async def test_closing_fails_what_waits_and_what_flies() -> None:
    async def body() -> None:
        server, tasks = Server(), Tasks(logger)
        combiner: Combiner[str, str] = Combiner(server.one, server.many, tasks)
        first = asyncio.ensure_future(combiner.run("n", "a"))
        await server.sent(1)
        flying = [asyncio.ensure_future(combiner.run("n", op)) for op in "bc"]
        server.go[0].set()
        await first
        await server.sent(2)  # b and c fly, in a sender task
        waiting = asyncio.ensure_future(combiner.run("n", "d"))
        await asyncio.sleep(0)
        await tasks.aclose()
        for future in [*flying, waiting]:
            with pytest.raises(BackendUnavailable, match="closed"):
                await future
        # Once closed, an operation that waits for a statement in flight fails too.
        alone = asyncio.ensure_future(combiner.run("n", "e"))
        await server.sent(3)
        late = asyncio.ensure_future(combiner.run("n", "f"))
        await asyncio.sleep(0)
        server.go[2].set()
        assert await alone == "n:e"
        with pytest.raises(BackendUnavailable, match="closed"):
            await late

    await on_asyncio(body)
