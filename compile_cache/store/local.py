"""The store in one directory: every operation of :class:`~compile_cache.store.Store` on local disk.

:class:`LocalStore` holds the store's parts (:class:`~.parts.StoreParts`: the file layer, the
paths, the counters, the pack checks, the entries' upkeep) and its size cap, and runs each
operation through the module that does it (:mod:`.loading`, :mod:`.publishing`,
:mod:`.maintenance`, :mod:`.verifier`, :mod:`.archive`, :mod:`.stats`). It knows nothing of
object storage: :mod:`.tiered` composes it with a remote tier.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._paths import check_key
from ..locks import BaseLock, make_lock
from . import archive, loading, maintenance, publishing, stats, verifier
from ._io import check_seconds, errno_name, key_list
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

__all__ = ["LocalStore"]


class LocalStore:
    """The store whose parts are ``parts``, capped at ``max_size`` bytes (0: no cap);
    ``location_source``: how its location was chosen (shown by ``stats``)."""

    def __init__(self, parts: StoreParts, *, max_size: int, location_source: str) -> None:
        self.parts = parts
        self.max_size = max_size
        self.location_source = location_source

    # -- counters ----------------------------------------------------------------------------------
    def record_outcome(self, key: str, outcome: str, *, previous: str | None = None,
                       seconds_saved: float | None = None, nbytes: int = 0) -> None:
        """See :meth:`Store.record_outcome`."""
        check_key(key)
        seconds_saved = None if seconds_saved is None else float(seconds_saved)
        if outcome in ("hit", "partial"):
            self.parts.keeper.touch_used(key)
        stats.record_outcome(self.parts, key, outcome, previous=previous,
                             seconds_saved=seconds_saved, nbytes=nbytes)

    def record_error(self, kind: str) -> None:
        """Count an error of ``kind``."""
        self.parts.counters.bump(errors=1, errors_by_kind={str(kind): 1})

    def record_failed_hit(self, key: str) -> None:
        """The hit counted for ``key`` becomes a miss."""
        check_key(key)
        self.parts.counters.bump(hits=-1, misses=1)

    def record_lock_fallback(self, exc: BaseException) -> None:
        """Count a lock that could not be taken."""
        self.parts.counters.bump(lock_fallbacks=1, errors_by_kind={f"lock-{errno_name(exc)}": 1})

    def stats(self) -> dict[str, Any]:
        """See :meth:`Store.stats`."""
        return stats.summary(self.parts, self.max_size, self.location_source)

    def zero_stats(self) -> None:
        """Reset every counter to zero (the size counter starts again at the exact size)."""
        self.parts.fs.require_writable("zero the stats")
        self.parts.counters.zero(size=maintenance.total_size(self.parts))

    # -- publish / load ----------------------------------------------------------------------------
    def publish(
        self, key: str, members: Mapping[str, bytes | bytearray | memoryview],
        metadata: Mapping[str, Any] | None = None, entry_info: Mapping[str, Any] | None = None,
        compile_seconds: float = 0.0, member_info: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> PackInfo | None:
        """See :meth:`Store.publish`."""
        return publishing.publish(self.parts, self.max_size, key, members, metadata, entry_info,
                                  compile_seconds, member_info)

    def load(self, key: str) -> list[Pack]:
        """See :meth:`Store.load`."""
        return loading.load(self.parts, key)

    def quarantine(self, pack: PackInfo, reason: str, *, counter: str = "corrupt") -> Path | None:
        """See :meth:`Store.quarantine`."""
        return self.parts.keeper.set_aside(pack.path, pack.key, reason, counter)

    def usable(self, pack: PackInfo) -> bool:
        """See :meth:`Store.usable`."""
        return self.parts.checker.usable(pack)

    def has(self, key: str) -> bool:
        """See :meth:`Store.has`."""
        return bool(self.parts.layout.pack_paths(check_key(key)))

    def lock(self, key: str, timeout: float | None = 60.0, wait_alive: float | None = None) -> BaseLock:
        """See :meth:`Store.lock`."""
        check_key(key)
        base = self.parts.layout.lock_base(key)
        if self.parts.fs.read_only:
            return make_lock(base, mode="none", timeout=timeout)
        return self.parts.fs.lock_at(base, timeout, wait_alive)

    def evict_lock_holder(self) -> str | None:
        """See :meth:`Store.evict_lock_holder`."""
        if self.parts.fs.read_only:
            return None
        lock = self.parts.fs.lock_at(self.parts.layout.lock_base("evict"), timeout=0)
        try:
            lock.acquire(0)
        except OSError:
            holder = lock.holder()
            if holder is None:
                return "an unknown process (no holder record)"
            return f"{holder} (last heartbeat {holder.age:.0f} s ago)"
        lock.release()
        return None

    # -- listing -----------------------------------------------------------------------------------
    def entry(self, key: str) -> EntryInfo | None:
        """See :meth:`Store.entry`."""
        return EntryInfo.read(self.parts.layout, check_key(key))

    def entries(self) -> list[EntryInfo]:
        """See :meth:`Store.entries`."""
        out = []
        for key in self.parts.layout.keys():
            info = self.entry(key)
            if info is not None:
                out.append(info)
        return out

    # -- maintenance -------------------------------------------------------------------------------
    def plan_eviction(self, max_size: int | str | None = None, older_than: float | str | None = None,
                      keys: Iterable[str] | None = None) -> EvictionPlan:
        """See :meth:`Store.plan_eviction`."""
        criteria = maintenance.eviction_criteria(self.max_size, max_size, older_than, keys)
        if criteria is None:
            return maintenance.NOTHING_TO_EVICT
        return maintenance.plan_eviction(self.parts, *criteria)

    def compact(self, keys: Iterable[str] | None = None, dry_run: bool = False) -> list[CompactReport]:
        """See :meth:`Store.compact`."""
        if not dry_run:
            self.parts.fs.require_writable("compact")
        return maintenance.compact_all(self.parts, key_list(keys or self.parts.layout.keys()), dry_run)

    def clear(self) -> int:
        """See :meth:`Store.clear`."""
        self.parts.fs.require_writable("clear")
        return maintenance.clear(self.parts)

    def verify(self, *, temp_age: float = maintenance.ORPHAN_AGE, lock_stale_after: float | None = None,
               labels: Iterable[str] | None = None) -> VerifyReport:
        """See :meth:`Store.verify`: the scan (its ``fix()`` fixes what it lists)."""
        return verifier.scan(self.parts, check_seconds("temp_age", temp_age), lock_stale_after,
                             None if labels is None else frozenset(labels))

    # -- export / import ---------------------------------------------------------------------------
    def export(self, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> int:
        """See :meth:`Store.export`."""
        return archive.export(self.parts, path, keys)

    def import_archive(self, path: str | os.PathLike[str]) -> ImportReport:
        """See :meth:`Store.import_archive`."""
        self.parts.fs.require_writable("import")
        return archive.import_archive(self.parts, self.max_size, path)
