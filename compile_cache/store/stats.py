"""The store's counters: hits, misses, errors, bytes and seconds, summed over every process.

Each process adds to one of :data:`STATS_SHARDS` shard files (chosen by host and pid), under a
short lock, read-modify-write; ``stats`` sums the shards. A count that cannot be written now
(lock busy, read-only or vanished store, I/O error) is kept in memory and goes out with the next
one.

The store's size is a counter too (``stored_bytes``): publishes and imports add what they
wrote, evictions and quarantine take away what they removed, so checking the size cap after a
publish reads a few small shard files instead of walking a store of thousands of packs
(:func:`tracked_size`). Files removed by hand make it drift; ``verify``, ``prune`` and ``clear``
walk the store anyway and set it to the exact size (:func:`correct_size`, which also counts
``size_recounts``: a store whose size was never counted that way has not been calibrated).

One meaning of "hit", decided per start (``compile_regions`` and its first forwards, see
:mod:`compile_cache.session`) by :func:`record_outcome`:

``hits``          packs were restored and the start compiled nothing new
``partial_hits``  packs were restored, then new graphs compiled (new shapes, the backward)
``misses``        nothing restored from the store, and the start compiled
``local_hits``    nothing restored from the store, but torch's own local cache had every graph
                  (the store was not needed: not counted in the hit rate)
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._paths import HOSTNAME, is_temp_name
from .._sizes import format_size
from ..locks import optional_lock
from ._io import json_bytes
from .layout import PACK_RE

if TYPE_CHECKING:
    from .core import Store

__all__ = [
    "COUNTERS",
    "OUTCOMES",
    "STATS_SHARDS",
    "add_counts",
    "bump",
    "correct_size",
    "record_outcome",
    "shard_index",
    "summary",
    "tracked_size",
    "zero",
]

logger = logging.getLogger("compile_cache")

STATS_SHARDS = 8
#: Seconds a shard whose lock could not be taken is tried without waiting.
BUSY_BACKOFF = 30.0
_busy_until: dict[str, float] = {}
COUNTERS: tuple[str, ...] = (
    "hits",
    "partial_hits",
    "misses",
    "local_hits",
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
    "stored_bytes",
    "size_recounts",
    "signature_mismatch",
    "load_failures",
    "lock_fallbacks",
    "untrusted",
    "precompile_hits",
    "precompile_declined",
    "precompile_load_errors",
    "precompile_unproven",
    # a store on object storage (compile_cache.store.remote)
    "remote_errors",
    "remote_downloads",
    "bytes_downloaded",
    "remote_uploads",
    "bytes_uploaded",
)
_GARBAGE_SHARD = {"errors": 1, "errors_by_kind": {"stats_file": 1}}
#: a start's outcome -> the counter it bumps
OUTCOMES: dict[str, str] = {
    "hit": "hits", "partial": "partial_hits", "miss": "misses", "local": "local_hits",
}


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


#: The threads of one process (the job's, the background publisher's) share a store's pending
#: counts and its stats shard: one at a time, or a count one of them adds is lost.
_bump_lock = threading.RLock()


def _new_bump_lock_in_child() -> None:
    global _bump_lock  # a fork while the publisher's thread held it would leave it held
    _bump_lock = threading.RLock()


os.register_at_fork(after_in_child=_new_bump_lock_in_child)


def bump(store: Store, delta: Mapping[str, Any]) -> None:
    """Add ``delta`` to the persisted counters; kept in memory and retried if the write fails."""
    with _bump_lock:
        _bump(store, delta)


def _bump(store: Store, delta: Mapping[str, Any]) -> None:
    add_counts(store._pending, delta)
    if getattr(store, "remote", None) is not None:
        store.remote.count(store, dict(delta))  # the URL's counters (this process's object)
    if store.read_only or not store.fs.is_dir(store.layout.base):
        return  # kept in memory: a vanished store is not re-created just for counters
    n = shard_index()
    shard = store.layout.stats_shard(n)
    busy_key = str(shard)
    # A shard lock that could not be taken lately (a dead holder, judged stale only after a
    # while) is tried without waiting: each counter update must not stall the job 2 s.
    wait = 0.0 if time.monotonic() < _busy_until.get(busy_key, 0.0) else 2.0
    lock = store._lock_at(store.layout.lock_base(f"stats-{n}"), timeout=wait)
    try:
        with optional_lock(lock) as held:
            if not held:
                if wait:
                    _busy_until[busy_key] = time.monotonic() + BUSY_BACKOFF
                return  # pending deltas go out with the next update
            current, garbage = store.fs.read_json(shard)
            merged = add_counts({}, current or {})
            if garbage:
                logger.warning("compile cache stats file %s was unreadable; counting from zero", shard)
                add_counts(merged, _GARBAGE_SHARD)
            add_counts(merged, store._pending)
            store._write(shard, json_bytes(merged), fsync=False)
            store._pending = {}
    except OSError as exc:
        logger.debug("could not update stats %s: %s", shard, exc)


def record_precompile(store: Store, *, hits: int = 0, declined: int = 0,
                      load_errors: int = 0, unproven: int = 0) -> None:
    """Count region groups whose precompile entry loaded, declined, or failed to load, and the
    graphs of loaded entries not installed because they could not prove the values they were
    traced under (:mod:`compile_cache.precompiled`)."""
    bump(store, {"precompile_hits": hits, "precompile_declined": declined,
                 "precompile_load_errors": load_errors, "precompile_unproven": unproven})


def saved_seconds(store: Store, key: str) -> float:
    """The compile seconds the key's packs recorded: what restoring them saved."""
    from ..errors import CorruptPackError
    from .pack import read_pack_header_from

    total = 0.0
    for path in store.layout.pack_paths(key):
        with contextlib.suppress(OSError, CorruptPackError, TypeError, ValueError), \
                store.fs.open_read(path, trust=False) as fh:
            total += float(read_pack_header_from(fh)[0].get("compile_seconds") or 0.0)
    return total


