"""Keeping the store healthy: eviction (LRU, size cap, age, keys), clear, and verify (fix).

Functions of a :class:`~compile_cache.store.Store` (its ``evict``, ``clear`` and ``verify``
methods call them). Entries are removed by renaming them out of sight first (atomic), so a reader
sees all of an entry or none of it; a lock only keeps two evicters from doing the same work.
"""

from __future__ import annotations

import contextlib
import logging
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import config
from .._paths import is_temp_name
from .._sizes import format_size
from ..errors import CorruptPackError, UnsafeStorePathError
from ..locks import optional_lock
from ..locks.scan import break_stale_lock, is_lock_leftover, is_lock_name, is_stale
from . import generations, stats
from ._io import check_seconds, errno_name
from .pack import IncompatiblePackError, SignatureMismatchError, content_hash, encode_pack
from .records import CompactReport, EntryInfo, VerifyReport
from .safety import trust_problem

if TYPE_CHECKING:
    from .core import Store

__all__ = [
    "ORPHAN_AGE",
    "QUARANTINE_KEEP",
    "clear",
    "compact",
    "compact_all",
    "enforce_cap",
    "evict",
    "recount_size",
    "remove_entries",
    "total_size",
    "verify",
]

logger = logging.getLogger("compile_cache")

#: Temp files and empty entries younger than this are someone's publish in progress.
ORPHAN_AGE = 15 * 60.0
#: Quarantined packs are kept this long for inspection, then deleted by evict()/verify(fix=True).
QUARANTINE_KEEP = 7 * 86400.0


def total_size(store: Store) -> int:
    """Bytes in all entries, from stat calls only: a walk of the whole store (maintenance only;
    a publish reads the size counter instead, :func:`~.stats.tracked_size`)."""
    return sum(size for _key, size, _used in _usage(store))


def recount_size(store: Store) -> int:
    """Walk the store and set the size counter to its exact size; return it."""
    exact = total_size(store)
    stats.correct_size(store, exact)
    return exact


def _usage(store: Store) -> list[tuple[str, int, float]]:
    """``(key, bytes, last used)`` of every entry, from stat calls only (no pack is opened)."""
    out = []
    now = time.time()
    for key in store.layout.keys():
        size, newest = 0, 0.0
        for directory in (store.layout.entry_dir(key), store.layout.packs_dir(key)):
            with contextlib.suppress(OSError):
                for name, st in store.fs.files(directory):
                    size += st.st_size
                    if name != "used":
                        newest = max(newest, st.st_mtime)
        try:
            used = store.fs.lstat(store.layout.used_file(key)).st_mtime
        except OSError:
            used = newest
        if used > now + 60:  # a time in the future is not trusted: the entry's files' say
            used = min(newest, now)
        out.append((key, size, used))
    return out


def enforce_cap(store: Store, protect: set[str]) -> None:
    """Evict least-recently-used entries (never those in ``protect``) above the size cap.

    The size comes from the counters (a few small files, however many packs the store holds);
    only a store above its cap, or one whose size was never counted, is walked, by one process
    at a time (the ``evict`` lock; the others go on: that process does the job).
    """
    size, calibrated = stats.tracked_size(store)
    if calibrated and size <= store.max_size:
        return
    lock = store._lock_at(store.layout.lock_base("evict"), timeout=0)
    with optional_lock(lock) as held:
        if not held:  # another process evicting now does the job for us
            return
        size, calibrated = stats.tracked_size(store)
        if not calibrated:  # a store filled before its size was counted: count it once
            size = recount_size(store)
        if size > store.max_size:
            remove_entries(store, store.max_size, None, None, False, protect=protect)


