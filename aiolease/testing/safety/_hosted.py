"""A backend hosted in a server process for the workers (``memory://`` lives in one process).

``python -m aiolease.testing.remote --url memory://`` serves it over TCP; workers
reach it as ``remote://HOST:PORT``. The same object is the :class:`ServerControl`
of that server: :meth:`kill` sends ``SIGKILL``, :meth:`start` starts it again on the
same port.
"""

from __future__ import annotations

import re
from pathlib import Path

from anyio.abc import Process

from ..._exceptions import BackendUnavailable
from ._procs import ChildError, first_line, python_module, stop_for_sure

__all__ = ["HostedServer"]

_LISTENING = re.compile(r"listening on (.+):(\d+)$")


class HostedServer:
    """One ``aiolease.testing.remote`` server process.

    :param url: the backend it serves (``memory://``)
    :param log: where its stderr goes
    :param loop: the event loop it runs on
    :param startup_timeout: seconds it may take to print its address
    """

    def __init__(
        self, url: str, log: Path, *, loop: str = "asyncio", startup_timeout: float = 60.0
    ) -> None:
        self.served_url = url
        self.log = log
        self.loop = loop
        self.startup_timeout = startup_timeout
        self.host = "127.0.0.1"
        self.port = 0
        self._process: Process | None = None

    def __repr__(self) -> str:
        return f"<HostedServer {self.served_url} at {self.host}:{self.port}>"

    def url(self, **query: object) -> str:
        """``remote://HOST:PORT``, with ``query`` options for the client."""
        options = "&".join(f"{k}={v}" for k, v in query.items())
        return f"remote://{self.host}:{self.port}" + (f"?{options}" if options else "")

    async def start(self) -> None:
        """Start the server (on the same port as before, if it ran before).

        :raises BackendUnavailable: it did not come up
        """
        args = ["--url", self.served_url, "--host", self.host, "--port", str(self.port)]
        process = await python_module(
            "aiolease.testing.remote", [*args, "--loop", self.loop], stderr=self.log
        )
        try:
            line = await first_line(process, self.startup_timeout, self.log)
            match = _LISTENING.search(line.strip())
            if match is None:
                raise ChildError(f"unexpected first line {line!r}")
        except ChildError as exc:
            await stop_for_sure(process)
            raise BackendUnavailable(f"the {self.served_url} server did not start: {exc}") from exc
        self.port = int(match.group(2))
        self._process = process

    async def kill(self) -> None:
        """Kill the server with ``SIGKILL`` and reap it."""
        process, self._process = self._process, None
        if process is not None:
            await stop_for_sure(process)

    async def aclose(self) -> None:
        """Stop the server if it runs."""
        await self.kill()
