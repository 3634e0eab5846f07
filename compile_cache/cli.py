"""The ``compile-cache`` command line (also ``python -m compile_cache``).

Subcommands: ``warm`` (compile a model into the store ahead of a job), ``ls``, ``stats``,
``verify``, ``prune``, ``clear``, ``export``, ``import`` and ``doctor``. Every one takes
``--cache-dir`` and ``--help``; those that report take ``--json``. Output follows ``ccache -s``
and ``hf cache ls``: aligned columns, human sizes and ages.

Exit codes: 0 success; 1 a problem the command found (``verify`` with problems left, a ``warm``
whose code is not all in the store) or an unexpected error (with a traceback); 2 bad input (one
line on stderr: a bad TARGET, size, path, an unknown model name, a refused confirmation).

This is the only module of the package that prints.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import config
from ._sizes import format_age, format_size, parse_age, parse_size
from .errors import CompileCacheError, ConfigError

PROG = "compile-cache"
#: torch's variables doctor shows next to compile_cache's registry (compile_cache.config)
_TORCH_VARS: tuple[tuple[str, str], ...] = (
    ("TORCHINDUCTOR_CACHE_DIR", "torch's local Inductor cache (packs are restored into it)"),
    ("TRITON_CACHE_DIR", "Triton's local kernel cache (packs are restored into it)"),
)


class UsageError(CompileCacheError):
    """Bad command-line input: one line on stderr, exit code 2."""


# ---------------------------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------------------------
def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: set[int] | None = None) -> str:
    """Aligned columns, two spaces apart; columns in ``right`` are right-aligned."""
    right = right or set()
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _pairs(rows: Sequence[tuple[str, Any]], indent: str = "") -> str:
    """``label   value`` lines with the values aligned (``ccache -s`` style)."""
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"{indent}{label.ljust(width)}  {value}" for label, value in rows)


def _ago(timestamp: float, now: float | None = None) -> str:
    if not timestamp:
        return "-"
    return f"{format_age((now or time.time()) - timestamp)} ago"


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _confirm(args: argparse.Namespace, question: str) -> bool:
    """True when ``-y`` was given or the user says yes on a TTY; refuses (UsageError) otherwise."""
    if args.yes:
        return True
    if not _is_tty(sys.stdin):
        raise UsageError(f"refusing to {question} without confirmation: pass -y (stdin is not a terminal)")
    answer = input(f"{question[0].upper()}{question[1:]}? [y/N] ").strip().lower()
    return answer in ("y", "yes")


# ---------------------------------------------------------------------------------------------
# Store helpers
# ---------------------------------------------------------------------------------------------
def _open_store(args: argparse.Namespace, **kwargs: Any) -> Any:
    """The store of ``--cache-dir`` (or the environment/default); a file there is a usage error."""
    from .store import Store

    if args.cache_dir is not None:
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
            raise UsageError(f"--key {prefix!r}: no cache entry with that key in {store.root}")
        if len(matches) > 1 and prefix not in matches:
            raise UsageError(f"--key {prefix!r} is ambiguous: {len(matches)} entries start with it")
        key = prefix if prefix in matches else matches[0]
        if key not in out:
            out.append(key)
    return out


def _short_class(name: object) -> str:
    text = str(name or "-")
    return text.rsplit(".", 1)[-1]


def _entry_row(entry: Any, now: float) -> list[str]:
    meta = entry.metadata or {}
    return [
        entry.key[:12],
        _short_class(meta.get("model_class")),
        str(meta.get("regions") or "-"),
        str(len(entry.packs)),
        format_size(entry.size),
        _ago(entry.created, now),
        _ago(entry.last_used, now),
        str(meta.get("torch") or "-"),
        str(meta.get("device") or "-"),
    ]


_ENTRY_HEADERS = ("KEY", "MODEL", "REGIONS", "PACKS", "SIZE", "CREATED", "LAST USED", "TORCH", "DEVICE")


def _entry_json(entry: Any) -> dict[str, Any]:
    data = entry.to_dict()
    meta = entry.metadata or {}
    data.update(
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
    store = _open_store(args)
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
    if args.json:
        _print_json({"store": str(store.root), "entries": [_entry_json(e) for e in entries]})
        return 0
    if args.quiet:
        for e in entries:
            print(e.key)
        return 0
    if not entries:
        print(f"No cache entries in {store.root}")
        return 0
    now = time.time()
    print(_table(_ENTRY_HEADERS, [_entry_row(e, now) for e in entries], right={3, 4}))
    total = sum(e.size for e in entries)
    packs = sum(len(e.packs) for e in entries)
    print(f"\n{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {packs} pack(s), "
          f"{format_size(total)} in {store.root}")
    return 0


# ---------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------
def cmd_stats(args: argparse.Namespace) -> int:
    """Hit/miss counters summed over every process that used the store."""
    store = _open_store(args)
    if args.zero:
        store.zero_stats()
        if args.json:
            _print_json({"zeroed": True, "store": str(store.root)})
        else:
            print(f"Statistics zeroed in {store.root}")
        return 0
    s = store.stats()
    if args.json:
        _print_json(s)
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
        ("Hits", s["hits"]),
        ("Misses", s["misses"]),
        ("Hit rate", rate),
        ("Errors", errors),
        ("Corrupt packs", f"{s['corrupt']} ({s['quarantined']} in quarantine)"),
        ("Incompatible packs", s["incompatible"]),
        ("Published", f"{s['publishes']} packs, {format_size(s['bytes_published'])}"),
        ("Restored", format_size(s["bytes_restored"])),
        ("Compile time spent", f"{s['compile_seconds']:.1f} s"),
        ("Compile time saved", f"{s['seconds_saved']:.1f} s (estimated)"),
        ("Evicted", f"{s['evictions']} entries, {format_size(s['evicted_bytes'])}"),
        ("Cache size", used),
    ]
    if s["read_only"]:
        rows.append(("Read-only", s["read_only_reason"]))
    print(_pairs(rows))
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
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every pack's header and checksum, temp files and locks; ``--fix`` removes the broken."""
    store = _open_store(args)
    report = store.verify(fix=args.fix)
    remaining = store.verify() if args.fix else report
    if args.json:
        data = report.to_dict()
        data["remaining"] = remaining.to_dict()
        data["store"] = str(store.root)
        _print_json(data)
        return 0 if remaining.ok else 1
    print(f"Checked {report.checked_entries} entries, {report.checked_packs} packs in {store.root}")
    found = _problems(report)
    if found:
        print(_table(("PROBLEM", "WHERE"), found))
    for path in report.incompatible_packs:
        print(f"note: pack of another format version left in place: {path}")
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
def _print_removal(entries: Sequence[Any], verb: str, store: Any, as_json: bool, dry_run: bool) -> None:
    if as_json:
        _print_json({
            "store": str(store.root), "dry_run": dry_run,
            "removed": [e.key for e in entries], "bytes": sum(e.size for e in entries),
        })
        return
    if not entries:
        print(f"Nothing to {verb} in {store.root}")
        return
    now = time.time()
    print(_table(_ENTRY_HEADERS, [_entry_row(e, now) for e in entries], right={3, 4}))
    total = format_size(sum(e.size for e in entries))
    what = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} ({total})"
    print(f"\nWould remove {what}" if dry_run else f"\nRemoved {what}")