def remove_entries(
    store: Store, max_size: int | None, older_than: float | None, keys: set[str] | None,
    dry_run: bool, protect: set[str],
) -> list[EntryInfo]:
    """Choose the entries ``evict`` removes (the union of its criteria) and remove them.

    Chosen from stat calls only; only the chosen entries' pack headers are read (for the
    :class:`EntryInfo` returned).
    """
    usage = sorted(_usage(store), key=lambda u: (u[2], u[0]))
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
    infos = [EntryInfo.read(store.layout, k) for k in chosen]
    removed = sorted((e for e in infos if e is not None), key=lambda e: (e.last_used, e.key))
    if dry_run:
        return removed
    done = []
    for e in removed:
        if remove_entry_dir(store, e.path):
            done.append(e)
    if done:
        freed = sum(e.size for e in done)
        store._bump(evictions=len(done), evicted_bytes=freed, stored_bytes=-freed)
        logger.info("evicted %d entries (%s)", len(done), format_size(freed))
    prune_quarantine(store, QUARANTINE_KEEP)
    return done


def evict(store: Store, max_size: int | None, older_than: float | None, keys: set[str] | None,
          dry_run: bool) -> list[EntryInfo]:
    """``Store.evict``: remove entries, then set the size counter exact (prune walks anyway)."""
    removed = remove_entries(store, max_size, older_than, keys, dry_run, protect=set())
    if not dry_run:
        recount_size(store)
    return removed


def remove_entry_dir(store: Store, path: Path) -> bool:
    """Rename an entry out of sight (atomic), then delete it: readers see all of it or none."""
    aside = store.layout.aside_path(path)
    try:
        store._mkdirs(store.layout.tmp_dir)
        store.fs.rename(path, aside)
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.debug("could not move %s aside (%s); deleting in place", path, exc)
        try:
            return store.fs.rmtree(path)
        except OSError:
            return False
    with contextlib.suppress(OSError):
        store.fs.rmtree(aside)
    return True


def prune_quarantine(store: Store, keep: float) -> list[Path]:
    """Delete quarantined packs older than ``keep`` seconds; return them."""
    old = []
    cutoff = time.time() - keep
    quarantine = store.layout.quarantine_dir
    with contextlib.suppress(OSError):
        for name in store.fs.listdir(quarantine):
            path = quarantine / name
            with contextlib.suppress(OSError):
                if store.fs.lstat(path).st_mtime < cutoff:
                    store.fs.unlink(path)
                    old.append(path)
    return old


def clear(store: Store) -> int:
    """Remove every entry and quarantined pack (counters are kept); return entries removed."""
    count = 0
    for key in list(store.layout.keys()):
        count += remove_entry_dir(store, store.layout.entry_dir(key))
    prune_quarantine(store, -1.0)
    recount_size(store)
    return count


def _remove_path(store: Store, path: Path) -> None:
    with contextlib.suppress(OSError):
        store.fs.remove(path)


def _odd_lock(store: Store, path: Path) -> bool:
    """Whether the lock name ``path`` holds something no lock of ours is (a link, a FIFO)."""
    try:
        mode = store.fs.lstat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISDIR(mode) or stat.S_ISREG(mode))


