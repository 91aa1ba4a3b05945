"""Tools for testing aiolease and its backends.

* :mod:`aiolease.testing.conformance`: the backend conformance checks (no pytest needed)
* :mod:`aiolease.testing.pytest_plugin`: ``--aiolease-url`` and the backend fixtures
* :mod:`aiolease.testing.model`: a hypothesis state machine holding a backend against
  the memory model (needs hypothesis)
* :mod:`aiolease.testing.faults`: :class:`~aiolease.testing.faults.FaultyBackend`
"""

from .conformance import CHECKS as CHECKS
from .conformance import BackendFactory as BackendFactory
from .conformance import Check as Check
from .conformance import check_backend as check_backend

__all__ = ["CHECKS", "BackendFactory", "Check", "check_backend"]
