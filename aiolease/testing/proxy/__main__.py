"""``python -m aiolease.testing.proxy``: see :mod:`aiolease.testing.proxy._cli`."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
