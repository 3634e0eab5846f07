"""The ``compile-cache`` command line (also ``python -m compile_cache``): see :mod:`.main`.

``compile-cache ls|stats|verify|prune|clear|export|import`` never import torch; ``warm`` and
``doctor`` import it when they run.
"""

from __future__ import annotations

from .main import build_parser, main
from .output import UsageError

__all__ = ["UsageError", "build_parser", "main"]
