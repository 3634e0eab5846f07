"""Finding and breaking stale locks: what ``verify`` and waiting ``mkdir`` lockers use."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from .._paths import HOSTNAME
from .base import (
    DEFAULT_STALE_AFTER,
    LOCK_SUFFIX,
    LOCKDIR_SUFFIX,
    OWNER_FILE,
    read_holder,
)
from .observe import CLOCK_SKEW, unchanged_for

__all__ = [
    "break_stale_lock",
    "heartbeat_age",
    "is_lock_leftover",
    "is_lock_name",
    "is_stale",
    "read_holder",
]

logger = logging.getLogger("compile_cache")

#: Infixes of the names a lock directory is renamed to when it is broken or released.
STALE_INFIX = ".stale-"
RELEASE_INFIX = ".release-"


def is_lock_name(name: str) -> bool:
    """Whether ``name`` is a lock as this package writes it (``<base>.lock``/``<base>.lockdir``)."""
    return name.endswith((LOCK_SUFFIX, LOCKDIR_SUFFIX))


def is_lock_leftover(name: str) -> bool:
    """Whether ``name`` is a broken or released lock directory set aside (removable when old)."""
    return STALE_INFIX in name or RELEASE_INFIX in name


def heartbeat_age(lock_dir: str | os.PathLike[str]) -> float | None:
    """Seconds since the holder of a ``mkdir`` lock last showed it is alive: the newer of the
    time recorded in its owner file and that file's mtime (a holder's heartbeat refreshes
    them), each only if it is not in the future (beyond :data:`CLOCK_SKEW`). None when there
    is no readable owner file, or when every time it has is in the future."""
    path = Path(lock_dir)
    holder = read_holder(path)
    if holder is None:
        return None
    try:
        mtime = os.stat(path / OWNER_FILE).st_mtime
    except OSError:
        mtime = holder.time
    now = time.time()
    trusted = [t for t in (holder.time, mtime) if t <= now + CLOCK_SKEW]
    return max(0.0, now - max(trusted)) if trusted else None


def is_stale(
    lock_path: str | os.PathLike[str], *, stale_after: float = DEFAULT_STALE_AFTER,
    one_look: bool = False,
) -> bool:
    """Whether a lock left on disk is stale.

    For a ``.lockdir`` (mkdir lock) this is the breaking rule: its holder is dead in this pid
    namespace, or its heartbeat (:func:`heartbeat_age`) is older than ``stale_after`` seconds
    (``COMPILE_CACHE_LOCK_STALE``, 120 s). A holder on another host or container cannot be asked
    whether it lives, so a dead one costs its waiters ``stale_after`` seconds, not the lock
    timeout. For a ``.lock`` file
    (fcntl/flock) the kernel already released it if the holder died, so it is stale (removable
    garbage) when nobody holds it now and it has not been touched for ``stale_after`` seconds.

    A time in the future (a holder whose clock ran ahead) is never trusted: a waiter judges such
    a lock on its own clock, stale once its record has not changed for ``stale_after`` seconds
    (:func:`unchanged_for`); ``one_look`` (``verify``, which does not wait) calls it stale when
    its times are more than ``stale_after`` ahead.
    """
    path = Path(lock_path)
    if path.is_dir():
        holder = read_holder(path)
        limit = stale_after
        if holder is None:
            try:
                age = time.time() - path.stat().st_mtime
            except OSError:
                return False
            if age < -CLOCK_SKEW:  # made "in the future": judged by whether it changes
                return (-age > limit) if one_look else unchanged_for(path) > limit
            # An owner file is written microseconds after mkdir: missing for long means a crash.
            return age > limit
        if holder.is_alive() is False:
            return True
        beat = heartbeat_age(path)
        if beat is not None:
            return beat > limit
        if one_look:  # every time it has is ahead of ours: by more than the stale age, bogus
            return holder.time - time.time() > limit
        return unchanged_for(path / OWNER_FILE) > limit
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False
    if abs(age) <= stale_after:  # fresh, or in the future by less than the stale age
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
    """Remove the lock at ``lock_path`` if :func:`is_stale`; return whether it was removed.

    A lock directory is first renamed to a unique name (atomic: of two breakers only one wins),
    then its owner is re-read; if the lock changed hands in between, it is renamed back.
    """
    path = Path(lock_path)
    if not is_stale(path, stale_after=stale_after, one_look=one_look):
        return False
    if not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
            return True
        return False
    seen = read_holder(path)
    aside = path.with_name(f"{path.name}{STALE_INFIX}{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except OSError:
        return False  # somebody else broke it first
    now = read_holder(aside)
    if now != seen:  # it was released and re-taken between our check and the rename
        with contextlib.suppress(OSError):
            os.rename(aside, path)
            logger.debug("lock %s changed hands while breaking it; put it back", path)
            return False
    logger.warning("broke stale lock %s held by %s", path, seen or "nobody (no owner file)")
    shutil.rmtree(aside, ignore_errors=True)
    return True
