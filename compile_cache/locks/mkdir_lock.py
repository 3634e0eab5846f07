"""``mkdir``: ``mkdir <base>.lockdir`` is atomic on every filesystem, including NFS and Lustre.

The holder writes ``host:pid:time`` into ``<base>.lockdir/owner``. The lock survives a crashed
holder, so waiters break it when the holder's pid is dead on this host, or when it is older than
``stale_after`` seconds (:mod:`.scan`). Releasing renames the directory aside first, and leaves
it alone if someone broke and re-took it meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from pathlib import Path

from .._paths import HOSTNAME, atomic_write
from .base import LOCKDIR_SUFFIX, OWNER_FILE, BaseLock, LockHolder
from .scan import RELEASE_INFIX, break_stale_lock

__all__ = ["MkdirLock"]

logger = logging.getLogger("compile_cache")


class MkdirLock(BaseLock):
    """The ``mkdir`` strategy."""

    mode = "mkdir"
    suffix = LOCKDIR_SUFFIX

    def __init__(self, base: str | os.PathLike[str], **options: object) -> None:
        super().__init__(base, **options)  # type: ignore[arg-type]
        self._token: bytes | None = None

    def _try_once(self) -> bool:
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
        self._token = self._new_holder()
        try:
            atomic_write(path / OWNER_FILE, self._token, mode=self.file_mode, fsync=False)
        except OSError as exc:  # informative only; an owner-less lock goes stale after a minute
            logger.debug("could not record lock owner in %s: %s", path, exc)

    def _release_on_disk(self) -> None:
        path = self.path
        try:
            with open(path / OWNER_FILE, "rb") as fh:
                current = fh.read(200)
        except OSError:
            current = None
        if current is not None and current != self._token:
            logger.warning(
                "lock %s was broken and re-taken by %s while held here; leaving it",
                path, LockHolder.parse(current.decode(errors="replace")) or "another process",
            )
            return
        aside = path.with_name(f"{path.name}{RELEASE_INFIX}{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except OSError:
            return
        shutil.rmtree(aside, ignore_errors=True)
