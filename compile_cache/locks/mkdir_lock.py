"""``mkdir``: ``mkdir <base>.lockdir`` is atomic on every filesystem, including NFS and Lustre.

The holder writes ``host:pid:time:namespace`` into ``<base>.lockdir/owner`` and rewrites it with
a new ``time`` every heartbeat while it holds the lock. The lock survives a crashed holder, so
waiters break it when its heartbeat is older than ``stale_after`` seconds, or sooner when the
holder's pid is dead in this very pid namespace (:mod:`.scan`). Releasing renames the directory
aside first, and leaves it alone if someone broke and re-took it meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from pathlib import Path

from .._paths import HOSTNAME, atomic_write
from .base import LOCKDIR_SUFFIX, OWNER_FILE, BaseLock, LockHolder, read_holder
from .scan import RELEASE_INFIX, break_stale_lock

__all__ = ["MkdirLock"]

logger = logging.getLogger("compile_cache")


class MkdirLock(BaseLock):
    """The ``mkdir`` strategy."""

    mode = "mkdir"
    suffix = LOCKDIR_SUFFIX

    def __init__(self, base: str | os.PathLike[str], **options: object) -> None:
        super().__init__(base, **options)  # type: ignore[arg-type]
        self._owner: LockHolder | None = None

    def try_once(self) -> bool:
        path = self.path
        try:
            os.mkdir(path, self.dir_mode)
        except FileNotFoundError:
            self._ensure_parent()
            return False
        except FileExistsError:
            if break_stale_lock(path, stale_after=self.stale_after):
                return self._try_once_more(path)
            return False
        self._write_owner(path)
        return True

    def _try_once_more(self, path: Path) -> bool:
        try:
            os.mkdir(path, self.dir_mode)
        except OSError:
            return False
        self._write_owner(path)
        return True

    def _write_owner(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            os.chmod(path, self.dir_mode)  # exact, whatever the umask: the group can break it
        self._owner = self._me()
        try:
            atomic_write(path / OWNER_FILE, self._owner.encode(), mode=self.file_mode, fsync=False)
        except OSError as exc:  # informative only; an owner-less lock goes stale after a minute
            logger.debug("could not record lock owner in %s: %s", path, exc)

    def refresh(self) -> bool:
        path = self.path
        if not path.is_dir():
            return False  # broken (renamed aside) by a waiter that found it stale
        current = read_holder(path)
        if current is not None and not current.same_process(self._owner):
            return False  # broken and re-taken by someone else
        assert self._owner is not None
        self._owner = self._owner.beat()
        atomic_write(path / OWNER_FILE, self._owner.encode(), mode=self.file_mode, fsync=False)
        return True

    def release_on_disk(self) -> None:
        path = self.path
        try:
            with open(path / OWNER_FILE, "rb") as fh:
                current: LockHolder | None = LockHolder.parse(fh.read(200).decode(errors="replace"))
                readable = True
        except OSError:
            current, readable = None, False
        if readable and not (current is not None and current.same_process(self._owner)):
            logger.warning(
                "lock %s was broken and re-taken by %s while held here; leaving it",
                path, current or "another process",
            )
            return
        aside = path.with_name(f"{path.name}{RELEASE_INFIX}{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except OSError:
            return
        shutil.rmtree(aside, ignore_errors=True)
