"""Inter-process locks that also work on NFS and Lustre, with holders, timeouts and stale-lock breaking.

A lock here only avoids duplicate work (two ranks compiling the same thing); the store's
correctness never depends on it, so every failure mode degrades to "no lock": a timeout raises
:class:`LockTimeoutError` and the caller goes on without it.

Modes (``COMPILE_CACHE_LOCK=fcntl|flock|mkdir|none``; default chosen by :func:`lock_mode_for`):

``fcntl``  POSIX record lock on ``<base>.lock`` (default on local filesystems). The kernel drops it
           when the holder dies, so it never goes stale. If ``fcntl`` raises ``ENOLCK`` (NFS
           without lockd) the lock falls back to ``mkdir`` for that filesystem.
``flock``  BSD ``flock`` on ``<base>.lock``: fine locally, but on NFS it can be emulated or local
           to one client (Lustre ``localflock``), so it is never chosen automatically.
``mkdir``  ``mkdir <base>.lockdir`` is atomic on every filesystem, including NFS and Lustre. The
           holder writes ``host:pid:time`` into ``<base>.lockdir/owner``. The lock survives a
           crashed holder, so waiters break it when the holder's pid is dead on this host, or when
           it is older than ``stale_after`` seconds (holders of long locks call :meth:`FileLock.refresh`).
``none``   no locking at all.

Waiting logs ``still waiting for <host:pid>`` every ``wait_log_interval`` seconds (10 by default)
on the ``compile_cache`` logger.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from . import config
from ._paths import HOSTNAME, atomic_write
from .errors import ConfigError, LockTimeoutError

__all__ = [
    "DEFAULT_STALE_AFTER",
    "LOCK_MODES",
    "FileLock",
    "LockHolder",
    "break_stale_lock",
    "filesystem_type",
    "is_stale",
    "lock_mode_for",
    "optional_lock",
    "read_holder",
]

logger = logging.getLogger("compile_cache")

LOCK_MODES: tuple[str, ...] = ("fcntl", "flock", "mkdir", "none")
#: A ``mkdir`` lock whose holder has not refreshed it for this long is broken by waiters.
DEFAULT_STALE_AFTER = 1800.0
#: Filesystem types where fcntl/flock cannot be trusted across nodes: ``mkdir`` is used instead.
NETWORK_FILESYSTEMS: frozenset[str] = frozenset(
    {
        "nfs", "nfs4", "lustre", "ceph", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "glusterfs",
        "fuse.glusterfs", "fuse.sshfs", "fuse.ceph", "9p", "afs", "panfs", "ocfs2", "gfs2",
        "wekafs", "fuse.juicefs", "fuse.gcsfuse", "fuse.s3fs",
    }
)
LOCK_SUFFIX = ".lock"
LOCKDIR_SUFFIX = ".lockdir"
OWNER_FILE = "owner"

_ENOLCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
# Devices where fcntl raised ENOLCK: every later lock on them uses mkdir directly.
_enolck_devices: set[int] = set()
# fcntl locks belong to the process, not the thread: a per-path threading lock keeps two threads
# of one process apart too, and stops one thread from closing the fd another thread locked.
_local_locks: dict[str, threading.Lock] = {}
_local_locks_guard = threading.Lock()


def _local_lock(key: str) -> threading.Lock:
    with _local_locks_guard:
        return _local_locks.setdefault(key, threading.Lock())


def _unescape_mount(field: str) -> str:
    """/proc/mounts escapes space, tab, newline and backslash as octal (``\\040``)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and len(field[i + 1 : i + 4]) == 3:
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def filesystem_type(path: str | os.PathLike[str], *, mounts_file: str = "/proc/mounts") -> str:
    """The type (``ext4``, ``nfs4``, ``lustre``...) of the filesystem holding ``path``, or ``"unknown"``.

    ``path`` need not exist: its nearest existing ancestor is used. Read from ``/proc/mounts``
    (longest mount-point prefix wins), so it is Linux-only and returns ``"unknown"`` elsewhere.
    """
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    real = os.path.realpath(probe)
    best, best_type = "", "unknown"
    try:
        with open(mounts_file, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return "unknown"
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point, fs_type = _unescape_mount(fields[1]), fields[2]
        prefix = mount_point.rstrip("/") + "/"
        if (real == mount_point or (real + "/").startswith(prefix)) and len(mount_point) >= len(best):
            best, best_type = mount_point, fs_type
    return best_type


def _device_of(path: str | os.PathLike[str]) -> int | None:
    probe = os.path.abspath(path)
    while True:
        try:
            return os.stat(probe).st_dev
        except OSError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return None
            probe = parent


def lock_mode_for(path: str | os.PathLike[str]) -> tuple[str, str]:
    """The lock mode to use for locks under ``path``, and why (for ``doctor``).

    ``COMPILE_CACHE_LOCK`` wins when set (a bad value raises :class:`ConfigError`); otherwise
    ``mkdir`` on network/cluster filesystems (NFS, Lustre, GPFS, CephFS...) or where ``fcntl``
    already failed with ``ENOLCK`` in this process, and ``fcntl`` everywhere else.
    """
    env = config.LOCK.value()
    if env is not None:
        return env, f"COMPILE_CACHE_LOCK={env}"
    fs_type = filesystem_type(path)
    if fs_type in NETWORK_FILESYSTEMS or fs_type.startswith("nfs") or "lustre" in fs_type:
        return "mkdir", f"{fs_type} filesystem: fcntl/flock are unreliable across nodes there"
    device = _device_of(path)
    if device is not None and device in _enolck_devices:
        return "mkdir", f"fcntl raised ENOLCK on this {fs_type} filesystem"
    return "fcntl", f"local {fs_type} filesystem"


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
        """Seconds since the holder took (or last refreshed) the lock."""
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


def _lock_file(base: Path) -> Path:
    return base.with_name(base.name + LOCK_SUFFIX)


def _lock_dir(base: Path) -> Path:
    return base.with_name(base.name + LOCKDIR_SUFFIX)


def read_holder(lock_path: str | os.PathLike[str]) -> LockHolder | None:
    """The holder recorded in a lock file or lock directory; ``None`` if absent or unreadable."""
    path = Path(lock_path)
    target = path / OWNER_FILE if path.is_dir() else path
    try:
        with open(target, encoding="utf-8", errors="replace") as fh:
            return LockHolder.parse(fh.read(200))
    except OSError:
        return None


def is_stale(lock_path: str | os.PathLike[str], *, stale_after: float = DEFAULT_STALE_AFTER) -> bool:
    """Whether a lock left on disk is stale: its holder is dead on this host, or it is too old.

    For a ``.lockdir`` (mkdir lock) this is the breaking rule. For a ``.lock`` file (fcntl/flock)
    the kernel already released it if the holder died, so it is stale (removable garbage) when
    nobody holds it now and it has not been touched for ``stale_after`` seconds.
    """
    path = Path(lock_path)
    if path.is_dir():
        holder = read_holder(path)
        if holder is None:
            try:
                age = time.time() - path.stat().st_mtime
            except OSError:
                return False
            # An owner file is written microseconds after mkdir: missing for long means a crash.
            return age > min(stale_after, 60.0)
        return holder.is_alive() is False or holder.age > stale_after
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False
    if age <= stale_after:
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
    lock_path: str | os.PathLike[str], *, stale_after: float = DEFAULT_STALE_AFTER
) -> bool:
    """Remove the lock at ``lock_path`` if :func:`is_stale`; return whether it was removed.

    A lock directory is first renamed to a unique name (atomic: of two breakers only one wins),
    then its owner is re-read; if the lock changed hands in between, it is renamed back.
    """
    path = Path(lock_path)
    if not is_stale(path, stale_after=stale_after):
        return False
    if not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
            return True
        return False
    seen = read_holder(path)
    aside = path.with_name(f"{path.name}.stale-{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}")
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


