"""What every lock strategy shares: the timeout loop, the holder record and its heartbeat,
logging, and a per-path threading guard.

A strategy (``fcntl_lock``, ``mkdir_lock``, :class:`NoLock`) implements three steps: take the
lock on disk once without waiting (:meth:`BaseLock.try_once`), refresh the holder record while
held (:meth:`BaseLock.refresh`) and release it (:meth:`BaseLock.release_on_disk`). The steps are
public: a strategy may stand in for another (fcntl's lock hands them to its mkdir fallback after
``ENOLCK``), and the heartbeat thread calls :meth:`BaseLock.beat`; callers take the lock with
:meth:`BaseLock.acquire`, never with a bare step. :class:`BaseLock` does the rest: wait up to the timeout (and, with ``wait_alive``, past it while
the holder's heartbeat is fresh), log who holds it every ``wait_log_interval`` seconds, raise
:class:`LockTimeoutError` naming the holder, and keep two threads of one process apart (fcntl
locks belong to the process, not the thread).

The holder record is ``host:pid:time:namespace``. ``time`` is the holder's last heartbeat: one
thread per process rewrites the record of every lock it holds every ``max(1, stale_after / 10)``
seconds, however long the compile under it runs. A lock is stale when its heartbeat is older than
``stale_after``; ``host`` and ``pid`` only speed up the local case, and only when the
``namespace`` (boot id and pid namespace) is this process's own: containers that share a
hostname, or a pid number, never break each other's live lock.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from .. import config
from .._paths import HOSTNAME
from ..errors import LockTimeoutError
from .observe import CLOCK_SKEW, unchanged_for
from .ondisk import DirOpener, path_directory, read_link, read_record

__all__ = [
    "DEFAULT_STALE_AFTER",
    "LOCAL_NAMESPACE",
    "LOCKDIR_SUFFIX",
    "LOCK_SUFFIX",
    "OWNER_FILE",
    "BaseLock",
    "LockHolder",
    "NoLock",
    "read_holder",
    "read_holder_at",
]

logger = logging.getLogger("compile_cache")

#: A lock whose holder's heartbeat is this old is stale: ``mkdir`` waiters break it
#: (``COMPILE_CACHE_LOCK_STALE`` sets it for the store's locks).
DEFAULT_STALE_AFTER: float = config.LOCK_STALE.default
LOCK_SUFFIX = ".lock"
#: Seconds a waiter given ``wait_alive`` goes on trying while a held lock has no holder record: a
#: lock changing hands has none for an instant (a holder clears its record before it releases;
#: a new holder writes its record just after it takes the lock).
RECORDLESS_GRACE = 1.0
LOCKDIR_SUFFIX = ".lockdir"
OWNER_FILE = "owner"

# fcntl locks belong to the process, not the thread: a per-path threading lock keeps two threads
# of one process apart too, and stops one thread from closing the fd another thread locked.
_local_locks: dict[str, threading.Lock] = {}
_local_locks_guard = threading.Lock()


def _local_lock(key: str) -> threading.Lock:
    with _local_locks_guard:
        return _local_locks.setdefault(key, threading.Lock())


def _local_namespace() -> str:
    """This process's pid namespace on this boot (``<boot id>.<pid ns inode>``), or ``""``."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip().replace("-", "")[:12]
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError):
        return ""
    return f"{boot}.{pid_ns}" if boot else ""


