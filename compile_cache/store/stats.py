"""The store's counters: hits, misses, errors, bytes and seconds, summed over every process.

Each process adds to one of :data:`STATS_SHARDS` shard files (chosen by host and pid), under a
short lock, read-modify-write; ``stats`` sums the shards. A count that cannot be written now
(lock busy, read-only or vanished store, I/O error) is kept in memory and goes out with the next
one. One definition of a hit: the caller restored the key's packs and they worked
(:meth:`Store.record_hit`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._paths import HOSTNAME
from .._sizes import format_size
from ..locks import optional_lock
from ._io import json_bytes, read_json_file

if TYPE_CHECKING:
    from .core import Store

__all__ = ["COUNTERS", "STATS_SHARDS", "add_counts", "bump", "shard_index", "summary", "zero"]

logger = logging.getLogger("compile_cache")

STATS_SHARDS = 8
COUNTERS: tuple[str, ...] = (
    "hits",
    "misses",
    "errors",
    "corrupt",
    "incompatible",
    "publishes",
    "bytes_published",
    "bytes_restored",
    "seconds_saved",
    "compile_seconds",
    "evictions",
    "evicted_bytes",
    "backend_fallbacks",
    "capture_fallbacks",
)
_GARBAGE_SHARD = {"errors": 1, "errors_by_kind": {"stats_file": 1}}


def shard_index() -> int:
    """The shard this process writes (host and pid hashed)."""
    return zlib.crc32(f"{HOSTNAME}:{os.getpid()}".encode()) % STATS_SHARDS


def add_counts(into: dict[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
    """Adds the known counters of ``delta`` (and ``errors_by_kind``) into ``into``."""
    for name, value in delta.items():
        if name == "errors_by_kind":
            kinds = into.setdefault("errors_by_kind", {})
            if isinstance(value, dict):
                for kind, n in value.items():
                    if isinstance(n, (int, float)) and not isinstance(n, bool):
                        kinds[str(kind)] = kinds.get(str(kind), 0) + n
        elif name in COUNTERS and isinstance(value, (int, float)) and not isinstance(value, bool):
            into[name] = into.get(name, 0) + value
    return into


def bump(store: Store, delta: Mapping[str, Any]) -> None:
    """Add ``delta`` to the persisted counters; kept in memory and retried if the write fails."""
    add_counts(store._pending, delta)
    if store.read_only or not store.layout.base.is_dir():
        return  # kept in memory: a vanished store is not re-created just for counters
    n = shard_index()
    shard = store.layout.stats_shard(n)
    lock = store._lock_at(store.layout.lock_base(f"stats-{n}"), timeout=2.0)
    try:
        with optional_lock(lock) as held:
            if not held:
                return  # pending deltas go out with the next update
            current, garbage = read_json_file(shard)
            merged = add_counts({}, current or {})
            if garbage:
                logger.warning("compile cache stats file %s was unreadable; counting from zero", shard)
                add_counts(merged, _GARBAGE_SHARD)
            add_counts(merged, store._pending)
            store._write(shard, json_bytes(merged), fsync=False)
            store._pending = {}
    except OSError as exc:
        logger.debug("could not update stats %s: %s", shard, exc)


def summary(store: Store) -> dict[str, Any]:
    """Counters summed over all processes, plus the store's size, cap and location (see
    :meth:`Store.stats` for the keys)."""
    totals: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
    totals["errors_by_kind"] = {}
    stats_dir = store.layout.stats_dir
    try:
        shard_names = sorted(os.listdir(stats_dir))
    except OSError:
        shard_names = []
    for name in shard_names:
        if not store.layout.is_stats_shard(name):
            continue
        data, garbage = read_json_file(stats_dir / name)
        if garbage:
            add_counts(totals, _GARBAGE_SHARD)
        elif data:
            add_counts(totals, data)
    add_counts(totals, store._pending)
    entries = store.entries()
    size = sum(e.size for e in entries)
    lookups = totals["hits"] + totals["misses"]
    try:
        quarantined = len(os.listdir(store.layout.quarantine_dir))
    except OSError:
        quarantined = 0
    totals.update(
        hit_rate=(totals["hits"] / lookups) if lookups else None,
        entries=len(entries),
        packs=sum(len(e.packs) for e in entries),
        size=size,
        size_human=format_size(size),
        max_size=store.max_size,
        max_size_human=format_size(store.max_size) if store.max_size else "unlimited",
        quarantined=quarantined,
        location=str(store.root),
        location_source=store.location_source,
        read_only=store.read_only,
        read_only_reason=store.read_only_reason,
        lock_mode=store.lock_mode,
    )
    return totals


def zero(store: Store) -> None:
    """Remove every shard (and forget the counts not written yet)."""
    store._pending = {}
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(store.layout.stats_dir):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(store.layout.stats_dir / name)
