"""The store's file-system work, in one place: nothing inside the store is resolved through a link.

Every store operation that creates, opens, moves or deletes goes through :class:`StoreFS`. It
opens the store's root by its path (checked when the store opened, :func:`~.safety.check_tree`,
and checked again here on the descriptor), then walks down one name at a time relative to the
directory descriptor it holds, each step with ``O_NOFOLLOW | O_DIRECTORY``; the last name is
opened, created, renamed or removed relative to its parent's descriptor. So a symlink that
another group member swaps in for ``v1/tmp``, ``v1/stats``, ``v1/quarantine`` or any directory
of an entry *after* the store opened is refused when it is used, never followed, and nothing
outside the store's tree is ever deleted or moved. Files are opened non-blocking (a FIFO where a
pack or a stats shard should be never hangs), then checked on the descriptor (``fstat``): a
regular file, and, where its content will be trusted, of a trusted owner and mode
(:func:`~.safety.trust_problem`).

A refusal is an :class:`~compile_cache.errors.UnsafeStorePathError`, which is an ``OSError``
too: every caller's handling of a failed I/O (a miss, a skipped record, a counted error) applies.
Paths are the absolute paths :class:`~.layout.Layout` builds (they must lie under the root) or
paths relative to the root.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .. import config
from .._paths import atomic_write
from ..errors import StoreError, UnsafeStoreError, UnsafeStorePathError
from ..locks import BaseLock, DirOpener, make_lock
from ._io import MAX_JSON_BYTES, json_object, make_dirs, warn_once
from .safety import trust_problem

logger = logging.getLogger("compile_cache")

__all__ = ["StoreFS"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
#: open() of a link with O_NOFOLLOW (ELOOP; some systems say EMLINK or EFTYPE), or of a
#: non-directory with O_DIRECTORY (ENOTDIR).
_LINK_ERRNOS = {errno.ELOOP, errno.EMLINK, errno.ENOTDIR, getattr(errno, "EFTYPE", errno.ELOOP)}

PathLike = str | os.PathLike[str] | Iterable[str]


def _one_link_soon(fd: int) -> bool:
    """Whether the file open at ``fd``, seen with a second link, is down to one within a few
    milliseconds: a first-writer-wins write links its temp file to the name, then removes the
    temp name; a hard link planted to somebody's file elsewhere stays."""
    for _ in range(5):
        time.sleep(0.002)
        if os.fstat(fd).st_nlink == 1:
            return True
    return False


