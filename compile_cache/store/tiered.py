"""A store on object storage: a local store (its read-through tier) composed with a remote tier.

:class:`TieredStore` has the operations of :class:`~.local.LocalStore` and runs each on the local
store and the remote tier (:class:`~.remote.RemoteTier`: the objects under the URL): a load
fetches what the local tier lacks first, a publish pushes after writing locally, listings and
maintenance work on the URL's objects. Neither side knows the other: the tier gets the local
store's parts to work with, and listens to its counters and use marks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._paths import check_key
from ..locks import BaseLock
from . import maintenance, remote_verify
from ._io import check_seconds, key_list
from .local import LocalStore
from .records import (
    CompactReport,
    EntryInfo,
    EvictionPlan,
    ImportReport,
    Pack,
    PackInfo,
    VerifyReport,
)
from .remote import RemoteTier

__all__ = ["TieredStore"]


class TieredStore:
    """The store whose objects are ``tier``'s, read through the local store ``local``."""

    def __init__(self, local: LocalStore, tier: RemoteTier) -> None:
        self.local, self.tier = local, tier
        parts = local.parts
        tier.attach(parts)
        parts.counters.listeners.append(tier.count)  # the URL's counters (this process's object)
        parts.keeper.use_listeners.append(tier.record_use)
        if tier.made_local and not parts.fs.read_only:
            parts.counters.exact_when_new()  # no walk at the first fetch's cap check

    def prefetch(self, key: str) -> bool:
        """Start bringing ``key``'s packs over in the background (:meth:`RemoteTier.prefetch`);
        the next load of ``key`` waits for them."""
        return self.tier.prefetch(check_key(key))

    def fetch(self, key: str, *, strict: bool = False) -> int:
        """Bring ``key``'s packs the local tier lacks (see :meth:`RemoteTier.fetch`), then keep
        the local tier within its cap; the bytes downloaded."""
        moved = self.tier.fetch(key, strict=strict)
        if moved and self.local.max_size:
            with contextlib.suppress(OSError):
                maintenance.enforce_cap(self.local.parts, self.local.max_size, protect={key})
        return moved

    # -- counters ----------------------------------------------------------------------------------
    def record_outcome(self, key: str, outcome: str, *, previous: str | None = None,
                       seconds_saved: float | None = None, nbytes: int = 0) -> None:
        """See :meth:`Store.record_outcome`."""
        self.local.record_outcome(key, outcome, previous=previous, seconds_saved=seconds_saved,
                                  nbytes=nbytes)

    def record_error(self, kind: str) -> None:
        """Count an error of ``kind``."""
        self.local.record_error(kind)

    def record_failed_hit(self, key: str) -> None:
        """The hit counted for ``key`` becomes a miss."""
        self.local.record_failed_hit(key)

    def record_lock_fallback(self, exc: BaseException) -> None:
        """Count a lock that could not be taken."""
        self.local.record_lock_fallback(exc)

    def stats(self) -> dict[str, Any]:
        """The URL's counters and footprint, with the local tier's size."""
        return self.tier.summary(self.local.stats())

    def zero_stats(self) -> None:
        """Reset every counter, the local tier's and the URL's."""
        self.local.zero_stats()
        self.tier.zero()

    # -- publish / load ----------------------------------------------------------------------------
    def publish(
        self, key: str, members: Mapping[str, bytes | bytearray | memoryview],
        metadata: Mapping[str, Any] | None = None, entry_info: Mapping[str, Any] | None = None,
        compile_seconds: float = 0.0, member_info: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> PackInfo | None:
        """Publish locally, then put what the URL lacks (also what an earlier publish could not)."""
        info = self.local.publish(key, members, metadata, entry_info, compile_seconds, member_info)
        self.tier.push(key)
        return info

    def load(self, key: str) -> list[Pack]:
        """Fetch what the local tier lacks, then load from it."""
        self.fetch(check_key(key))
        return self.local.load(key)

    def quarantine(self, pack: PackInfo, reason: str, *, counter: str = "corrupt") -> Path | None:
        """See :meth:`Store.quarantine` (the local tier's copy)."""
        return self.local.quarantine(pack, reason, counter=counter)

    def usable(self, pack: PackInfo) -> bool:
        """See :meth:`Store.usable`."""
        return self.local.usable(pack)

    def has(self, key: str) -> bool:
        """Whether the URL has a pack of ``key`` (the local tier's answer on a fault)."""
        return self.tier.has(check_key(key))

    def lock(self, key: str, timeout: float | None = 60.0, wait_alive: float | None = None) -> BaseLock:
        """A lock in the local tier (see :meth:`Store.lock`)."""
        return self.local.lock(key, timeout, wait_alive)

    # -- listing -----------------------------------------------------------------------------------
    def entry(self, key: str) -> EntryInfo | None:
        """The entry's packs, fetched into the local tier."""
        self.fetch(check_key(key))
        return self.local.entry(key)

    def entries(self) -> list[EntryInfo]:
        """Every entry under the URL."""
        return self.tier.entries()

    # -- maintenance -------------------------------------------------------------------------------
    def plan_eviction(self, max_size: int | str | None = None, older_than: float | str | None = None,
                      keys: Iterable[str] | None = None) -> EvictionPlan:
        """The entries under the URL an eviction removes (see :meth:`RemoteTier.plan_eviction`)."""
        criteria = maintenance.eviction_criteria(self.local.max_size, max_size, older_than, keys)
        if criteria is None:
            return maintenance.NOTHING_TO_EVICT
        return self.tier.plan_eviction(*criteria)

    def compact(self, keys: Iterable[str] | None = None, dry_run: bool = False) -> list[CompactReport]:
        """Compact the local tier's entries (each fetched first)."""
        if not dry_run:
            self.local.parts.fs.require_writable("compact")
        chosen = key_list(keys or self.local.parts.layout.keys())
        for key in chosen:
            self.fetch(key)
        return self.local.compact(chosen, dry_run)

    def clear(self) -> int:
        """Remove every entry under the URL and in the local tier."""
        self.local.parts.fs.require_writable("clear")
        return self.tier.clear()

    def verify(self, *, temp_age: float = maintenance.ORPHAN_AGE, lock_stale_after: float | None = None,
               labels: Iterable[str] | None = None) -> VerifyReport:
        """The URL's verify scan (:mod:`.remote_verify`; its ``fix()`` fixes what it lists)."""
        del lock_stale_after  # no locks on object storage
        return remote_verify.verify(self.tier, check_seconds("temp_age", temp_age),
                                    None if labels is None else frozenset(labels))

    # -- export / import ---------------------------------------------------------------------------
    def export(self, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> int:
        """Export the URL's entries (all, or ``keys``), fetched through the local tier."""
        chosen = key_list(keys) if keys is not None else list(self.tier.listing())
        for key in chosen:
            self.fetch(key, strict=True)
        return self.local.export(path, chosen)

    def import_archive(self, path: str | os.PathLike[str]) -> ImportReport:
        """Import into the local tier, then put every imported key's packs (faults raise)."""
        report = self.local.import_archive(path)
        for key in report.keys:
            self.tier.push(key, strict=True)
        return report
