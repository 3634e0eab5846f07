"""The store's commands: ``ls``, ``stats``, ``verify``, ``prune``, ``clear``, ``export``, ``import``.

They present what :class:`~compile_cache.store.Store` finds and plans, and run exactly what they
showed: ``prune`` shows an eviction plan (:meth:`~compile_cache.store.Store.plan_eviction`) and,
once confirmed, executes that plan; ``verify --fix`` shows the scan and fixes what it listed
(:meth:`~compile_cache.store.VerifyReport.fix`). They never import torch, so they start in well
under a second.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._sizes import format_size, parse_age, parse_size
from .output import PROG, UsageError, ago, confirm, pairs, print_json, table

__all__ = [
    "cmd_clear", "cmd_export", "cmd_import", "cmd_ls", "cmd_prune", "cmd_stats", "cmd_verify",
    "open_store",
]


# ---------------------------------------------------------------------------------------------
# Store helpers
# ---------------------------------------------------------------------------------------------
def open_store(args: argparse.Namespace, **kwargs: Any) -> Any:
    """The store of ``--cache-dir`` (or the environment/default); a file there is a usage error."""
    from ..store import Store
    from ..store.backends import is_url

    if args.cache_dir is not None and not is_url(args.cache_dir):
        path = Path(args.cache_dir).expanduser()
        if os.path.lexists(path) and not path.is_dir():
            raise UsageError(f"--cache-dir {args.cache_dir}: exists and is not a directory")
    return Store(args.cache_dir, **kwargs)


def _resolve_keys(store: Any, wanted: Sequence[str]) -> list[str]:
    """Full keys for ``wanted`` keys or unique key prefixes (as ``ls`` shows them)."""
    keys = [e.key for e in store.entries()]
    out: list[str] = []
    for prefix in wanted:
        prefix = prefix.strip().lower()
        matches = [k for k in keys if k.startswith(prefix)] if prefix else []
        if not matches:
            raise UsageError(f"--key {prefix!r}: no cache entry with that key in {store.location}")
        if len(matches) > 1 and prefix not in matches:
            raise UsageError(f"--key {prefix!r} is ambiguous: {len(matches)} entries start with it")
        key = prefix if prefix in matches else matches[0]
        if key not in out:
            out.append(key)
    return out


def _short_class(name: object) -> str:
    text = str(name or "-")
    return text.rsplit(".", 1)[-1]


def _differing_settings(entries: Sequence[Any]) -> dict[str, str]:
    """For entries of one model (same structure), the settings that tell them apart:
    key -> ``threads=2, mode='max-autotune'``; entries alone with their model get nothing."""
    from ..explain import compare, short_value

    groups: dict[str, list[Any]] = {}
    for e in entries:
        model = (e.metadata or {}).get("model")  # entry.json is data from the store: any shape
        structure = model.get("structure") if isinstance(model, dict) else None
        if isinstance(structure, str):
            groups.setdefault(structure, []).append(e)
    out: dict[str, str] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        fields: list[str] = []
        first = members[0].metadata
        for other in members[1:]:
            for d in compare(first, other.metadata):
                if d.field not in fields:
                    fields.append(d.field)
        for e in members:
            out[e.key] = ", ".join(short_value(e.metadata, f) for f in fields) or "-"
    return out


def _entry_row(entry: Any, now: float, settings: dict[str, str] | None = None) -> list[str]:
    meta = entry.metadata or {}
    row = [
        entry.key[:12],
        _short_class(meta.get("model_class")),
        str(meta.get("regions") or "-"),
        str(len(entry.packs)),
        format_size(entry.size),
        ago(entry.created, now),
        ago(entry.last_used, now),
        str(meta.get("torch") or "-"),
        str(meta.get("device") or "-"),
    ]
    if settings is not None:
        row.append(settings.get(entry.key, "-"))
    return row


_ENTRY_HEADERS = ("KEY", "MODEL", "REGIONS", "PACKS", "SIZE", "CREATED", "LAST USED", "TORCH", "DEVICE")
#: ls's last column when entries of one model differ: what tells them apart
_SETTINGS_HEADER = "DIFFERS (same model)"


def _entry_json(entry: Any, settings: dict[str, str]) -> dict[str, Any]:
    data = entry.to_dict()
    meta = entry.metadata or {}
    data.update(
        differs=settings.get(entry.key),
        compile=meta.get("compile"),
        precompile=meta.get("precompile"),
        short_key=entry.key[:12],
        model_class=meta.get("model_class"),
        regions=meta.get("regions"),
        torch=meta.get("torch"),
        device=meta.get("device"),
        size_human=format_size(entry.size),
    )
    return data


# ---------------------------------------------------------------------------------------------
# ls
# ---------------------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    """One row per cache entry."""
    store = open_store(args)
    entries = store.entries()
    sort_keys: dict[str, Callable[[Any], Any]] = {
        "size": lambda e: -e.size,
        "used": lambda e: -e.last_used,
        "created": lambda e: -e.created,
    }
    entries.sort(key=sort_keys[args.sort])
    if args.limit is not None:
        if args.limit < 0:
            raise UsageError(f"--limit {args.limit}: must be 0 or more")
        entries = entries[: args.limit]
    settings = _differing_settings(entries)
    if args.json:
        print_json({"store": store.location, "entries": [_entry_json(e, settings) for e in entries]})
        return 0
    if args.quiet:
        for e in entries:
            print(e.key)
        return 0
    if not entries:
        print(f"No cache entries in {store.location}")
        return 0
    now = time.time()
    headers = (*_ENTRY_HEADERS, _SETTINGS_HEADER) if settings else _ENTRY_HEADERS
    rows = [_entry_row(e, now, settings if settings else None) for e in entries]
    print(table(headers, rows, right={3, 4}))
    total = sum(e.size for e in entries)
    packs = sum(len(e.packs) for e in entries)
    print(f"\n{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {packs} pack(s), "
          f"{format_size(total)} in {store.location}")
    return 0


# ---------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------
def cmd_stats(args: argparse.Namespace) -> int:
    """Hit/miss counters summed over every process that used the store."""
    store = open_store(args)
    if args.zero:
        store.zero_stats()
        if args.json:
            print_json({"zeroed": True, "store": store.location})
        else:
            print(f"Statistics zeroed in {store.location}")
        return 0
    s = store.stats()
    if args.json:
        print_json(s)
        return 0
    rate = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f} %"
    cap = s["max_size"]
    used = f"{s['size_human']} of {s['max_size_human']}"
    if cap:
        used += f" ({100 * s['size'] / cap:.1f} %)"
    errors = str(s["errors"])
    if s["errors_by_kind"]:
        errors += "  (" + ", ".join(f"{k}: {v}" for k, v in sorted(s["errors_by_kind"].items())) + ")"
    rows = [
        ("Cache directory", f"{s['location']} ({s['location_source']})"),
        ("Entries", f"{s['entries']} ({s['packs']} packs)"),
        ("Hits", f"{s['hits']}  (restored from the store, compiled nothing new)"),
        ("Partial hits", f"{s['partial_hits']}  (restored, then compiled new graphs: new shapes, backward)"),
        ("Misses", f"{s['misses']}  (nothing restored from the store, compiled)"),
        ("Hit rate", f"{rate}  (hits / hits + partial hits + misses)"),
        ("Local-cache hits", f"{s['local_hits']}  (nothing from the store: torch's own local cache had it)"),
        ("Errors", errors),
        ("Fallbacks", f"{s['capture_fallbacks']} directory-diff capture(s), "
                      f"{s['backend_fallbacks']} Python fingerprint(s)"),
        ("Corrupt packs", f"{s['corrupt']} ({s['quarantined']} in quarantine)"),
        ("Incompatible packs", s["incompatible"]),
        ("Failed to load", f"{s['load_failures']} restored packs torch could not load (quarantined)"),
        ("Other signer", f"{s['signature_mismatch']} packs signed with another key (left for them)"),
        ("Untrusted", f"{s['untrusted']} directories/packs another user owns or can write"),
        ("Lock fallbacks", f"{s['lock_fallbacks']} compiles without the lock"),
        ("Published", f"{s['publishes']} packs, {format_size(s['bytes_published'])}"),
        ("Restored", format_size(s["bytes_restored"])),
        ("Compile time spent", f"{s['compile_seconds']:.1f} s"),
        ("Compile time saved", f"{s['seconds_saved']:.1f} s (estimated)"),
        ("Precompile", f"{s['precompile_hits']} hits, {s['precompile_declined']} declined, "
                       f"{s['precompile_load_errors']} load errors (region groups), "
                       f"{s['precompile_unproven']} graphs traced again (values changed since)"),
        ("Evicted", f"{s['evictions']} entries, {format_size(s['evicted_bytes'])}"),
        ("Cache size", used),
    ]
    if "local_tier" in s:  # a store on object storage
        rows.insert(1, ("Local tier", f"{s['local_tier']} ({s['local_tier_size_human']} on this node)"))
        rows.append(("Object storage", f"{s['remote_downloads']} packs downloaded "
                     f"({format_size(s['bytes_downloaded'])}), {s['remote_uploads']} uploaded "
                     f"({format_size(s['bytes_uploaded'])}), {s['remote_errors']} errors (misses)"))
    if s["read_only"]:
        rows.append(("Read-only", s["read_only_reason"]))
    print(pairs(rows))
    return 0


# ---------------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------------
def _problems(report: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = [("corrupt pack", f"{p}: {why}") for p, why in report.corrupt_packs]
    out += [("orphaned temp file", str(p)) for p in report.orphaned_temp]
    out += [("stale lock", str(p)) for p in report.stale_locks]
    out += [("unreadable entry.json", str(p)) for p in report.bad_entries]
    out += [("unreadable stats file", str(p)) for p in report.bad_stats]
    out += [("empty entry", str(p)) for p in report.empty_entries]
    out += [("untrusted", f"{p}: {why}") for p, why in report.untrusted]
    out += [("not checked (local error, pack left as it is)", f"{p}: {why}")
            for p, why in report.unchecked]
    out += [("not fixed", f"{p}: {why}") for p, why in report.not_fixed]
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every pack as a restoring job does (limits, checksum, signature, every member: a
    shared library must be complete), temp files and locks; ``--fix`` removes the broken."""
    from ..store.members import PACK_LABELS

    store = open_store(args)
    report = store.verify(labels=PACK_LABELS)
    if args.fix:
        report.fix()  # what this scan listed, and only that
    remaining = store.verify(labels=PACK_LABELS) if args.fix else report
    if args.json:
        data = report.to_dict()
        data["remaining"] = remaining.to_dict()
        data["store"] = store.location
        print_json(data)
        return 0 if remaining.ok else 1
    print(f"Checked {report.checked_entries} entries, {report.checked_packs} packs in {store.location}")
    found = _problems(report)
    if found:
        print(table(("PROBLEM", "WHERE"), found))
    for path in report.incompatible_packs:
        print(f"note: pack of another format version left in place: {path}")
    for path in report.other_signer_packs:
        print(f"note: pack signed with another key (or unsigned) left for its readers: {path}")
    if report.compactable:
        print(("" if args.fix else "note: ") + _compacted_line(report.compactable, not args.fix)
              + ("" if args.fix else f" (`{PROG} verify --fix` or `{PROG} prune` does it)"))
    if args.fix and found:
        print(f"Fixed {len(found)} problem(s): corrupt packs quarantined, the rest removed")
    left = _problems(remaining)
    if left:
        if args.fix:
            print(f"{len(left)} problem(s) remain")
        else:
            print(f"{len(left)} problem(s) found; run `{PROG} verify --fix` to remove them")
        return 1
    if not found:
        print("OK: no problems found")
    return 0