#: Where this process's pids live (boot id and pid namespace); ``""`` where unknowable.
LOCAL_NAMESPACE = _local_namespace()


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock, as written into it: ``host:pid:time:namespace``.

    ``time`` is the holder's last heartbeat (when it took the lock, or refreshed it since).
    ``namespace`` says where ``pid`` means something (see :data:`LOCAL_NAMESPACE`); records of
    older writers (``host:pid:time``) have none.
    """

    host: str
    pid: int
    time: float
    namespace: str = ""

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"

    @property
    def age(self) -> float:
        """Seconds since the holder's last heartbeat; ``inf`` for a heartbeat further in the
        future than :data:`CLOCK_SKEW` (a clock that ran ahead: never trusted)."""
        now = time.time()
        if self.time > now + CLOCK_SKEW:
            return math.inf
        return max(0.0, now - self.time)

    def is_alive(self) -> bool | None:
        """Whether the holder process still runs; ``None`` when that cannot be known here.

        Known only for a holder on this host *and* in this pid namespace on this boot: another
        container with the same hostname has its own pids, so its pid says nothing here.
        """
        if self.host != HOSTNAME or not self.namespace or self.namespace != LOCAL_NAMESPACE:
            return None
        return _pid_alive(self.pid)

    def same_process(self, other: LockHolder | None) -> bool:
        """Whether ``other`` names the same process (host, pid, namespace; any heartbeat)."""
        return other is not None and (self.host, self.pid, self.namespace) == (
            other.host, other.pid, other.namespace
        )

    def beat(self) -> LockHolder:
        """The same holder with a heartbeat now."""
        return LockHolder(self.host, self.pid, time.time(), self.namespace)

    def encode(self) -> bytes:
        tail = f":{self.namespace}" if self.namespace else ""
        return f"{self.host}:{self.pid}:{self.time:.3f}{tail}\n".encode()

    @classmethod
    def parse(cls, text: str) -> LockHolder | None:
        """Parse ``host:pid:time[:namespace]``; ``None`` for anything else (empty, partial,
        garbage, a time that is not a finite number)."""
        parts = text.strip().split(":")
        if len(parts) not in (3, 4) or not parts[0]:
            return None
        try:
            when = float(parts[2])
            holder = cls(parts[0], int(parts[1]), when, parts[3] if len(parts) == 4 else "")
        except ValueError:
            return None
        # A heartbeat of NaN or inf (a record another member wrote) would look fresh for ever.
        return holder if math.isfinite(when) else None


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


def read_holder_at(dfd: int, name: str) -> LockHolder | None:
    """The holder recorded in the lock ``name`` of the directory open at ``dfd`` (a ``mkdir``
    lock's link text, the ``owner`` file of an older release's lock directory, or a lock file);
    None if absent, unreadable or garbage (never blocks, never follows a link)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):  # a mkdir lock: the link's text is the record
        text = read_link(dfd, name)
        return None if text is None else LockHolder.parse(text)
    raw = read_record(dfd, name, OWNER_FILE if stat.S_ISDIR(st.st_mode) else None)
    return None if raw is None else LockHolder.parse(raw.decode("utf-8", errors="replace"))


def read_holder(lock_path: str | os.PathLike[str]) -> LockHolder | None:
    """The holder recorded in a lock file or lock directory given by path; ``None`` if absent
    or unreadable (:func:`read_holder_at` in its directory)."""
    path = Path(lock_path)
    try:
        dfd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return read_holder_at(dfd, path.name)
    finally:
        os.close(dfd)


