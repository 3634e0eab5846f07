"""What every lock strategy shares: the timeout loop, the holder record, logging, and a
per-path threading guard.

A strategy (``fcntl_lock``, ``mkdir_lock``, :class:`NoLock`) implements two steps: take the
lock on disk once without waiting (:meth:`BaseLock._try_once`) and release it
(:meth:`BaseLock._release_on_disk`). :class:`BaseLock` does the rest: wait up to the timeout,
log who holds it every ``wait_log_interval`` seconds, raise :class:`LockTimeoutError` naming the
holder, and keep two threads of one process apart (fcntl locks belong to the process, not the
thread).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from .._paths import HOSTNAME
from ..errors import LockTimeoutError

__all__ = [
    "DEFAULT_STALE_AFTER",
    "HEARTBEAT_STALE_AFTER",
    "LOCKDIR_SUFFIX",
    "LOCK_SUFFIX",
    "OWNER_FILE",
    "BaseLock",
    "LockHolder",
    "NoLock",
    "read_holder",
]

logger = logging.getLogger("compile_cache")

#: A lock left on disk this long is stale whatever its heartbeat (and an unheld ``.lock`` file
#: this old is garbage for ``verify``).
DEFAULT_STALE_AFTER = 1800.0
#: A ``mkdir`` lock whose holder's heartbeat (its owner file's time) is older than this is
#: broken by waiters: a live holder refreshes it well within this (``compile_cache.locks``).
HEARTBEAT_STALE_AFTER = 60.0
LOCK_SUFFIX = ".lock"
LOCKDIR_SUFFIX = ".lockdir"
OWNER_FILE = "owner"

# fcntl locks belong to the process, not the thread: a per-path threading lock keeps two threads
# of one process apart too, and stops one thread from closing the fd another thread locked.
_local_locks: dict[str, threading.Lock] = {}
_local_locks_guard = threading.Lock()


def _local_lock(key: str) -> threading.Lock:
    with _local_locks_guard:
        return _local_locks.setdefault(key, threading.Lock())


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock, as written into it: ``host:pid:time``."""

    host: str
    pid: int
    time: float

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"

    @property
    def age(self) -> float:
        """Seconds since the holder took the lock."""
        return max(0.0, time.time() - self.time)

    def is_alive(self) -> bool | None:
        """Whether the holder process still runs: ``None`` when it is on another host (unknowable)."""
        if self.host != HOSTNAME:
            return None
        return _pid_alive(self.pid)

    def encode(self) -> bytes:
        return f"{self.host}:{self.pid}:{self.time:.3f}\n".encode()

    @classmethod
    def parse(cls, text: str) -> LockHolder | None:
        """Parse ``host:pid:time``; ``None`` for anything else (empty, partial, garbage)."""
        try:
            host, pid, stamp = text.strip().rsplit(":", 2)
            return cls(host, int(pid), float(stamp)) if host else None
        except ValueError:
            return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    except OSError:
        return True
    try:  # a killed but unreaped child still answers kill(0): treat a zombie as dead
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def read_holder(lock_path: str | os.PathLike[str]) -> LockHolder | None:
    """The holder recorded in a lock file or lock directory; ``None`` if absent or unreadable."""
    path = Path(lock_path)
    target = path / OWNER_FILE if path.is_dir() else path
    try:
        with open(target, encoding="utf-8", errors="replace") as fh:
            return LockHolder.parse(fh.read(200))
    except OSError:
        return None



