"""The store: the public face over a local store, or a local tier and object storage.

Every file is written under a unique temp name beside its target (host-pid-random), fsynced and
``os.replace``\\ d: a reader sees a whole file or none. Packs are never modified, only added or
removed, so concurrent publishers, readers and evicters need no lock for correctness; locks only
avoid duplicate work. A pack that fails a check is a miss (counted, quarantined), never a crash,
and an I/O error while publishing (``ENOSPC``, ``EACCES``, ``EROFS``) is a warning and a counted
error, never an exception in the training job.

:class:`Store` builds the store's parts (:class:`~.parts.StoreParts`: the file layer
:mod:`.fs`, the paths :mod:`.layout`, the counters :mod:`.counters`, the pack checks
:mod:`.checker`, the entries' upkeep :mod:`.keeper`) and hands each operation to a
:class:`~.local.LocalStore`, or for a URL to a :class:`~.tiered.TieredStore` (the local store
plus the objects under the URL, :mod:`.remote`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import config
from .._paths import check_key
from .._sizes import parse_size
from ..errors import StoreError
from ..locks import BaseLock, filesystem_type, lock_mode_for
from ._io import check_seconds
from .checker import PackChecker
from .counters import Counters
from .fs import StoreFS
from .layout import Layout
from .local import LocalStore
from .maintenance import ORPHAN_AGE
from .pack import PackLimits
from .parts import StoreParts
from .records import (
    CompactReport,
    EntryInfo,
    EvictionPlan,
    ImportReport,
    Pack,
    PackInfo,
    VerifyReport,
)
from .remote import RemoteTier, remote_location
from .safety import check_tree, resolve_location
from .tiered import TieredStore

__all__ = ["DEFAULT_MAX_SIZE", "Store"]

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
        self.remote: RemoteTier | None
        self.remote, path, source = remote_location(path)
        self.root, self.location_source = resolve_location(path)
        self.location_source = source or self.location_source  # location: as shown, no credentials
        self.location: str = self.remote.display if self.remote else str(self.root)
        self.shared_group: bool = config.SHARED.value()
        cap = config.MAX_SIZE.value() if max_size is None else parse_size(max_size, name="max_size")
        if signing_key is None:
            signing_key = config.SIGNING_KEY.value()
        key = (signing_key.encode() if isinstance(signing_key, str) else signing_key) or None
        checker = PackChecker(PackLimits.from_config(), key)
        self.lock_mode, self.lock_reason = lock_mode_for(self.root)
        #: Every file operation in the store (:mod:`.fs`: no link inside the store is followed),
        #: its modes and read-only state.
        self.fs = StoreFS(self.root, self.shared_group, lock_mode=self.lock_mode)
        self.dir_mode, self.file_mode = self.fs.dir_mode, self.fs.file_mode
        self._read_only_from(read_only)
        self._open_root()
        #: The store's collaborators: paths, counters, pack checks, entries' upkeep.
        self.parts = StoreParts.build(self.fs, checker)
        local = LocalStore(self.parts, location_source=self.location_source, max_size=cap)
        self._local = local
        self._ops: LocalStore | TieredStore = (local if self.remote is None
                                               else TieredStore(local, self.remote))
        self._check_layout()

    def _read_only_from(self, read_only: bool | None) -> None:
        """The read-only state asked for (the argument, else ``COMPILE_CACHE_READ_ONLY``)."""
        if read_only is None:
            if config.READ_ONLY.value():
                self.fs.set_read_only("COMPILE_CACHE_READ_ONLY is set")
        elif read_only:
            self.fs.set_read_only("read_only=True")

    def _open_root(self) -> None:
        """Check the root (a directory, or made now) and go read-only where it cannot be written."""
        # os.path's checks, not Path's: an unsearchable parent must not raise PermissionError here.
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise StoreError(f"compile cache location {self.root} exists and is not a directory")
        if not os.path.exists(self.root) and not self.read_only:
            try:
                self.fs.make_root()
            except OSError as exc:
                self.fs.go_read_only(f"cannot create {self.root}: {exc.strerror or exc}")

    def _check_layout(self) -> None:
        """Check the root and every layout dir (trusted, no link), and make the missing ones."""
        layout = self.layout
        # The root (symlinks resolved, each ours), every layout dir (no link: refused at use too).
        check_tree(self.root, (), self.shared_group)
        self.fs.check_dirs((layout.base, *layout.dirs))
        if os.path.isdir(self.root) and not os.access(self.root, os.R_OK | os.X_OK):
            self.fs.go_read_only(f"{self.root} is not readable by this user")
        if self.read_only:
            return
        if not os.access(self.root, os.W_OK | os.X_OK) or (
            layout.base.exists() and not os.access(layout.base, os.W_OK | os.X_OK)
        ):
            self.fs.go_read_only(f"{self.root} is not writable by this user")
            return
        try:
            self.fs.make_dirs(layout.dirs)
        except OSError as exc:
            self.fs.go_read_only(f"cannot write in {self.root}: {exc.strerror or exc}")

    # -- what the store is -----------------------------------------------------------------------
    def __repr__(self) -> str:
        ro = ", read_only" if self.read_only else ""
        return f"Store({self.location!r}, source={self.location_source}{ro})"

    @property
    def layout(self) -> Layout:
        """Every path of the store (``v1/entries/...``, ``stats/``, ``locks/``, ...)."""
        return self.parts.layout

    @property
    def counters(self) -> Counters:
        """The store's counters (:mod:`.counters`)."""
        return self.parts.counters

    @property
    def read_only(self) -> bool:
        """Whether the store is read-only (``read_only_reason`` says why)."""
        return self.fs.read_only

    @property
    def read_only_reason(self) -> str | None:
        """Why the store is read-only (None while it is writable)."""
        return self.fs.read_only_reason

    @property
    def max_size(self) -> int:
        """The size cap in bytes (0: none)."""
        return self._local.max_size

    @max_size.setter
    def max_size(self, value: int) -> None:
        self._local.max_size = value

    @property
    def signing_key(self) -> bytes | None:
        """The key packs are signed and checked with (None: unsigned)."""
        return self.parts.checker.signing_key

    @property
    def signer(self) -> str | None:
        """The id packs signed with this store's key carry (None without a key)."""
        return self.parts.checker.signer

    @property
    def limits(self) -> PackLimits:
        """The bounds a pack must stay within (COMPILE_CACHE_MAX_PACK_SIZE, ...)."""
        return self.parts.checker.limits

    # -- counters (compile_cache.store.counters, .stats) -------------------------------------------
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
        self._ops.record_outcome(key, outcome, previous=previous, seconds_saved=seconds_saved,
                                 nbytes=nbytes)

    def record_error(self, kind: str) -> None:
        """Count an error of ``kind`` (e.g. ``"restore"``, ``"ENOSPC"``)."""
        self._ops.record_error(kind)

    def record_backend_fallback(self) -> None:
        """Count a fallback from the native fingerprint backend to the reference one."""
        self.counters.bump(backend_fallbacks=1)

    def record_capture_fallback(self) -> None:
        """Count a capture that diffed the local cache dirs (a torch hook it needs is missing)."""
        self.counters.bump(capture_fallbacks=1)

    def record_failed_hit(self, key: str) -> None:
        """The hit counted for ``key`` was not one after all (torch could not load what the
        restore put in place): it becomes a miss."""
        self._ops.record_failed_hit(key)

    def record_lock_fallback(self, exc: BaseException) -> None:
        """Count a lock that could not be taken (timeout, EACCES, ENOLCK): the caller went on
        without it."""
        self._ops.record_lock_fallback(exc)

    def stats(self) -> dict[str, Any]:
        """Counters summed over all processes, plus the store's size, cap and location.

        Keys: every counter of :data:`~compile_cache.store.stats.COUNTERS`, ``errors_by_kind``,
        ``hit_rate``, ``entries``, ``packs``, ``size``, ``max_size``, ``size_human``,
        ``max_size_human``, ``quarantined``, ``location``, ``location_source``, ``read_only``,
        ``read_only_reason``, ``lock_mode``; on object storage also ``local_tier(_size)``.
        """
        return self._ops.stats()

    def zero_stats(self) -> None:
        """Reset every counter to zero (entries are kept)."""
        self._ops.zero_stats()

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
        return self._ops.publish(key, members, metadata, entry_info, compile_seconds, member_info)

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
        return self._ops.load(key)

    def prefetch(self, key: str) -> bool:
        """On object storage, start bringing ``key``'s packs into the local tier in the
        background (listing, downloads, expansion: network I/O on a thread that imports
        nothing), so that the caller's own work overlaps them; the next :meth:`load` of ``key``
        waits for them and checks every pack as always. True if started; a directory store (or
        a client that must stay on one thread) has nothing to start."""
        return isinstance(self._ops, TieredStore) and self._ops.prefetch(check_key(key))

    def quarantine(self, pack: PackInfo, reason: str, *, counter: str = "corrupt") -> Path | None:
        """Set ``pack`` aside (a pack its user found unusable: a member restore refused, or a
        library torch could not load): counted under ``counter``, warned once. Returns where it
        went, or None (read-only store, already gone)."""
        return self._ops.quarantine(pack, reason, counter=counter)

    def usable(self, pack: PackInfo) -> bool:
        """Whether this store's reader accepts ``pack`` by its signer (from the header only):
        with a signing key only packs signed with it, without one every pack."""
        return self._ops.usable(pack)

    def has(self, key: str) -> bool:
        """Whether ``key`` has at least one pack (unverified: :meth:`load` checks them)."""
        check_key(key)
        return self._ops.has(key)

    def lock(self, key: str, timeout: float | None = 60.0, wait_alive: float | None = None) -> BaseLock:
        """A lock for ``key`` (``with store.lock(key): ...``): only avoids duplicate compiles.

        Raises :class:`LockTimeoutError` on timeout (``wait_alive``: or later, while the holder's
        heartbeat is fresh), after which callers go on without it. Read-only store: a no-op lock.
        """
        return self._ops.lock(key, timeout, wait_alive)

    def rename_safety(self) -> tuple[bool | None, str]:
        """Whether the store is safe against another group member's renames on its filesystem,
        and why (:meth:`~.fs.StoreFS.rename_safety`, probed in its locks directory). On a FUSE
        mount the answer says what the filesystem leaves open: its server resolves paths, so a
        member's rename of a store directory between two steps can still redirect a write."""
        safe, why = self.fs.rename_safety(self.layout.locks_dir)
        kind = filesystem_type(self.root)
        if safe and kind.startswith("fuse."):
            why += (f"; but {kind} resolves paths on its server, so a member who renames one of "
                    "the store's directories between two steps can redirect a write (share it only "
                    "with people you would let write to your home; docs/security.md)")
        return safe, why

    def evict_lock_holder(self) -> str | None:
        """Who holds the lock of the size cap's eviction now (``host:pid``, its heartbeat's
        age), or None when it is free (``doctor``: a lock held for long is worth a look; a
        publisher over the cap waits for it a bounded time, then evicts without it)."""
        return self._local.evict_lock_holder()

    # -- listing -------------------------------------------------------------------------------
    def entry(self, key: str) -> EntryInfo | None:
        """The :class:`EntryInfo` of ``key``, or ``None`` if it has no entry directory."""
        return self._ops.entry(key)

    def entries(self) -> list[EntryInfo]:
        """Every entry, sorted by key."""
        return self._ops.entries()

    # -- maintenance (compile_cache.store.maintenance, .verifier) ---------------------------------
    def plan_eviction(
        self,
        max_size: int | str | None = None,
        older_than: float | str | None = None,
        keys: Iterable[str] | None = None,
    ) -> EvictionPlan:
        """The entries :meth:`evict` would remove, as a frozen plan; ``plan.execute()`` removes
        exactly those (an entry added after the plan was made is never removed by it).

        The criteria are :meth:`evict`'s. Executing raises :class:`StoreError` on a read-only store.
        """
        return self._ops.plan_eviction(max_size, older_than, keys)

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
            self.fs.require_writable("evict")
        plan = self.plan_eviction(max_size, older_than, keys)
        return list(plan.entries) if dry_run else plan.execute()

    def compact(self, keys: Iterable[str] | None = None, dry_run: bool = False) -> list[CompactReport]:
        """Merge each entry's packs (all, or ``keys``) into one holding its current generation."""
        return self._ops.compact(keys, dry_run)

    def clear(self) -> int:
        """Remove every entry and quarantined pack (counters are kept); return entries removed."""
        return self._ops.clear()

    def verify(
        self, fix: bool = False, *, temp_age: float = ORPHAN_AGE,
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
            self.fs.require_writable("fix the store")
        report = self._ops.verify(temp_age=temp_age, lock_stale_after=lock_stale_after, labels=labels)
        return report.fix() if fix else report

    # -- export / import (compile_cache.store.archive) --------------------------------------------
    def export(self, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> int:
        """Write entries (all, or ``keys``) with their valid packs into one tar archive at ``path``.

        ``.tar.gz``/``.tgz`` names are gzip-compressed. Corrupt packs are skipped (and
        quarantined). Returns the number of packs exported. Unknown ``keys`` raise StoreError.
        """
        return self._ops.export(path, keys)

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
        self.fs.require_writable("import")
        return self._ops.import_archive(path)
