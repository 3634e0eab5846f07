"""Human sizes and ages: ``20G``, ``512M``, ``1.5GiB``; ``30d``, ``12h``, ``90m``.

Used for ``COMPILE_CACHE_MAX_SIZE``, ``prune --max-size 20G --older-than 30d`` and the ``ls`` /
``stats`` output. Size units are binary (``K`` = 1024, like ccache and ``du -h``); ``KB``, ``KiB``
and ``K`` all mean the same. A value that cannot be read raises :class:`ConfigError` naming it, so
a typo in an environment variable fails loudly instead of silently meaning "no limit".
"""

from __future__ import annotations

import math
import re

from .errors import ConfigError

__all__ = ["format_age", "format_size", "parse_age", "parse_size"]

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "p": 1 << 50,
}
_AGE_UNITS: dict[str, float] = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 7 * 86400.0,
}
_NUMBER = r"\s*(\d+(?:\.\d*)?|\.\d+)\s*"
_SIZE_RE = re.compile(_NUMBER + r"([kmgtp]?)(?:i?b)?\s*", re.IGNORECASE)
_AGE_RE = re.compile(_NUMBER + r"([a-z]*)\s*", re.IGNORECASE)


def parse_size(value: str | int | float, *, name: str = "size") -> int:
    """Bytes in ``value``: an int, or a string such as ``"20G"``, ``"512M"``, ``"1.5GiB"``, ``"100"``.

    ``name`` (e.g. ``"COMPILE_CACHE_MAX_SIZE"``) is put in the error message so the user knows
    which setting to fix. Negative, NaN or unknown-unit values raise :class:`ConfigError`.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size such as '20G', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name}: expected a non-negative size, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a size such as '20G', got {value!r}")
    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise ConfigError(
            f"{name}: cannot read size {value!r}; use a number with an optional unit "
            "B, K, M, G, T or P (binary: 1K = 1024 bytes), e.g. '20G' or '512M'"
        )
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[unit.lower()])


def format_size(nbytes: int | float) -> str:
    """``nbytes`` for people: ``"512 B"``, ``"1.5 KiB"``, ``"20.0 GiB"`` (binary units)."""
    value = float(nbytes)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def parse_age(value: str | int | float, *, name: str = "age") -> float:
    """Seconds in ``value``: a number of seconds, or a string such as ``"30d"``, ``"12h"``, ``"90m"``.

    Units: ``s``, ``m``/``min``, ``h``, ``d``, ``w``; no unit means seconds. Bad values raise
    :class:`ConfigError` naming ``name`` and the value.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected an age such as '30d', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name}: expected a non-negative age, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected an age such as '30d', got {value!r}")
    match = _AGE_RE.fullmatch(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _AGE_UNITS:
        raise ConfigError(
            f"{name}: cannot read age {value!r}; use a number with a unit s, m, h, d or w, "
            "e.g. '30d' or '12h'"
        )
    return float(match.group(1)) * _AGE_UNITS[unit]


def format_age(seconds: float) -> str:
    """``seconds`` for people, one unit, rounded down: ``"40s"``, ``"12m"``, ``"5h"``, ``"3d"``."""
    seconds = float(seconds)
    if not math.isfinite(seconds):  # a time read from another writer's record: not trusted
        return "?"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
