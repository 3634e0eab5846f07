"""Keeping the store healthy: eviction (LRU, size cap, age, keys), clear, and verify (fix).

The functions behind a store's ``plan_eviction``/``evict``, ``clear``, ``compact`` and
``verify``; they take the store's parts (:class:`~.parts.StoreParts`). Eviction is planned first
(:func:`plan_eviction`: a frozen :class:`~.records.EvictionPlan`, from stat calls only) and then
executed as planned. Entries are removed by renaming them out of sight first (atomic), so a
reader sees all of an entry or none of it; a lock only keeps two evicters from doing the same
work. Verify scans (:mod:`.verify_scan`) and fixes what it listed only when asked
(:meth:`~.records.VerifyReport.fix`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._sizes import format_size, parse_age, parse_size
from ..errors import CorruptPackError
from ..locks import optional_lock
from . import generations
from ._io import key_list, warn_once
from .loading import load
from .pack import content_hash, encode_pack
from .parts import StoreParts
from .records import CompactReport, EntryInfo, EvictionPlan

__all__ = [
    "ORPHAN_AGE",
    "QUARANTINE_KEEP",
    "clear",
    "compact",
    "compact_all",
    "enforce_cap",
    "eviction_criteria",
    "plan_eviction",
    "prune_quarantine",
    "recount_size",
    "remove_entry_dir",
    "total_size",
]

logger = logging.getLogger("compile_cache")

#: Temp files and empty entries younger than this are someone's publish in progress.
ORPHAN_AGE = 15 * 60.0
#: Quarantined packs are kept this long for inspection, then deleted by evict()/verify(fix=True).
QUARANTINE_KEEP = 7 * 86400.0


def total_size(parts: StoreParts) -> int:
    """Bytes in all entries, from stat calls only: a walk of the whole store (maintenance only;
    a publish reads the size counter instead, :func:`~.stats.tracked_size`)."""
    return sum(size for _key, size, _used in _usage(parts))


def recount_size(parts: StoreParts) -> int:
    """Walk the store and set the size counter to its exact size; return it."""
    exact = total_size(parts)
    parts.counters.correct_size(exact)
    return exact


def _usage(parts: StoreParts) -> list[tuple[str, int, float]]:
    """``(key, bytes, last used)`` of every entry, from stat calls only (no pack is opened)."""
    out = []
    now = time.time()
    fs, layout = parts.fs, parts.layout
    for key in layout.keys():
        size, newest = 0, 0.0
        for directory in (layout.entry_dir(key), layout.packs_dir(key)):
            with contextlib.suppress(OSError):
                for name, st in fs.files(directory):
                    size += st.st_size
                    if name != "used":
                        newest = max(newest, st.st_mtime)
        try:
            used = fs.lstat(layout.used_file(key)).st_mtime
        except OSError:
            used = newest
        if used > now + 60:  # a time in the future is not trusted: the entry's files' say
            used = min(newest, now)
        out.append((key, size, used))
    return out


#: The plan when there is nothing to evict by (no criterion, no cap).
NOTHING_TO_EVICT = EvictionPlan(entries=(), run=lambda _entries: [])


def eviction_criteria(
    cap: int, max_size: int | str | None, older_than: float | str | None, keys: Iterable[str] | None,
) -> tuple[int | None, float | None, set[str] | None] | None:
    """``(max_size, older_than, keys)`` of an eviction, parsed (``"20G"``, ``"30d"``, checked
    keys); with no criterion the store's own ``cap``; None when there is nothing to evict by."""
    if max_size is None and older_than is None and keys is None:
        if not cap:
            return None
        max_size = cap
    return (None if max_size is None else parse_size(max_size, name="max_size"),
            None if older_than is None else parse_age(older_than, name="older_than"),
            None if keys is None else set(key_list(keys)))


#: Seconds a publisher over the size cap waits for the eviction lock; then it evicts without it.
EVICT_LOCK_WAIT = 5.0


