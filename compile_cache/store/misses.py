"""What ``explain`` reads from the store: every entry's record, and the last misses.

An entry's ``entry.json`` holds the readable record of its key (:func:`compile_cache.keys.key_fields`:
model, compile settings, environment fields, plan, precompile). A start whose key is not in the
store writes a small miss record (``v1/misses/<key>.json``: the same record, when, where, and the
reason it was given), so that ``python -m compile_cache explain`` without a TARGET can explain the
last misses later, without importing torch. A start that found its key and still compiled (a
partial hit) writes one too (``v1/misses/<key>.partial.<start>.json``: what it compiled and why,
:func:`compile_cache.explain.partial_causes`). Only the newest :data:`MISS_KEEP` are kept. Writing
a record is best effort: it never fails a job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from .._paths import HOSTNAME, check_key
from ._io import json_bytes
from .fs import StoreFS
from .layout import Layout

__all__ = ["MISS_KEEP", "bad_records", "entry_records", "last_misses", "last_partials", "record_miss", "record_partial"]

logger = logging.getLogger("compile_cache")

#: How many miss records the store keeps (the newest).
MISS_KEEP = 20


class StoreFiles(Protocol):
    """What these functions use of a store: its files and their paths (a ``Store`` has both)."""

    @property
    def fs(self) -> StoreFS: ...

    @property
    def layout(self) -> Layout: ...


def entry_records(store: StoreFiles) -> Iterator[tuple[str, dict[str, Any], int]]:
    """``(key, entry.json record, number of packs)`` for every entry; cheap: no pack is read."""
    layout = store.layout
    for key in layout.keys():
        record, _garbage = store.fs.read_json(layout.entry_json(key))
        yield key, record or {}, len(layout.pack_file_names(key))


def record_miss(store: StoreFiles, key: str, record: Mapping[str, Any], reason: str) -> None:
    """Remember that a start missed ``key`` (with what it used and why); keeps the newest few."""
    data = {"key": key, "time": time.time(), "host": HOSTNAME, "pid": os.getpid(),
            "reason": reason, "record": dict(record)}
    _write(store, key, store.layout.miss_file(key), data)


def record_partial(store: StoreFiles, key: str, start: str, data: Mapping[str, Any]) -> None:
    """Remember why the start ``start`` (hex id) that restored ``key`` still compiled (``data``:
    its counts and causes); one file per start, rewritten as it compiles more; newest few kept."""
    full = {**data, "kind": "partial", "key": key, "time": time.time(), "host": HOSTNAME,
            "pid": os.getpid()}
    _write(store, key, store.layout.partial_file(key, start), full)


def _write(store: StoreFiles, key: str, path: Any, data: Mapping[str, Any]) -> None:
    if store.fs.read_only:
        return
    try:
        blob = json_bytes(dict(data))
        store.fs.mkdirs(store.layout.misses_dir)
        store.fs.write(path, blob, fsync=False)
        names = sorted(store.fs.listdir(store.layout.misses_dir))
    except (OSError, TypeError, ValueError) as exc:
        logger.debug("could not record the miss of %s: %s", key, exc)
        return
    stamped = []
    for name in names:
        if name.endswith(".json"):
            with contextlib.suppress(OSError):
                stamped.append((store.fs.lstat(store.layout.misses_dir / name).st_mtime, name))
    for _mtime, name in sorted(stamped, reverse=True)[MISS_KEEP:]:
        with contextlib.suppress(OSError):
            store.fs.unlink(store.layout.misses_dir / name)


def _records(store: StoreFiles) -> list[dict[str, Any]]:
    try:
        names = [n for n in store.fs.listdir(store.layout.misses_dir) if n.endswith(".json")]
    except OSError:
        return []
    out = []
    for name in names:
        data, _garbage = store.fs.read_json(store.layout.misses_dir / name)
        if isinstance(data, dict) and _record_problem(data) is None:
            out.append(data)
    out.sort(key=_when, reverse=True)
    return out


def _record_problem(data: Mapping[str, Any]) -> str | None:
    """Why a miss record read back cannot be used (another writer's record is not trusted)."""
    key = data.get("key")
    if not isinstance(key, str):
        return "it names no key"
    try:
        check_key(key)
    except ValueError:
        return f"its key {key[:80]!r} is not a cache key (8-128 lower-case hex digits)"
    return None


def bad_records(store: StoreFiles) -> list[tuple[str, str]]:
    """``(file name, why)`` of every miss record that is unreadable or not one of ours: skipped
    by ``explain``, reported by ``doctor``."""
    try:
        names = sorted(n for n in store.fs.listdir(store.layout.misses_dir) if n.endswith(".json"))
    except OSError:
        return []
    out = []
    for name in names:
        data, garbage = store.fs.read_json(store.layout.misses_dir / name)
        if garbage or not isinstance(data, dict):
            out.append((name, "not a readable JSON record"))
        elif (why := _record_problem(data)) is not None:
            out.append((name, why))
    return out


def _when(record: Mapping[str, Any]) -> float:
    """A record's time; 0 when it is not a number (another writer's record is not trusted)."""
    value = record.get("time")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def last_misses(store: StoreFiles, limit: int = MISS_KEEP) -> list[dict[str, Any]]:
    """The recorded misses, newest first (at most ``limit``); unreadable records are skipped."""
    return [d for d in _records(store) if d.get("kind", "miss") == "miss"][:limit]


def last_partials(store: StoreFiles, limit: int = MISS_KEEP, key: str | None = None) -> list[dict[str, Any]]:
    """The recorded partial hits (of ``key``, or of any), newest first, at most ``limit``."""
    return [d for d in _records(store)
            if d.get("kind") == "partial" and (key is None or d["key"] == key)][:limit]
