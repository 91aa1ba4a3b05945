"""An asyncio-only backend runs unchanged under trio, through the trio-asyncio bridge."""

from __future__ import annotations

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, Elector, Lease, LeaseHeldError
from aiolease._bridge import AsyncioBridge
from aiolease._registry import BUILTIN
from aiolease.testing import CHECKS, Check
from aiolease.testing.asyncio_only import AsyncioOnlyBackend

pytestmark = pytest.mark.anyio

URL = "asyncio-memory://"


@pytest.fixture(autouse=True)
def _register(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        BUILTIN, "asyncio-memory", "aiolease.testing.asyncio_only:AsyncioOnlyBackend"
    )


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_backend_really_needs_asyncio(anyio_backend: str) -> None:
    with pytest.raises(RuntimeError, match="no running event loop"):
        await AsyncioOnlyBackend().read("x")


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_unbridged_use_under_trio_is_a_clear_error(anyio_backend: str) -> None:
    with pytest.raises(aiolease.UnsupportedCapability, match="open_backend"):
        await AsyncLock(AsyncioOnlyBackend(), "x", ttl=1).acquire_nowait()


async def test_open_backend_bridges_under_trio_only(anyio_backend: str) -> None:
    async with aiolease.open_backend(URL) as backend:
        assert isinstance(backend, AsyncioBridge) == (anyio_backend == "trio")
        async with AsyncLock(backend, "x", ttl=1) as lease:
            assert lease.token == 1
            with pytest.raises(LeaseHeldError) as info:
                await AsyncLock(backend, "x", ttl=1).acquire_nowait()
            assert info.value.holder is not None and info.value.holder.token == 1
        assert await backend.read("x") is None


async def test_mutual_exclusion_and_wakeups_across_the_bridge(anyio_backend: str) -> None:
    async with aiolease.open_backend(URL) as backend:
        lock = AsyncLock(backend, "x", ttl=1)
        tokens: list[int] = []
        inside = 0

        async def worker() -> None:
            nonlocal inside
            for _ in range(3):
                async with lock as lease:
                    inside += 1
                    assert inside == 1
                    await anyio.sleep(0.001)
                    inside -= 1
                    tokens.append(lease.token)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(worker)
        assert tokens == sorted(tokens) and len(set(tokens)) == 9


async def test_cancellation_crosses_the_bridge(anyio_backend: str) -> None:
    async with aiolease.open_backend(URL) as backend:
        held = await AsyncLock(backend, "x", ttl=30).acquire()
        with pytest.raises(TimeoutError):
            await AsyncLock(backend, "x", ttl=30).acquire(timeout=0.05)
        holder = await backend.read("x")
        assert holder is not None and holder.owner == held.owner
        assert await held.release() is True


async def test_elector_and_observe_across_the_bridge(anyio_backend: str) -> None:
    async with aiolease.open_backend(URL) as backend:
        seen: list[int | None] = []
        saw_two, saw_three = anyio.Event(), anyio.Event()

        async def observe(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            async for leader in Elector(backend, "e", ttl=1).observe():
                seen.append(None if leader is None else leader.token)
                if len(seen) == 1:
                    task_status.started()
                if len(seen) == 2:
                    saw_two.set()
                if len(seen) == 3:
                    saw_three.set()

        async def work(lease: Lease) -> int:
            # A term shorter than one read of the observer may go unseen (observe()
            # coalesces changes closer together than that): end it once it was seen.
            await saw_two.wait()
            return lease.token

        async with anyio.create_task_group() as tg:
            await tg.start(observe)
            assert await Elector(backend, "e", ttl=1).run(work) == 1
            await saw_three.wait()
            tg.cancel_scope.cancel()
        assert seen == [None, 1, None]


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance_across_the_bridge(anyio_backend: str, check: Check) -> None:
    """The whole contract holds for an asyncio-only backend under both loops."""
    await check(lambda: aiolease.open_backend(URL))


async def test_an_error_opening_a_bridged_backend_is_the_typed_error(anyio_backend: str) -> None:
    # Under trio the backend is opened inside trio-asyncio's loop nursery, which
    # wraps what escapes it in an exception group; the caller gets the error itself.
    with pytest.raises(aiolease.InvalidArgument, match="expected 'asyncio-memory://'"):
        async with aiolease.open_backend("asyncio-memory://host/path"):
            pass  # pragma: no cover


async def test_an_unknown_option_of_a_bridged_backend_is_invalid(anyio_backend: str) -> None:
    with pytest.raises(aiolease.InvalidArgument, match="takes no options.*'foo'"):
        async with aiolease.open_backend(URL, foo=1):
            pass  # pragma: no cover


class _Leaky(AsyncioOnlyBackend):
    """Leaves an asyncio future whose error nobody retrieves, as asyncpg can."""

    @classmethod
    async def from_url(cls, url: str, **options: object) -> _Leaky:
        import asyncio
        import gc

        future = asyncio.get_running_loop().create_future()
        future.set_exception(RuntimeError("never retrieved"))
        del future
        gc.collect()
        await asyncio.sleep(0)
        return cls()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_an_unretrieved_asyncio_error_is_logged_not_raised_under_trio(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(BUILTIN, "leaky", f"{__name__}:_Leaky")
    async with aiolease.open_backend("leaky://") as backend:
        async with AsyncLock(backend, "x", ttl=2) as lease:
            assert lease.token >= 1
        assert await backend.read("x") is None
    assert "never retrieved" in caplog.text


class _BodyError(Exception):
    pass


async def test_an_error_from_the_block_comes_out_as_itself(anyio_backend: str) -> None:
    cause = OSError("underneath")
    with pytest.raises(_BodyError) as info:
        async with aiolease.open_backend(URL):
            raise _BodyError("from the block") from cause
    assert info.value.__cause__ is cause
    with pytest.raises(aiolease.LeaseLostError):
        async with aiolease.open_backend(URL) as backend:
            async with AsyncLock(backend, "x", ttl=2) as lease:
                await backend.release("x", lease.owner, lease.token)
                await backend.try_acquire("x", "thief", 2, "thief", {})
                await lease.renew()


class _CutOff(AsyncioOnlyBackend):
    """Its releases are cancelled on the asyncio side, as the trio-asyncio loop's close
    cancels a release still in flight (a block's, racing the close of its backend)."""

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        import asyncio

        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.Event().wait()  # the server's reply, which the cancel cuts off
        raise AssertionError("not cancelled")  # pragma: no cover


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_an_asyncio_side_cancel_reaches_trio_as_backend_unavailable(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under trio an ``asyncio.CancelledError`` is no cancellation: a bridged call cut off
    on the asyncio side raises :class:`~aiolease.BackendUnavailable`, and a block whose
    release it was ends as a block whose release failed (the error logged), instead of
    letting asyncio's exception out of ``async with`` (seen in CI: a block's release in
    flight when ``open_backend`` closed the loop under it)."""
    monkeypatch.setitem(BUILTIN, "cut-off", f"{__name__}:_CutOff")
    async with aiolease.open_backend("cut-off://") as backend:
        with pytest.raises(aiolease.BackendUnavailable, match="cancelled on its asyncio loop"):
            await backend.release("x", "someone", 1)
        async with AsyncLock(backend, "y", ttl=30) as lease:
            assert lease.token == 1
        assert "release of lease 'y' failed" in caplog.text
