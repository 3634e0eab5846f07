"""The store itself: where it is, publish and load, entries, quarantine, locks.

Every file is written under a unique temp name beside its target (host-pid-random), fsynced and
``os.replace``\\ d: a reader sees a whole file or none. Packs are never modified, only added or
removed, so concurrent publishers, readers and evicters need no lock for correctness; locks only
avoid duplicate work. A pack that fails a check is a miss (counted, quarantined), never a crash,
and an I/O error while publishing (``ENOSPC``, ``EACCES``, ``EROFS``) is a warning and a counted
error, never an exception in the training job.

The pack format is :mod:`.pack`, the paths :mod:`.layout`, the counters :mod:`.stats`,
eviction and verify :mod:`.maintenance`, export/import :mod:`.archive`, and the location and
permission checks :mod:`.safety`; :class:`Store` ties them together with its public methods.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import config
from .._paths import HOSTNAME, check_key
from .._sizes import parse_age, parse_size
from ..errors import StoreError
from ..locks import BaseLock, lock_mode_for, make_lock
from . import archive, loading, maintenance, publishing, stats
from ._io import (
    check_seconds,
    errno_name,
    key_list,
    make_dirs,
    torch_version,
    warn_once,
)
from .fs import StoreFS
from .layout import Layout
from .pack import FORMAT_VERSION, PackLimits, signer_id
from .reader import CheckedPack
from .records import CompactReport, EntryInfo, ImportReport, Pack, PackInfo, VerifyReport
from .remote import remote_location
from .safety import check_tree, resolve_location

__all__ = ["DEFAULT_MAX_SIZE", "Store"]

logger = logging.getLogger("compile_cache")

#: Default size cap (``COMPILE_CACHE_MAX_SIZE`` overrides; ``0`` means no cap).
DEFAULT_MAX_SIZE: int = config.MAX_SIZE.default


class Store:
    """The store at ``path``: a directory, or a URL such as ``s3://bucket/prefix`` (:mod:`.remote`).

    ``max_size``: size cap (int bytes or ``"20G"``); default ``COMPILE_CACHE_MAX_SIZE`` or 20 GiB;
    ``0`` means no cap. ``read_only``: default ``COMPILE_CACHE_READ_ONLY``; a store that exists
    but cannot be written, or cannot be created, is read-only too (``read_only_reason`` says why).
    ``signing_key``: default ``COMPILE_CACHE_SIGNING_KEY``.

    Raises :class:`StoreError` if ``path`` is an existing non-directory, :class:`UnsafeStoreError`
    if it is writable by other users, :class:`ConfigError` for a bad environment value.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        max_size: int | str | None = None,
        read_only: bool | None = None,
        signing_key: bytes | str | None = None,
    ) -> None:
        if read_only is not None and not isinstance(read_only, bool):
            raise TypeError(f"read_only must be a bool or None, got {type(read_only).__name__}: {read_only!r}")
        if signing_key is not None and not isinstance(signing_key, (bytes, str)):
            raise TypeError(f"signing_key must be bytes, str or None, "
                            f"got {type(signing_key).__name__}")
        #: On object storage (``s3://...``): its objects, ``root`` its local tier (:mod:`.remote`).
        self.remote, path, source = remote_location(path)
        self.root, self.location_source = resolve_location(path)
        self.location_source = source or self.location_source  # location: as shown, no credentials
        self.location: str = self.remote.display if self.remote else str(self.root)
        self.shared_group: bool = config.SHARED.value()
        self.dir_mode, self.file_mode = (0o2775, 0o664) if self.shared_group else (0o700, 0o600)
        self.max_size = (config.MAX_SIZE.value() if max_size is None
                         else parse_size(max_size, name="max_size"))
        if signing_key is None:
            signing_key = config.SIGNING_KEY.value()
        self.signing_key: bytes | None = (signing_key.encode() if isinstance(signing_key, str)
                                          else signing_key) or None
        #: The id packs signed with this store's key carry (None without a key).
        self.signer: str | None = signer_id(self.signing_key)
        #: The bounds a pack must stay within (COMPILE_CACHE_MAX_PACK_SIZE, ...).
        self.limits: PackLimits = PackLimits.from_config()
        self.lock_mode, self.lock_reason = lock_mode_for(self.root)
        #: Every file operation in the store (:mod:`.fs`: no link inside the store is followed).
        self.fs = StoreFS(self.root, self.shared_group)
        #: Every path of the store (``v1/entries/...``, ``stats/``, ``locks/``, ...).
        self.layout = Layout(self.root, self.fs)
        self.base = self.layout.base
        self.entries_dir = self.layout.entries_dir
        self.stats_dir = self.layout.stats_dir
        self.tmp_dir = self.layout.tmp_dir
        self.quarantine_dir = self.layout.quarantine_dir
        self.locks_dir = self.layout.locks_dir
        self._pending: dict[str, Any] = {}
        self.read_only_reason: str | None = None
        if read_only is None:
            read_only = config.READ_ONLY.value()
            if read_only:
                self.read_only_reason = "COMPILE_CACHE_READ_ONLY is set"
        elif read_only:
            self.read_only_reason = "read_only=True"
        self.read_only: bool = bool(read_only)

        # os.path's checks, not Path's: an unsearchable parent must not raise PermissionError here.
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise StoreError(f"compile cache location {self.root} exists and is not a directory")
        if not os.path.exists(self.root) and not self.read_only:
            try:
                self._mkdirs(self.root, anchor=None)
            except OSError as exc:
                self._go_read_only(f"cannot create {self.root}: {exc.strerror or exc}")
        # The root (symlinks resolved, each ours), every layout dir (no link: refused at use too).
        check_tree(self.root, (), self.shared_group)
        self.fs.check_dirs((self.base, *self.layout.dirs))
        if os.path.isdir(self.root) and not os.access(self.root, os.R_OK | os.X_OK):
            self._go_read_only(f"{self.root} is not readable by this user")
        if not self.read_only:
            if not os.access(self.root, os.W_OK | os.X_OK) or (
                self.base.exists() and not os.access(self.base, os.W_OK | os.X_OK)
            ):
                self._go_read_only(f"{self.root} is not writable by this user")
            else:
                try:
                    self.fs.make_dirs(self.layout.dirs, self.dir_mode)
                except OSError as exc:
                    self._go_read_only(f"cannot write in {self.root}: {exc.strerror or exc}")

    # -- plumbing --------------------------------------------------------------------------------
    def __repr__(self) -> str:
        ro = ", read_only" if self.read_only else ""
        return f"Store({self.location!r}, source={self.location_source}{ro})"

    def _go_read_only(self, reason: str) -> None:
        # Logged only: the one user-visible warning comes with the first skipped publish.
        self.read_only = True
        self.read_only_reason = reason
        logger.info("compile cache %s is read-only: %s", self.root, reason)

    def _require_writable(self, what: str) -> None:
        if self.read_only:
            raise StoreError(f"cannot {what}: compile cache {self.root} is read-only ({self.read_only_reason})")

    def _mkdirs(self, path: Path, anchor: Path | None = ...) -> None:  # type: ignore[assignment]
        """Create ``path`` and missing parents below ``anchor`` (default: the store root, and then
        never through a link inside it) with our mode."""
        if anchor is ... or anchor == self.root:
            self.fs.mkdirs(path, self.dir_mode)
        else:
            make_dirs(path, anchor, self.dir_mode)

    def _io_error(self, what: str, exc: BaseException, path: Path | None = None) -> None:
        kind = errno_name(exc)
        where = f" ({path})" if path else ""
        warn_once(self.root, f"io-{what}-{kind}",
                  f"compile cache: could not {what}{where}: {kind}: {exc}; going on without caching it")
        self._bump(errors=1, errors_by_kind={kind: 1})

    def _write(self, target: Path, data: Any, *, exclusive: bool = False, fsync: bool = True) -> bool:
        return self.fs.write(target, data, mode=self.file_mode, exclusive=exclusive, fsync=fsync)

    def _touch_used(self, key: str) -> None:
        """Mark ``key`` used now (LRU): the ``used`` file's mtime, created with the store's mode."""
        if self.read_only:
            return
        if self.remote is not None:
            self.remote.record_use(self, key)
        used = self.layout.used_file(key)
        try:
            self.fs.touch(used, self.file_mode)
        except PermissionError:
            # Another member's file without group write (an older store): replace it by ours.
            with contextlib.suppress(OSError):
                self._write(used, b"", fsync=False)
        except OSError:
            pass

    def _lock_at(self, base: Path, timeout: float | None, wait_alive: float | None = None) -> BaseLock:
        """A lock under this store's locks dir, with its mode, permissions and stale age."""
        usable = self.fs.is_dir(self.layout.locks_dir)  # a link there: no lock (never needed)
        return make_lock(base, mode=self.lock_mode if usable else "none", timeout=timeout,
                         stale_after=config.LOCK_STALE.value(), wait_alive=wait_alive,
                         dir_mode=self.dir_mode, file_mode=self.file_mode)

    # -- counters (compile_cache.store.stats) ------------------------------------------------------
    def _bump(self, **delta: Any) -> None:
        """Add ``delta`` to the persisted counters; kept in memory and retried if the write fails."""
        stats.bump(self, delta)

    def record_hit(self, key: str, seconds_saved: float | None = None, nbytes: int = 0) -> None:
        """Count a hit (restored, compiled nothing new); ``seconds_saved`` defaults to the compile
        seconds recorded in the key's packs. Marks ``key`` used."""
        self.record_outcome(key, "hit", seconds_saved=seconds_saved, nbytes=nbytes)

    def record_miss(self, key: str) -> None:
        """Count a miss for ``key`` (nothing usable was in the store)."""
        self.record_outcome(key, "miss")

    def record_outcome(self, key: str, outcome: str, *, previous: str | None = None,
                       seconds_saved: float | None = None, nbytes: int = 0) -> None:
        """Count a start as ``hit``, ``partial``, ``miss`` or ``local`` (see
        :mod:`compile_cache.store.stats`); ``previous``: what it was counted as before."""
        check_key(key)
        seconds_saved = None if seconds_saved is None else float(seconds_saved)
        if outcome in ("hit", "partial"):
            self._touch_used(key)
        stats.record_outcome(self, key, outcome, previous=previous,
                             seconds_saved=seconds_saved, nbytes=nbytes)

    def record_error(self, kind: str) -> None:
        """Count an error of ``kind`` (e.g. ``"restore"``, ``"ENOSPC"``)."""
        self._bump(errors=1, errors_by_kind={str(kind): 1})

    def record_backend_fallback(self) -> None:
        """Count a fallback from the native fingerprint backend to the reference one."""
        self._bump(backend_fallbacks=1)

    def record_capture_fallback(self) -> None:
        """Count a capture that diffed the local cache dirs (a torch hook it needs is missing)."""
        self._bump(capture_fallbacks=1)

    def record_failed_hit(self, key: str) -> None:
        """The hit counted for ``key`` was not one after all (torch could not load what the
        restore put in place): it becomes a miss."""
        check_key(key)
        self._bump(hits=-1, misses=1)

    def record_lock_fallback(self, exc: BaseException) -> None:
        """Count a lock that could not be taken (timeout, EACCES, ENOLCK): the caller went on
        without it."""
        self._bump(lock_fallbacks=1, errors_by_kind={f"lock-{errno_name(exc)}": 1})

    def stats(self) -> dict[str, Any]:
        """Counters summed over all processes, plus the store's size, cap and location.

        Keys: every counter of :data:`~compile_cache.store.stats.COUNTERS`, ``errors_by_kind``,
        ``hit_rate``, ``entries``, ``packs``, ``size``, ``max_size``, ``size_human``,
        ``max_size_human``, ``quarantined``, ``location``, ``location_source``, ``read_only``,
        ``read_only_reason``, ``lock_mode``; on object storage also ``local_tier(_size)``.
        """
        return self.remote.summary(self, stats.summary(self)) if self.remote else stats.summary(self)

    def zero_stats(self) -> None:
        """Reset every counter to zero (entries are kept)."""
        self._require_writable("zero the stats")
        stats.zero(self, size=maintenance.total_size(self))  # the size counter stays
        if self.remote is not None:
            self.remote.zero(self)

    # -- publish / load --------------------------------------------------------------------------
    def publish(
        self,
        key: str,
        members: Mapping[str, bytes | bytearray | memoryview],
        metadata: Mapping[str, Any] | None = None,
        entry_info: Mapping[str, Any] | None = None,
        compile_seconds: float = 0.0,
        member_info: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> PackInfo | None:
        """Add a pack of ``members`` to ``key``; return its :class:`PackInfo`, or ``None``.

        ``None`` means nothing was written: the same content is already there (packs are
        content-addressed), the store is read-only (one warning), the pack would break the
        limits a reader checks (one warning, a counted error: ``COMPILE_CACHE_MAX_PACK_SIZE``,
        ``_MAX_PACK_MEMBERS``, ``_MAX_MEMBER_NAME``), or an I/O error happened (``ENOSPC``,
        ``EACCES``, ``EROFS``, a directory removed under us: one warning per kind, a counted
        error, never an exception). ``metadata`` goes into the pack header; ``entry_info`` into
        ``entry.json`` when this publish creates the entry; ``member_info`` per member into the
        member table (``{"file_size": n}``: what the capture saw of the finished file). Programming
        errors still raise: a bad key (``ValueError``), an unsafe member name
        (:class:`UnsafePathError`), non-bytes members or non-JSON metadata (``TypeError``).
        May evict least-recently-used entries afterwards to stay under ``max_size`` (by the size
        counter: no walk of the store).
        """
        info = publishing.publish(self, key, members, metadata, entry_info, compile_seconds, member_info)
        if self.remote is not None:
            self.remote.push(self, key)  # also what an earlier publish could not put
        return info

    def _entry_record(self, key: str, entry_info: Mapping[str, Any] | None) -> dict[str, Any]:
        record: dict[str, Any] = {"created": time.time(), "torch": torch_version(), "host": HOSTNAME}
        record.update(entry_info or {})
        record.update(key=key, format=FORMAT_VERSION)
        return record

    def _write_entry_json(self, entry: Path, data: bytes) -> int:
        """Write ``entry.json`` unless a good one exists; the bytes this added to the store."""
        path = entry / "entry.json"
        current, garbage = self.fs.read_json(path)
        if current is not None:
            return 0
        return len(data) if self._write(path, data, exclusive=not garbage) and not garbage else 0

    def load(self, key: str) -> list[Pack]:
        """Every valid pack of ``key``, oldest first; ``[]`` when there is none.

        The packs are one consistent set: all of them are opened before any is read, and if a
        listed pack vanishes meanwhile (evicted, quarantined, superseded) the entry is listed
        again; an entry that is gone is a miss, never a part of it. Each pack is checked without
        being read whole (:func:`~compile_cache.store.reader.open_pack`): its size and member
        count against the limits, from its first bytes; its header, checksum and signature;
        then every member (:mod:`~compile_cache.store.members`: a shared library must be a
        complete ELF/Mach-O file of the size the capture recorded). A pack that fails is counted
        as ``corrupt``, moved to quarantine and skipped; a pack of another format version is
        counted as ``incompatible`` and left alone; a pack signed with another key (or unsigned,
        while this store has a key) is a miss for this reader only, counted as
        ``signature_mismatch`` and left for the readers who hold that key. A directory or pack
        that another user owns or can write (:mod:`~compile_cache.store.safety`) is refused,
        counted as ``untrusted``. Members are read on demand from the open pack files
        (:class:`~compile_cache.store.reader.PackMembers`). Loading does not count a hit or a miss
        (the caller knows whether the restore worked: :meth:`record_hit`, :meth:`record_miss`);
        it marks the entry used.
        """
        if self.remote is not None:
            self.remote.fetch(self, check_key(key))
        return loading.load(self, key)

    def _check_pack(
        self, path: Path, fh: Any, key: str, labels: Any = None, *, close: bool = True,
    ) -> CheckedPack:
        """Every check of one open pack file (see :meth:`load`); the file is closed on failure."""
        return loading.check_pack(self, fh, key, labels, close=close)

    def _corrupt(self, path: Path, key: str, exc: BaseException) -> None:
        moved = self._quarantine(path, key)
        where = f"moved to {moved}" if moved else "left in place (read-only store)"
        warn_once(self.root, "corrupt", f"compile cache: pack {path} is unusable ({exc}); "
                   f"treated as a miss and {where}")
        self._bump(corrupt=1)

    def _quarantine(self, path: Path, key: str) -> Path | None:
        if self.read_only:
            return None
        target = self.layout.quarantine_path(key, path)
        try:
            size = self.fs.lstat(path).st_size
            self._mkdirs(self.quarantine_dir)
            self.fs.rename(path, target)
        except OSError:
            return None
        self._bump(stored_bytes=-size)
        return target

    def quarantine(self, pack: PackInfo, reason: str, *, counter: str = "corrupt") -> Path | None:
        """Set ``pack`` aside (a pack its user found unusable: a member restore refused, or a
        library torch could not load): counted under ``counter``, warned once. Returns where it
        went, or None (read-only store, already gone)."""
        moved = self._quarantine(pack.path, pack.key)
        where = f"moved to {moved}" if moved else "left in place (read-only store or already gone)"
        warn_once(self.root, f"quarantine-{counter}",
                  f"compile cache: pack {pack.path} is unusable ({reason}); treated as a miss and {where}")
        self._bump(**{counter: 1})
        return moved

    def usable(self, pack: PackInfo) -> bool:
        """Whether this store's reader accepts ``pack`` by its signer (from the header only):
        with a signing key only packs signed with it, without one every pack."""
        if self.signing_key is None:
            return True
        return pack.signed and pack.signer in (None, self.signer)

    def has(self, key: str) -> bool:
        """Whether ``key`` has at least one pack (unverified: :meth:`load` checks them)."""
        check_key(key)
        return self.remote.has(self, key) if self.remote else bool(self.layout.pack_paths(key))

    def lock(self, key: str, timeout: float | None = 60.0, wait_alive: float | None = None) -> BaseLock:
        """A lock for ``key`` (``with store.lock(key): ...``): only avoids duplicate compiles.

        Raises :class:`LockTimeoutError` on timeout (``wait_alive``: or later, while the holder's
        heartbeat is fresh), after which callers go on without it. Read-only store: a no-op lock.
        """
        check_key(key)
        if self.read_only:
            return make_lock(self.layout.lock_base(key), mode="none", timeout=timeout)
        return self._lock_at(self.layout.lock_base(key), timeout, wait_alive)

    # -- listing -------------------------------------------------------------------------------
    def entry(self, key: str) -> EntryInfo | None:
        """The :class:`EntryInfo` of ``key``, or ``None`` if it has no entry directory."""
        if self.remote is not None:  # a remote store: its packs, fetched into the local tier
            self.remote.fetch(self, check_key(key))
        return EntryInfo.read(self.layout, check_key(key))

    def entries(self) -> list[EntryInfo]:
        """Every entry, sorted by key."""
        out: list[EntryInfo] = self.remote.entries(self) if self.remote else []
        for key in () if self.remote else self.layout.keys():
            info = self.entry(key)
            if info is not None:
                out.append(info)
        return out

    # -- maintenance (compile_cache.store.maintenance) --------------------------------------------
    def evict(
        self,
        max_size: int | str | None = None,
        older_than: float | str | None = None,
        keys: Iterable[str] | None = None,
        dry_run: bool = False,
    ) -> list[EntryInfo]:
        """Remove entries; return those removed (or, with ``dry_run``, those that would be).

        Selects the union of: the ``keys`` given; entries not used for ``older_than`` (seconds
        or ``"30d"``); least-recently-used entries until the store fits ``max_size`` (bytes or
        ``"20G"``). With no criterion, enforces the store's own cap. Also deletes quarantined
        packs older than a week. Raises :class:`StoreError` on a read-only store (unless dry run).
        """
        if not dry_run:
            self._require_writable("evict")
        if max_size is None and older_than is None and keys is None:
            if not self.max_size:
                return []
            max_size = self.max_size
        return (self.remote.evict if self.remote else maintenance.evict)(
            self,
            None if max_size is None else parse_size(max_size, name="max_size"),
            None if older_than is None else parse_age(older_than, name="older_than"),
            None if keys is None else set(key_list(keys)),
            dry_run,
        )

    def compact(self, keys: Iterable[str] | None = None, dry_run: bool = False) -> list[CompactReport]:
        """Merge each entry's packs (all, or ``keys``) into one holding its current generation."""
        if not dry_run:
            self._require_writable("compact")
        return maintenance.compact_all(self, key_list(keys or self.layout.keys()), dry_run)

    def clear(self) -> int:
        """Remove every entry and quarantined pack (counters are kept); return entries removed."""
        self._require_writable("clear")
        return self.remote.clear(self) if self.remote else maintenance.clear(self)

    def verify(
        self, fix: bool = False, *, temp_age: float = maintenance.ORPHAN_AGE,
        lock_stale_after: float | None = None, labels: Iterable[str] | None = None,
    ) -> VerifyReport:
        """Check every pack, entry.json, stats file, temp file and lock.

        Packs get the checks a restoring job's :meth:`load` makes (limits, header, checksum,
        signature, and every member: a shared library must be complete, of the size the capture
        recorded; ``labels``: the first parts member names may have, None for any), and the
        directories and packs their owner and mode. Reports corrupt packs, untrusted
        directories and packs, orphaned temp files older than ``temp_age`` seconds (a crashed
        publisher's), stale locks (dead holder, heartbeat older than ``lock_stale_after``,
        default ``COMPILE_CACHE_LOCK_STALE``), garbage ``entry.json`` and stats files, and empty
        entries. With ``fix=True`` corrupt packs are quarantined and the rest removed (``fix`` raises
        :class:`StoreError` on a read-only store). Packs of another format version, or signed
        with another key, are listed but never touched.
        """
        temp_age = check_seconds("temp_age", temp_age)
        if fix:
            self._require_writable("fix the store")
        if self.remote is not None:
            return self.remote.verify(self, fix, temp_age, None if labels is None else frozenset(labels))
        return maintenance.verify(self, fix, temp_age, lock_stale_after,
                                  None if labels is None else frozenset(labels))

    # -- export / import (compile_cache.store.archive) --------------------------------------------
    def export(self, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> int:
        """Write entries (all, or ``keys``) with their valid packs into one tar archive at ``path``.

        ``.tar.gz``/``.tgz`` names are gzip-compressed. Corrupt packs are skipped (and
        quarantined). Returns the number of packs exported. Unknown ``keys`` raise StoreError.
        """
        if self.remote is not None:  # the URL's entries, through the local tier
            keys = self.remote.fetch_all(self, keys)
        return archive.export(self, path, keys)

    def import_archive(self, path: str | os.PathLike[str]) -> ImportReport:
        """Add the entries of an archive made by :meth:`export`; importing twice is harmless.

        Every member is validated before anything is moved into the store: only regular files
        and directories (no symlinks, hard links, devices, FIFOs), safe relative names, the
        expected layout, each declared size within ``COMPILE_CACHE_MAX_PACK_SIZE`` and the total
        within the store's size cap (checked before the member is read: a gzip bomb stops at its
        header), and every pack as :meth:`load` checks it (prefix, checksum, signature, members)
        plus its key and content hash. The archive is read once, in chunks, into a private temp
        dir. A bad archive raises :class:`UnsafePathError` / :class:`CorruptPackError` and leaves
        the store untouched. Raises :class:`StoreError` on a read-only store.
        """
        self._require_writable("import")
        report = archive.import_archive(self, path)
        for key in report.keys if self.remote else ():
            self.remote.push(self, key, strict=True)  # type: ignore[union-attr]
        return report
