"""Safe relative paths and atomic writes, shared by the store and the restore code.

Pack members and archive members name files that will be written under a cache directory that
torch later ``pickle.loads`` and ``dlopen``\\ s: a name that escapes that directory would let a pack
write anywhere. So names are checked on write *and* on read, with one rule set:

* a non-empty ``str`` of POSIX relative parts joined by ``/``;
* no absolute path, no Windows drive, no backslash, no NUL or other control character;
* no empty part (``a//b``, trailing ``/``), no ``.`` or ``..`` part.

:func:`atomic_write` writes through a unique temporary name beside the target
(``.<name>.tmp-<host>-<pid>-<random>``), fsyncs and ``os.replace``\\ s, so a reader never sees a
half-written file and two writers of the same content never corrupt each other.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import socket
from collections.abc import Iterable
from pathlib import Path

from .errors import UnsafePathError

__all__ = [
    "HOSTNAME",
    "TEMP_MARKER",
    "atomic_write",
    "check_key",
    "check_member_name",
    "fsync_dir",
    "is_temp_name",
    "temp_path",
]

#: This host's name as it appears in temp names and lock holders (no ``:`` or ``/``).
HOSTNAME: str = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname() or "localhost")[:64]
#: Every temp file this package creates has this in its name; ``verify`` finds orphans by it.
TEMP_MARKER = ".tmp-"

_KEY_RE = re.compile(r"[0-9a-f]{8,128}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_DRIVE_RE = re.compile(r"^[A-Za-z]:")
MAX_MEMBER_NAME = 4096


def check_member_name(name: object) -> str:
    """Return ``name`` if it is a safe POSIX relative path, else raise :class:`UnsafePathError`.

    Used on every member name of a pack when it is written and again when it is read, and on
    every archive member on import: a crafted pack is rejected before anything is written.
    """
    if not isinstance(name, str):
        raise UnsafePathError(f"member name must be a str, got {type(name).__name__}: {name!r}")
    if not name:
        raise UnsafePathError("empty member name")
    if len(name) > MAX_MEMBER_NAME:
        raise UnsafePathError(f"member name longer than {MAX_MEMBER_NAME} characters: {name[:80]!r}...")
    if "\\" in name:
        raise UnsafePathError(f"backslash in member name {name!r}: only POSIX '/' paths are allowed")
    if _CONTROL_RE.search(name):
        raise UnsafePathError(f"NUL or control character in member name {name!r}")
    if name.startswith("/") or _DRIVE_RE.match(name):
        raise UnsafePathError(f"absolute member name {name!r}: only relative paths are allowed")
    for part in name.split("/"):
        if part in ("", ".", ".."):
            raise UnsafePathError(
                f"member name {name!r} has an empty, '.' or '..' part: it could escape its directory"
            )
    return name


def check_key(key: object) -> str:
    """Return ``key`` if it is a lower-case hex string of 8 to 128 digits, else raise ValueError.

    Keys become directory names; restricting them to hex keeps them path-safe by construction.
    """
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"cache key must be 8-128 lower-case hex digits, got {key!r}")
    return key


def temp_path(target: str | os.PathLike[str]) -> Path:
    """A unique temp name beside ``target``: ``.<name>.tmp-<host>-<pid>-<random>``."""
    target = Path(target)
    return target.with_name(
        f".{target.name[:120]}{TEMP_MARKER}{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}"
    )


def is_temp_name(name: str) -> bool:
    """Whether a file name looks like one :func:`temp_path` made."""
    return name.startswith(".") and TEMP_MARKER in name


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write fewer). Tests patch this."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:  # pragma: no cover - os.write raises instead on real errors
            raise OSError(errno.EIO, "short write")
        view = view[written:]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename into it survives a crash; best effort (not all FS allow it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    target: str | os.PathLike[str],
    data: bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview],
    *,
    mode: int = 0o600,
    fsync: bool = True,
    exclusive: bool = False,
    dir_fd: int | None = None,
) -> bool:
    """Write ``data`` to ``target`` so readers see the old file, or the whole new one, never a part.

    Writes a unique temp file in ``target``'s directory, fsyncs it, then ``os.replace``\\ s it (or,
    with ``exclusive=True``, hard-links it so the first writer wins and later writers leave the
    existing file alone). ``data`` may be a list of chunks, written in order. ``mode`` is applied
    exactly, regardless of the umask. ``dir_fd``: ``target`` is a plain name in the directory
    open at that descriptor (the store's file layer: nothing is resolved through a link). Returns
    whether ``target`` was written (always ``True`` unless ``exclusive`` and it already existed).
    Errors (``ENOSPC``, ``EACCES``...) propagate as ``OSError`` after the temp file is removed.
    """
    target = Path(target)
    tmp: Path | None = temp_path(target)
    at = {} if dir_fd is None else {"dir_fd": dir_fd}
    pair = {} if dir_fd is None else {"src_dir_fd": dir_fd, "dst_dir_fd": dir_fd}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode, **at)
    try:
        try:
            os.fchmod(fd, mode)
            if isinstance(data, (bytes, bytearray, memoryview)):
                data = (data,)
            for chunk in data:
                _write_all(fd, chunk)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            try:
                os.link(tmp, target, **pair)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                # No hard links here (some FUSE/SMB mounts): replace unless someone beat us to it.
                try:
                    os.stat(target, follow_symlinks=False, **at)
                    return False
                except FileNotFoundError:
                    pass
                os.replace(tmp, target, **pair)
                tmp = None
        else:
            os.replace(tmp, target, **pair)
            tmp = None
        if fsync:
            if dir_fd is None:
                fsync_dir(target.parent)
            else:
                with contextlib.suppress(OSError):
                    os.fsync(dir_fd)
        return True
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp, **at)
            except OSError:
                pass
