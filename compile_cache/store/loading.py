"""Loading a key's packs: one consistent set, each checked before anything reads it whole.

The function behind :meth:`Store.load` (see there for the rules). The directories from
``entries/`` down to the key's ``packs/`` and every pack file must pass the trust rule of
:mod:`.safety`; every pack is opened before any is read (a listing that changes meanwhile is
taken again; an entry that vanished is a miss, never a part of it), then checked by
:mod:`.reader` (limits, header, checksum, signature) and :mod:`.members` (each member).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

from .._paths import check_key
from ..errors import CorruptPackError, UnsafeStorePathError
from ._io import torch_version, warn_once
from .fs import StoreFS
from .pack import IncompatiblePackError, SignatureMismatchError
from .parts import StoreParts
from .reader import PackMembers
from .records import Pack, PackInfo

__all__ = ["OPEN_BUDGET", "Reopener", "load", "open_pack_path"]

logger = logging.getLogger("compile_cache")


def load(parts: StoreParts, key: str) -> list[Pack]:
    """See :meth:`Store.load`."""
    check_key(key)
    keeper, counters = parts.keeper, parts.counters
    opened = _open_entry(parts, key)
    if opened is None:
        return []
    ours = torch_version()
    packs: list[Pack] = []
    mismatched: list[str] = []
    for path, fh in opened:
        try:
            if isinstance(fh, Reopener):
                reopener, fh = fh, fh.open()
            else:
                reopener = None
            checked = parts.checker.check(fh, key, vouched=True)
            if reopener is not None:
                checked.reopen_on_demand(reopener.read_at, reopener.close)
        except IncompatiblePackError as exc:
            logger.info("skipping pack %s: %s", path, exc)
            counters.bump(incompatible=1)
            continue
        except SignatureMismatchError as exc:
            logger.info("skipping pack %s for this reader: %s", path, exc)
            mismatched.append(str(exc))
            counters.bump(signature_mismatch=1)
            continue
        except CorruptPackError as exc:
            keeper.corrupt(path, key, exc)
            continue
        except OSError as exc:
            keeper.io_error("read", exc, path)
            continue
        header = checked.header
        theirs = header.get("torch")
        if isinstance(theirs, str) and "unknown" not in (theirs, ours) and theirs != ours:
            # Keys include the environment, so this pack was put here by hand or by a bug;
            # its artifacts were built for another torch. Set it aside so that a republish
            # of the same content (same pack name) is not blocked by it.
            checked.close()
            moved = keeper.quarantine(path, key)
            warn_once(parts.root, "foreign-torch",
                       f"compile cache: pack {path} was written by torch {theirs}, this is "
                       f"torch {ours}; treated as a miss and "
                       + (f"moved to {moved}" if moved else "left in place (read-only store)"))
            counters.bump(incompatible=1)
            continue
        info = PackInfo.from_header(key, path.stem, path, checked.size, header, checked.signed)
        packs.append(Pack(members=PackMembers(checked), header=header, info=info))
    if mismatched and not packs:
        warn_once(parts.root, "signature",
                  f"compile cache: no pack of {key[:12]} is signed with this "
                  f"COMPILE_CACHE_SIGNING_KEY ({len(mismatched)} skipped: {mismatched[0]}); a miss "
                  "for this job, the packs are left for readers holding their key")
    if packs:
        keeper.touch_used(key)
    packs.sort(key=lambda p: (p.info.created, p.info.name))
    return packs


def _open_entry(parts: StoreParts, key: str, attempts: int = 3) -> list[tuple[Path, Any]] | None:
    """Open every pack of ``key`` (one consistent listing), after checking the entry's
    directories; None when there is nothing usable (counted where it is an error)."""
    for _attempt in range(attempts):
        try:
            paths = parts.layout.pack_paths(key, strict=True)
        except UnsafeStorePathError as exc:  # a link on the way: refused, never followed
            parts.keeper.untrusted(str(exc))
            return None
        except OSError as exc:  # EACCES, EIO, ESTALE: a miss for this job, counted
            parts.keeper.io_error("read", exc, parts.layout.packs_dir(key))
            return None
        if not paths:
            return None
        if not _entry_trusted(parts, key):
            return None
        try:
            with parts.fs.directory(parts.layout.packs_dir(key), trust=True) as at:
                opened, vanished = _open_listed(parts, key, paths, at)
        except OSError:
            return None  # gone meanwhile, or refused (counted by _entry_trusted)
        if not vanished:
            return opened
        for _path, fh in opened:
            fh.close()
        if not parts.fs.is_dir(parts.layout.entry_dir(key)):
            return None  # evicted while we read it: a miss, not a part of it
    logger.info("compile cache: entry %s kept changing while it was read; a miss", key[:12])
    return None


#: Packs a load keeps open at once; the packs of an entry past it are opened, checked and
#: closed one at a time, and opened again (the same file) when a member is read.
OPEN_BUDGET = 64


class Reopener:
    """Opens one pack file again on demand, refusing a different file under its name (another
    inode, size or mtime than when it was listed: replaced meanwhile)."""

    def __init__(self, fs: StoreFS, path: Path, fh: Any) -> None:
        self.fs, self.path = fs, path
        st = os.fstat(fh.fileno())
        self._identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def open(self) -> Any:
        """The pack file, open (the caller's to close), if it is still the one listed."""
        fh = open_pack_path(self.fs, self.path)
        st = os.fstat(fh.fileno())
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self._identity:
            fh.close()
            raise FileNotFoundError(errno.ENOENT, "pack replaced since it was listed", str(self.path))
        return fh

    def read_at(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset``, the file open only meanwhile (holding no descriptor)."""
        with self.open() as fh:
            return os.pread(fh.fileno(), n, offset)

    def close(self) -> None:
        """Nothing is held between reads."""


def open_pack_path(fs: StoreFS, path: Path, at: int | None = None) -> Any:
    """Open one pack of the store for reading: no link followed, a regular file, trusted (see
    :meth:`~.fs.StoreFS.open_read`); ``at``: its directory, already open. Tests replace it to
    race other processes."""
    if at is not None:
        return fs.open_read_in(at, path, trust=True)
    return fs.open_read(path, trust=True)


def _open_listed(parts: StoreParts, key: str, paths: list[Path],
                 at: int) -> tuple[list[tuple[Path, Any]], bool]:
    """Open the listed packs (in their directory, open at ``at``): ``(opened, vanished)``; past
    :data:`OPEN_BUDGET` a pack is noted (:class:`Reopener`) and closed again."""
    keeper = parts.keeper
    opened: list[tuple[Path, Any]] = []
    for path in paths:
        try:
            fh = open_pack_path(parts.fs, path, at)
        except FileNotFoundError:
            for _path, other in opened:
                other.close()
            return [], True
        except UnsafeStorePathError as exc:
            if exc.reason == "trust":
                keeper.untrusted(exc.strerror)
            else:  # a link, a FIFO, a device where a pack should be: set aside
                keeper.corrupt(path, key, exc)
            continue
        except OSError as exc:
            keeper.io_error("read", exc, path)
            continue
        if len(opened) >= OPEN_BUDGET:  # past the budget: checked one at a time, later
            try:
                reopener = Reopener(parts.fs, path, fh)
            finally:
                fh.close()
            fh = reopener
        opened.append((path, fh))
    return opened, False


def _entry_trusted(parts: StoreParts, key: str) -> bool:
    """The directories from the store root down to the key's ``packs/`` may be trusted (none
    a link: :mod:`.fs` refuses those)."""
    try:
        with parts.fs.directory(parts.layout.packs_dir(key), trust=True):
            return True
    except UnsafeStorePathError as exc:
        parts.keeper.untrusted(exc.strerror)
        return False
    except OSError:
        return True  # gone, or unreadable: the pack listing says so
