"""The few asyncio tools the backend needs.

What grpc.aio calls need beyond the backends' toolkit
(:mod:`aiolease.backends._asyncio`, where the clock and the waits are): calls that
finish through a cancellation, and calls cancelled by a closed channel.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar, cast

from ..._exceptions import BackendUnavailable
from .._asyncio import now, retrieve, run_to_end

__all__ = [
    "CallCancelled",
    "await_unary",
    "cancellable",
    "finishing",
    "read_owned",
    "shielded",
    "unshielded",
]

T = TypeVar("T")

logger = logging.getLogger("aiolease.backends.etcd")

#: Set inside :func:`shielded`: nobody cancels the calls made there (see :func:`cancellable`).
_SHIELDED: contextvars.ContextVar[bool] = contextvars.ContextVar("_SHIELDED", default=False)


class _Grace:
    """The caller's cancellation held back by :func:`finishing`, and until when."""

    __slots__ = ("cancelled", "give_up", "grace")

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.cancelled: asyncio.CancelledError | None = None
        self.give_up = math.inf


#: Set inside :func:`finishing` (see :func:`cancellable`).
_GRACE: contextvars.ContextVar[_Grace | None] = contextvars.ContextVar("_GRACE", default=None)


class CallCancelled(BackendUnavailable):
    """A gRPC call was cancelled by something other than its caller (a closed channel)."""


async def shielded(coro: Coroutine[Any, Any, T], grace: float = math.inf) -> T:
    """Run ``coro`` to its end even if the caller is cancelled meanwhile, then re-raise
    the cancellation: its outcome is seen and recorded by ``coro`` itself.

    A cancelled caller waits at most ``grace`` more seconds (then ``coro`` is
    cancelled); anyio re-delivers its cancellation on every loop turn meanwhile.

    :raises asyncio.CancelledError: the caller's own (anyio tells its scopes' apart)
    """
    return await run_to_end(_in_shield(coro), grace)


async def finishing(coro: Coroutine[Any, Any, T], grace: float) -> T:
    """:func:`shielded` for a coroutine whose only waits are gRPC unary calls made through
    :func:`cancellable`, run in the caller's own task (no task, no extra loop turn).

    When the caller is cancelled while such a call is in flight, the call goes on and
    its reply is awaited (at most ``grace`` seconds after the first cancellation), and
    ``coro`` goes on with it; the cancellation is re-raised when ``coro`` is done. A
    reply that does not come within ``grace`` cancels the call and ends ``coro`` with
    the caller's cancellation.

    :raises asyncio.CancelledError: the caller's own (anyio tells its scopes' apart)
    """
    state = _Grace(grace)
    token = _GRACE.set(state)
    try:
        result = await coro
    except BaseException:
        if state.cancelled is not None:
            raise state.cancelled from None
        raise
    finally:
        _GRACE.reset(token)
    if state.cancelled is not None:
        raise state.cancelled
    return result


async def cancellable(call: Awaitable[T]) -> T:
    """Await ``call`` (a gRPC call, or a coroutine that drives one); cancel it when the
    caller is cancelled, and re-raise the caller's own cancellation.

    Awaited directly, grpc.aio turns a cancellation into a *new*, bare ``CancelledError``
    (``UnaryUnaryCall.__await__`` raises one once the call reports itself cancelled). That
    loses the message by which anyio tells its cancel scopes' cancellations apart, so a
    ``move_on_after`` or a shielded scope's deadline would let it escape as a crash. Here
    the caller waits on a future of its own, whose cancellation is the canceller's: one
    that the call's done callback resolves (unary calls: no task, no extra loop turn),
    or a task that runs a coroutine. Inside :func:`shielded`, where nobody cancels the
    caller, ``call`` is awaited as it is.

    :raises CallCancelled: the call was cancelled, but not by the caller (the channel closed)
    """
    current = asyncio.current_task()
    before = _cancelling(current)
    if _SHIELDED.get():
        try:
            return await call
        except asyncio.CancelledError:
            if _cancelling(current) == before:
                raise CallCancelled("etcd call cancelled: the connection was closed") from None
            raise
    if hasattr(call, "add_done_callback") and hasattr(call, "cancel"):
        return cast(T, await await_unary(call))
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.cancelled() and _cancelling(current) == before:
            raise CallCancelled("etcd call cancelled: the connection was closed") from None
        task.cancel()
        task.add_done_callback(retrieve)
        raise


async def read_owned(call: Any) -> Any:
    """The next message of the gRPC stream ``call``, read by a background task of the
    backend (:func:`unshielded`): cancelled only by the backend's close, whose
    cancellation needs no message, so the read is awaited as it is, without the task and
    shield :func:`cancellable` makes per read (a watch stream reads one per change).

    :raises CallCancelled: the call was cancelled, but not by the caller (the stream was
        closed)
    """
    current = asyncio.current_task()
    before = _cancelling(current)
    try:
        return await call.read()
    except asyncio.CancelledError:
        if _cancelling(current) == before:
            raise CallCancelled("etcd call cancelled: the connection was closed") from None
        raise


async def await_unary(call: Any) -> Any:
    """:func:`cancellable` for a grpc.aio unary call (the hot path, without its checks):
    awaited through a future that the call's done callback resolves."""
    if _SHIELDED.get():
        return await cancellable(call)
    try:
        await _resolver(call)
    except asyncio.CancelledError as exc:
        state = _GRACE.get()
        if state is None:
            call.cancel()
            raise
        await _wait_out(call, state, exc)
    try:
        return await call  # done: returns (or raises) without waiting
    except asyncio.CancelledError:
        raise CallCancelled("etcd call cancelled: the connection was closed") from None


def _resolver(call: Any) -> asyncio.Future[None]:
    """A future that ``call``'s done callback resolves."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def resolve(_: object) -> None:
        if not done.done():
            done.set_result(None)

    call.add_done_callback(resolve)
    return done


async def _wait_out(call: Any, state: _Grace, exc: asyncio.CancelledError) -> None:
    """The caller of :func:`finishing` was cancelled (``exc``): wait for ``call`` as long
    as the grace allows (anyio re-delivers the cancellation meanwhile; it is held back).

    :raises asyncio.CancelledError: the call did not finish in time (it is cancelled)
    """
    if state.cancelled is None:
        state.cancelled, state.give_up = exc, now() + state.grace
    while not call.done() and now() < state.give_up:
        waiter = _resolver(call)
        try:
            await asyncio.wait({waiter}, timeout=state.give_up - now())
        except asyncio.CancelledError:
            pass  # anyio's re-delivery of the same cancellation: held back
    if not call.done():
        call.cancel()
        raise state.cancelled


def _cancelling(task: asyncio.Task[Any] | None) -> int:
    """How many cancellations of ``task`` are pending (Python 3.11+; else 0)."""
    count = getattr(task, "cancelling", None)
    return int(count()) if count is not None else 0


async def _in_shield(coro: Coroutine[Any, Any, T]) -> T:
    _SHIELDED.set(True)  # in this task's own context only
    return await coro


async def unshielded(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` as a background task (:class:`~aiolease.backends._asyncio.Tasks`)
    of the backend: cancelled when the backend closes, even if it was started inside
    :func:`shielded`."""
    _SHIELDED.set(False)  # a background task is cancelled when the backend closes
    await coro
