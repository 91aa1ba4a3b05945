"""``python -m aiolease.testing.proxy``: a :class:`FaultProxy` in its own process.

For tests that must cut another OS process off its server: start the proxy,
point that process at it, and switch modes by writing lines to the proxy's stdin::

    $ python -m aiolease.testing.proxy --target 127.0.0.1:6379
    listening on 127.0.0.1:41234
    delay 0.2
    ok delay
    blackhole
    ok blackhole
    stats
    ok blackhole latency=0 connections=1 accepted=1 to_target=14 to_client=7 held=14
    warp
    error unknown command 'warp'; one of: pass, delay SECONDS, blackhole, reset, refuse, ...

The first line of stdout gives the address. Then each command line gets one
answer line, printed once the mode is in force: ``ok <mode> ...`` or
``error <why>``. Blank lines are ignored. ``quit``, or the end of stdin (the
parent went away), stops the proxy and closes every connection.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import anyio

from ..._exceptions import InvalidArgument
from ._proxy import FaultProxy, ProxyMode

__all__ = ["main", "parse_address"]

COMMANDS = "pass, delay SECONDS, blackhole, reset, refuse, stats, quit"


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6 host]:port`` -> ``(host, port)``.

    :raises InvalidArgument: no host, or no port number
    """
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise InvalidArgument(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the proxy until ``quit`` or the end of stdin; the exit status.

    :param argv: the arguments (default: ``sys.argv[1:]``)
    """
    parser = argparse.ArgumentParser(
        prog="python -m aiolease.testing.proxy",
        description="A TCP proxy that injects faults, switched by commands on stdin: " + COMMANDS,
    )
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="the server")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any)")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args(argv)
    try:
        proxy = FaultProxy(*parse_address(args.target), host=args.host, port=args.port)
    except InvalidArgument as exc:
        parser.error(str(exc))
    try:
        anyio.run(_serve, proxy, _LineReader(sys.stdin.fileno()), backend=args.backend)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _serve(proxy: FaultProxy, commands: _LineReader) -> None:
    async with proxy:
        _answer(f"listening on {proxy.address}")
        while (line := await commands.readline()) is not None:
            if not line:
                continue
            if line == "quit":
                break
            _answer(await _run(proxy, line))


async def _run(proxy: FaultProxy, line: str) -> str:
    """Carry out one command; its answer."""
    word, *rest = line.split()
    try:
        if word == "stats" and not rest:
            return "ok " + _stats(proxy)
        if word == "delay" and len(rest) == 1:
            await proxy.delay(_seconds(rest[0]))
        elif word in {"pass", "blackhole", "reset", "refuse"} and not rest:
            await proxy.set_mode(ProxyMode(word))
        else:
            raise InvalidArgument(f"unknown command {line!r}; one of: {COMMANDS}")
    except (InvalidArgument, OSError) as exc:
        return f"error {exc}"
    return f"ok {proxy.mode.value}"


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidArgument(f"delay takes seconds, got {text!r}") from None


def _stats(proxy: FaultProxy) -> str:
    s = proxy.statistics()
    return (
        f"{s.mode.value} latency={s.latency:g} connections={s.connections}"
        f" accepted={s.accepted} to_target={s.bytes_to_target} to_client={s.bytes_to_client}"
        f" held={s.held_bytes}"
    )


def _answer(line: str) -> None:
    print(line, flush=True)


class _LineReader:
    """Lines from a file descriptor (a pipe or a terminal), without a thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = b""
        self._eof = False

    async def readline(self) -> str | None:
        """The next line, stripped; None at the end of input."""
        while b"\n" not in self._buffer and not self._eof:
            await self._wait_readable()
            data = os.read(self._fd, 4096)  # readable: this does not block
            self._eof = not data
            self._buffer += data
        if not self._buffer:
            return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8", "replace").strip()

    async def _wait_readable(self) -> None:
        try:
            await anyio.wait_readable(self._fd)
        except PermissionError:  # a regular file or /dev/null: never blocks
            await anyio.lowlevel.checkpoint()