# ---------------------------------------------------------------------------------------------
# prune / clear
# ---------------------------------------------------------------------------------------------
def _print_removal(entries: Sequence[Any], verb: str, store: Any, as_json: bool, dry_run: bool,
                   compacted: Sequence[Any] = ()) -> None:
    if as_json:
        print_json({
            "store": store.location, "dry_run": dry_run,
            "removed": [e.key for e in entries], "bytes": sum(e.size for e in entries),
            "compacted": [c.to_dict() for c in compacted],
        })
        return
    if not entries and not compacted:
        print(f"Nothing to {verb} in {store.location}")
        return
    if entries:
        now = time.time()
        print(table(_ENTRY_HEADERS, [_entry_row(e, now) for e in entries], right={3, 4}))
        total = format_size(sum(e.size for e in entries))
        what = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} ({total})"
        print(f"\nWould remove {what}" if dry_run else f"\nRemoved {what}")
    if compacted:
        print(_compacted_line(compacted, dry_run))


def _compacted_line(compacted: Sequence[Any], dry_run: bool) -> str:
    """One line for entries whose superseded packs are merged away (see store.generations)."""
    packs = sum(len(c.merged) for c in compacted)
    before = format_size(sum(c.bytes_before for c in compacted))
    n = len(compacted)
    what = f"{n} entr{'y' if n == 1 else 'ies'} holding superseded generations ({packs} packs, {before})"
    if dry_run:
        return f"Would compact {what} into one pack each"
    return f"Compacted {what} into one pack each ({format_size(sum(c.bytes_after for c in compacted))})"