def verify(
    store: Store, fix: bool, temp_age: float, lock_stale_after: float | None, labels: Any = None,
) -> VerifyReport:
    """See :meth:`Store.verify` (``lock_stale_after`` None: ``COMPILE_CACHE_LOCK_STALE``)."""
    stale = config.LOCK_STALE.value() if lock_stale_after is None else lock_stale_after
    lock_stale_after = check_seconds("lock_stale_after", stale)
    layout = store.layout
    report = VerifyReport(fixed=bool(fix))
    now = time.time()

    def old(path: Path) -> bool:
        try:
            return now - store.fs.lstat(path).st_mtime > temp_age
        except OSError:
            return False

    for key in list(layout.keys()):
        report.checked_entries += 1
        entry = layout.entry_dir(key)
        _data, garbage = store.fs.read_json(layout.entry_json(key))
        if garbage:
            report.bad_entries.append(layout.entry_json(key))
            if fix:
                _remove_path(store, layout.entry_json(key))
        for directory in (entry, layout.packs_dir(key)):
            with contextlib.suppress(OSError):
                for name in store.fs.listdir(directory):
                    if is_temp_name(name) and old(directory / name):
                        report.orphaned_temp.append(directory / name)
                        if fix:
                            _remove_path(store, directory / name)
        for directory in (entry.parent, entry, layout.packs_dir(key)):
            try:
                st = store.fs.lstat(directory)
            except OSError:
                continue
            problem = trust_problem(st, directory, store.shared_group)
            if not stat.S_ISDIR(st.st_mode):
                report.untrusted.append((directory, f"{directory} is a symlink or not a "
                                         "directory: compile_cache follows no link in its store"))
            elif problem is not None:
                report.untrusted.append((directory, problem.message))
        packs = layout.pack_paths(key)
        for path in packs:
            report.checked_packs += 1
            try:
                fh = store.fs.open_read(path)
                # The same checks as a restoring job's load (limits, checksum, signature, members).
                store._check_pack(path, fh, key, labels).close()
            except FileNotFoundError:
                continue
            except UnsafeStorePathError as exc:
                if exc.reason != "type":
                    report.untrusted.append((path, str(exc)))
                    continue
                report.corrupt_packs.append((path, str(exc)))  # a FIFO, a device, a directory
                if fix:
                    store._quarantine(path, key)
                    store._bump(corrupt=1)
            except IncompatiblePackError:
                report.incompatible_packs.append(path)
            except SignatureMismatchError:
                report.other_signer_packs.append(path)
            except CorruptPackError as exc:  # only a content check sets a pack aside
                report.corrupt_packs.append((path, str(exc)))
                if fix:
                    store._quarantine(path, key)
                    store._bump(corrupt=1)
            except OSError as exc:  # this node's error (EMFILE, EIO): counted, the pack kept
                report.unchecked.append((path, f"{errno_name(exc)}: {exc}"))
                store._bump(errors=1, errors_by_kind={errno_name(exc): 1})
        try:  # superseded generations: listed, merged away with fix
            compacted = compact(store, key, dry_run=not fix)
        except OSError as exc:  # ENOSPC mid-merge: said so, never "OK"
            report.not_fixed.append((entry, f"could not compact: {errno_name(exc)}: {exc}"))
            store._bump(errors=1, errors_by_kind={errno_name(exc): 1})
            compacted = None
        except CorruptPackError as exc:  # a pack changed under us: the next run compacts
            logger.debug("could not compact %s: %s", key, exc)
            compacted = None
        if compacted is not None:
            report.compactable.append(compacted)
            packs = layout.pack_paths(key)
        anchor = layout.packs_dir(key) if store.fs.is_dir(layout.packs_dir(key)) else entry
        if not packs and old(anchor):
            report.empty_entries.append(entry)
            if fix:
                remove_entry_dir(store, entry)

    with contextlib.suppress(OSError):
        for name in store.fs.listdir(layout.tmp_dir):
            if old(layout.tmp_dir / name):
                report.orphaned_temp.append(layout.tmp_dir / name)
                if fix:
                    _remove_path(store, layout.tmp_dir / name)
    with contextlib.suppress(OSError):
        for name in store.fs.listdir(layout.locks_dir):
            path = layout.locks_dir / name
            if is_lock_leftover(name) or is_temp_name(name):
                if old(path):
                    report.orphaned_temp.append(path)
                    if fix:
                        _remove_path(store, path)
            elif is_lock_name(name) and _odd_lock(store, path):
                report.orphaned_temp.append(path)  # a link or a FIFO: no lock of ours, never followed
                if fix:
                    _remove_path(store, path)
            elif is_lock_name(name):
                # A lockdir is stale by its holder's heartbeat; an unheld lock file is only
                # garbage, kept as long as a temp file (copying a store must not flag its locks).
                age = lock_stale_after if store.fs.is_dir(path) else max(lock_stale_after, temp_age)
                if is_stale(path, stale_after=age, one_look=True):
                    report.stale_locks.append(path)
                    if fix:
                        break_stale_lock(path, stale_after=age, one_look=True)
    with contextlib.suppress(OSError):
        for name in store.fs.listdir(layout.stats_dir):
            path = layout.stats_dir / name
            if is_temp_name(name):
                if old(path):
                    report.orphaned_temp.append(path)
                    if fix:
                        _remove_path(store, path)
                continue
            if store.fs.read_json(path)[1]:
                report.bad_stats.append(path)
                if fix:
                    _remove_path(store, path)
    if fix:
        report.old_quarantine = prune_quarantine(store, QUARANTINE_KEEP)
    exact = total_size(store)
    report.size_drift = stats.tracked_size(store)[0] - exact
    if fix and not store.read_only:
        stats.correct_size(store, exact)
    return report


