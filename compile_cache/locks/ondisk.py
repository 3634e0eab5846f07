"""Where a lock's files are reached: a directory descriptor, and single names in it.

A lock lives in a directory that other users may write (a group-shared store's ``locks/``), so
nothing a lock does is resolved through a path. The directory is opened once per step by a
:data:`DirOpener` (the store passes its own file layer's walk, which follows no link from the
store's root down: :meth:`compile_cache.store.fs.StoreFS.directory_opener`); inside it every
name is created, opened, renamed or removed relative to that descriptor with ``O_NOFOLLOW``,
records are opened non-blocking and read bounded (a FIFO planted as a record never hangs), and
modes change only through ``fchmod`` on a descriptor. A file is written only when
:func:`own_file` says it is a regular file with one link that this user owns: a hard link to
somebody's file (``fs.protected_hardlinks=0``), a FIFO or another member's file is never
written, only replaced by renaming a fresh file of ours over its name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

__all__ = [
    "LINK_ERRNOS",
    "DirOpener",
    "open_lockdir",
    "open_record",
    "own_file",
    "path_directory",
    "read_link",
    "read_record",
]

#: A callable that opens the directory the lock lives in: ``with opener() as dfd: ...``.
DirOpener = Callable[[], AbstractContextManager[int]]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC
RECORD_FLAGS = os.O_RDONLY | NOFOLLOW | NONBLOCK | CLOEXEC
#: open() of a link with O_NOFOLLOW (ELOOP; some systems say EMLINK or EFTYPE), or of a
#: non-directory with O_DIRECTORY (ENOTDIR).
LINK_ERRNOS = frozenset({errno.ELOOP, errno.EMLINK, errno.ENOTDIR, getattr(errno, "EFTYPE", errno.ELOOP)})
#: A holder record is one short line; more is never read.
RECORD_LIMIT = 200


def path_directory(parent: str | os.PathLike[str], mode: int) -> DirOpener:
    """The opener of a lock directory given by the caller's own path (a lock outside a store):
    created with ``mode`` (set exactly on its descriptor) when missing; the path itself is the
    caller's, as given."""
    parent = Path(parent)

    @contextlib.contextmanager
    def opener() -> Iterator[int]:
        made = False
        try:
            fd = os.open(parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC)
        except FileNotFoundError:
            os.makedirs(parent.parent, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(parent, 0o700)
                made = True
            fd = os.open(parent, DIR_FLAGS)
        try:
            if made:
                st = os.fstat(fd)
                if st.st_uid == os.geteuid():
                    os.fchmod(fd, mode)  # exact, whatever the umask
            yield fd
        finally:
            os.close(fd)

    return opener


def own_file(st: os.stat_result) -> bool:
    """Whether a lock file with status ``st`` may be written by this process: a regular file
    with exactly one link, owned by this user (a second link would make a write reach
    somebody's file elsewhere)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()


def open_lockdir(dfd: int, name: str) -> int | None:
    """A descriptor of the lock directory ``name`` in ``dfd`` (never through a link); None when
    there is none, or a link or anything but a directory is there."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dfd)
    except OSError:
        return None


def open_record(dfd: int, name: str) -> int | None:
    """A read-only descriptor of the regular file ``name`` in ``dfd`` (non-blocking, never
    through a link); None for a link, a FIFO, a device, a directory or nothing."""
    try:
        fd = os.open(name, RECORD_FLAGS, dir_fd=dfd)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def read_link(dfd: int, name: str) -> str | None:
    """The text of the symbolic link ``name`` in ``dfd`` (a ``mkdir`` lock's holder record), at
    most :data:`RECORD_LIMIT` characters; None when ``name`` is not a link. ``readlink`` never
    follows the link and never blocks."""
    try:
        text = os.readlink(name, dir_fd=dfd)
    except (OSError, ValueError):
        return None
    return text[:RECORD_LIMIT] if isinstance(text, str) else None


def read_record(dfd: int, name: str, inner: str | None = None) -> bytes | None:
    """At most :data:`RECORD_LIMIT` bytes of the regular file ``name`` in ``dfd`` (``inner``:
    of the file ``inner`` in the directory ``name``), or None if it is not one; never blocks,
    never follows a link."""
    where = dfd
    if inner is not None:
        sub = open_lockdir(dfd, name)
        if sub is None:
            return None
        where, name = sub, inner
    try:
        fd = open_record(where, name)
        if fd is None:
            return None
        try:
            return os.read(fd, RECORD_LIMIT)
        except OSError:
            return None
        finally:
            os.close(fd)
    finally:
        if where != dfd:
            os.close(where)
