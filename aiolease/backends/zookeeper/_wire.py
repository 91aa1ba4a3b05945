"""Requests to ZooKeeper over an aiozk client, and the session clock they feed.

aiozk keeps the connection (it reconnects, and re-registers watches); this module
sends the requests itself, over aiozk's connection, for three reasons:

* **no hidden retry**: aiozk's own ``send`` re-sends a request after a broken
  connection, so that a create could run twice. Here a request is sent once; a
  lost reply is reported as :class:`~aiolease.BackendUnavailable`, and the caller
  finds its node again by name (see :mod:`._nodes`).
* **pipelining**: several requests go out before any reply is awaited, and
  ZooKeeper answers a session's requests in order (a create, then the children of
  its parent: one round trip).
* **the session clock**: every reply on the backend's session moves
  :attr:`Wire.confirmed` to the time its request was *sent*. The server cannot
  have expired the session before ``confirmed + negotiated timeout``: that is the
  clock the leases' local deadlines follow, whatever aiozk believes of its state.

Errors: a ZooKeeper answer that a caller expects (no node, node exists) is returned
as the exception instance; everything else is mapped to
:class:`~aiolease.BackendUnavailable` or :class:`~aiolease.BackendTimeout`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiozk import exc as zk_exc
from aiozk.connection import size_struct
from aiozk.states import States

from ..._exceptions import BackendTimeout, BackendUnavailable
from .._asyncio import now, retrieve, timeout_after
from . import _codec as codec

__all__ = ["EXPECTED", "Then", "Wire"]

#: ZooKeeper answers a caller handles itself (returned, not raised).
EXPECTED: tuple[type[BaseException], ...] = (
    zk_exc.NoNode,
    zk_exc.NodeExists,
    zk_exc.NotEmpty,
    zk_exc.BadVersion,
)


#: Whether requests written while others' replies are awaited wait for the end of the
#: event loop's step, to go out together (see :meth:`Wire._write`).
CORK = True

#: Put aiozk's heartbeat off on a send only if it was put off longer ago than this
#: share of the session timeout.
BEAT_SLACK = 0.02


def _suspend(session: Any, conn: Any) -> None:
    """Tell aiozk that ``conn``, if still its connection, is lost: it reconnects."""
    connected = session.state.current_state in (States.CONNECTED, States.READ_ONLY)
    if session.conn is conn and connected:
        session.state.transition_to(States.SUSPENDED)


async def _abandon(session: Any) -> None:
    """Stop what aiozk may still run for ``session`` (a reconnect under way, a ping) and
    close its connection: a server cut off must not keep a half-open socket alive."""
    session.closing = True
    tasks = [t for t in (session.repair_loop_task, session.heartbeat_task) if t is not None]
    if session.heartbeat_handle is not None:
        session.heartbeat_handle.cancel()
    conn = session.conn
    if conn is not None and conn.read_loop_task is not None:
        tasks.append(conn.read_loop_task)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    if conn is not None and conn.writer is not None:
        conn.closing = True
        conn.writer.close()
    session.started = False


#: What :meth:`Wire.send` calls with the last request's reply future once it is done.
Then = Callable[["asyncio.Future[Any]"], object]


class _NoReply(Exception):
    """Set on the replies of requests that got none by their deadline (the watchdog)."""


@dataclass(eq=False)
class _Sent:
    """Requests written: where, on which session, when, their replies to come, and
    the time by which they must have come."""

    session: Any
    conn: Any
    sid: int
    at: float
    futures: list[asyncio.Future[Any]]
    deadline: float
    expired: bool = False


class Wire:
    """Requests over one aiozk client, and the clock of its session.

    :param client: a started (or to be started) ``aiozk.ZKClient``
    :param timeout: seconds one request may take
    :param described: the servers, for messages
    :param owned: whether the backend opened the client (and closes it)
    """

    def __init__(self, client: Any, timeout: float, described: str, owned: bool) -> None:
        self.client = client
        self.timeout = timeout
        self.described = described
        self.owned = owned
        #: The session id the backend's nodes ride on (0: none yet).
        self.session_id = 0
        #: The negotiated session timeout of :attr:`session_id`, seconds.
        self.negotiated = 0.0
        #: Local send time of the last request of :attr:`session_id` that was answered.
        self.confirmed = -math.inf
        #: Why the last request failed without an answer, if it did.
        self.error: BaseException | None = None
        #: Called with the old session id when replies come on a new session.
        self.on_new_session: Callable[[int], object] = lambda old: None
        self.requests = 0
        #: When aiozk's heartbeat was last put off (see :meth:`_write`).
        self._beat = -math.inf
        #: Requests written whose replies are awaited, and the one timer that fails
        #: those whose deadline passes (see :meth:`_watch`).
        self._inflight: dict[_Sent, None] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_at = math.inf
        #: Requests written while replies were awaited, to go out together at the end of
        #: the event loop's step (see :meth:`_write`), and their connection.
        self._corked: list[bytes] = []
        self._cork_told: list[str] = []
        self._cork_conn: Any = None
        self._flush_handle: asyncio.Handle | None = None
        #: Paths whose delete, once answered, sets these futures (see :meth:`deleted`).
        self._deletes: dict[str, list[asyncio.Future[bool]]] = {}

    @property
    def expires(self) -> float:
        """Local time before which the server cannot have expired the session."""
        return self.confirmed + self.negotiated

    def path(self, path: str) -> str:
        """``path`` as the client sends it (under a client's own chroot, if it has one)."""
        return str(self.client.normalize_path(path)) if self.client.chroot else path

    async def start(self) -> None:
        """Start the client's session (if it is not started yet), bounded by the timeout.

        :raises BackendUnavailable: no server answered in time
        """
        try:
            async with timeout_after(self.timeout):
                await self.client.session.start()
        except (asyncio.TimeoutError, OSError, zk_exc.ZKError) as exc:
            raise BackendUnavailable(
                f"ZooKeeper {self.described}: no session within {self.timeout:g}s ({exc!r})"
            ) from exc
        self._note_session(self.client.session, -math.inf)

    def _note_session(self, session: Any, sent: float) -> None:
        """Replies came on ``session``'s current id for requests sent at ``sent``."""
        sid = int(session.session_id or 0)
        if sid != self.session_id:
            old = self.session_id
            self.session_id = sid
            self.negotiated = float(session.timeout)
            self.confirmed = sent
            if old:
                self.on_new_session(old)
        elif sent > self.confirmed:
            self.confirmed = sent

    async def _connected(self, session: Any, deadline: float) -> None:
        if session.state.current_state == States.CONNECTED and session.conn is not None:
            return
        try:
            async with timeout_after(max(deadline - now(), 0.0)):
                await session.state.wait_for(States.CONNECTED)
        except asyncio.TimeoutError as exc:
            raise BackendTimeout(
                f"ZooKeeper {self.described}: not connected within {self.timeout:g}s"
            ) from exc

    async def send(
        self, *requests: Any, timeout: float | None = None, then: Then | None = None
    ) -> list[Any]:
        """Send ``requests`` back to back, once each; their responses in order (an
        expected ZooKeeper error, :data:`EXPECTED`, as the exception instance).

        :param then: called with the last request's reply future once it is done
            (answered, or failed), whoever awaits the replies

        :raises BackendUnavailable: the connection broke, or the server refused a request
        :raises BackendTimeout: no connection, or no reply, within the timeout
        """
        session = self.client.session
        deadline = now() + (self.timeout if timeout is None else timeout)
        if not session.started:
            raise BackendUnavailable(f"ZooKeeper {self.described}: the client is closed")
        reading = getattr(session.conn, "read_loop_task", None)
        if reading is not None and reading.done():
            _suspend(session, session.conn)  # its connection died: aiozk reconnects
        await self._connected(session, deadline)
        return await self._replies(self._write(requests, deadline, then))

    def send_now(self, *requests: Any, then: Then | None = None) -> Awaitable[list[Any]] | None:
        """:meth:`send`, the requests written before returning; ``None`` (nothing
        written) when the connection is not up."""
        session = self.client.session
        conn = session.conn
        reading = getattr(conn, "read_loop_task", None)
        if (
            not session.started
            or conn is None
            or conn.closing
            or reading is None
            or reading.done()
            or session.state.current_state != States.CONNECTED
        ):
            return None
        return self._replies(self._write(requests, now() + self.timeout, then))

    def _write(self, requests: tuple[Any, ...], deadline: float, then: Then | None = None) -> _Sent:
        """Write ``requests`` on the current connection (no wait); their replies are
        due by ``deadline``; ``then`` called with the last reply's future once done."""
        session = self.client.session
        conn = session.conn
        sent = _Sent(session, conn, int(session.session_id or 0), now(), [], deadline)
        loop = asyncio.get_running_loop()
        payloads = []
        told: list[str] = []  # paths of deletes that somebody waits for
        busy = bool(conn.pending)
        # aiozk's Connection.send, but one write (one system call) for them all.
        for request in requests:
            session.xid = session.xid % 0x7FFFFFFF + 1
            future: asyncio.Future[Any] = loop.create_future()
            future.add_done_callback(retrieve)
            if getattr(request, "then", None) is not None:
                future.add_done_callback(request.then)
            sent.futures.append(future)
            if conn.closing:
                future.set_exception(zk_exc.ConnectError(conn.host, conn.port))
                continue
            body = request.serialize(session.xid)
            payloads.append(size_struct.pack(len(body)) + body)
            if self._deletes and request.target in self._deletes:
                told.append(request.target)
            conn.opcode_xref[session.xid] = request.opcode
            conn.pending[session.xid] = future
        if payloads:
            if self._corked and self._cork_conn is not conn:
                self._flush()  # (what waits for another connection goes first)
            if self._corked or (CORK and busy):
                # Replies are awaited: this step's other writes join these, one
                # system call (and one read of the server's) for them all.
                self._corked.extend(payloads)
                self._cork_told.extend(told)
                self._cork_conn = conn
                if self._flush_handle is None:
                    self._flush_handle = loop.call_soon(self._flush)
            else:
                self._put(conn, payloads, told)
        if then is not None and sent.futures:
            sent.futures[-1].add_done_callback(then)
        self.requests += len(requests)
        self._inflight[sent] = None
        if deadline < self._watchdog_at:
            self._watch(deadline)
        if sent.at - self._beat > session.timeout * BEAT_SLACK:
            # What aiozk does on a send (its ping waits), at most so often: its ping
            # then comes at most that much sooner than it would have.
            self._beat = sent.at
            session.set_heartbeat()
        return sent

    def _put(self, conn: Any, payloads: list[bytes], told: list[str]) -> None:
        """Write ``payloads`` on ``conn`` (one system call)."""
        try:
            conn.writer.write(b"".join(payloads))
        except Exception:  # as aiozk: every pending request fails, the state follows
            conn.abort()
        else:
            for path in told:
                self._tell_deleted(path)

    def _flush(self) -> None:
        """Write what waits to be written (:meth:`_write`)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        conn, payloads, told = self._cork_conn, self._corked, self._cork_told
        self._cork_conn, self._corked, self._cork_told = None, [], []
        if not payloads:
            return
        if conn.closing:
            conn.abort()  # its requests fail (aiozk may have drained them already)
            return
        self._put(conn, payloads, told)

    def _watch(self, at: float) -> None:
        """Run :meth:`_expire` at ``at`` (instead of when it was due)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog_at = at
        self._watchdog = asyncio.get_running_loop().call_at(at, self._expire)

    def _expire(self) -> None:
        """Fail the replies of every request past its deadline (:class:`_NoReply`); wake
        again at the next deadline. One timer for all requests, not one per request:
        most replies come long before their deadline, and a timer set and cancelled
        per request was a good share of a request's own time."""
        self._watchdog, self._watchdog_at = None, math.inf
        current = now()
        due = math.inf
        for sent in list(self._inflight):
            if sent.deadline > current:
                due = min(due, sent.deadline)
                continue
            del self._inflight[sent]
            sent.expired = True
            for future in sent.futures:
                if not future.done():
                    future.set_exception(_NoReply())
        if due < math.inf:
            self._watch(due)

    async def _replies(self, sent: _Sent) -> list[Any]:
        try:
            # ZooKeeper answers a session's requests in order, and a broken connection
            # fails them all at once (and so does the watchdog, at their deadline):
            # once the last is done, all are. Awaited directly (asyncio.wait would cost
            # a step of the loop more).
            for future in reversed(sent.futures):
                if not future.done():
                    try:
                        await future
                    except Exception:  # noqa: S110 - its outcome is read below
                        pass
        finally:
            self._inflight.pop(sent, None)
        if sent.expired:
            # As aiozk's own heartbeat does: a server that does not answer in time is
            # left for another (or the same one, on a new connection).
            _suspend(sent.session, sent.conn)
            self.error = BackendTimeout(f"ZooKeeper {self.described}: no reply in time")
            raise BackendTimeout(f"ZooKeeper {self.described}: no reply within {self.timeout:g}s")
        return self._outcomes(sent.session, sent.conn, sent.sid, sent.at, sent.futures)

    def _outcomes(
        self, session: Any, conn: Any, sid: int, sent: float, futures: list[asyncio.Future[Any]]
    ) -> list[Any]:
        results: list[Any] = []
        failure: BaseException | None = None
        for future in futures:
            problem = future.exception()
            if problem is None:
                zxid, response = future.result()
                session.last_zxid = max(session.last_zxid or 0, zxid or 0)
                results.append(response)
            elif isinstance(problem, EXPECTED):
                results.append(problem)
            elif failure is None:
                failure = problem
        if failure is not None:
            if isinstance(failure, (zk_exc.ConnectError, zk_exc.ConnectionLoss)):
                _suspend(session, conn)  # as aiozk's own send does
            self.error = BackendUnavailable(f"ZooKeeper {self.described}: {failure!r}")
            raise BackendUnavailable(f"ZooKeeper {self.described}: {failure!r}") from failure
        if sid == session.session_id:
            self.error = None
            self._note_session(session, sent)
        return results

    # -- the requests the backend makes --------------------------------------------------

    # The requests the backend makes (see ._codec).
    create = staticmethod(codec.create)
    children = staticmethod(codec.children)

    async def create_and_list(
        self,
        path: str,
        parent: str,
        data: bytes,
        created_then: Callable[[Any], None] | None = None,
        listed_then: Callable[[Any], None] | None = None,
        listing: bool = True,
    ) -> tuple[Any, Any]:
        """Create the ephemeral sequential node ``path`` under ``parent`` (a container
        node, made first if it is missing or was reaped) and list ``parent``'s children,
        in one round trip when ``parent`` exists: the create's and the listing's
        responses (the listing's may be an expected error; ``None`` when not
        ``listing`` and ``parent`` existed). ``created_then``, ``listed_then``: each
        request's ``then`` (:class:`._codec.Request`).

        :raises BackendUnavailable: the node cannot be created
        """
        create = self.create(path, data, sequence=True, ephemeral=True, container=False)
        create.then = created_then
        children = self.children(parent)
        children.then = listed_then
        if not listing:
            (created,) = await self.send(create)
            if not isinstance(created, Exception):
                return created, None
        else:
            created, listed = await self.send(create, children)
        if isinstance(created, Exception):  # no parent node yet (or a container reaped)
            await self.send(
                self.create(parent, b"", sequence=False, ephemeral=False, container=True)
            )
            created, listed = await self.send(create, children)
            if isinstance(created, Exception):
                raise BackendUnavailable(f"ZooKeeper: cannot create a node under {parent!r}")
        return created, listed

    get = staticmethod(codec.get)
    multi = staticmethod(codec.multi)
    exists = staticmethod(codec.exists)
    set_data = staticmethod(codec.set_data)
    delete = staticmethod(codec.delete)

    def watch(self, kind: int, path: str) -> tuple[asyncio.Future[None], Callable[[], None]]:
        """A future set by the next ``kind`` event (``protocol.WatchEvent``) on ``path``,
        and the function that stops waiting for it. Register before the request that
        sets the watch, so that no event is missed."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def fire(_: object) -> None:
            if not future.done():
                future.set_result(None)

        session = self.client.session
        session.add_watch_callback(kind, path, fire)

        def stop() -> None:
            session.remove_watch_callback(kind, path, fire)

        return future, stop

    def deleted(self, path: str) -> asyncio.Future[bool]:
        """A future set to ``True`` once this wire writes a delete of ``path`` (as
        sent) on its connection, before the reply; to ``False`` by :meth:`wake_deleted`.
        No watch, no request of its own. Call :meth:`forget` with it when done.

        ZooKeeper applies one session's requests in the order they were written: any
        request this session writes afterwards is applied after the delete. (Whether
        the node is gone for the other sessions yet is another matter: see
        ``ZooKeeperBackend.wait_turn``.)"""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._deletes.setdefault(path, []).append(future)
        return future

    def _tell_deleted(self, path: str) -> None:
        for future in self._deletes.get(path, ()):
            if not future.done():
                future.set_result(True)

    def forget(self, path: str, future: asyncio.Future[bool]) -> None:
        """Stop the :meth:`deleted` ``future`` of ``path`` from being set."""
        waiting = self._deletes.get(path)
        if waiting is not None and future in waiting:
            waiting.remove(future)
            if not waiting:
                del self._deletes[path]

    def wake_deleted(self) -> None:
        """Set every :meth:`deleted` future to ``False`` (the backend closes)."""
        for waiting in self._deletes.values():
            for future in waiting:
                if not future.done():
                    future.set_result(False)

    async def aclose(self) -> None:
        """Close the client if the backend opened it (its session, and its nodes, end)."""
        if self._watchdog is not None and not self._inflight:
            self._watchdog.cancel()
            self._watchdog, self._watchdog_at = None, math.inf
        if not self.owned:
            return
        session = self.client.session
        try:
            if session.state.current_state == States.CONNECTED:
                async with timeout_after(self.timeout):
                    await self.client.close()
        except (asyncio.TimeoutError, OSError, zk_exc.ZKError):
            pass  # the session ends by itself after its timeout
        finally:
            await _abandon(session)