class StoreFS:
    """File operations under the store ``root`` that never follow a link inside it.

    ``group_mode``: the store is group-shared (``COMPILE_CACHE_SHARED=group``), which decides
    whom :func:`~.safety.trust_problem` trusts and the modes of what it creates. It also holds
    the store's read-only state (a store that cannot be written goes read-only, never fails)
    and makes its locks (``lock_mode``: :func:`~compile_cache.locks.lock_mode_for`).
    """

    def __init__(self, root: Path, group_mode: bool, *, lock_mode: str = "none") -> None:
        self.root = Path(root)
        self.group_mode = group_mode
        self._prefix = str(self.root).rstrip("/") + "/"
        #: The modes of what the store creates (exact, whatever the umask).
        self.dir_mode, self.file_mode = (0o2775, 0o664) if group_mode else (0o700, 0o600)
        self.lock_mode = lock_mode
        self.read_only = False
        #: Why the store is read-only (None while it is writable).
        self.read_only_reason: str | None = None

    # -- read-only state and locks ---------------------------------------------------------------
    def set_read_only(self, reason: str) -> None:
        """Mark the store read-only for ``reason`` (an option, or the environment)."""
        self.read_only, self.read_only_reason = True, reason

    def go_read_only(self, reason: str) -> None:
        """The store cannot be written (``reason``): logged only, the one user-visible warning
        comes with the first skipped publish."""
        self.set_read_only(reason)
        logger.info("compile cache %s is read-only: %s", self.root, reason)

    def require_writable(self, what: str) -> None:
        """Raise :class:`StoreError` if the store is read-only (``what``: the refused operation)."""
        if self.read_only:
            raise StoreError(f"cannot {what}: compile cache {self.root} is read-only ({self.read_only_reason})")

    def make_root(self) -> None:
        """Create the store's root and its missing parents (those outside it get the umask's mode)."""
        make_dirs(self.root, None, self.dir_mode)

    def lock_at(self, base: Path, timeout: float | None, wait_alive: float | None = None) -> BaseLock:
        """A lock at ``base`` (in the store's locks dir) with the store's lock mode, file modes
        and stale age; a locks dir that is a link gives a no-op lock (a lock is never needed)."""
        usable = self.is_dir(base.parent)
        return make_lock(base, mode=self.lock_mode if usable else "none", timeout=timeout,
                         stale_after=config.LOCK_STALE.value(), wait_alive=wait_alive,
                         dir_mode=self.dir_mode, file_mode=self.file_mode,
                         directory=self.directory_opener(base.parent))

    def directory_opener(self, path: PathLike) -> DirOpener:
        """What a lock opens its directory ``path`` with: :meth:`directory`, the walk from the
        root that follows no link (missing directories made with the store's mode), so every
        step of the lock is relative to a descriptor of the real locks directory."""
        parts = self.parts(path)

        @contextlib.contextmanager
        def opener() -> Iterator[int]:
            fd = self._walk(parts, create=self.dir_mode)
            try:
                yield fd
            finally:
                os.close(fd)

        return opener

    def rename_safety(self, directory: PathLike) -> tuple[bool | None, str]:
        """Whether this store is safe against another member's renames, and why (``doctor``):
        probed in ``directory`` (the locks dir) on this filesystem. Every store step, locks
        included, is relative to a directory descriptor and opens with ``O_NOFOLLOW``, so a name
        a member swaps for a link is refused, never followed; this checks that the filesystem
        really refuses it (a link made and opened here). None: not probed (read-only, absent)."""
        if self.read_only:
            return None, "not probed: the store is read-only here"
        name = f".link-probe-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            with self.directory(directory) as dfd:
                os.symlink("link-probe-target", name, dir_fd=dfd)
                try:
                    try:
                        os.close(os.open(name, _FILE_FLAGS | os.O_CREAT, 0o600, dir_fd=dfd))
                    except OSError as exc:
                        if exc.errno in _LINK_ERRNOS:
                            return True, ("yes: every step works relative to a directory descriptor "
                                          "and this filesystem refuses a link opened with O_NOFOLLOW; "
                                          "a file is written only with one link and this user's owner")
                        return None, f"not probed: {exc.strerror or exc}"
                    with contextlib.suppress(OSError):
                        os.unlink("link-probe-target", dir_fd=dfd)
                    return False, ("NO: this filesystem followed a link opened with O_NOFOLLOW; "
                                   "a member could redirect this store's writes (use another filesystem)")
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=dfd)
        except OSError as exc:
            return None, f"not probed: {exc.strerror or exc}"

    # -- paths -----------------------------------------------------------------------------------
    def parts(self, path: PathLike) -> tuple[str, ...]:
        """``path``'s names below the root; a path outside the store, or with ``..``, is refused."""
        if isinstance(path, (str, os.PathLike)):
            text = os.fspath(path)
            rest = text[len(self._prefix):] if text.startswith(self._prefix) else None
            if rest and "/." not in "/" + rest and "//" not in rest:
                rel = tuple(rest.split("/"))  # the common case, without pathlib
                if all(rel):
                    return rel
            p = Path(path)
            if p.is_absolute():
                try:
                    rel = p.relative_to(self.root).parts
                except ValueError:
                    raise UnsafeStorePathError(
                        f"refusing to touch {path}: it is outside the compile cache {self.root}",
                        "outside", str(path)) from None
            else:
                rel = p.parts
        else:
            rel = tuple(path)
        for part in rel:
            if part in ("", ".", "..") or "/" in part or "\0" in part:
                raise UnsafeStorePathError(
                    f"refusing to touch {path}: {part!r} could leave the compile cache {self.root}",
                    "outside", str(path))
        return tuple(rel)

    def _show(self, parts: tuple[str, ...]) -> str:
        return str(self.root.joinpath(*parts))

    def _refused(self, parts: tuple[str, ...], exc: OSError | None, what: str) -> UnsafeStorePathError:
        where = self._show(parts)
        return UnsafeStorePathError(
            f"refusing to use {where}: it is {what}; compile_cache follows no link inside its "
            f"store (remove it, `rm {where}`, and `verify --fix` recreates what is needed)",
            "link" if exc is not None and exc.errno != errno.ENOTDIR else "type", where)

    def _check(self, fd: int, parts: tuple[str, ...]) -> os.stat_result:
        st = os.fstat(fd)
        problem = trust_problem(st, self._show(parts), self.group_mode)
        if problem is not None:
            raise UnsafeStorePathError(problem.message, "trust", self._show(parts))
        return st

    # -- directories -----------------------------------------------------------------------------
    def _open_root(self, trust: bool) -> int:
        fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        try:
            if trust:
                self._check(fd, ())
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _walk(self, parts: tuple[str, ...], *, trust: bool = False, create: int | None = None) -> int:
        """A descriptor of the directory ``parts`` (the caller closes it). ``trust``: each
        directory on the way must pass :func:`trust_problem`; ``create``: make missing ones
        with that mode (exact, whatever the umask)."""
        fd = self._open_root(trust)
        try:
            for i, name in enumerate(parts):
                made = False
                try:
                    nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if create is None:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, create, dir_fd=fd)
                        made = True
                    nfd = self._open_dir_at(fd, name, parts[: i + 1])
                except OSError as exc:
                    if exc.errno in _LINK_ERRNOS:
                        raise self._refused(parts[: i + 1], exc, "a symlink or not a directory") from exc
                    raise
                os.close(fd)
                fd = nfd
                if made and create is not None:
                    os.fchmod(fd, create)
                if trust:
                    self._check(fd, parts[: i + 1])
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _open_dir_at(self, fd: int, name: str, parts: tuple[str, ...]) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            if exc.errno in _LINK_ERRNOS:
                raise self._refused(parts, exc, "a symlink or not a directory") from exc
            raise

    @contextlib.contextmanager
    def directory(self, path: PathLike, *, trust: bool = False) -> Iterator[int]:
        """``with fs.directory(path) as fd``: the directory, reached without following a link."""
        fd = self._walk(self.parts(path), trust=trust)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _parent(self, path: PathLike, *, trust: bool = False,
                create: int | None = None) -> Iterator[tuple[int, str]]:
        parts = self.parts(path)
        if not parts:
            raise UnsafeStorePathError(f"refusing to replace the compile cache root {self.root}",
                                       "outside", str(self.root))
        fd = self._walk(parts[:-1], trust=trust, create=create)
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def check_dirs(self, dirs: Iterable[PathLike]) -> None:
        """When the store opens: raise :class:`UnsafeStoreError` if one of ``dirs`` that exists
        is not trusted (another user's, world-writable: the store is refused, with the fix). A
        link or a non-directory there is warned about once and refused at every use (an
        operation that needs it is a counted error or a miss), so that another group member
        cannot stop everyone's jobs by planting one."""
        for directory in dirs:
            try:
                with self.directory(directory, trust=True):
                    pass
            except UnsafeStorePathError as exc:
                if exc.reason == "trust":
                    raise UnsafeStoreError(str(exc)) from None
                warn_once(self.root, f"link-{directory}", f"compile cache: {exc}")
            except OSError:
                continue  # absent, or not searchable by us: nothing in it is loaded here either

    def mkdirs(self, path: PathLike, mode: int | None = None) -> None:
        """Create the directory ``path`` and its missing parents below the root with ``mode``
        (default: the store's). A missing root raises FileNotFoundError: a vanished store is
        not re-created here."""
        os.close(self._walk(self.parts(path), create=self.dir_mode if mode is None else mode))

    def make_dirs(self, dirs: Iterable[PathLike], mode: int | None = None) -> None:
        """:meth:`mkdirs` of each of ``dirs``; one that is a link (or on a link) is left alone
        (refused at each use, warned about by :meth:`check_dirs`), other errors raise."""
        for directory in dirs:
            with contextlib.suppress(UnsafeStorePathError):
                self.mkdirs(directory, mode)

    def listdir(self, path: PathLike) -> list[str]:
        """The names in the directory ``path`` (unsorted)."""
        with self.directory(path) as fd:
            return os.listdir(fd)

    def files(self, path: PathLike) -> list[tuple[str, os.stat_result]]:
        """``(name, lstat)`` of every regular file directly in the directory ``path``."""
        out = []
        with self.directory(path) as fd, os.scandir(fd) as it:
            for item in it:
                with contextlib.suppress(OSError):
                    if item.is_file(follow_symlinks=False):
                        out.append((item.name, item.stat(follow_symlinks=False)))
        return out

    # -- one name --------------------------------------------------------------------------------
    def lstat(self, path: PathLike) -> os.stat_result:
        """The status of ``path`` itself (a link is not followed)."""
        parts = self.parts(path)
        if not parts:
            fd = self._open_root(False)
            try:
                return os.fstat(fd)
            finally:
                os.close(fd)
        with self._parent(parts) as (fd, name):
            return os.stat(name, dir_fd=fd, follow_symlinks=False)

    def exists(self, path: PathLike) -> bool:
        """Whether anything (a link included) is at ``path``; False when it cannot be reached."""
        try:
            self.lstat(path)
        except OSError:
            return False
        return True

    def is_dir(self, path: PathLike) -> bool:
        """Whether ``path`` is a real directory (not a link to one)."""
        try:
            return stat.S_ISDIR(self.lstat(path).st_mode)
        except OSError:
            return False

    def open_read(self, path: PathLike, *, trust: bool = True) -> BinaryIO:
        """Open the regular file ``path`` for reading (unbuffered). Non-blocking open, then
        checked on the descriptor: a link, a FIFO, a device or a directory is refused
        (:class:`UnsafeStorePathError`); with ``trust``, so is a file or directory on the way
        that :func:`trust_problem` refuses."""
        parts = self.parts(path)
        with self._parent(parts, trust=trust) as (dfd, _name):
            return self.open_read_in(dfd, parts, trust=trust)

    def open_read_in(self, dfd: int, path: PathLike, *, trust: bool = True) -> BinaryIO:
        """:meth:`open_read` of ``path`` whose directory is already open at ``dfd`` (reached
        by :meth:`directory`): a load of a thousand packs walks the store once, not per pack."""
        parts = self.parts(path)
        try:
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in _LINK_ERRNOS:
                raise self._refused(parts, exc, "a symlink") from exc
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._refused(parts, None, "not a regular file")
            if st.st_nlink > 1 and not _one_link_soon(fd):
                raise self._refused(parts, None, f"a file with {os.fstat(fd).st_nlink} links (a hard link "
                                    "to a file elsewhere is never read)")
            if trust:
                self._check(fd, parts)
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~getattr(os, "O_NONBLOCK", 0))
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb", buffering=0)  # type: ignore[return-value]

    def read(self, path: PathLike, limit: int, *, trust: bool = False) -> bytes:
        """At most ``limit`` bytes of the regular file ``path`` (see :meth:`open_read`)."""
        with self.open_read(path, trust=trust) as fh:
            return fh.read(limit)

    def read_json(self, path: PathLike, limit: int = MAX_JSON_BYTES) -> tuple[dict[str, Any] | None, bool]:
        """``(data, garbage)`` of a JSON-object record: ``(None, False)`` if absent, ``(None,
        True)`` if unreadable (a link, a FIFO, too large, too deep, not an object)."""
        try:
            raw = self.read(path, limit + 1)
        except FileNotFoundError:
            return None, False
        except OSError:
            return None, True
        if len(raw) > limit:
            return None, True
        return json_object(raw)

    def create(self, path: PathLike, mode: int | None = None) -> BinaryIO:
        """A new file at ``path`` (``O_EXCL``: nothing there, not even a link) open for
        writing, with ``mode`` exactly (default: the store's)."""
        mode = self.file_mode if mode is None else mode
        with self._parent(path) as (dfd, name):
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode,
                         dir_fd=dfd)
        try:
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "wb")  # type: ignore[return-value]

    def write(self, path: PathLike, data: Any, *, mode: int | None = None, exclusive: bool = False,
              fsync: bool = True) -> bool:
        """:func:`~compile_cache._paths.atomic_write` of ``path``, in its directory reached
        without following a link (``mode``: default the store's)."""
        mode = self.file_mode if mode is None else mode
        with self._parent(path) as (fd, name):
            return atomic_write(name, data, mode=mode, exclusive=exclusive, fsync=fsync, dir_fd=fd)

    def touch(self, path: PathLike, mode: int | None = None) -> None:
        """Set ``path``'s times to now, creating it (with ``mode``, default the store's) if
        absent; never through a link, and never on a file with a second link (a hard link to
        somebody's file elsewhere): such a name gets a fresh file of ours, renamed over it."""
        mode = self.file_mode if mode is None else mode
        with self._parent(path) as (dfd, name):
            try:
                fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                fd = None
            except OSError as exc:
                if exc.errno not in _LINK_ERRNOS:
                    raise
                fd = -1  # a link: replaced below, never followed
            if fd is not None and fd >= 0:
                try:
                    st = os.fstat(fd)
                    if stat.S_ISREG(st.st_mode) and (st.st_nlink == 1 or _one_link_soon(fd)):
                        os.utime(fd)
                        return
                finally:
                    os.close(fd)
            if fd is None:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode,
                             dir_fd=dfd)
                try:
                    os.fchmod(fd, mode)  # exact, whatever the umask (group mode: 0664)
                finally:
                    os.close(fd)
                return
            logger.info("%s was not a plain file of the store's; replaced it", self._show(self.parts(path)))
            atomic_write(name, b"", mode=mode, fsync=False, dir_fd=dfd)

    def unlink(self, path: PathLike) -> None:
        """Remove the file (or link: never its target) at ``path``."""
        with self._parent(path) as (fd, name):
            os.unlink(name, dir_fd=fd)

    def rmtree(self, path: PathLike) -> bool:
        """Remove the directory ``path`` and everything in it, links removed as links (never
        followed); best effort. Whether it is gone."""
        with contextlib.suppress(FileNotFoundError), self._parent(path) as (fd, name):
            shutil.rmtree(name, dir_fd=fd, ignore_errors=True)
            try:
                os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return True
            return False
        return True

    def remove(self, path: PathLike) -> None:
        """Remove ``path``, a directory tree or anything else (never what a link points to)."""
        if stat.S_ISDIR(self.lstat(path).st_mode):
            self.rmtree(path)
        else:
            self.unlink(path)

    def rename(self, src: PathLike, dst: PathLike) -> None:
        """``os.replace`` of ``src`` to ``dst``, both in the store, each reached without links."""
        with self._parent(src) as (sfd, sname), self._parent(dst) as (dfd, dname):
            os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
