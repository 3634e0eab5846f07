"""The ``python -m compile_cache`` command line (also ``compile-cache``): see :mod:`.main`.

``ls|stats|verify|prune|clear|export|import`` and ``explain`` without a TARGET never import
torch; ``warm``, ``doctor`` and ``explain TARGET`` import it when they run.
"""

from __future__ import annotations

from .main import build_parser, main
from .output import UsageError

__all__ = ["UsageError", "build_parser", "main"]
