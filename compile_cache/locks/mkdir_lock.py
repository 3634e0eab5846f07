"""``mkdir``: the lock for network and cluster filesystems (NFS, Lustre, FUSE mounts), where a
lock is the atomic creation of a name in the locks directory.

The name ``<base>.lockdir`` is a **symbolic link whose text is the holder record**
(``host:pid:time:namespace``; the link is never followed, only read with ``readlink``).
``symlink`` is as atomic as ``mkdir`` on every filesystem (it fails when the name exists), and
the record comes with it: nothing is ever created, written or mode-changed *inside* a lock, so
there is no directory whose contents a member could redirect. That matters where a descriptor
does not pin a directory: a FUSE filesystem such as ``sshfs`` resolves every step by path on
its server, so a member who swapped a lock directory for a link between two steps of a holder
(after it was opened) redirected the holder's next write into the link's target (a file made in
somebody's ``~/.ssh``). With the link form, every step acts on the one name in ``locks/``:

- take: ``symlink(record, name)``; an existing name whose text is this very record is ours
  (NFS may answer a retransmitted create with ``EEXIST``);
- heartbeat: a new link with a fresh time at a unique temp name, renamed over the name, only
  while the name still holds our record;
- release: renamed aside to a unique name, then removed, if it still holds our record.

A waiter breaks the lock (:mod:`.scan`) when its heartbeat is older than ``stale_after`` seconds,
or sooner when the holder's pid is dead in this very pid namespace. A member's rename can make
a lock of ours look lost (its holder then stops beating and leaves it), never reach a file
outside the store. The name is ``.lockdir`` as before, so that a job of an older release, whose
lock is a directory holding an ``owner`` file, and a job of this one exclude each other on one
store; such a directory is still read and broken as before, and still taken on a filesystem
without symbolic links (some CIFS mounts), where the directory is made private, opened with
``O_NOFOLLOW | O_DIRECTORY`` and written by descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat

from .._paths import atomic_write
from .base import LOCKDIR_SUFFIX, OWNER_FILE, BaseLock, LockHolder
from .ondisk import open_lockdir, read_link, read_record
from .scan import BEAT_INFIX, RELEASE_INFIX, aside_name, break_stale_lock_at, remove_at

__all__ = ["MkdirLock"]

logger = logging.getLogger("compile_cache")

#: ``symlink`` errors of a filesystem without symbolic links: the directory form is taken.
_NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def _text(holder: LockHolder) -> str:
    return holder.encode().decode().strip()


class MkdirLock(BaseLock):
    """The ``mkdir`` strategy: a symbolic link holding the record (a directory where the
    filesystem has no links)."""

    mode = "mkdir"
    suffix = LOCKDIR_SUFFIX

    def __init__(self, base: str | os.PathLike[str], **options: object) -> None:
        super().__init__(base, **options)  # type: ignore[arg-type]
        self._owner: LockHolder | None = None
        self._text: str | None = None  # the link's text while we hold it (link form)
        self._made: tuple[int, int] | None = None  # (st_dev, st_ino) of our directory (dir form)

    def try_once(self) -> bool:
        name = self.path.name
        with self.directory() as dfd:
            taken = self._create(dfd, name)
            if taken is not None:
                return taken
            if not break_stale_lock_at(dfd, self.path, stale_after=self.stale_after):
                return False
            return bool(self._create(dfd, name))

    def _create(self, dfd: int, name: str) -> bool | None:
        """Take the free name: True when taken, None when the name exists (held)."""
        owner = self._me()
        text = _text(owner)
        try:
            os.symlink(text, name, dir_fd=dfd)
        except FileExistsError:
            if read_link(dfd, name) == text:  # our own create, answered twice (NFS)
                self._owner, self._text = owner, text
                return True
            return None
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            return self._create_dir(dfd, name)
        self._owner, self._text, self._made = owner, text, None
        return True

    # -- the link form ---------------------------------------------------------------------------
    def refresh(self) -> bool:
        if self._text is None:
            return self._refresh_dir()
        name = self.path.name
        with self.directory() as dfd:
            if read_link(dfd, name) != self._text:
                return False  # broken by a waiter that found it stale, or renamed by a member
            assert self._owner is not None
            owner = self._owner.beat()
            text = _text(owner)
            temp = aside_name(name, BEAT_INFIX)
            os.symlink(text, temp, dir_fd=dfd)
            try:
                os.rename(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=dfd)
                raise
            self._owner, self._text = owner, text
            return True

    def release_on_disk(self) -> None:
        if self._text is None:
            self._release_dir()
            return
        name, mine = self.path.name, self._text
        self._text = None
        with self.directory() as dfd:
            now = read_link(dfd, name)
            if now != mine:
                if now is None:
                    logger.warning("lock %s was broken while held here; leaving what is there now", self.path)
                else:
                    logger.warning("lock %s was broken and re-taken by %s while held here; leaving it",
                                   self.path, LockHolder.parse(now) or "another process")
                return
            aside = aside_name(name, RELEASE_INFIX)
            try:
                os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                return
            moved = read_link(dfd, aside)
            if moved is not None and moved != mine:  # re-taken in between: give it back
                with contextlib.suppress(OSError):
                    os.symlink(moved, name, dir_fd=dfd)
            remove_at(dfd, aside)

    # -- the directory form (a filesystem without symbolic links) --------------------------------
    def _create_dir(self, dfd: int, name: str) -> bool | None:
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
        except FileExistsError:
            return None
        return self._take_dir(dfd, name)

    def _take_dir(self, dfd: int, name: str) -> bool:
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
            self._owner, self._text = self._me(), None
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

    def _refresh_dir(self) -> bool:
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

    def _release_dir(self) -> None:
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
