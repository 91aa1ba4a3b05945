"""A TCP proxy that misbehaves on command, to cut a client off its real server.

* :class:`FaultProxy`: the proxy, run in a task group (``async with``)
* :class:`ProxyMode`: pass, delay, blackhole, reset, refuse
* :class:`ProxyStatistics`: what :meth:`FaultProxy.statistics` returns
* ``python -m aiolease.testing.proxy``: a proxy in its own process, switched over stdin
  (see :mod:`aiolease.testing.proxy._cli`)
"""

from ._cli import main as main
from ._proxy import CHUNK_SIZE as CHUNK_SIZE
from ._proxy import FaultProxy as FaultProxy
from ._proxy import ProxyMode as ProxyMode
from ._proxy import ProxyStatistics as ProxyStatistics

__all__ = ["CHUNK_SIZE", "FaultProxy", "ProxyMode", "ProxyStatistics", "main"]
