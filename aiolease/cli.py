"""The ``aiolease`` command: hold a lock or lead an election around a program.

The console script ``aiolease`` and ``python -m aiolease`` run :func:`main`; the
command itself lives in :mod:`aiolease._cli` (see :mod:`aiolease._cli._main` for its
usage and exit statuses).
"""

from __future__ import annotations

from ._cli import EXIT_ERROR as EXIT_ERROR
from ._cli import EXIT_LOST as EXIT_LOST
from ._cli import EXIT_TIMEOUT as EXIT_TIMEOUT
from ._cli import EXIT_USAGE as EXIT_USAGE
from ._cli import build_parser as build_parser
from ._cli import main as main
from ._cli import run as run

__all__ = ["EXIT_ERROR", "EXIT_LOST", "EXIT_TIMEOUT", "EXIT_USAGE", "build_parser", "main", "run"]