def enforce_cap(parts: StoreParts, max_size: int, protect: set[str]) -> None:
    """Evict least-recently-used entries (never those in ``protect``) above ``max_size``.

    The size comes from the counters (a few small files, however many packs the store holds);
    only a store above its cap, or one whose size was never counted, is walked, by one process
    at a time (the ``evict`` lock). A process that cannot take the lock within
    :data:`EVICT_LOCK_WAIT` seconds evicts without it (warned once, a counted lock fallback).
    """
    size, calibrated = parts.counters.tracked_size()
    if calibrated and size <= max_size:
        return
    lock = parts.fs.lock_at(parts.layout.lock_base("evict"), timeout=EVICT_LOCK_WAIT)
    with optional_lock(lock) as held:
        if not held:
            # Nobody evicts for that long: a holder that never lets go (a member's process, a
            # stuck one) must not turn the cap off for everyone. Eviction needs no lock for
            # correctness (an entry is renamed aside first), so this process evicts without it.
            holder = lock.holder()
            warn_once(parts.fs.root, "evict-lock",
                      f"compile cache {parts.fs.root}: the eviction lock was held by "
                      f"{holder or 'an unknown process'} for more than {EVICT_LOCK_WAIT:g} s; "
                      "keeping the size cap without it (`doctor` shows who holds it)")
            parts.counters.bump(lock_fallbacks=1, errors_by_kind={"lock-evict": 1})
        size, calibrated = parts.counters.tracked_size()
        if not calibrated:  # a store filled before its size was counted: count it once
            size = recount_size(parts)
        if size > max_size:
            remove_entries(parts, plan_eviction(parts, max_size, None, None, protect=protect).entries)


def plan_eviction(
    parts: StoreParts, max_size: int | None, older_than: float | None, keys: set[str] | None,
    protect: set[str] = frozenset(),  # type: ignore[assignment]
) -> EvictionPlan:
    """The entries ``evict`` would remove (the union of its criteria), as a frozen plan whose
    ``execute()`` removes exactly them (then prunes old quarantine and recounts the size).

    Chosen from stat calls only; only the chosen entries' pack headers are read (for the
    :class:`EntryInfo` listed).
    """
    usage = sorted(_usage(parts), key=lambda u: (u[2], u[0]))
    chosen: dict[str, int] = {}
    if keys:
        chosen.update((k, size) for k, size, _used in usage if k in keys)
    if older_than is not None:
        cutoff = time.time() - older_than
        chosen.update((k, size) for k, size, used in usage if used < cutoff)
    if max_size is not None:
        total = sum(size for k, size, _used in usage if k not in chosen)
        for k, size, _used in usage:
            if total <= max_size:
                break
            if k in chosen or k in protect:
                continue
            chosen[k] = size
            total -= size
    infos = [EntryInfo.read(parts.layout, k) for k in chosen]
    entries = tuple(sorted((e for e in infos if e is not None), key=lambda e: (e.last_used, e.key)))
    return EvictionPlan(entries=entries, run=functools.partial(_execute_plan, parts))


def _execute_plan(parts: StoreParts, entries: tuple[EntryInfo, ...]) -> list[EntryInfo]:
    """``EvictionPlan.execute`` of a local store: remove ``entries``, then set the size exact."""
    parts.fs.require_writable("evict")
    done = remove_entries(parts, entries)
    recount_size(parts)
    return done


def remove_entries(parts: StoreParts, entries: tuple[EntryInfo, ...]) -> list[EntryInfo]:
    """Remove the entries listed (those gone meanwhile are skipped), count them, and prune
    the old quarantine; the entries removed."""
    done = [e for e in entries if remove_entry_dir(parts, e.path)]
    if done:
        freed = sum(e.size for e in done)
        parts.counters.bump(evictions=len(done), evicted_bytes=freed, stored_bytes=-freed)
        logger.info("evicted %d entries (%s)", len(done), format_size(freed))
    prune_quarantine(parts, QUARANTINE_KEEP)
    return done


def remove_entry_dir(parts: StoreParts, path: Path) -> bool:
    """Rename an entry out of sight (atomic), then delete it: readers see all of it or none."""
    fs = parts.fs
    aside = parts.layout.aside_path(path)
    try:
        fs.mkdirs(parts.layout.tmp_dir)
        fs.rename(path, aside)
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.debug("could not move %s aside (%s); deleting in place", path, exc)
        try:
            return fs.rmtree(path)
        except OSError:
            return False
    with contextlib.suppress(OSError):
        fs.rmtree(aside)
    return True


def prune_quarantine(parts: StoreParts, keep: float) -> list[Path]:
    """Delete quarantined packs older than ``keep`` seconds; return them."""
    old = []
    cutoff = time.time() - keep
    quarantine = parts.layout.quarantine_dir
    with contextlib.suppress(OSError):
        for name in parts.fs.listdir(quarantine):
            path = quarantine / name
            with contextlib.suppress(OSError):
                if parts.fs.lstat(path).st_mtime < cutoff:
                    parts.fs.unlink(path)
                    old.append(path)
    return old