class FileLock:
    """An inter-process lock on ``base`` (a path without suffix, e.g. ``v1/locks/<key>``).

    Use as a context manager (``with FileLock(p, timeout=30): ...``) or with
    :meth:`acquire` / :meth:`release`. Not re-entrant. ``mode=None`` picks :func:`lock_mode_for`.
    ``timeout=None`` waits forever; ``0`` tries once. On timeout :class:`LockTimeoutError` is
    raised naming the holder.
    """

    def __init__(
        self,
        base: str | os.PathLike[str],
        *,
        mode: str | None = None,
        timeout: float | None = 60.0,
        stale_after: float = DEFAULT_STALE_AFTER,
        poll_interval: float = 0.05,
        wait_log_interval: float = 10.0,
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
    ) -> None:
        self.base = Path(base)
        if mode is None:
            mode, reason = lock_mode_for(self.base.parent)
        else:
            if mode not in LOCK_MODES:
                raise ConfigError(f"lock mode {mode!r} is not one of {', '.join(LOCK_MODES)}")
            reason = "requested"
        self.mode: str = mode
        self.reason: str = reason
        self.timeout = timeout
        self.stale_after = stale_after
        self.poll_interval = poll_interval
        self.wait_log_interval = wait_log_interval
        self.dir_mode = dir_mode
        self.file_mode = file_mode
        self._fd: int | None = None
        self._token: bytes | None = None
        self._local: threading.Lock | None = None
        self._held = False

    @property
    def path(self) -> Path:
        """The file (fcntl/flock) or directory (mkdir) that is the lock on disk."""
        return _lock_dir(self.base) if self.mode == "mkdir" else _lock_file(self.base)

    @property
    def is_locked(self) -> bool:
        """Whether this object holds the lock now."""
        return self._held

    def holder(self) -> LockHolder | None:
        """Who holds the lock on disk now (possibly this process), if recorded."""
        return read_holder(self.path)

    def acquire(self, timeout: float | None = ...) -> FileLock:  # type: ignore[assignment]
        """Take the lock, waiting up to ``timeout`` seconds (default: the constructor's)."""
        if self._held:
            raise RuntimeError(f"lock {self.path} is already held by this object (not re-entrant)")
        if timeout is ...:
            timeout = self.timeout
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        if self.mode == "none":
            self._held = True
            return self
        local = _local_lock(os.path.abspath(self.base))
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not local.acquire(timeout=-1 if remaining is None else remaining):
            raise LockTimeoutError(
                f"could not take lock {self.path} within {timeout}s: held by another thread of this process"
            )
        try:
            self._acquire_on_disk(deadline, timeout)
        except BaseException:
            local.release()
            raise
        self._local = local
        self._held = True
        return self

    def _acquire_on_disk(self, deadline: float | None, timeout: float | None) -> None:
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

    def _try_once(self) -> bool:
        if self.mode == "mkdir":
            return self._try_mkdir()
        return self._try_fcntl()

    # -- fcntl / flock -------------------------------------------------------------------------
    def _try_fcntl(self) -> bool:
        path = self.path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), self.file_mode)
        except FileNotFoundError:
            self._ensure_parent()
            return False
        try:
            if self.mode == "flock":
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            if exc.errno in _ENOLCK_ERRNOS:
                device = _device_of(path)
                if device is not None:
                    _enolck_devices.add(device)
                logger.warning(
                    "%s locking is not supported on %s (%s); falling back to mkdir locks",
                    self.mode, path.parent, errno.errorcode.get(exc.errno or 0, exc),
                )
                self.mode, self.reason = "mkdir", f"{self.mode} raised {errno.errorcode.get(exc.errno or 0)}"
                return self._try_mkdir()
            raise
        try:
            # The file may have been unlinked (verify --fix) between open and lock: retry then.
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                os.close(fd)
                return False
            os.ftruncate(fd, 0)
            os.pwrite(fd, LockHolder(HOSTNAME, os.getpid(), time.time()).encode(), 0)
        except FileNotFoundError:
            os.close(fd)
            return False
        except OSError:
            pass  # the holder record is informative only
        self._fd = fd
        return True

    # -- mkdir -----------------------------------------------------------------------------------
    def _try_mkdir(self) -> bool:
        path = self.path
        try:
            os.mkdir(path, self.dir_mode)
        except FileNotFoundError:
            self._ensure_parent()
            return False
        except FileExistsError:
            if break_stale_lock(path, stale_after=self.stale_after):
                return self._try_mkdir_once_more(path)
            return False
        self._write_owner(path)
        return True

    def _try_mkdir_once_more(self, path: Path) -> bool:
        try:
            os.mkdir(path, self.dir_mode)
        except OSError:
            return False
        self._write_owner(path)
        return True

    def _write_owner(self, path: Path) -> None:
        self._token = LockHolder(HOSTNAME, os.getpid(), time.time()).encode()
        try:
            atomic_write(path / OWNER_FILE, self._token, mode=self.file_mode, fsync=False)
        except OSError as exc:  # informative only; an owner-less lock goes stale after a minute
            logger.debug("could not record lock owner in %s: %s", path, exc)

    def refresh(self) -> None:
        """Re-stamp the holder time, so a long ``mkdir`` lock is not broken as stale."""
        if self._held and self.mode == "mkdir":
            self._write_owner(self.path)

    def release(self) -> None:
        """Release the lock; releasing a lock that is not held does nothing."""
        if not self._held:
            return
        self._held = False
        try:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                try:
                    if self.mode == "flock":
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    else:
                        fcntl.lockf(fd, fcntl.LOCK_UN)
                finally:
                    os.close(fd)
            elif self.mode == "mkdir":
                self._release_mkdir()
        finally:
            if self._local is not None:
                local, self._local = self._local, None
                local.release()

    def _release_mkdir(self) -> None:
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
        aside = path.with_name(f"{path.name}.release-{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except OSError:
            return
        shutil.rmtree(aside, ignore_errors=True)

    def __enter__(self) -> FileLock:
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


@contextlib.contextmanager
def optional_lock(lock: FileLock, timeout: float | None = ...) -> Iterator[bool]:  # type: ignore[assignment]
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


def _reset() -> None:
    """Forget the filesystems where fcntl raised ENOLCK (tests)."""
    _enolck_devices.clear()