class _Heartbeat:
    """One daemon thread per process that refreshes the record of every lock the process holds.

    A lock is refreshed every :attr:`BaseLock.heartbeat_interval` seconds while held; the thread
    sleeps until the next refresh is due, or, holding nothing, until a lock is taken.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: weakref.WeakKeyDictionary[BaseLock, float] = weakref.WeakKeyDictionary()
        self._thread: threading.Thread | None = None

    def add(self, lock: BaseLock) -> None:
        with self._cond:
            self._due[lock] = time.monotonic() + lock.heartbeat_interval
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="compile_cache-lock-heartbeat", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def remove(self, lock: BaseLock) -> None:
        with self._cond:
            self._due.pop(lock, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [lock for lock, at in self._due.items() if at <= now]
                if not due:
                    wait = min(self._due.values(), default=None)
                    self._cond.wait(None if wait is None else max(0.05, wait - now))
                    continue
                for lock in due:
                    self._due[lock] = now + lock.heartbeat_interval
            for lock in due:
                try:
                    kept = lock.beat()
                except OSError as exc:  # a slow or flaky filesystem: try again next time
                    logger.debug("could not refresh lock %s: %s", lock.path, exc)
                    continue
                if not kept:
                    logger.warning(
                        "lock %s was broken while held here (its heartbeat was late?); "
                        "no longer refreshing it", lock.path,
                    )
                    self.remove(lock)


_heartbeat = _Heartbeat()


def _after_fork_in_child() -> None:  # the parent's thread and locks do not live in the child
    global _heartbeat
    _heartbeat = _Heartbeat()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class BaseLock:
    """An inter-process lock on ``base`` (a path without suffix, e.g. ``v1/locks/<key>``).

    Use as a context manager (``with make_lock(p, timeout=30): ...``) or with
    :meth:`acquire` / :meth:`release`. Not re-entrant. ``timeout=None`` waits forever; ``0``
    tries once. On timeout :class:`LockTimeoutError` is raised naming the holder, unless
    ``wait_alive`` is set: then the wait goes on past the timeout while the holder's heartbeat
    is fresh, until ``wait_alive`` seconds after the wait began (a compile that runs long is not
    taken for a dead one). While held, the lock's record is refreshed every
    :attr:`heartbeat_interval` seconds. ``reason`` says why this mode was chosen (for ``doctor``).
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
        wait_alive: float | None = None,
        directory: DirOpener | None = None,
    ) -> None:
        self.base = Path(base)
        #: Opens the directory the lock lives in (the store's file layer for its locks, else
        #: the caller's own path): every step works relative to it, never through a path.
        self.directory: DirOpener = (
            directory if directory is not None else path_directory(self.base.parent, dir_mode)
        )
        self.reason: str = reason
        self.timeout = timeout
        self.stale_after = stale_after
        self.poll_interval = poll_interval
        self.wait_log_interval = wait_log_interval
        self.dir_mode = dir_mode
        self.file_mode = file_mode
        self.wait_alive = wait_alive
        #: Seconds the last :meth:`acquire` waited; and whether it went on past its timeout
        #: because the holder's heartbeat was fresh.
        self.waited = 0.0
        self.waited_past_timeout = False
        self._local: threading.Lock | None = None
        self._held = False
        self._io = threading.Lock()  # the heartbeat thread and release never touch disk at once

    # -- what a strategy implements ------------------------------------------------------------
    def try_once(self) -> bool:
        """Take the lock on disk if it is free now; never waits."""
        raise NotImplementedError

    def release_on_disk(self) -> None:
        """Give the lock on disk back (called only while held)."""
        raise NotImplementedError

    def refresh(self) -> bool:
        """Rewrite the holder record with a heartbeat now; False if the lock is no longer ours."""
        return True

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
        try:
            with self.directory() as dfd:
                return read_holder_at(dfd, self.path.name)
        except OSError:
            return None

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two refreshes of the holder record: a tenth of the stale age, >= 1 s."""
        return max(1.0, self.stale_after / 10.0)

    def _is_fresh(self, holder: LockHolder | None) -> bool:
        if holder is None or holder.is_alive() is False:
            return False
        if holder.age <= self.stale_after:
            return True
        # A heartbeat time in the future is not trusted: fresh only while the record changes,
        # as this process's own clock sees it.
        if holder.age != math.inf:
            return False
        try:
            with self.directory() as dfd:
                return unchanged_for(dfd, self.path) <= self.stale_after
        except OSError:
            return False

    def beat(self) -> bool:
        """One heartbeat (the heartbeat thread); False when the lock is no longer ours."""
        with self._io:
            if not self._held:
                return True
            return self.refresh()

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
        started = time.monotonic()
        self.waited_past_timeout = False
        try:
            self._wait_on_disk(deadline, timeout)
        except BaseException:
            local.release()
            raise
        finally:
            self.waited = time.monotonic() - started
        self._local = local
        self._held = True
        if self.mode != "none":
            _heartbeat.add(self)
        return self

    def _try_bounded(self) -> bool:
        """:meth:`try_once`, whose I/O errors (a lock file another user made and nobody may
        replace, a locks directory that is a link, EROFS) are a :class:`LockTimeoutError`: the
        one error :meth:`acquire` documents, and the one every caller goes on without."""
        try:
            return self.try_once()
        except LockTimeoutError:
            raise
        except OSError as exc:
            raise LockTimeoutError(
                f"could not take lock {self.path} ({self.mode}): {type(exc).__name__}: {exc}"
            ) from exc

    def _wait_on_disk(self, deadline: float | None, timeout: float | None) -> None:
        started = time.monotonic()
        next_log = started + self.wait_log_interval
        unrecorded_since: float | None = None  # when the holder's record was first seen missing
        while True:
            if self._try_bounded():
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                waiting_alive = self.wait_alive is not None and now - started < self.wait_alive
                holder = self.holder()
                if holder is not None:
                    unrecorded_since = None
                elif unrecorded_since is None:
                    unrecorded_since = now
                if waiting_alive and holder is None and now - unrecorded_since < RECORDLESS_GRACE:
                    # No record: the holder is releasing right now (its record goes before the
                    # lock does) or a new holder is writing its record. Either way the lock is
                    # changing hands, not held by a dead process: look again.
                    deadline = now + self.poll_interval
                elif waiting_alive and self._is_fresh(holder):
                    if not self.waited_past_timeout:
                        logger.info(
                            "lock %s: %s still holds it past the %ss timeout and its heartbeat is "
                            "fresh; waiting for it (up to %.0fs in all)",
                            self.path, holder, timeout, self.wait_alive,
                        )
                    self.waited_past_timeout = True
                    deadline = now + self.poll_interval
                else:
                    beat = f" (last heartbeat {holder.age:.0f}s ago)" if holder is not None else ""
                    past = (
                        f" and {now - started:.0f}s in all while its heartbeat was fresh"
                        if self.waited_past_timeout else ""
                    )
                    raise LockTimeoutError(
                        f"could not take lock {self.path} ({self.mode}) within {timeout}s{past}; "
                        f"held by {holder or 'an unknown process'}{beat}"
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

    def _new_holder(self) -> bytes:
        """The holder record this process writes into the lock: ``host:pid:time:namespace``."""
        return self._me().encode()

    @staticmethod
    def _me() -> LockHolder:
        return LockHolder(HOSTNAME, os.getpid(), time.time(), LOCAL_NAMESPACE)

    def release(self) -> None:
        """Release the lock; releasing a lock that is not held does nothing."""
        if not self._held:
            return
        _heartbeat.remove(self)
        try:
            with self._io:
                self._held = False
                self.release_on_disk()
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
        self.waited, self.waited_past_timeout = 0.0, False
        return self

    def try_once(self) -> bool:
        return True

    def release_on_disk(self) -> None:
        return None
