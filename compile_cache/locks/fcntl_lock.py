"""``fcntl`` and ``flock``: kernel locks on ``<base>.lock``, released by the kernel if the holder dies.

``fcntl`` (POSIX record locks) is the default on local filesystems. ``flock`` (BSD) is fine
locally, but on NFS it can be emulated or local to one client (Lustre ``localflock``), so it is
never chosen automatically. Where the filesystem refuses the lock (``ENOLCK`` from NFS without
lockd, ``EOPNOTSUPP``...), the lock falls back to ``mkdir`` for that filesystem, from then on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path

from . import modes
from .base import BaseLock
from .mkdir_lock import MkdirLock

__all__ = ["FcntlLock", "FlockLock"]

logger = logging.getLogger("compile_cache")

_ENOLCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})


class FcntlLock(BaseLock):
    """The ``fcntl`` strategy (``fcntl.lockf``)."""

    mode = "fcntl"

    def __init__(self, base: str | os.PathLike[str], **options: object) -> None:
        super().__init__(base, **options)  # type: ignore[arg-type]
        self._fd: int | None = None
        self._fallback: MkdirLock | None = None  # after ENOLCK: the mkdir lock in its place

    @property
    def path(self) -> Path:
        return self._fallback.path if self._fallback is not None else super().path

    def _lock(self, fd: int) -> None:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock(self, fd: int) -> None:
        fcntl.lockf(fd, fcntl.LOCK_UN)

    def try_once(self) -> bool:
        if self._fallback is not None:
            return self._fallback.try_once()
        path = self.path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), self.file_mode)
        except FileNotFoundError:
            self._ensure_parent()
            return False
        self._exact_mode(fd)
        try:
            self._lock(fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            if exc.errno in _ENOLCK_ERRNOS:
                return self._fall_back(path, exc)
            raise
        try:
            # The file may have been unlinked (verify --fix) between open and lock: retry then.
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                os.close(fd)
                return False
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._new_holder(), 0)
        except FileNotFoundError:
            os.close(fd)
            return False
        except OSError:
            pass  # the holder record is informative only
        self._fd = fd
        return True

    def _exact_mode(self, fd: int) -> None:
        """Our own lock file gets the store's mode whatever the umask (group mode: 0664), so the
        next member of the group can open it for writing."""
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and (st.st_mode & 0o7777) != self.file_mode:
                os.fchmod(fd, self.file_mode)

    def _fall_back(self, path: Path, exc: OSError) -> bool:
        code = errno.errorcode.get(exc.errno or 0, str(exc))
        modes.note_enolck(path)
        logger.warning(
            "%s locking is not supported on %s (%s); falling back to mkdir locks",
            self.mode, path.parent, code,
        )
        reason = f"{self.mode} raised {code}"
        self._fallback = MkdirLock(
            self.base, timeout=self.timeout, stale_after=self.stale_after,
            poll_interval=self.poll_interval, wait_log_interval=self.wait_log_interval,
            dir_mode=self.dir_mode, file_mode=self.file_mode, reason=reason,
            wait_alive=self.wait_alive,
        )
        self.mode, self.reason = "mkdir", reason
        return self._fallback.try_once()

    def refresh(self) -> bool:
        if self._fallback is not None:
            return self._fallback.refresh()
        if self._fd is None:
            return True
        record = self._new_holder()
        os.pwrite(self._fd, record, 0)  # overwrite in place: a reader never sees an empty record
        os.ftruncate(self._fd, len(record))
        return True

    def release_on_disk(self) -> None:
        if self._fallback is not None:
            self._fallback.release_on_disk()
            return
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        try:
            self._unlock(fd)
        finally:
            os.close(fd)


class FlockLock(FcntlLock):
    """The ``flock`` strategy (``fcntl.flock``)."""

    mode = "flock"

    def _lock(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