def cmd_prune(args: argparse.Namespace) -> int:
    """Evict entries by size cap (LRU), age, or key; compact the rest (superseded packs go)."""
    max_size = parse_size(args.max_size, name="--max-size") if args.max_size is not None else None
    older = parse_age(args.older_than, name="--older-than") if args.older_than is not None else None
    store = open_store(args)
    keys = _resolve_keys(store, args.key) if args.key else None
    criteria = {"max_size": max_size, "older_than": older, "keys": keys}
    plan = store.plan_eviction(**criteria)
    planned = list(plan.entries)
    if args.dry_run:
        removed = {e.key for e in planned}
        compactable = [c for c in store.compact(dry_run=True) if c.key not in removed]
        _print_removal(planned, "prune", store, args.json, True, compactable)
        return 0
    if not planned:
        _print_removal([], "prune", store, args.json, False, store.compact())
        return 0
    if not confirm(args, f"remove {len(planned)} cache entries from {store.location}"):
        print("Aborted")
        return 1
    removed = plan.execute()  # the entries shown, not a new choice
    _print_removal(removed, "prune", store, args.json, False, store.compact())
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    """Remove every entry (counters are kept)."""
    store = open_store(args)
    entries = store.entries()
    if args.dry_run:
        _print_removal(entries, "clear", store, args.json, True)
        return 0
    if not confirm(args, f"remove all {len(entries)} cache entries from {store.location}"):
        print("Aborted")
        return 1
    store.clear()
    _print_removal(entries, "clear", store, args.json, False)
    return 0


