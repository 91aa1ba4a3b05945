"""``python -m aiolease.testing.safety``: see :mod:`aiolease.testing.safety._cli`."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
