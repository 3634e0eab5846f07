"""What ``explain`` reads from the store: every entry's record, and the last misses.

An entry's ``entry.json`` holds the readable record of its key (:func:`compile_cache.keys.key_fields`:
model, compile settings, environment fields, plan, precompile). A start whose key is not in the
store writes a small miss record (``v1/misses/<key>.json``: the same record, when, where, and the
reason it was given), so that ``python -m compile_cache explain`` without a TARGET can explain the
last misses later, without importing torch. Only the newest :data:`MISS_KEEP` are kept. Writing a
miss record is best effort: it never fails a job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from .._paths import HOSTNAME
from ._io import json_bytes
from .fs import StoreFS
from .layout import Layout

__all__ = ["MISS_KEEP", "entry_records", "last_misses", "record_miss"]

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
    if store.fs.read_only:
        return
    data = {"key": key, "time": time.time(), "host": HOSTNAME, "pid": os.getpid(),
            "reason": reason, "record": dict(record)}
    try:
        blob = json_bytes(data)
        store.fs.mkdirs(store.layout.misses_dir)
        store.fs.write(store.layout.miss_file(key), blob, fsync=False)
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


def last_misses(store: StoreFiles, limit: int = MISS_KEEP) -> list[dict[str, Any]]:
    """The recorded misses, newest first (at most ``limit``); unreadable records are skipped."""
    try:
        names = [n for n in store.fs.listdir(store.layout.misses_dir) if n.endswith(".json")]
    except OSError:
        return []
    out = []
    for name in names:
        data, _garbage = store.fs.read_json(store.layout.misses_dir / name)
        if isinstance(data, dict) and isinstance(data.get("key"), str):
            out.append(data)
    out.sort(key=lambda d: float(d.get("time") or 0.0), reverse=True)
    return out[:limit]