def record_outcome(
    store: Store, key: str, outcome: str, *, previous: str | None = None,
    seconds_saved: float | None = None, nbytes: int = 0,
) -> None:
    """Count one start as ``outcome`` (a key of :data:`OUTCOMES`). ``previous``: the outcome this
    start was counted as before (a hit that then compiled a new shape becomes a partial hit), so
    that every start is counted once; restored bytes and saved seconds are counted only once."""
    if outcome not in OUTCOMES or (previous is not None and previous not in OUTCOMES):
        raise ValueError(f"outcome must be one of {sorted(OUTCOMES)}, got {outcome!r}/{previous!r}")
    if outcome == previous:
        return
    delta: dict[str, Any] = {OUTCOMES[outcome]: 1}
    if previous is not None:
        delta[OUTCOMES[previous]] = -1
    elif outcome in ("hit", "partial"):
        delta["seconds_saved"] = float(saved_seconds(store, key) if seconds_saved is None else seconds_saved)
        delta["bytes_restored"] = int(nbytes)
    bump(store, delta)


def _footprint(store: Store) -> tuple[int, int, int]:
    """(entries, packs, bytes) as :meth:`Store.entries` counts them (regular files of each
    entry directory and its packs), from directory listings and lstat only: ``stats`` reads no
    pack header and no ``entry.json``, so it stays quick on a store of thousands of entries."""
    entries = packs = size = 0
    layout = store.layout
    for key in layout.keys():
        try:
            scan = store.fs.files(layout.entry_dir(key))
        except OSError:
            continue
        entries += 1
        size += sum(st.st_size for _name, st in scan)
        with contextlib.suppress(OSError):
            for name, st in store.fs.files(layout.packs_dir(key)):
                if PACK_RE.fullmatch(name):
                    size += st.st_size
                    packs += 1
    return entries, packs, size


def _totals(store: Store) -> dict[str, Any]:
    """Every counter summed over the shards, plus this process's counts not written yet."""
    totals: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
    totals["errors_by_kind"] = {}
    stats_dir = store.layout.stats_dir
    try:
        shard_names = sorted(store.fs.listdir(stats_dir))
    except OSError:
        shard_names = []
    for name in shard_names:
        if not store.layout.is_stats_shard(name):
            continue
        data, garbage = store.fs.read_json(stats_dir / name)
        if garbage:
            add_counts(totals, _GARBAGE_SHARD)
        elif data:
            add_counts(totals, data)
    add_counts(totals, store._pending)
    return totals


def tracked_size(store: Store) -> tuple[int, bool]:
    """The store's size from its counters (no walk), and whether it was ever calibrated by an
    exact count (if not, the counter misses what was published before it existed)."""
    totals = _totals(store)
    return max(0, int(totals["stored_bytes"])), totals["size_recounts"] > 0


def correct_size(store: Store, exact: int) -> None:
    """Set the size counter to ``exact`` (a walk's result): adds the difference, counts a recount."""
    current = int(_totals(store)["stored_bytes"])
    bump(store, {"stored_bytes": int(exact) - current, "size_recounts": 1})
    if current != exact:
        logger.debug("compile cache %s: size counter corrected from %d to %d bytes",
                     store.root, current, exact)


def summary(store: Store) -> dict[str, Any]:
    """Counters summed over all processes, plus the store's size, cap and location (see
    :meth:`Store.stats` for the keys)."""
    totals = _totals(store)
    entries, packs, size = _footprint(store)
    lookups = totals["hits"] + totals["partial_hits"] + totals["misses"]
    try:
        quarantined = len(store.fs.listdir(store.layout.quarantine_dir))
    except OSError:
        quarantined = 0
    totals.update(
        hit_rate=(totals["hits"] / lookups) if lookups else None,
        entries=entries,
        packs=packs,
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


def zero(store: Store, size: int | None = None) -> None:
    """Remove every shard (and forget the counts not written yet); with ``size``, the size
    counter starts again at that exact size (it is not a usage counter)."""
    store._pending = {}
    with contextlib.suppress(OSError):
        for name in store.fs.listdir(store.layout.stats_dir):
            if store.layout.is_stats_shard(name) or is_temp_name(name):
                with contextlib.suppress(OSError):
                    store.fs.unlink(store.layout.stats_dir / name)
    if size is not None:
        correct_size(store, size)