def cmd_prune(args: argparse.Namespace) -> int:
    """Evict entries by size cap (LRU), age, or key."""
    max_size = parse_size(args.max_size, name="--max-size") if args.max_size is not None else None
    older = parse_age(args.older_than, name="--older-than") if args.older_than is not None else None
    store = _open_store(args)
    keys = _resolve_keys(store, args.key) if args.key else None
    criteria = {"max_size": max_size, "older_than": older, "keys": keys}
    if args.dry_run:
        _print_removal(store.evict(dry_run=True, **criteria), "prune", store, args.json, True)
        return 0
    planned = store.evict(dry_run=True, **criteria)
    if not planned:
        _print_removal([], "prune", store, args.json, False)
        return 0
    if not _confirm(args, f"remove {len(planned)} cache entries from {store.root}"):
        print("Aborted")
        return 1
    _print_removal(store.evict(**criteria), "prune", store, args.json, False)
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    """Remove every entry (counters are kept)."""
    store = _open_store(args)
    entries = store.entries()
    if args.dry_run:
        _print_removal(entries, "clear", store, args.json, True)
        return 0
    if not _confirm(args, f"remove all {len(entries)} cache entries from {store.root}"):
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
    store = _open_store(args)
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
        _print_json({"file": str(target), "entries": entries, "packs": packs, "bytes": size})
    else:
        print(f"Exported {packs} pack(s) of {entries} entr{'y' if entries == 1 else 'ies'} "
              f"to {target} ({format_size(size)})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Add an archive's entries; every member is validated before anything is written."""
    source = Path(args.file)
    if not source.is_file():
        raise UsageError(f"{args.file}: no such archive file")
    store = _open_store(args)
    report = store.import_archive(source)
    if args.json:
        _print_json({"file": str(source), "store": str(store.root), "keys": report.keys,
                     "packs_added": report.packs_added, "packs_present": report.packs_present})
    else:
        print(f"Imported {len(report.keys)} entr{'y' if len(report.keys) == 1 else 'ies'} into "
              f"{store.root}: {report.packs_added} pack(s) added, {report.packs_present} already present")
    return 0


# ---------------------------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------------------------
def _backend_info() -> dict[str, Any]:
    fingerprint = importlib.import_module("compile_cache.fingerprint")  # the package's name is a function
    info: dict[str, Any] = {"backend": fingerprint.backend, "fallbacks": fingerprint.backend_fallbacks}
    impl = getattr(fingerprint, "_implementation", None)
    path = getattr(impl, "__file__", None) if fingerprint.backend == "native" else None
    if path is None:
        spec = importlib.util.find_spec("compile_cache._C")
        path = spec.origin if spec else None
    info["extension"] = path
    built = None
    for attr in ("torch_version", "__torch_version__", "TORCH_VERSION"):
        built = getattr(impl, attr, None) if fingerprint.backend == "native" else None
        if built:
            break
    info["built_against_torch"] = str(built) if built else None
    return info


def cmd_doctor(args: argparse.Namespace) -> int:
    """Where the store is and why, whether it is safe and usable, and what splits cache keys."""
    import torch

    from . import __version__
    from .distributed.hazards import cross_rank_hazards
    from .keys import environment, environment_digest
    from .locks import filesystem_type, lock_mode_for
    from .store import Store
    from .store.safety import describe_dir, resolve_location

    root, source = resolve_location(args.cache_dir)
    source_text = {
        "argument": "--cache-dir argument",
        "COMPILE_CACHE_DIR": "COMPILE_CACHE_DIR environment variable",
        "XDG_CACHE_HOME": "$XDG_CACHE_HOME/compile_cache",
        "default": "default (~/.cache/compile_cache)",
    }.get(source, source)
    problems: list[str] = []
    try:
        shared = bool(config.SHARED.value())
    except ConfigError as exc:
        shared = False
        problems.append(str(exc))
    exists = root.is_dir()
    if os.path.lexists(root) and not exists:
        problems.append(f"{root} exists and is not a directory")
    try:
        lock_mode, lock_reason = lock_mode_for(root)
    except ConfigError as exc:
        lock_mode, lock_reason = "?", str(exc)
        problems.append(str(exc))
    perms, safe = describe_dir(root, shared) if exists else ("does not exist yet (created on first use)", True)
    if not safe:
        problems.append(f"store permissions: {perms}")
    store_state: dict[str, Any] = {}
    if exists:
        try:
            store = Store(root)
            st = store.stats()
            store_state = {
                "read_only": store.read_only, "read_only_reason": store.read_only_reason,
                "entries": st["entries"], "size": st["size"], "max_size": st["max_size"],
                "signed": store.signing_key is not None,
            }
        except CompileCacheError as exc:
            problems.append(f"store unusable: {exc}")
    elif not problems:
        parent = root.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            problems.append(f"{root} does not exist and {parent} is not writable: the store would be read-only")

    from .torch_compat import capabilities

    caps = [{"name": c.name, "available": c.available, "detail": c.detail} for c in capabilities()]
    env = environment()
    hazards = cross_rank_hazards()
    backend = _backend_info()
    variables = config.describe()
    problems.extend(v["error"] for v in variables if v["error"] and v["error"] not in problems)
    for name, meaning in _TORCH_VARS:
        value = os.environ.get(name)
        variables.append({"name": name, "value": value if value is not None else "unset",
                          "source": "environment" if value is not None else "default",
                          "default": "torch's", "allowed": "a directory path", "meaning": meaning,
                          "error": None})

    data = {
        "version": __version__,
        "store": {
            "location": str(root), "source": source, "exists": exists,
            "filesystem": filesystem_type(root), "lock_mode": lock_mode, "lock_reason": lock_reason,
            "permissions": perms, "safe": safe, "group_shared": shared, **store_state,
        },
        "environment": {"key": environment_digest(env), "fields": env, "hazards": hazards},
        "fingerprint": backend,
        "torch": {"version": torch.__version__, "git": getattr(torch.version, "git_version", None)},
        "variables": variables,
        "capabilities": caps,
        "problems": problems,
    }
    if args.json:
        _print_json(data)
        return 1 if problems else 0

    s = data["store"]
    print(f"compile_cache {__version__}\n")
    print("Store")
    rows = [
        ("location", s["location"]),
        ("from", source_text),
        ("filesystem", s["filesystem"]),
        ("lock mode", f"{lock_mode} ({lock_reason})"),
        ("permissions", perms),
        ("sharing", "group (COMPILE_CACHE_SHARED=group)" if shared else "private to this user"),
    ]
    if store_state:
        ro = store_state["read_only"]
        rows.append(("read-only", f"yes: {store_state['read_only_reason']}" if ro else "no"))
        cap = format_size(store_state["max_size"]) if store_state["max_size"] else "unlimited"
        rows.append(("size", f"{format_size(store_state['size'])} of {cap}, {store_state['entries']} entries"))
        rows.append(("signing", "packs signed and checked (COMPILE_CACHE_SIGNING_KEY set)"
                     if store_state["signed"] else "off (checksums only)"))
    print(_pairs(rows, "  "))
    print("\nEnvironment key (packs are restored only where it is equal)")
    device = env.get("device_name") or "cpu only (no CUDA)"
    print(_pairs([
        ("key", data["environment"]["key"]),
        ("torch", f"{env['torch']} (git {env['torch_git'][:12] or '?'}, CUDA {env['torch_cuda'] or 'none'})"),
        ("python", env["python"]),
        ("cpu threads", env["cpu_threads"]),
        ("cpu capability", env["cpu_capability"]),
        ("device", device),
    ], "  "))
    if hazards:
        print("  differs most often across nodes/ranks:")
        for hazard in hazards:
            print(f"    - {hazard}")
    else:
        print("  no cross-rank hazard found (device index 0, thread count pinned)")
    print("\nFingerprint backend")
    fb_rows = [
        ("backend", backend["backend"] + (f" (fell back {backend['fallbacks']}x)" if backend["fallbacks"] else "")),
        ("extension", backend["extension"] or "not found"),
        ("built against", f"torch {backend['built_against_torch']}" if backend["built_against_torch"]
         else f"not recorded in the extension (running torch {torch.__version__})"),
    ]
    print(_pairs(fb_rows, "  "))
    print("\nTorch capabilities (private torch API compile_cache uses; a missing one degrades, "
          "with one warning)")
    print(_table(("  CAPABILITY", "STATE", "DETAIL"),
                 [(f"  {c['name']}", "available" if c["available"] else "MISSING", c["detail"])
                  for c in caps]))
    print("\nEnvironment variables (precedence: command-line argument > variable > default)")
    print(_table(("  VARIABLE", "VALUE", "SOURCE", "DEFAULT", "MEANING"),
                 [(f"  {v['name']}", v["value"], v["source"], v["default"], v["meaning"])
                  for v in variables]))
    if problems:
        print("\nProblems")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("\nNo problems found")
    return 0


# ---------------------------------------------------------------------------------------------
# warm
# ---------------------------------------------------------------------------------------------
def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: expected key=value, e.g. n_layer=2")
        out[key.strip()] = _parse_value(value)
    return out


def _int_list(values: Sequence[str] | None, flag: str) -> list[int] | None:
    if not values:
        return None
    out = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                number = int(part)
            except ValueError:
                raise UsageError(f"{flag} {value!r}: expected whole numbers, e.g. 1,4,8") from None
            if number <= 0:
                raise UsageError(f"{flag} {number}: must be positive")
            out.append(number)
    return out or None


def _load_target(target: str) -> Any:
    """The factory named by ``package.module:factory`` or ``path/to/file.py:factory``."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"TARGET {target!r}: expected package.module:factory or path/to/file.py:factory")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            # Imported under its own name with its directory on sys.path, as `import stem` in a
            # job would: the class's module name is part of the fingerprint, hence of the key.
            path = Path(module_name).resolve()
            if not path.is_file():
                raise UsageError(f"TARGET {target!r}: no such file {module_name}")
            sys.path.insert(0, str(path.parent))
            module = importlib.import_module(path.stem)
            origin = getattr(module, "__file__", None)
            if origin is None or Path(origin).resolve() != path:
                raise UsageError(
                    f"TARGET {target!r}: the name {path.stem!r} is already taken by {origin or 'a built-in module'}; "
                    "rename the file or use package.module:factory"
                )
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:  # the console script's case
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except Exception as exc:  # ImportError, SyntaxError, or an error the module raised on import
        raise UsageError(f"TARGET {target!r} does not import: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UsageError(f"TARGET {target!r}: module {module_name} has no attribute {attr!r}")
    if not callable(factory):
        raise UsageError(f"TARGET {target!r}: {attr} is not callable")
    return factory


def _unpack_factory_result(result: Any, target: str) -> tuple[Any, list[Any] | None]:
    from torch import nn

    if isinstance(result, nn.Module):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        model, inputs = result
        return model, list(inputs) if isinstance(inputs, list) else [inputs]
    raise UsageError(
        f"TARGET {target!r} returned {type(result).__name__}; expected a torch.nn.Module, "
        "(model, example_inputs) or (model, [example_inputs, ...])"
    )


def _build_hf(name: str, overrides: dict[str, Any]) -> Any:
    """A random-weight causal LM from its config: never downloads anything."""
    import torch

    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise UsageError(f"--hf needs transformers: {exc}") from None
    try:
        config = AutoConfig.for_model(name, **overrides)
    except (ValueError, KeyError) as exc:
        raise UsageError(f"--hf {name!r}: unknown model type ({str(exc).splitlines()[0]})") from None
    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        raise UsageError(f"--hf {name!r}: cannot build a causal LM ({str(exc).splitlines()[0]})") from None


def _token_grid(model: Any, batch_sizes: list[int] | None, seq_lens: list[int] | None) -> list[Any]:
    """Random ``input_ids`` for every (batch, seq) pair; ``use_cache=False`` for causal LMs."""
    import torch

    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise UsageError(
            "the model needs example inputs: make the TARGET factory return (model, example_inputs)"
        )
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq_lens = seq_lens or [min(128, max_pos) if isinstance(max_pos, int) else 128]
    if isinstance(max_pos, int) and max(seq_lens) > max_pos:
        raise UsageError(f"--seq-len {max(seq_lens)}: longer than the model's {max_pos} positions")
    generator = torch.Generator().manual_seed(0)
    grid = []
    for b in batch_sizes or [1]:
        for s in seq_lens:
            inputs: dict[str, Any] = {"input_ids": torch.randint(0, vocab, (b, s), generator=generator)}
            if hasattr(config, "use_cache"):
                inputs["use_cache"] = False
            grid.append(inputs)
    return grid


def _parse_dtype(name: str | None) -> Any:
    import torch

    if name is None:
        return None
    value = getattr(torch, name.strip().removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise UsageError(f"--dtype {name!r}: not a torch dtype (e.g. float32, bfloat16, float16)")
    return value


def _parse_device(name: str | None) -> Any:
    import torch

    if name is None:
        return None
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name!r}: {exc}") from None


def _move(value: Any, device: Any, dtype: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value.to(device) if device is not None else value
    if isinstance(value, tuple):
        return tuple(_move(v, device, dtype) for v in value)
    if isinstance(value, list):
        return [_move(v, device, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _move(v, device, dtype) for k, v in value.items()}
    return value


def cmd_warm(args: argparse.Namespace) -> int:
    """Compile a model into the store ahead of a job, over a grid of input shapes."""
    if bool(args.target) == bool(args.hf):
        raise UsageError("give a TARGET (package.module:factory or file.py:factory) or --hf NAME, not both"
                         if args.target else "give a TARGET (package.module:factory) or --hf NAME")
    overrides = _parse_overrides(args.set or [])
    if overrides and not args.hf:
        raise UsageError("--set only applies to --hf models")
    batch_sizes = _int_list(args.batch_size, "--batch-size")
    seq_lens = _int_list(args.seq_len, "--seq-len")
    dtype = _parse_dtype(args.dtype)
    device = _parse_device(args.device)
    if args.cache_dir is not None:
        path = Path(args.cache_dir).expanduser()
        if os.path.lexists(path) and not path.is_dir():
            raise UsageError(f"--cache-dir {args.cache_dir}: exists and is not a directory")

    if args.hf:
        model, inputs = _build_hf(args.hf, overrides), None
    else:
        factory = _load_target(args.target)
        model, inputs = _unpack_factory_result(factory(), args.target)
    if inputs is None:
        inputs = _token_grid(model, batch_sizes, seq_lens)
    elif batch_sizes or seq_lens:
        raise UsageError("--batch-size/--seq-len apply to --hf or to factories that return a model alone")
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
        inputs = [_move(x, device, dtype) for x in inputs]

    compile_kwargs: dict[str, Any] = {}
    if args.mode is not None:
        compile_kwargs["mode"] = args.mode
    if args.backend is not None:
        compile_kwargs["backend"] = args.backend
    if args.dynamic is not None:
        compile_kwargs["dynamic"] = args.dynamic
    if args.fullgraph:
        compile_kwargs["fullgraph"] = True

    from .api import warm
    from .session import last_report

    progress = not args.json and _is_tty(sys.stderr)
    start = time.perf_counter()
    results = warm(model, inputs, cache_dir=args.cache_dir, train=args.train,
                   precompile=True if args.precompile else None, progress=progress, **compile_kwargs)
    seconds = time.perf_counter() - start
    report = last_report()
    key = results[0].key if results else None
    if report is not None and report.key != key:
        report = None
    problems = list(report.errors) if report else ["no store was used (see the warning above)"]
    compiled = sum(r.status == "compiled" for r in results)
    published = sum(r.published_bytes for r in results)
    if report is not None and compiled and not published:
        from .store import Store

        with contextlib.suppress(CompileCacheError, OSError):
            store = Store(report.store)
            if store.read_only:
                problems.append(f"the store is read-only ({store.read_only_reason}): compiled code was not saved")
    summary = {
        "key": key,
        "store": report.store if report else None,
        "results": [r.to_dict() for r in results],
        "seconds": seconds,
        "first_output_seconds": results[0].seconds if results else 0.0,
        "compiled": compiled,
        "fxgraph_hits": sum(r.fxgraph_hits for r in results),
        "fxgraph_misses": sum(r.fxgraph_misses for r in results),
        "restored_packs": report.restored_packs if report else 0,
        "published_packs": sum(r.published_packs for r in results),
        "published_bytes": published,
        "hit": bool(report and report.hit),
        "errors": problems,
        "ok": not problems,
    }
    if args.json:
        _print_json(summary)
    else:
        rows = [
            (r.shape, r.status, f"{r.seconds:.2f}", format_size(r.published_bytes) if r.published_bytes else "-")
            for r in results
        ]
        print(_table(("SHAPE", "RESULT", "SECONDS", "PUBLISHED"), rows, right={2, 3}))
        restored = f"restored {report.restored_packs} pack(s)" if report and report.restored_packs else "nothing restored"
        print(f"\nkey {str(key)[:12]}: {restored}, {compiled} of {len(results)} shape(s) compiled, "
              f"{format_size(published)} published, {seconds:.1f} s in all")
        if report:
            print(f"store: {report.store}")
    if problems:
        for p in problems:
            print(f"{PROG} warm: not everything is in the store: {p}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (exposed for docs and tests)."""
    store_opts = argparse.ArgumentParser(add_help=False)
    store_opts.add_argument(
        "--cache-dir", metavar="DIR",
        help="the store (default: COMPILE_CACHE_DIR, then $XDG_CACHE_HOME/compile_cache, then ~/.cache/compile_cache)",
    )
    store_opts.add_argument("-v", "--verbose", action="store_true", help="log what compile_cache does to stderr")
    json_opts = argparse.ArgumentParser(add_help=False)
    json_opts.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    confirm_opts = argparse.ArgumentParser(add_help=False)
    confirm_opts.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    confirm_opts.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    both = [store_opts, json_opts]

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Manage the compile_cache store of torch.compile artifacts.",
        epilog=f"Run `{PROG} COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("warm", parents=both, help="compile a model into the store ahead of a job",
                       description="Compile a model over a grid of input shapes and publish the "
                       "compiled code to the store, so jobs on any node restore it instead of compiling.")
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help="package.module:factory or path/to/file.py:factory; the factory returns a model, "
                   "(model, example_inputs) or (model, [example_inputs, ...])")
    p.add_argument("--hf", metavar="NAME", help="a transformers model type (gpt2, llama, ...) built from its "
                   "config with random weights (never downloads)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for --hf (repeatable)")
    p.add_argument("--batch-size", action="append", metavar="N[,N...]", help="batch sizes of the input grid")
    p.add_argument("--seq-len", action="append", metavar="N[,N...]", help="sequence lengths of the input grid")
    p.add_argument("--train", action="store_true", help="warm forward and backward (default: inference)")
    p.add_argument("--dtype", help="cast the model and floating inputs (float32, bfloat16, ...)")
    p.add_argument("--device", help="move the model and inputs (cpu, cuda, cuda:0, ...)")
    p.add_argument("--mode", help="torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    p.add_argument("--backend", help="torch.compile backend (default inductor)")
    p.add_argument("--dynamic", type=_bool_arg, metavar="true|false", help="torch.compile dynamic=")
    p.add_argument("--fullgraph", action="store_true", help="torch.compile fullgraph=True")
    p.add_argument("--precompile", action="store_true", help="also cache Dynamo's traced code")
    p.set_defaults(func=cmd_warm)

    p = sub.add_parser("ls", parents=both, help="list cache entries",
                       description="One row per cache entry: key, model, regions, packs, size, ages.")
    p.add_argument("--sort", choices=("size", "used", "created"), default="used",
                   help="order (largest, most recently used, newest first; default used)")
    p.add_argument("--limit", type=int, metavar="N", help="show at most N entries")
    p.add_argument("-q", "--quiet", action="store_true", help="print full keys only")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("stats", parents=both, help="hit/miss statistics",
                       description="Hits, misses, errors, bytes and compile time saved, summed over processes.")
    p.add_argument("--zero", action="store_true", help="reset the counters")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("verify", parents=both, help="check every pack's header and checksum",
                       description="Check packs, entry files, temp files and locks. Exit 1 when problems remain.")
    p.add_argument("--fix", action="store_true", help="quarantine corrupt packs, remove orphans and stale locks")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("prune", parents=[*both, confirm_opts], help="evict entries by size, age or key",
                       description="Remove entries: least recently used beyond --max-size, unused for "
                       "--older-than, or named by --key. Without criteria, enforce the store's cap.")
    p.add_argument("--max-size", metavar="SIZE", help="keep the store under SIZE (e.g. 20G)")
    p.add_argument("--older-than", metavar="AGE", help="remove entries not used for AGE (e.g. 30d)")
    p.add_argument("--key", action="append", metavar="K", help="remove this entry (key or prefix; repeatable)")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("clear", parents=[*both, confirm_opts], help="remove every entry",
                       description="Remove every entry and quarantined pack (statistics are kept).")
    p.set_defaults(func=cmd_clear)

    p = sub.add_parser("export", parents=both, help="write entries to one archive",
                       description="Write entries with their valid packs into one tar archive "
                       "(.tar.gz/.tgz: compressed), e.g. for an air-gapped cluster.")
    p.add_argument("file", metavar="FILE", help="the archive to write")
    p.add_argument("--key", action="append", metavar="K", help="export only this entry (repeatable)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", parents=both, help="add the entries of an archive",
                       description="Validate every member of an archive made by export, then add "
                       "its entries. Importing twice is harmless.")
    p.add_argument("file", metavar="FILE", help="the archive to read")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("doctor", parents=both, help="diagnose the store and the environment",
                       description="Where the store is and why, filesystem and lock mode, "
                       "permissions, the environment key and its cross-node hazards, the "
                       "fingerprint backend and the environment variables.")
    p.set_defaults(func=cmd_doctor)
    return parser


def _bool_arg(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``compile-cache`` and ``python -m compile_cache``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "verbose", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log = logging.getLogger("compile_cache")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        return int(args.func(args))
    except (CompileCacheError, ValueError) as exc:
        # User errors: one line, no traceback. StoreError covers a corrupt archive, an unsafe or
        # read-only store; ValueError a bad key or value; ConfigError a bad size or variable.
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `compile-cache ls | head`: the reader went away; not an error.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return 0


__all__ = ["UsageError", "build_parser", "main"]
