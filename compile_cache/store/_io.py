"""Small file and warning helpers shared by the store's modules (no layout, no format)."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._paths import check_key
from .._warnings import warn
from ..errors import UnsafeStoreError

logger = logging.getLogger("compile_cache")

#: A JSON file (entry.json, a stats shard) larger than this is garbage, not read.
MAX_JSON_BYTES = 4 << 20
#: A JSON record nested deeper than this is garbage, not parsed (ours nest 6 levels at most; a
#: deeply nested value planted by someone who can write the store or the bucket would otherwise
#: end in a RecursionError that no handler expects).
MAX_JSON_DEPTH = 32
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class StoreWarning(UserWarning):
    """A one-time, user-visible warning from the store (read-only store, disk full, corrupt pack)."""


_warned: set[tuple[str, str]] = set()


def warn_once(root: Path, what: str, message: str) -> None:
    """Warn once per (store, kind of problem) per process; log every time at debug."""
    logger.debug("%s", message)
    if (str(root), what) in _warned:
        return
    _warned.add((str(root), what))
    warn(message, StoreWarning)


def torch_version() -> str:
    """torch's version without importing torch (5 s) when it is not loaded yet."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(getattr(torch, "__version__", "unknown"))
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:
        return "unknown"


def errno_name(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, type(exc).__name__) if code else type(exc).__name__


def json_depth_ok(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``raw`` nests at most ``limit`` arrays/objects deep, told without
    parsing it: strings dropped, then the innermost ``[]``/``{}`` pairs removed ``limit`` times
    (each a C-speed pass). Unbalanced text passes here and fails in the parser."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return True
        shorter = _INNERMOST.sub(b"", brackets)
        if shorter == brackets:
            return True
        brackets = shorter
    return not brackets


def _no_constant(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON: a record holding one is garbage."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A JSON number too large for a float (``1e400``) is garbage, never ``inf``."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_json(raw: bytes | str, *, max_bytes: int = MAX_JSON_BYTES, what: str = "record") -> Any:
    """Parse one JSON record we read from the store (or a bucket), bounded in size and nesting
    depth: any failure is a ``ValueError`` saying why (a skipped record or a counted miss for
    the caller), never a ``RecursionError`` or ``MemoryError``."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise ValueError(f"{what} of {len(data)} bytes is over the limit of {max_bytes}")
    try:  # the C parser first: it gives up at once on a value nested a million deep
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, RecursionError, MemoryError) as exc:
        raise ValueError(f"{what} is not JSON: {type(exc).__name__}") from None
    if (data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH) and not json_depth_ok(data):
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def json_object(raw: bytes) -> tuple[dict[str, Any] | None, bool]:
    """(data, garbage) of a record that must be a JSON object: ``(None, True)`` unless it is one
    (see :func:`parse_json`)."""
    try:
        data = parse_json(raw)
    except ValueError:
        return None, True
    return (data, False) if isinstance(data, dict) else (None, True)


def key_list(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list of checked keys; a lone string (an easy slip for ``[key]``) is a TypeError."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"keys must be an iterable of cache keys, got {type(keys).__name__}: {keys!r}")
    return [check_key(k) for k in keys]


def check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}: {value!r}")
    return float(value)


def json_bytes(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()




def make_dirs(path: Path, anchor: Path | None, dir_mode: int) -> None:
    """Create ``path`` and its missing parents with ``dir_mode`` (exact, whatever the umask).

    Parents above ``anchor`` (the store root; None when creating the root itself) get the umask's
    mode. Reaching a missing ``anchor`` raises FileNotFoundError: the store itself is gone
    (removed, or an unmounted network path) and is not re-created under the mount point.
    """
    missing = []
    probe = path
    while not probe.is_dir():
        if probe == anchor:
            raise FileNotFoundError(errno.ENOENT, "compile cache directory vanished", str(anchor))
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        ours = anchor is not None or directory == path  # parents outside the store: umask
        try:
            os.mkdir(directory, dir_mode if ours else 0o777)
        except FileExistsError:
            continue
        if ours:
            _fchmod_new_dir(directory, dir_mode)


def _fchmod_new_dir(directory: Path, dir_mode: int) -> None:
    """Give the directory just made at ``directory`` its exact mode, on a descriptor opened
    without following a link, and only if it is this user's: never a chmod by path, which
    would follow a link swapped in since the mkdir."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, dir_mode)
    finally:
        os.close(fd)


def make_private_dirs(base: Path, parts: tuple[str, ...], group_mode: bool = False) -> bool:
    """Make ``base/parts[0]/parts[1]/...``: ``base`` (the user's cache dir or a directory the
    user chose) with ``os.makedirs`` at 0700 where missing, then each of ``parts`` below it at
    0700 exactly, reached without following a link and refused (:class:`UnsafeStoreError`)
    when it is a link, not a directory, or a directory others could plant files in
    (``group_mode``: a group-shared store's, :func:`~.safety.trust_problem`). True if the last
    one was made now (then it is empty)."""
    from .safety import trust_problem

    os.makedirs(base, 0o700, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    made = False
    try:
        for i, name in enumerate(parts):
            shown = base.joinpath(*parts[: i + 1])
            made = False
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
                made = True
            except FileExistsError:
                pass
            try:
                nfd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                              | getattr(os, "O_CLOEXEC", 0), dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise UnsafeStoreError(f"refusing to use {shown}: it is a symlink or not a directory "
                                           "(a local tier is reached without following links)") from None
                raise
            os.close(fd)
            fd = nfd
            if made:
                os.fchmod(fd, 0o700)
            problem = trust_problem(os.fstat(fd), shown, group_mode)
            if problem is not None:
                raise UnsafeStoreError(problem.message)
        return made
    finally:
        os.close(fd)


def reset_warnings() -> None:
    """Forget which one-time warnings were shown (tests)."""
    _warned.clear()
