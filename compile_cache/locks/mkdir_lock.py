"""``mkdir``: ``mkdir <base>.lockdir`` is atomic on every filesystem, including NFS and Lustre.

The holder writes ``host:pid:time:namespace`` into ``<base>.lockdir/owner`` and rewrites it with
a new ``time`` every heartbeat while it holds the lock. The lock survives a crashed holder, so
waiters break it when its heartbeat is older than ``stale_after`` seconds, or sooner when the
holder's pid is dead in this very pid namespace (:mod:`.scan`). Releasing renames the directory
aside first, and leaves it alone if someone broke and re-took it meanwhile.

Every step works in the lock's directory by descriptor (:mod:`.ondisk`): the new directory is
made private (0700), opened with ``O_NOFOLLOW | O_DIRECTORY``, checked to be a directory of this
user's, and only then given its mode with ``fchmod`` and its owner record (written inside it by
descriptor). A group member who swaps it for a link (to somebody's ``~/.ssh``) between the
``mkdir`` and the open makes this try fail, and nothing outside the store is touched. The
holder's later steps (heartbeat, release) first check that the name still holds the very
directory it made (device and inode).
"""

from __future__ import annotations

import logging
import os
import stat

from .._paths import atomic_write
from .base import LOCKDIR_SUFFIX, OWNER_FILE, BaseLock, LockHolder
from .ondisk import open_lockdir, read_record
from .scan import RELEASE_INFIX, aside_name, break_stale_lock_at, remove_at

__all__ = ["MkdirLock"]

logger = logging.getLogger("compile_cache")


class MkdirLock(BaseLock):
    """The ``mkdir`` strategy."""

    mode = "mkdir"
    suffix = LOCKDIR_SUFFIX

    def __init__(self, base: str | os.PathLike[str], **options: object) -> None:
        super().__init__(base, **options)  # type: ignore[arg-type]
        self._owner: LockHolder | None = None
        self._made: tuple[int, int] | None = None  # (st_dev, st_ino) of the directory we made

    def try_once(self) -> bool:
        name = self.path.name
        with self.directory() as dfd:
            try:
                os.mkdir(name, 0o700, dir_fd=dfd)
            except FileExistsError:
                if not break_stale_lock_at(dfd, self.path, stale_after=self.stale_after):
                    return False
                try:
                    os.mkdir(name, 0o700, dir_fd=dfd)
                except OSError:
                    return False
            return self._take(dfd, name)

    def _take(self, dfd: int, name: str) -> bool:
        """The directory just made at ``name``: ours only if the name still holds a directory of
        this user's (never a link put there since); then its mode and our record."""
        fd = open_lockdir(dfd, name)
        if fd is None:
            logger.warning("lock %s was replaced right after it was made (not a directory now); "
                           "not taking it", self.path)
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                logger.warning("lock %s was replaced right after it was made (owner uid %d); "
                               "not taking it", self.path, st.st_uid)
                return False
            os.fchmod(fd, self.dir_mode)  # exact, whatever the umask: the group can break it
            self._made = (st.st_dev, st.st_ino)
            self._owner = self._me()
            try:
                atomic_write(OWNER_FILE, self._owner.encode(), mode=self.file_mode, fsync=False, dir_fd=fd)
            except OSError as exc:  # informative only; an owner-less lock goes stale after a minute
                logger.debug("could not record lock owner in %s: %s", self.path, exc)
            return True
        finally:
            os.close(fd)

    def _ours(self, dfd: int) -> int | None:
        """A descriptor of our lock directory, if its name still holds the one we made."""
        fd = open_lockdir(dfd, self.path.name)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._made:
            os.close(fd)
            return None
        return fd

    def refresh(self) -> bool:
        with self.directory() as dfd:
            fd = self._ours(dfd)
            if fd is None:
                return False  # broken (renamed aside) by a waiter that found it stale
            try:
                raw = read_record(fd, OWNER_FILE)
                current = None if raw is None else LockHolder.parse(raw.decode("utf-8", errors="replace"))
                if current is not None and not current.same_process(self._owner):
                    return False  # broken and re-taken by someone else
                assert self._owner is not None
                self._owner = self._owner.beat()
                atomic_write(OWNER_FILE, self._owner.encode(), mode=self.file_mode, fsync=False, dir_fd=fd)
                return True
            finally:
                os.close(fd)

    def release_on_disk(self) -> None:
        with self.directory() as dfd:
            fd = self._ours(dfd)
            if fd is None:
                logger.warning("lock %s was broken while held here; leaving what is there now",
                               self.path)
                return
            try:  # non-blocking, bounded: a FIFO planted as the record never hangs the release
                raw = read_record(fd, OWNER_FILE)
            finally:
                os.close(fd)
            current = None if raw is None else LockHolder.parse(raw.decode("utf-8", errors="replace"))
            if raw is not None and not (current is not None and current.same_process(self._owner)):
                logger.warning(
                    "lock %s was broken and re-taken by %s while held here; leaving it",
                    self.path, current or "another process",
                )
                return
            aside = aside_name(self.path.name, RELEASE_INFIX)
            try:
                os.rename(self.path.name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                return
            remove_at(dfd, aside)
