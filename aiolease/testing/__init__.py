"""Tools for testing aiolease and its backends.

* :mod:`aiolease.testing.conformance`: the backend conformance checks (no pytest needed)
* :mod:`aiolease.testing.pytest_plugin`: ``--aiolease-url``, the backend fixtures and
  ``aiolease_server`` for the real servers of :mod:`aiolease.testing.servers`
* :mod:`aiolease.testing.model`: a hypothesis state machine holding a backend against
  the memory model (needs hypothesis)
* :mod:`aiolease.testing.faults`: :class:`~aiolease.testing.faults.FaultyBackend`
* :mod:`aiolease.testing.memory`: :class:`DrivenMemoryBackend`, for an application's
  own tests: a clock the test moves, and held leases lost on demand
* :mod:`aiolease.testing.proxy`: :class:`FaultProxy`, a TCP proxy that passes, delays,
  blackholes, resets or refuses traffic, switchable at run time
* :mod:`aiolease.testing.remote`: serve any backend over TCP (``remote://``)
* :mod:`aiolease.testing.etcd_cluster`: kill and restart members of the test etcd cluster
* :mod:`aiolease.testing.safety`: the multi-process safety harness under faults
"""

from .conformance import CHECKS as CHECKS
from .conformance import BackendFactory as BackendFactory
from .conformance import Check as Check
from .conformance import check_backend as check_backend
from .conformance import checks_for as checks_for
from .memory import DrivenMemoryBackend as DrivenMemoryBackend
from .proxy import FaultProxy as FaultProxy
from .proxy import ProxyMode as ProxyMode
from .proxy import ProxyStatistics as ProxyStatistics

__all__ = [
    "CHECKS",
    "BackendFactory",
    "Check",
    "DrivenMemoryBackend",
    "FaultProxy",
    "ProxyMode",
    "ProxyStatistics",
    "check_backend",
    "checks_for",
]
