"""Inter-process locks that also work on NFS and Lustre, with holders, timeouts and stale-lock breaking.

A lock here only avoids duplicate work (two ranks compiling the same thing); the store's
correctness never depends on it, so every failure mode degrades to "no lock": a timeout raises
:class:`~compile_cache.errors.LockTimeoutError` and the caller goes on without it.

One strategy per file, behind one base class (:mod:`.base`: the timeout loop, the holder record,
logging, the threading guard):

``fcntl``  (:mod:`.fcntl_lock`) POSIX record lock on ``<base>.lock``, the default on local
           filesystems. The kernel drops it when the holder dies, so it never goes stale. If
           ``fcntl`` raises ``ENOLCK`` (NFS without lockd) the lock falls back to ``mkdir`` for
           that filesystem.
``flock``  (:mod:`.fcntl_lock`) BSD ``flock`` on ``<base>.lock``: fine locally, but on NFS it
           can be emulated or local to one client (Lustre ``localflock``), so it is never chosen
           automatically.
``mkdir``  (:mod:`.mkdir_lock`) the atomic creation of the name ``<base>.lockdir``, on every
           filesystem including NFS, Lustre and FUSE mounts: a symbolic link whose text is
           the holder record ``host:pid:time:namespace`` (never followed; nothing is written
           inside a lock). Waiters break the lock when its heartbeat is older than
           ``stale_after`` seconds, or when the holder's pid is dead in this pid namespace
           (:mod:`.scan`, also used by ``verify``).
``none``   no locking at all.

Heartbeat: while a lock is held, one thread per process rewrites its holder record every
``max(1, stale_after / 10)`` seconds, so a compile that runs for an hour keeps a fresh lock and a
crashed holder's lock goes stale within ``stale_after``. A waiter given ``wait_alive`` keeps
waiting past its timeout while the holder's heartbeat is fresh (:class:`BaseLock`).

The mode comes from ``COMPILE_CACHE_LOCK`` or the filesystem (:func:`lock_mode_for`, in
:mod:`.modes`). Waiting logs ``still waiting for <host:pid>`` every ``wait_log_interval``
seconds (10 by default) on the ``compile_cache`` logger.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError, LockTimeoutError
from .base import DEFAULT_STALE_AFTER, LOCAL_NAMESPACE, BaseLock, LockHolder, NoLock, read_holder
from .fcntl_lock import FcntlLock, FlockLock
from .mkdir_lock import MkdirLock
from .modes import LOCK_MODES, NETWORK_FILESYSTEMS, filesystem_type, lock_mode_for
from .ondisk import DirOpener
from .scan import break_stale_lock, is_stale

__all__ = [
    "DEFAULT_STALE_AFTER",
    "LOCAL_NAMESPACE",
    "LOCK_MODES",
    "NETWORK_FILESYSTEMS",
    "BaseLock",
    "DirOpener",
    "FileLock",
    "LockHolder",
    "break_stale_lock",
    "filesystem_type",
    "is_stale",
    "lock_mode_for",
    "make_lock",
    "optional_lock",
    "read_holder",
]

logger = logging.getLogger("compile_cache")

_STRATEGIES: dict[str, type[BaseLock]] = {
    "fcntl": FcntlLock,
    "flock": FlockLock,
    "mkdir": MkdirLock,
    "none": NoLock,
}


def make_lock(
    base: str | os.PathLike[str],
    *,
    mode: str | None = None,
    timeout: float | None = 60.0,
    stale_after: float = DEFAULT_STALE_AFTER,
    poll_interval: float = 0.05,
    wait_log_interval: float = 10.0,
    dir_mode: int = 0o700,
    file_mode: int = 0o600,
    wait_alive: float | None = None,
    directory: DirOpener | None = None,
) -> BaseLock:
    """The lock on ``base`` (a path without suffix) with the strategy for ``mode``.

    ``mode=None`` picks :func:`lock_mode_for` of ``base``'s directory; an unknown mode raises
    :class:`ConfigError`. ``timeout=None`` waits forever; ``0`` tries once. ``wait_alive``: go on
    waiting past ``timeout`` while the holder's heartbeat is fresh, up to that many seconds in all.
    ``directory`` opens the directory the lock lives in (a store passes its file layer's, which
    follows no link); by default ``base``'s parent is opened by its path.
    """
    if mode is None:
        mode, reason = lock_mode_for(Path(base).parent)
    elif mode not in _STRATEGIES:
        raise ConfigError(f"lock mode {mode!r} is not one of {', '.join(LOCK_MODES)}")
    else:
        reason = "requested"
    return _STRATEGIES[mode](
        base, timeout=timeout, stale_after=stale_after, poll_interval=poll_interval,
        wait_log_interval=wait_log_interval, dir_mode=dir_mode, file_mode=file_mode,
        reason=reason, wait_alive=wait_alive, directory=directory,
    )


#: The name the store and older callers use: ``FileLock(base, mode=..., timeout=...)``.
FileLock = make_lock


@contextlib.contextmanager
def optional_lock(lock: BaseLock, timeout: float | None = ...) -> Iterator[bool]:  # type: ignore[assignment]
    """Hold ``lock`` if it can be taken in time; yield whether it is held. Never raises for the lock.

    For callers whose correctness does not depend on the lock (all of the store's): a timeout or
    an I/O error just means "go on without it".
    """
    try:
        lock.acquire(timeout)
    except (LockTimeoutError, OSError) as exc:
        logger.debug("going on without lock %s: %s", lock.path, exc)
        yield False
        return
    try:
        yield True
    finally:
        lock.release()