class BaseLock:
    """An inter-process lock on ``base`` (a path without suffix, e.g. ``v1/locks/<key>``).

    Use as a context manager (``with make_lock(p, timeout=30): ...``) or with
    :meth:`acquire` / :meth:`release`. Not re-entrant. ``timeout=None`` waits forever; ``0``
    tries once. On timeout :class:`LockTimeoutError` is raised naming the holder. ``reason``
    says why this mode was chosen (for ``doctor``).
    """

    #: The mode name (``COMPILE_CACHE_LOCK`` value) of the strategy.
    mode: str = "base"
    #: The suffix of the lock's path on disk (a file, or a directory for mkdir).
    suffix: str = LOCK_SUFFIX

    def __init__(
        self,
        base: str | os.PathLike[str],
        *,
        timeout: float | None = 60.0,
        stale_after: float = DEFAULT_STALE_AFTER,
        poll_interval: float = 0.05,
        wait_log_interval: float = 10.0,
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
        reason: str = "requested",
    ) -> None:
        self.base = Path(base)
        self.reason: str = reason
        self.timeout = timeout
        self.stale_after = stale_after
        self.poll_interval = poll_interval
        self.wait_log_interval = wait_log_interval
        self.dir_mode = dir_mode
        self.file_mode = file_mode
        self._local: threading.Lock | None = None
        self._held = False

    # -- what a strategy implements ------------------------------------------------------------
    def _try_once(self) -> bool:
        """Take the lock on disk if it is free now; never waits."""
        raise NotImplementedError

    def _release_on_disk(self) -> None:
        """Give the lock on disk back (called only while held)."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        """The file (fcntl/flock) or directory (mkdir) that is the lock on disk."""
        return self.base.with_name(self.base.name + self.suffix)

    @property
    def is_locked(self) -> bool:
        """Whether this object holds the lock now."""
        return self._held

    def holder(self) -> LockHolder | None:
        """Who holds the lock on disk now (possibly this process), if recorded."""
        return read_holder(self.path)

    def acquire(self, timeout: float | None = ...) -> BaseLock:  # type: ignore[assignment]
        """Take the lock, waiting up to ``timeout`` seconds (default: the constructor's)."""
        if self._held:
            raise RuntimeError(f"lock {self.path} is already held by this object (not re-entrant)")
        if timeout is ...:
            timeout = self.timeout
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        local = _local_lock(os.path.abspath(self.base))
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not local.acquire(timeout=-1 if remaining is None else remaining):
            raise LockTimeoutError(
                f"could not take lock {self.path} within {timeout}s: held by another thread of this process"
            )
        try:
            self._wait_on_disk(deadline, timeout)
        except BaseException:
            local.release()
            raise
        self._local = local
        self._held = True
        return self

    def _wait_on_disk(self, deadline: float | None, timeout: float | None) -> None:
        started = time.monotonic()
        next_log = started + self.wait_log_interval
        while True:
            if self._try_once():
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise LockTimeoutError(
                    f"could not take lock {self.path} ({self.mode}) within {timeout}s; "
                    f"held by {self.holder() or 'an unknown process'}"
                )
            if now >= next_log:
                logger.info(
                    "still waiting for %s to release lock %s (%.0fs)",
                    self.holder() or "an unknown holder", self.path, now - started,
                )
                next_log = now + self.wait_log_interval
            sleep = self.poll_interval
            if deadline is not None:
                sleep = min(sleep, max(0.0, deadline - now))
            time.sleep(sleep)

    def _ensure_parent(self) -> None:
        parent = self.path.parent
        if not parent.is_dir():
            os.makedirs(parent, mode=self.dir_mode, exist_ok=True)
            try:
                os.chmod(parent, self.dir_mode)  # exact, whatever the umask (group mode: 2775)
            except OSError:
                pass

    def _new_holder(self) -> bytes:
        """The holder record this process writes into the lock: ``host:pid:time``."""
        return LockHolder(HOSTNAME, os.getpid(), time.time()).encode()

    def release(self) -> None:
        """Release the lock; releasing a lock that is not held does nothing."""
        if not self._held:
            return
        self._held = False
        try:
            self._release_on_disk()
        finally:
            if self._local is not None:
                local, self._local = self._local, None
                local.release()

    def __enter__(self) -> BaseLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"FileLock({os.fspath(self.path)!r}, mode={self.mode!r}, locked={self._held})"


class NoLock(BaseLock):
    """``none``: no locking at all (also the lock of a read-only store)."""

    mode = "none"

    def acquire(self, timeout: float | None = ...) -> BaseLock:  # type: ignore[assignment]
        if self._held:
            raise RuntimeError(f"lock {self.path} is already held by this object (not re-entrant)")
        self._held = True
        return self

    def _try_once(self) -> bool:
        return True

    def _release_on_disk(self) -> None:
        return None