# ---------------------------------------------------------------------------------------------
# export / import
# ---------------------------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace) -> int:
    """Write entries into one archive (for air-gapped clusters)."""
    store = open_store(args)
    keys = _resolve_keys(store, args.key) if args.key else None
    target = Path(args.file)
    if target.is_dir():
        raise UsageError(f"{args.file}: is a directory; give an archive file name such as cache.tar")
    if not target.parent.is_dir():
        raise UsageError(f"{args.file}: directory {target.parent} does not exist")
    entries = len(keys) if keys is not None else len(store.entries())
    packs = store.export(target, keys)
    size = target.stat().st_size
    if args.json:
        print_json({"file": str(target), "entries": entries, "packs": packs, "bytes": size})
    else:
        print(f"Exported {packs} pack(s) of {entries} entr{'y' if entries == 1 else 'ies'} "
              f"to {target} ({format_size(size)})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Add an archive's entries; every member is validated before anything is written."""
    source = Path(args.file)
    if not source.is_file():
        raise UsageError(f"{args.file}: no such archive file")
    store = open_store(args)
    report = store.import_archive(source)
    if args.json:
        print_json({"file": str(source), "store": store.location, "keys": report.keys,
                     "packs_added": report.packs_added, "packs_present": report.packs_present})
    else:
        print(f"Imported {len(report.keys)} entr{'y' if len(report.keys) == 1 else 'ies'} into "
              f"{store.location}: {report.packs_added} pack(s) added, {report.packs_present} already present")
    return 0


