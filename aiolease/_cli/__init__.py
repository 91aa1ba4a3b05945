"""The ``aiolease`` command (:mod:`aiolease.cli` is its public face).

* :mod:`._main`: the parser and the subcommands (``lock``, ``elect``, ``status``,
  ``watch``, ``demo``, ``safety``)
* :mod:`._where`: which backend the command uses when none is given
* :mod:`._process`: running the protected command, under a keeper on POSIX
* :mod:`._keeper`: the keeper, a standard-library-only script launched by path
* :mod:`._demo`: ``aiolease demo``
"""

from __future__ import annotations

from ._main import EXIT_ERROR, EXIT_LOST, EXIT_TIMEOUT, EXIT_USAGE, build_parser, main, run

__all__ = ["EXIT_ERROR", "EXIT_LOST", "EXIT_TIMEOUT", "EXIT_USAGE", "build_parser", "main", "run"]
