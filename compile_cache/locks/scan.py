"""Finding and breaking stale locks: what ``verify`` and waiting ``mkdir`` lockers use."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from .._paths import HOSTNAME
from .base import (
    DEFAULT_STALE_AFTER,
    LOCK_SUFFIX,
    LOCKDIR_SUFFIX,
    OWNER_FILE,
    read_holder,
    read_holder_at,
)
from .observe import CLOCK_SKEW, unchanged_for
from .ondisk import CLOEXEC, open_lockdir, open_record, read_link

__all__ = [
    "aside_name",
    "break_stale_lock",
    "break_stale_lock_at",
    "heartbeat_age",
    "heartbeat_age_at",
    "is_lock_leftover",
    "is_lock_name",
    "is_stale",
    "is_stale_at",
    "read_holder",
    "remove_at",
]

logger = logging.getLogger("compile_cache")

#: Infixes of the names a lock is renamed to when it is broken or released, and of the temp
#: name a ``mkdir`` lock's heartbeat makes its new link at.
STALE_INFIX = ".stale-"
RELEASE_INFIX = ".release-"
BEAT_INFIX = ".beat-"


def is_lock_name(name: str) -> bool:
    """Whether ``name`` is a lock as this package writes it (``<base>.lock``/``<base>.lockdir``)."""
    return name.endswith((LOCK_SUFFIX, LOCKDIR_SUFFIX))


def is_lock_leftover(name: str) -> bool:
    """Whether ``name`` is a broken or released lock set aside, or a heartbeat's temp link
    (removable when old)."""
    return STALE_INFIX in name or RELEASE_INFIX in name or BEAT_INFIX in name


@contextlib.contextmanager
def _parent_of(lock_path: str | os.PathLike[str]) -> Iterator[int]:
    """The directory of a lock given by the caller's own path."""
    fd = os.open(Path(lock_path).parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _lstat(dfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None


def heartbeat_age(lock_dir: str | os.PathLike[str]) -> float | None:
    """:func:`heartbeat_age_at` of a lock directory given by path."""
    try:
        with _parent_of(lock_dir) as dfd:
            return heartbeat_age_at(dfd, Path(lock_dir).name)
    except OSError:
        return None


def heartbeat_age_at(dfd: int, name: str) -> float | None:
    """Seconds since the holder of the ``mkdir`` lock ``name`` (in the directory open at
    ``dfd``) last showed it is alive: the newer of the time in its record and the record's
    mtime (the link's own, or an older release's owner file's; a holder's heartbeat refreshes
    them), each only if it is not in the future (beyond :data:`CLOCK_SKEW`). None when there is
    no readable record, or when every time it has is in the future."""
    holder = read_holder_at(dfd, name)
    if holder is None:
        return None
    mtime = holder.time
    own = _lstat(dfd, name)
    if own is not None and stat.S_ISLNK(own.st_mode):
        mtime = own.st_mtime
    elif own is not None and (sub := open_lockdir(dfd, name)) is not None:
        try:
            mtime = os.stat(OWNER_FILE, dir_fd=sub, follow_symlinks=False).st_mtime
        except OSError:
            pass
        finally:
            os.close(sub)
    now = time.time()
    trusted = [t for t in (holder.time, mtime) if t <= now + CLOCK_SKEW]
    return max(0.0, now - max(trusted)) if trusted else None


def is_stale(
    lock_path: str | os.PathLike[str], *, stale_after: float = DEFAULT_STALE_AFTER,
    one_look: bool = False,
) -> bool:
    """:func:`is_stale_at` of a lock given by path."""
    try:
        with _parent_of(lock_path) as dfd:
            return is_stale_at(dfd, lock_path, stale_after=stale_after, one_look=one_look)
    except OSError:
        return False


def is_stale_at(
    dfd: int, lock_path: str | os.PathLike[str], *, stale_after: float = DEFAULT_STALE_AFTER,
    one_look: bool = False,
) -> bool:
    """Whether the lock left on disk at ``lock_path`` (its name in the directory open at
    ``dfd``: nothing is resolved through a path) is stale.

    For a ``.lockdir`` (mkdir lock: a link, or an older release's directory) this is the
    breaking rule: its holder is dead in this pid
    namespace, or its heartbeat (:func:`heartbeat_age_at`) is older than ``stale_after`` seconds
    (``COMPILE_CACHE_LOCK_STALE``, 120 s). A holder on another host or container cannot be asked
    whether it lives, so a dead one costs its waiters ``stale_after`` seconds, not the lock
    timeout. A link whose text is no record (a member's) is stale once ``stale_after`` old, and
    is then removed as a link, never followed. For a ``.lock`` file (fcntl/flock) the kernel
    already released it if the holder died, so it is stale (removable garbage) when nobody holds
    it now and it has not been touched for ``stale_after`` seconds. Anything else (a FIFO) is
    never a stale lock.

    A time in the future (a holder whose clock ran ahead) is never trusted: a waiter judges such
    a lock on its own clock, stale once its record has not changed for ``stale_after`` seconds
    (:func:`unchanged_for`); ``one_look`` (``verify``, which does not wait) calls it stale when
    its times are more than ``stale_after`` ahead.
    """
    name = os.path.basename(os.fspath(lock_path))
    st = _lstat(dfd, name)
    if st is None:
        return False
    limit = stale_after
    if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
        holder = read_holder_at(dfd, name)
        if holder is None:
            age = time.time() - st.st_mtime
            if age < -CLOCK_SKEW:  # made "in the future": judged by whether it changes
                return (-age > limit) if one_look else unchanged_for(dfd, lock_path) > limit
            # A link is made with its record; an older release's directory gets its owner file
            # microseconds after mkdir: missing for long means a crash, or a member's link.
            return age > limit
        if holder.is_alive() is False:
            return True
        beat = heartbeat_age_at(dfd, name)
        if beat is not None:
            return beat > limit
        if one_look:  # every time it has is ahead of ours: by more than the stale age, bogus
            return holder.time - time.time() > limit
        return unchanged_for(dfd, lock_path) > limit
    if not stat.S_ISREG(st.st_mode):
        return False
    if abs(time.time() - st.st_mtime) <= stale_after:  # fresh, or ahead by less than the stale age
        return False
    fd = open_record(dfd, name)
    if fd is None:
        return False
    try:  # a shared lock can be taken on a read-only descriptor: nobody holds it exclusively
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def break_stale_lock(
    lock_path: str | os.PathLike[str], *, stale_after: float = DEFAULT_STALE_AFTER,
    one_look: bool = False,
) -> bool:
    """:func:`break_stale_lock_at` of a lock given by path."""
    try:
        with _parent_of(lock_path) as dfd:
            return break_stale_lock_at(dfd, lock_path, stale_after=stale_after, one_look=one_look)
    except OSError:
        return False


def aside_name(name: str, infix: str) -> str:
    """A unique name beside the lock ``name`` for it to be renamed to (broken or released)."""
    return f"{name}{infix}{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}"


def break_stale_lock_at(
    dfd: int, lock_path: str | os.PathLike[str], *, stale_after: float = DEFAULT_STALE_AFTER,
    one_look: bool = False,
) -> bool:
    """Remove the lock at ``lock_path`` (its name in the directory open at ``dfd``) if
    :func:`is_stale_at`; return whether it was removed.

    A lock link (or an older release's lock directory) is first renamed to a unique name
    (atomic: of two breakers only one wins), then its record is re-read; if the lock changed
    hands in between, it is put back (a link made anew with the same text: a rename back could
    replace a lock taken since). Every step is relative to ``dfd``; what a link points to is
    never touched.
    """
    name = os.path.basename(os.fspath(lock_path))
    if not is_stale_at(dfd, lock_path, stale_after=stale_after, one_look=one_look):
        return False
    st = _lstat(dfd, name)
    if st is None:
        return False
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)
            return True
        return False
    seen = read_holder_at(dfd, name)
    aside = aside_name(name, STALE_INFIX)
    try:
        os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError:
        return False  # somebody else broke it first
    now = read_holder_at(dfd, aside)
    if now != seen:  # it was released and re-taken between our check and the rename
        text = read_link(dfd, aside)
        with contextlib.suppress(OSError):
            if text is not None:
                os.symlink(text, name, dir_fd=dfd)
                os.unlink(aside, dir_fd=dfd)
            else:
                os.rename(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            logger.debug("lock %s changed hands while breaking it; put it back", lock_path)
            return False
    logger.warning("broke stale lock %s held by %s", lock_path, seen or "nobody (no owner file)")
    remove_at(dfd, aside)
    return True


def remove_at(dfd: int, name: str) -> None:
    """Remove ``name`` in the directory open at ``dfd``, a tree or a file; links removed as
    links, never followed; best effort."""
    st = _lstat(dfd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)