def compact_all(store: Store, keys: list[str], dry_run: bool) -> list[CompactReport]:
    """:func:`compact` of each of ``keys`` (``Store.compact``, prune): an entry that cannot be
    compacted now (ENOSPC, a pack another process removed meanwhile) is a counted error or
    skipped, never the end of the run."""
    done = []
    for key in keys:
        try:
            report = compact(store, key, dry_run)
        except OSError as exc:
            store._io_error("compact", exc, store.layout.entry_dir(key))
            continue
        except CorruptPackError as exc:
            logger.debug("could not compact %s: %s", key, exc)
            continue
        if report is not None:
            done.append(report)
    return done


def compact(store: Store, key: str, dry_run: bool) -> CompactReport | None:
    """Merge ``key``'s packs into one holding exactly its current generation
    (:mod:`.generations`), then delete the packs merged; None when it is compact already.

    The new pack is written (temp name, fsync, rename) before any old pack goes, and it keeps
    the newest merged pack's creation time, so a pack another process publishes meanwhile is
    still the newer one; packs that arrive during the merge are never touched.
    """
    entry = store.entry(key)
    plan = generations.compaction([p for p in entry.packs if _ours(store, p)] if entry else [])
    if plan is None:
        return None
    merged, _ = plan
    report = CompactReport(key=key, merged=[p.path for p in merged],
                           bytes_before=sum(p.size for p in merged))
    if dry_run:
        return report
    loaded = {}
    for pack in store.load(key):
        if _ours(store, pack.info):
            loaded[pack.info.name] = pack
        else:
            pack.close()  # another signer's (or signed, for a keyless run): kept as it is
    try:
        return _merge(store, key, report, merged, loaded)
    finally:
        for pack in loaded.values():
            pack.close()


def _ours(store: Store, info: Any) -> bool:
    """Whether maintenance may rewrite the pack ``info``: one it verifies with its own key (with
    a key), or an unsigned one (without). Other signers' packs are kept as they are: a keyless
    ``prune`` must not merge signed packs into an unsigned one that no keyed reader loads."""
    return store.usable(info) if store.signing_key is not None else not info.signed


def _merge(store: Store, key: str, report: CompactReport, merged: list[Any],
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
    name = content_hash(members, store.signer)
    target = store.layout.pack_path(key, name)
    added = 0  # what the store's size counter gains (the merged pack) and loses (the merged ones)
    if members and not store.fs.exists(target):
        _, chunks, size = encode_pack(
            key, members, metadata, signing_key=store.signing_key, name=name,
            created=max(p.info.created for p in described),
            compile_seconds=sum(p.info.compile_seconds for p in described),
            member_info=member_info,
        )
        if store._write(target, chunks):
            added += size
    for pack in described:
        if pack.info.name != name:
            with contextlib.suppress(FileNotFoundError):
                store.fs.unlink(pack.info.path)
                added -= pack.info.size
    if added:
        store._bump(stored_bytes=added)
    report.written = target if members else None
    with contextlib.suppress(OSError):
        report.bytes_after = store.fs.lstat(target).st_size if members else 0
    logger.info("compacted %s: %d packs into one (%s -> %s)", key[:12], len(described),
                format_size(report.bytes_before), format_size(report.bytes_after))
    return report
