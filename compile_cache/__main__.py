"""``python -m compile_cache``: the ``compile-cache`` command line (see :mod:`compile_cache.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
