"""What the store's counters mean: hits, misses, errors, bytes and seconds, summed over every process.

The counters themselves (names, pending counts, the shard files) are :mod:`.counters`.

The store's size is a counter too (``stored_bytes``): publishes and imports add what they
wrote, evictions and quarantine take away what they removed, so checking the size cap after a
publish reads a few small shard files instead of walking a store of thousands of packs
(:meth:`~.counters.Counters.tracked_size`). Files removed by hand make it drift; ``verify``, ``prune`` and ``clear``
walk the store anyway and set it to the exact size (:meth:`~.counters.Counters.correct_size`, which also counts
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
from typing import Any, Protocol

from .._sizes import format_size
from ..errors import CorruptPackError
from .counters import COUNTERS, STATS_SHARDS, Counters
from .fs import StoreFS
from .layout import PACK_RE, Layout
from .pack import read_pack_header_from
from .parts import StoreParts

__all__ = [
    "COUNTERS",
    "OUTCOMES",
    "STATS_SHARDS",
    "record_outcome",
    "record_precompile",
    "summary",
]

#: a start's outcome -> the counter it bumps
OUTCOMES: dict[str, str] = {
    "hit": "hits", "partial": "partial_hits", "miss": "misses", "local": "local_hits",
}


class HasCounters(Protocol):
    """Anything with the store's :class:`~.counters.Counters` (a ``Store`` has them)."""

    @property
    def counters(self) -> Counters: ...


def record_precompile(store: HasCounters, *, hits: int = 0, declined: int = 0,
                      load_errors: int = 0, unproven: int = 0) -> None:
    """Count region groups whose precompile entry loaded, declined, or failed to load, and the
    graphs of loaded entries not installed because they could not prove the values they were
    traced under (:mod:`compile_cache.precompiled`)."""
    store.counters.bump(precompile_hits=hits, precompile_declined=declined,
                        precompile_load_errors=load_errors, precompile_unproven=unproven)


def saved_seconds(fs: StoreFS, layout: Layout, key: str) -> float:
    """The compile seconds the key's packs recorded: what restoring them saved."""
    total = 0.0
    for path in layout.pack_paths(key):
        with contextlib.suppress(OSError, CorruptPackError, TypeError, ValueError), \
                fs.open_read(path, trust=False) as fh:
            total += float(read_pack_header_from(fh)[0].get("compile_seconds") or 0.0)
    return total


def record_outcome(
    parts: StoreParts, key: str, outcome: str, *, previous: str | None = None,
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
        saved = saved_seconds(parts.fs, parts.layout, key) if seconds_saved is None else seconds_saved
        delta["seconds_saved"] = float(saved)
        delta["bytes_restored"] = int(nbytes)
    parts.counters.bump(delta)


def footprint(fs: StoreFS, layout: Layout) -> tuple[int, int, int]:
    """(entries, packs, bytes) as :meth:`Store.entries` counts them (regular files of each
    entry directory and its packs), from directory listings and lstat only: ``stats`` reads no
    pack header and no ``entry.json``, so it stays quick on a store of thousands of entries."""
    entries = packs = size = 0
    for key in layout.keys():
        try:
            scan = fs.files(layout.entry_dir(key))
        except OSError:
            continue
        entries += 1
        size += sum(st.st_size for _name, st in scan)
        with contextlib.suppress(OSError):
            for name, st in fs.files(layout.packs_dir(key)):
                if PACK_RE.fullmatch(name):
                    size += st.st_size
                    packs += 1
    return entries, packs, size


def summary(parts: StoreParts, max_size: int, location_source: str) -> dict[str, Any]:
    """Counters summed over all processes, plus the store's size, cap and location (see
    :meth:`Store.stats` for the keys)."""
    fs = parts.fs
    totals = parts.counters.totals()
    entries, packs, size = footprint(fs, parts.layout)
    lookups = totals["hits"] + totals["partial_hits"] + totals["misses"]
    try:
        quarantined = len(fs.listdir(parts.layout.quarantine_dir))
    except OSError:
        quarantined = 0
    totals.update(
        hit_rate=(totals["hits"] / lookups) if lookups else None,
        entries=entries,
        packs=packs,
        size=size,
        size_human=format_size(size),
        max_size=max_size,
        max_size_human=format_size(max_size) if max_size else "unlimited",
        quarantined=quarantined,
        location=str(fs.root),
        location_source=location_source,
        read_only=fs.read_only,
        read_only_reason=fs.read_only_reason,
        lock_mode=fs.lock_mode,
    )
    return totals
