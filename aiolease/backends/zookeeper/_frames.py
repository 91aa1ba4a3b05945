"""A faster reader of ZooKeeper's reply frames for the connections of aiozk clients the
backend opens.

aiozk reads each reply in three awaits, two of them through ``asyncio.wait_for``,
which on Python 3.11 and older starts a task of its own each time (and sets a timer):
several event loop steps per reply, where the reply is most often in the socket's
buffer already. :class:`FrameConnection` reads a frame's size and then its body,
each one ``readexactly`` (no step at all when the bytes are buffered), and parses it
with :mod:`._codec` (the replies to the backend's own requests; aiozk's parts
parse the others, as aiozk does). Everything else (connecting, the read loop, watches, closing)
is aiozk's.

No read timeout per frame: a reply that stops halfway is a reply that does not come
in time, and :class:`._wire.Wire` bounds every request (the keeper's pings
included) and hands a connection that does not answer back to aiozk, which closes it
(cancelling this read) and connects again.

It is installed on a client's session (:func:`install`), so that only the backend's
own connections use it; a client the application passes in is left as it is.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiozk import exc as zk_exc
from aiozk import protocol
from aiozk.connection import Connection, reply_header_struct, size_struct

from ._codec import PARSERS

__all__ = ["FrameConnection", "install"]

_HEADER = reply_header_struct.size


class FrameConnection(Connection):  # type: ignore[misc]  # aiozk is untyped
    """aiozk's connection, reading each reply frame in (at most) two awaits."""

    async def read_response(self, initial_connect: bool = False) -> tuple[Any, Any, Any]:
        try:
            raw_size = await self.reader.readexactly(size_struct.size)
            (size,) = size_struct.unpack(raw_size)
            body = await self.reader.readexactly(size)
        except asyncio.IncompleteReadError:
            raise ConnectionAbortedError from None
        # The replies to connect and close carry no reply header.
        if initial_connect or self.pending_specials[protocol.CLOSE_XID]:
            return (None, None, protocol.ConnectResponse.deserialize(body))
        xid, zxid, error_code = reply_header_struct.unpack_from(body)
        if error_code:
            self.opcode_xref.pop(xid)
            return (xid, zxid, zk_exc.get_response_error(error_code))
        payload = body[_HEADER:]
        if xid == protocol.WATCH_XID:
            return (xid, zxid, protocol.WatchEvent.deserialize(payload))
        opcode = self.opcode_xref.pop(xid)
        parse = PARSERS.get(opcode)
        if parse is None:  # a request of aiozk's own (a ping, watches set again)
            return (xid, zxid, protocol.response_xref[opcode].deserialize(payload))
        return (xid, zxid, parse(payload))


def install(client: Any) -> None:
    """Make ``client``'s session open :class:`FrameConnection` connections (before it
    connects)."""
    session = client.session

    async def make_connection(host: str, port: int) -> Any:
        conn = FrameConnection(
            host, port, watch_handler=session.event_dispatch, read_timeout=session.read_timeout
        )
        try:
            await conn.connect()
        except Exception:  # as aiozk's own: the next server is tried
            return None
        return conn

    session.make_connection = make_connection