def clear(parts: StoreParts) -> int:
    """Remove every entry and quarantined pack (counters are kept); return entries removed."""
    count = 0
    for key in list(parts.layout.keys()):
        count += remove_entry_dir(parts, parts.layout.entry_dir(key))
    prune_quarantine(parts, -1.0)
    recount_size(parts)
    return count


def compact_all(parts: StoreParts, keys: list[str], dry_run: bool) -> list[CompactReport]:
    """:func:`compact` of each of ``keys`` (``Store.compact``, prune): an entry that cannot be
    compacted now (ENOSPC, a pack another process removed meanwhile) is a counted error or
    skipped, never the end of the run."""
    done = []
    for key in keys:
        try:
            report = compact(parts, key, dry_run)
        except OSError as exc:
            parts.keeper.io_error("compact", exc, parts.layout.entry_dir(key))
            continue
        except CorruptPackError as exc:
            logger.debug("could not compact %s: %s", key, exc)
            continue
        if report is not None:
            done.append(report)
    return done


def compact(parts: StoreParts, key: str, dry_run: bool) -> CompactReport | None:
    """Merge ``key``'s packs into one holding exactly its current generation
    (:mod:`.generations`), then delete the packs merged; None when it is compact already.

    The new pack is written (temp name, fsync, rename) before any old pack goes, and it keeps
    the newest merged pack's creation time, so a pack another process publishes meanwhile is
    still the newer one; packs that arrive during the merge are never touched.
    """
    checker = parts.checker
    entry = EntryInfo.read(parts.layout, key)
    plan = generations.compaction([p for p in entry.packs if checker.ours(p)] if entry else [])
    if plan is None:
        return None
    merged, _ = plan
    report = CompactReport(key=key, merged=[p.path for p in merged],
                           bytes_before=sum(p.size for p in merged))
    if dry_run:
        return report
    loaded = {}
    for pack in load(parts, key):
        if checker.ours(pack.info):
            loaded[pack.info.name] = pack
        else:
            pack.close()  # another signer's (or signed, for a keyless run): kept as it is
    try:
        return _merge(parts, key, report, merged, loaded)
    finally:
        for pack in loaded.values():
            pack.close()


def _merge(parts: StoreParts, key: str, report: CompactReport, merged: list[Any],
           loaded: dict[str, Any]) -> CompactReport | None:
    described = [loaded[p.name] for p in merged if p.name in loaded]
    if len(described) != len(merged):
        return None  # changed under us (evicted, quarantined): the next run compacts
    selection = generations.select([p.info for p in loaded.values()])
    names = {p.info.name for p in described}
    members = {name: loaded[src].members[name] for name, src in selection.sources.items()
               if src in names}
    member_info = {name: loaded[src].members.info(name) for name, src in selection.sources.items()
                   if name in members}
    digests = {name: d for name, d in selection.wanted.items() if name in members and d}
    always: set[str] = set()
    isa: dict[str, object] = {}
    for pack in described:
        always.update(generations.manifest_of(pack.info.metadata)["always"])
        isa.update(pack.info.metadata.get("isa_probe") or {})
    metadata = dict(described[-1].info.metadata)
    metadata[generations.MANIFEST_KEY] = generations.make_manifest(
        selection.units, always, digests)
    metadata["isa_probe"] = {k: v for k, v in isa.items() if k in members} or None
    metadata["compacted"] = len(described)
    fs = parts.fs
    name = content_hash(members, parts.checker.signer)
    target = parts.layout.pack_path(key, name)
    added = 0  # what the store's size counter gains (the merged pack) and loses (the merged ones)
    if members and not fs.exists(target):
        _, chunks, size = encode_pack(
            key, members, metadata, signing_key=parts.checker.signing_key, name=name,
            created=max(p.info.created for p in described),
            compile_seconds=sum(p.info.compile_seconds for p in described),
            member_info=member_info,
            entry=next((p.header["entry"] for p in reversed(described)
                        if isinstance(p.header.get("entry"), dict)), None),
        )
        if fs.write(target, chunks):
            added += size
    for pack in described:
        if pack.info.name != name:
            with contextlib.suppress(FileNotFoundError):
                fs.unlink(pack.info.path)
                added -= pack.info.size
    if added:
        parts.counters.bump(stored_bytes=added)
    report.written = target if members else None
    with contextlib.suppress(OSError):
        report.bytes_after = fs.lstat(target).st_size if members else 0
    logger.info("compacted %s: %d packs into one (%s -> %s)", key[:12], len(described),
                format_size(report.bytes_before), format_size(report.bytes_after))
    return report
