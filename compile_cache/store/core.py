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
from .._paths import HOSTNAME, atomic_write, check_key, check_member_name
from .._sizes import parse_age, parse_size
from ..errors import CorruptPackError, StoreError
from ..locks import DEFAULT_STALE_AFTER, BaseLock, lock_mode_for, make_lock
from . import archive, maintenance, stats
from ._io import (
    check_seconds,
    errno_name,
    json_bytes,
    key_list,
    make_dirs,
    read_json_file,
    read_nofollow,
    torch_version,
    warn_once,
)
from .layout import Layout
from .pack import (
    FORMAT_VERSION,
    IncompatiblePackError,
    check_member_bytes,
    content_hash,
    decode_pack,
    encode_pack,
    is_signed,
    read_pack_header,
)
from .records import CompactReport, EntryInfo, ImportReport, Pack, PackInfo, VerifyReport
from .safety import check_safe_dir, resolve_location

__all__ = ["DEFAULT_MAX_SIZE", "Store"]

logger = logging.getLogger("compile_cache")

#: Default size cap (``COMPILE_CACHE_MAX_SIZE`` overrides; ``0`` means no cap).
DEFAULT_MAX_SIZE: int = config.MAX_SIZE.default


class Store:
    """The artifact store at ``path`` (see :func:`resolve_location` for the default).

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
            raise TypeError(
                f"signing_key must be bytes, str or None, got {type(signing_key).__name__}"
            )
        self.root, self.location_source = resolve_location(path)
        self.shared_group: bool = config.SHARED.value()
        self.dir_mode, self.file_mode = (0o2775, 0o664) if self.shared_group else (0o700, 0o600)
        if max_size is None:
            self.max_size = config.MAX_SIZE.value()
        else:
            self.max_size = parse_size(max_size, name="max_size")
        if signing_key is None:
            signing_key = config.SIGNING_KEY.value()
        self.signing_key: bytes | None = (
            signing_key.encode() if isinstance(signing_key, str) else signing_key
        ) or None
        self.lock_mode, self.lock_reason = lock_mode_for(self.root)
        #: Every path of the store (``v1/entries/...``, ``stats/``, ``locks/``, ...).
        self.layout = Layout(self.root)
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
        for directory in (self.root, self.base):
            check_safe_dir(directory, self.shared_group)
        if os.path.isdir(self.root) and not os.access(self.root, os.R_OK | os.X_OK):
            self._go_read_only(f"{self.root} is not readable by this user")
        if not self.read_only:
            if not os.access(self.root, os.W_OK | os.X_OK) or (
                self.base.exists() and not os.access(self.base, os.W_OK | os.X_OK)
            ):
                self._go_read_only(f"{self.root} is not writable by this user")
            else:
                try:
                    for directory in self.layout.dirs:
                        self._mkdirs(directory)
                except OSError as exc:
                    self._go_read_only(f"cannot write in {self.root}: {exc.strerror or exc}")

    # -- plumbing --------------------------------------------------------------------------------
    def __repr__(self) -> str:
        ro = ", read_only" if self.read_only else ""
        return f"Store({str(self.root)!r}, source={self.location_source}{ro})"

    def _go_read_only(self, reason: str) -> None:
        # Logged only: the one user-visible warning comes with the first skipped publish.
        self.read_only = True
        self.read_only_reason = reason
        logger.info("compile cache %s is read-only: %s", self.root, reason)

    def _require_writable(self, what: str) -> None:
        if self.read_only:
            raise StoreError(f"cannot {what}: compile cache {self.root} is read-only ({self.read_only_reason})")

    def _mkdirs(self, path: Path, anchor: Path | None = ...) -> None:  # type: ignore[assignment]
        """Create ``path`` and missing parents below ``anchor`` (default: the store root) with our mode."""
        make_dirs(path, self.root if anchor is ... else anchor, self.dir_mode)

    def _io_error(self, what: str, exc: BaseException, path: Path | None = None) -> None:
        kind = errno_name(exc)
        where = f" ({path})" if path else ""
        warn_once(
            self.root,
            f"io-{what}-{kind}",
            f"compile cache: could not {what}{where}: {kind}: {exc}; going on without caching it",
        )
        self._bump(errors=1, errors_by_kind={kind: 1})

    def _write(self, target: Path, data: Any, *, exclusive: bool = False, fsync: bool = True) -> bool:
        return atomic_write(target, data, mode=self.file_mode, exclusive=exclusive, fsync=fsync)

    def _touch_used(self, key: str) -> None:
        if self.read_only:
            return
        used = self.layout.used_file(key)
        try:
            os.utime(used)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.close(os.open(used, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), self.file_mode))
        except OSError:
            pass

    def _lock_at(self, base: Path, timeout: float | None) -> BaseLock:
        """A lock under this store's locks dir, with its mode and permissions."""
        return make_lock(base, mode=self.lock_mode, timeout=timeout,
                         dir_mode=self.dir_mode, file_mode=self.file_mode)

    # -- counters (compile_cache.store.stats) ------------------------------------------------------
    def _bump(self, **delta: Any) -> None:
        """Add ``delta`` to the persisted counters; kept in memory and retried if the write fails."""
        stats.bump(self, delta)

    def record_hit(self, key: str, seconds_saved: float | None = None, nbytes: int = 0) -> None:
        """Count a hit (the caller restored ``key`` and it worked) and mark ``key`` used.

        ``seconds_saved`` defaults to the compile seconds recorded in the key's packs.
        """
        check_key(key)
        if seconds_saved is None:
            seconds_saved = 0.0
            for path in self.layout.pack_paths(key):
                with contextlib.suppress(OSError, CorruptPackError):
                    seconds_saved += float(read_pack_header(path)[0].get("compile_seconds") or 0.0)
        self._touch_used(key)
        self._bump(hits=1, seconds_saved=float(seconds_saved), bytes_restored=int(nbytes))

    def record_miss(self, key: str) -> None:
        """Count a miss for ``key`` (nothing usable was in the store)."""
        check_key(key)
        self._bump(misses=1)

    def record_error(self, kind: str) -> None:
        """Count an error of ``kind`` (e.g. ``"restore"``, ``"ENOSPC"``)."""
        self._bump(errors=1, errors_by_kind={str(kind): 1})

    def record_backend_fallback(self) -> None:
        """Count a fallback from the native fingerprint backend to the reference one."""
        self._bump(backend_fallbacks=1)

    def record_capture_fallback(self) -> None:
        """Count a capture that diffed the local cache dirs (a torch hook it needs is missing)."""
        self._bump(capture_fallbacks=1)

    def stats(self) -> dict[str, Any]:
        """Every counter of :data:`.stats.COUNTERS` summed over all processes, ``errors_by_kind``,
        ``hit_rate``, ``entries``, ``packs``, ``size(_human)``, ``max_size(_human)``,
        ``quarantined``, ``location(_source)``, ``read_only(_reason)``, ``lock_mode``."""
        return stats.summary(self)

    def zero_stats(self) -> None:
        """Reset every counter to zero (entries are kept)."""
        self._require_writable("zero the stats")
        stats.zero(self)

    # -- publish / load --------------------------------------------------------------------------
    def publish(
        self,
        key: str,
        members: Mapping[str, bytes | bytearray | memoryview],
        metadata: Mapping[str, Any] | None = None,
        entry_info: Mapping[str, Any] | None = None,
        compile_seconds: float = 0.0,
    ) -> PackInfo | None:
        """Add a pack of ``members`` to ``key``; return its :class:`PackInfo`, or ``None``.

        ``None`` means nothing was written: the same content is already there (packs are
        content-addressed), the store is read-only (one warning), or an I/O error happened
        (``ENOSPC``, ``EACCES``, ``EROFS``, a directory removed under us: one warning per kind,
        a counted error, never an exception). ``metadata`` goes into the pack header;
        ``entry_info`` into ``entry.json`` when this publish creates the entry. Programming
        errors still raise: a bad key (``ValueError``), an unsafe member name
        (:class:`UnsafePathError`), non-bytes members or non-JSON metadata (``TypeError``).
        May evict least-recently-used entries afterwards to stay under ``max_size``.
        """
        check_key(key)
        if not isinstance(members, Mapping):
            raise TypeError(f"members must be a mapping of name -> bytes, got {type(members).__name__}")
        for member_name, data in members.items():
            check_member_name(member_name)
            check_member_bytes(member_name, data)
        entry_json = json_bytes(self._entry_record(key, entry_info))
        json_bytes(dict(metadata or {}))  # TypeError/ValueError now, not after the hashing
        if self.read_only:
            warn_once(self.root, "read-only-publish",
                       f"compile cache {self.root} is read-only ({self.read_only_reason}): "
                       "new compile artifacts are not saved")
            return None
        name = content_hash(members)
        entry = self.layout.entry_dir(key)
        target = self.layout.pack_path(key, name)
        try:
            if target.exists():
                self._touch_used(key)
                return None
            name, chunks, size = encode_pack(
                key, members, metadata, compile_seconds=compile_seconds,
                signing_key=self.signing_key, name=name,
            )
            for attempt in range(2):
                try:
                    self._mkdirs(target.parent)
                    self._write_entry_json(entry, entry_json)
                    self._write(target, chunks)
                    break
                except FileNotFoundError:
                    if attempt:  # the entry was evicted twice under us: give up quietly
                        raise
            self._touch_used(key)
        except OSError as exc:
            self._io_error("publish", exc, target)
            return None
        header = {"created": time.time(), "members": [{"size": len(members[m])} for m in members],
                  "compile_seconds": compile_seconds, "metadata": dict(metadata or {})}
        info = PackInfo._from_header(key, name, target, size, header, self.signing_key is not None)
        self._bump(publishes=1, bytes_published=size, compile_seconds=float(compile_seconds))
        if self.max_size:
            try:
                maintenance.enforce_cap(self, protect={key})
            except OSError as exc:
                logger.debug("eviction after publish failed: %s", exc)
        return info

    def _entry_record(self, key: str, entry_info: Mapping[str, Any] | None) -> dict[str, Any]:
        record: dict[str, Any] = {"created": time.time(), "torch": torch_version(), "host": HOSTNAME}
        record.update(entry_info or {})
        record.update(key=key, format=FORMAT_VERSION)
        return record

    def _write_entry_json(self, entry: Path, data: bytes) -> None:
        path = entry / "entry.json"
        current, garbage = read_json_file(path)
        if current is not None:
            return
        self._write(path, data, exclusive=not garbage)

    def load(self, key: str) -> list[Pack]:
        """Every valid pack of ``key``, oldest first; ``[]`` when there is none.

        A pack that fails its checks (truncated, altered, unsigned while a signing key is set,
        unsafe member names) is counted as ``corrupt``, moved to quarantine and skipped; a pack of
        another format version is counted as ``incompatible`` and left alone. Loading does not
        count a hit or a miss (the caller knows whether the restore worked: :meth:`record_hit`,
        :meth:`record_miss`); it marks the entry used.
        """
        check_key(key)
        packs: list[Pack] = []
        try:
            paths = self.layout.pack_paths(key, strict=True)
        except OSError as exc:  # EACCES, EIO, ESTALE: a miss for this job, counted
            self._io_error("read", exc, self.layout.packs_dir(key))
            return []
        ours = torch_version()
        for path in paths:
            try:
                data = read_nofollow(path)
                header, members = decode_pack(data, signing_key=self.signing_key, key=key)
            except FileNotFoundError:
                continue  # evicted or quarantined by another process meanwhile
            except IncompatiblePackError as exc:
                logger.info("skipping pack %s: %s", path, exc)
                self._bump(incompatible=1)
                continue
            except CorruptPackError as exc:
                self._corrupt(path, key, exc)
                continue
            except OSError as exc:
                self._io_error("read", exc, path)
                continue
            theirs = header.get("torch")
            if isinstance(theirs, str) and "unknown" not in (theirs, ours) and theirs != ours:
                # Keys include the environment, so this pack was put here by hand or by a bug;
                # its artifacts were built for another torch. Set it aside so that a republish
                # of the same content (same pack name) is not blocked by it.
                moved = self._quarantine(path, key)
                warn_once(self.root, "foreign-torch",
                           f"compile cache: pack {path} was written by torch {theirs}, this is "
                           f"torch {ours}; treated as a miss and "
                           + (f"moved to {moved}" if moved else "left in place (read-only store)"))
                self._bump(incompatible=1)
                continue
            info = PackInfo._from_header(key, path.stem, path, len(data), header, is_signed(data))
            packs.append(Pack(members=members, header=header, info=info))
        if packs:
            self._touch_used(key)
        packs.sort(key=lambda p: (p.info.created, p.info.name))
        return packs

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
            self._mkdirs(self.quarantine_dir)
            os.replace(path, target)
        except OSError:
            return None
        return target

    def has(self, key: str) -> bool:
        """Whether ``key`` has at least one pack (unverified: :meth:`load` checks them)."""
        return bool(self.layout.pack_paths(check_key(key)))

    def lock(self, key: str, timeout: float | None = 60.0) -> BaseLock:
        """A lock for ``key`` (``with store.lock(key): ...``): only avoids duplicate compiles.

        Raises :class:`LockTimeoutError` on timeout, after which callers go on without it. On a
        read-only store this is a no-op lock.
        """
        check_key(key)
        if self.read_only:
            return make_lock(self.layout.lock_base(key), mode="none", timeout=timeout)
        return self._lock_at(self.layout.lock_base(key), timeout)

    # -- listing -------------------------------------------------------------------------------
    def entry(self, key: str) -> EntryInfo | None:
        """The :class:`EntryInfo` of ``key``, or ``None`` if it has no entry directory."""
        return EntryInfo.read(self.layout, check_key(key))

    def entries(self) -> list[EntryInfo]:
        """Every entry, sorted by key."""
        out = []
        for key in self.layout.keys():
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
        return maintenance.remove_entries(
            self,
            None if max_size is None else parse_size(max_size, name="max_size"),
            None if older_than is None else parse_age(older_than, name="older_than"),
            None if keys is None else set(key_list(keys)),
            dry_run,
            protect=set(),
        )

    def compact(self, keys: Iterable[str] | None = None, dry_run: bool = False) -> list[CompactReport]:
        """Merge each entry's packs (all, or ``keys``) into one holding its current generation."""
        if not dry_run:
            self._require_writable("compact")
        done = [maintenance.compact(self, k, dry_run) for k in key_list(keys or self.layout.keys())]
        return [d for d in done if d is not None]

    def clear(self) -> int:
        """Remove every entry and quarantined pack (counters are kept); return entries removed."""
        self._require_writable("clear")
        return maintenance.clear(self)

    def verify(
        self, fix: bool = False, *, temp_age: float = maintenance.ORPHAN_AGE,
        lock_stale_after: float = DEFAULT_STALE_AFTER,
    ) -> VerifyReport:
        """Check every pack (header, checksum, signature), entry.json, stats file, temp file and lock.

        Reports corrupt packs, orphaned temp files older than ``temp_age`` seconds (a crashed
        publisher's), stale locks (dead holder or older than ``lock_stale_after``), garbage
        ``entry.json`` and stats files, and empty entries. With ``fix=True`` corrupt packs are
        quarantined and the rest removed (``fix`` raises :class:`StoreError` on a read-only store).
        Packs of another format version are listed but never touched.
        """
        temp_age = check_seconds("temp_age", temp_age)
        lock_stale_after = check_seconds("lock_stale_after", lock_stale_after)
        if fix:
            self._require_writable("fix the store")
        return maintenance.verify(self, fix, temp_age, lock_stale_after)

    # -- export / import (compile_cache.store.archive) --------------------------------------------
    def export(self, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> int:
        """Write entries (all, or ``keys``) with their valid packs into one tar archive at ``path``.

        ``.tar.gz``/``.tgz`` names are gzip-compressed. Corrupt packs are skipped (and
        quarantined). Returns the number of packs exported. Unknown ``keys`` raise StoreError.
        """
        return archive.export(self, path, keys)

    def import_archive(self, path: str | os.PathLike[str]) -> ImportReport:
        """Add the entries of an archive made by :meth:`export`; importing twice is harmless.

        Every member is validated before anything is written: only regular files and
        directories (no symlinks, hard links, devices, FIFOs), safe relative names, the expected
        layout, and every pack's checksum (and signature, with a signing key), key and content
        hash. A bad archive raises :class:`UnsafePathError` / :class:`CorruptPackError` and
        leaves the store untouched. Raises :class:`StoreError` on a read-only store.
        """
        self._require_writable("import")
        return archive.import_archive(self, path)
