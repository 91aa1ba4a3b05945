"""Deletes that wait for a place on the wire go together, in one ``Txn``.

A process whose thousands of lease bodies end together sends thousands of releases at
once. One ``DeleteRange`` each, :data:`~aiolease.backends.etcd._wire.MAX_IN_FLIGHT` at
a time, is one raft proposal each: at 10,000 leases the last releases waited past the
core's release bound (3 s) and were given up, their keys left to lapse with the
session. So a delete that finds every place of the wire taken joins the next batch
instead of the line: one ``Txn`` of up to :data:`MOST` deletes (etcd's default
``--max-txn-ops``), sent by a task of its own once it gets a place. A wire that is
not that busy sends each delete alone, as before.

A delete's answer is the ``DeleteRangeResponse`` its own request would have had. A
batch never holds the same key twice (etcd refuses overlapping writes in one ``Txn``):
a second delete of a key starts the next batch. A server whose ``--max-txn-ops`` is
lower than :data:`MOST` refuses the batch before applying any of it; its deletes are
then sent one by one, and batches stay that small from then on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aetcd import rpc

from ..._exceptions import BackendError, BackendUnavailable
from .._asyncio import Tasks, retrieve

__all__ = ["MOST", "DeleteBatches"]

#: The most deletes in one ``Txn`` (etcd's default ``--max-txn-ops``).
MOST = 128
#: What etcd says of a ``Txn`` with more operations than it allows.
TOO_MANY_OPS = "too many operations in txn request"

logger = logging.getLogger("aiolease.backends.etcd")


class _Batch:
    __slots__ = ("keys", "waiting")

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.waiting: list[tuple[Any, asyncio.Future[Any]]] = []


class DeleteBatches:
    """The batches of deletes of one wire.

    :param place: waits for a place among the wire's KV requests in flight (in line)
    :param give_back: gives that place back
    :param txn: sends a ``TxnRequest`` holding a place already; its reply
    """

    def __init__(
        self,
        place: Callable[[], Awaitable[None]],
        give_back: Callable[[], None],
        txn: Callable[[Any], Awaitable[Any]],
    ) -> None:
        self._place = place
        self._give_back = give_back
        self._txn = txn
        self._open: _Batch | None = None
        self._most = MOST
        self._tasks = Tasks(logger)
        #: ``Txn`` requests sent that carried more than one delete.
        self.batches = 0

    async def delete(self, request: Any) -> Any:
        """Delete as ``request`` asks, with the next batch; its ``DeleteRangeResponse``.

        :raises BackendError: the batch's request failed (mapped)
        :raises BackendUnavailable: the wire is closed
        """
        if self._tasks.closed:
            raise BackendUnavailable("the backend closed before the delete was sent")
        batch = self._open
        if batch is None or len(batch.waiting) >= self._most or request.key in batch.keys:
            batch = self._open = _Batch()
            self._tasks.spawn(self._send(batch), "aiolease-etcd-deletes")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.add_done_callback(retrieve)  # its caller may have stopped waiting
        batch.keys.add(request.key)
        batch.waiting.append((request, future))
        # The batch is sent whether or not this caller still waits: its caller's
        # release then counts the delete as unsure and sends it once more, later.
        return await asyncio.shield(future)

    async def _send(self, batch: _Batch) -> None:
        try:
            await self._place()
        except BaseException:  # cancelled: the wire closes
            if self._open is batch:
                self._open = None
            _fail(batch, asyncio.CancelledError())
            raise
        try:
            if self._open is batch:
                self._open = None  # from here on, deletes join the next batch
            await self._send_now(batch)
        except BaseException as exc:
            _fail(batch, exc)
            raise
        finally:
            self._give_back()

    async def _send_now(self, batch: _Batch) -> None:
        waiting = batch.waiting
        if len(waiting) > 1:
            try:
                reply = await self._txn(_txn_of([request for request, _ in waiting]))
            except BackendError as exc:
                if TOO_MANY_OPS not in str(exc):
                    raise
                # Refused before any of it was applied: one by one (below), and in
                # smaller batches from now on.
                self._most = max(1, min(self._most, len(waiting)) // 2)
            else:
                self.batches += 1
                for (_, future), response in zip(waiting, reply.responses, strict=True):
                    _answer(future, response.response_delete_range)
                return
        for request, future in waiting:
            try:
                reply = await self._txn(_txn_of([request]))
            except BackendError as exc:
                if not future.done():
                    future.set_exception(exc)
            else:
                _answer(future, reply.responses[0].response_delete_range)

    async def aclose(self) -> None:
        """Stop the batches not sent yet (their callers are told the backend closed)."""
        await self._tasks.aclose()


def _txn_of(requests: list[Any]) -> Any:
    return rpc.TxnRequest(success=[rpc.RequestOp(request_delete_range=r) for r in requests])


def _answer(future: asyncio.Future[Any], response: Any) -> None:
    if not future.done():
        future.set_result(response)


def _fail(batch: _Batch, exc: BaseException) -> None:
    error: BaseException = (
        exc
        if isinstance(exc, BackendError)
        else BackendUnavailable("the backend closed before the delete was sent")
    )
    for _, future in batch.waiting:
        if not future.done():
            future.set_exception(error)
