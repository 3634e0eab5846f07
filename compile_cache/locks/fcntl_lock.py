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
import secrets
import stat
from pathlib import Path

from .._paths import HOSTNAME, TEMP_MARKER
from . import modes
from .base import BaseLock
from .mkdir_lock import MkdirLock
from .ondisk import CLOEXEC, NOFOLLOW, NONBLOCK, open_record, own_file

__all__ = ["FcntlLock", "FlockLock"]

logger = logging.getLogger("compile_cache")

#: open() of the lock's name failing because what is there is not a lock file of ours to write:
#: a link (O_NOFOLLOW), a directory, another user's file without write access for us.
_NOT_OURS_ERRNOS = frozenset({errno.ELOOP, errno.EMLINK, errno.EISDIR, errno.EACCES, errno.EPERM,
                              errno.ENXIO, errno.ETXTBSY})
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

    def _lock_shared(self, fd: int) -> None:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)

    def try_once(self) -> bool:
        if self._fallback is not None:
            return self._fallback.try_once()
        with self.directory() as dfd:
            return self._try_at(dfd, self.path.name)

    def _try_at(self, dfd: int, name: str) -> bool:
        """One try in the lock's directory ``dfd``. Our own lock file (:func:`own_file`) is
        locked and written in place; anything else at the name (another member's file, a hard
        link to somebody's file, a FIFO, a link) is never written: locked first if it is a
        regular file (so that its holders are kept out), then replaced by a fresh file of ours."""
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | NOFOLLOW | NONBLOCK | CLOEXEC, self.file_mode,
                         dir_fd=dfd)
        except OSError as exc:
            if exc.errno in _NOT_OURS_ERRNOS:  # a link, another user's read-only file, a directory
                return self._replace(dfd, name, None)
            raise
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device: never locked, never written
            os.close(fd)
            return self._replace(dfd, name, None)
        if not self._lock_or_busy(fd, name):
            # closed: busy, or the filesystem refused the lock and the mkdir fallback answers
            return self._fallback.try_once() if self._fallback is not None else False
        if not own_file(st):
            return self._replace(dfd, name, fd)
        if not self._still_at(dfd, name, fd):  # unlinked (verify --fix) between open and lock
            os.close(fd)
            return False
        if stat.S_IMODE(st.st_mode) != self.file_mode:
            # exact, whatever the umask (group mode: 0664), so the next member can open it
            with contextlib.suppress(OSError):
                os.fchmod(fd, self.file_mode)
        self._hold(fd)
        return True

    def _lock_or_busy(self, fd: int, name: str) -> bool:
        """Lock ``fd``; False (``fd`` closed) when somebody holds it. ENOLCK and the like switch
        this lock to mkdir (its try's answer is then the fallback's, through ``_fallback``)."""
        try:
            self._lock(fd)
            return True
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            if exc.errno in _ENOLCK_ERRNOS:
                self._fall_back(self.path, exc)
                return False
            raise

    @staticmethod
    def _still_at(dfd: int, name: str, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino
        except FileNotFoundError:
            return False

    def _replace(self, dfd: int, name: str, held: int | None) -> bool:
        """Put a fresh lock file of ours, already locked, in place of what is at ``name``
        (``held``: that file, locked by us so that nobody takes it meanwhile), by renaming it
        over the name: the old file is never written, its link is replaced, not followed."""
        if held is None and self._held_elsewhere(dfd, name):
            return False
        fresh = f".{name}{TEMP_MARKER}{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, self.file_mode,
                         dir_fd=dfd)
        except OSError:
            if held is not None:
                os.close(held)
            raise
        try:
            os.fchmod(fd, self.file_mode)
            self._lock(fd)
            os.rename(fresh, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(fresh, dir_fd=dfd)
            logger.debug("could not replace lock %s: %s", self.path, exc)
            return False
        finally:
            if held is not None:
                os.close(held)  # its waiters find that the name holds another file now: retry
        logger.info("lock %s was not this user's own lock file; replaced it with a fresh one", self.path)
        self._hold(fd)
        return True

    def _held_elsewhere(self, dfd: int, name: str) -> bool:
        """Whether the regular file at ``name`` (that this process could not open for writing)
        is held by somebody: a shared lock on a read-only descriptor tells."""
        fd = open_record(dfd, name)
        if fd is None:
            return False
        try:
            self._lock_shared(fd)
        except OSError:
            return True
        finally:
            os.close(fd)  # closing drops the shared lock too
        return False

    def _hold(self, fd: int) -> None:
        """``fd`` (our own lock file, locked) is the lock now: write our record into it."""
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._new_holder(), 0)
        except OSError:
            pass  # the holder record is informative only
        self._fd = fd

    def _fall_back(self, path: Path, exc: OSError) -> None:
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
            wait_alive=self.wait_alive, directory=self.directory,
        )
        self.mode, self.reason = "mkdir", reason

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

    def _lock_shared(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
