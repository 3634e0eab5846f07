"""What every command shares: the program name, bad-input errors, and the output helpers.

Output follows ``ccache -s`` and ``hf cache ls``: aligned columns, human sizes and ages; every
reporting command also has ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._sizes import format_age
from ..errors import CompileCacheError

__all__ = ["PROG", "UsageError", "ago", "confirm", "is_tty", "pairs", "print_json", "table"]

def _prog(argv0: str) -> str:
    """The program as the user typed it: ``compile-cache`` (the console script) or, for
    ``python -m compile_cache`` and anything else, ``python -m compile_cache``."""
    name = os.path.basename(argv0 or "")
    if name in ("compile-cache", "compile-cache.exe"):
        return "compile-cache"
    return "python -m compile_cache"


PROG = _prog(sys.argv[0] if sys.argv else "")


class UsageError(CompileCacheError):
    """Bad command-line input: one line on stderr, exit code 2."""


def _finite(data: Any) -> Any:
    """``data`` with every float that is not finite (NaN, inf) as None: JSON has no such
    numbers, and a reader of ``--json`` must be able to parse what it gets."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def print_json(data: Any) -> None:
    """``data`` as strict JSON (never ``NaN`` or ``Infinity``) on stdout."""
    print(json.dumps(_finite(data), indent=2, sort_keys=True, default=str, allow_nan=False))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: set[int] | None = None) -> str:
    """Aligned columns, two spaces apart; columns in ``right`` are right-aligned."""
    right = right or set()
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def pairs(rows: Sequence[tuple[str, Any]], indent: str = "") -> str:
    """``label   value`` lines with the values aligned (``ccache -s`` style)."""
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"{indent}{label.ljust(width)}  {value}" for label, value in rows)


def ago(timestamp: float, now: float | None = None) -> str:
    if not timestamp:
        return "-"
    return f"{format_age((now or time.time()) - timestamp)} ago"


def is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def confirm(args: argparse.Namespace, question: str) -> bool:
    """True when ``-y`` was given or the user says yes on a TTY; refuses (UsageError) otherwise."""
    if args.yes:
        return True
    if not is_tty(sys.stdin):
        raise UsageError(f"refusing to {question} without confirmation: pass -y (stdin is not a terminal)")
    answer = input(f"{question[0].upper()}{question[1:]}? [y/N] ").strip().lower()
    return answer in ("y", "yes")


