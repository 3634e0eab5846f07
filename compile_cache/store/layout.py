"""The store's disk layout, in one place (nothing outside ``compile_cache.store`` knows it)::

    <root>/                                  COMPILE_CACHE_DIR, $XDG_CACHE_HOME/compile_cache, ~/.cache/compile_cache
      v1/entries/<key[:2]>/<key>/
          entry.json                         entry metadata, written once (first publisher wins)
          used                               empty file; its mtime is the last use (LRU)
          packs/<content-hash>.pack          one per publish; name = hash of the members' content
      v1/stats/shard-<n>.json                counters, read-modify-write under a short lock
      v1/quarantine/<key>-<pack>-<time>.pack packs that failed their checks, set aside
      v1/locks/<key>.lock | <key>.lockdir    see compile_cache.locks
      v1/tmp/                                entries being evicted (renamed here, then deleted)
      v1/misses/<key>.json                   the last misses, with what the missing start used (explain)
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from .._paths import HOSTNAME

__all__ = ["LAYOUT_DIR", "PACK_RE", "Layout"]

LAYOUT_DIR = "v1"
PACK_RE = re.compile(r"([0-9a-f]{32})\.pack")
_SHARD_RE = re.compile(r"shard-\d+\.json")
_PREFIX_RE = re.compile(r"[0-9a-f]{2}")
_KEY_RE = re.compile(r"[0-9a-f]{8,128}")


class Layout:
    """Every path of the store at ``root``, and the listings that follow the layout."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = root / LAYOUT_DIR
        self.entries_dir = self.base / "entries"
        self._entries = str(self.entries_dir)
        self.stats_dir = self.base / "stats"
        self.tmp_dir = self.base / "tmp"
        self.quarantine_dir = self.base / "quarantine"
        self.locks_dir = self.base / "locks"
        self.misses_dir = self.base / "misses"

    @property
    def dirs(self) -> tuple[Path, ...]:
        """The directories a writable store creates under ``base``."""
        return (self.entries_dir, self.stats_dir, self.tmp_dir, self.quarantine_dir, self.locks_dir)

    # -- one entry -------------------------------------------------------------------------------
    def entry_dir(self, key: str) -> Path:
        return self.entries_dir / key[:2] / key

    def packs_dir(self, key: str) -> Path:
        return self.entry_dir(key) / "packs"

    def pack_path(self, key: str, name: str) -> Path:
        return self.packs_dir(key) / f"{name}.pack"

    def entry_json(self, key: str) -> Path:
        return self.entry_dir(key) / "entry.json"

    def used_file(self, key: str) -> Path:
        return self.entry_dir(key) / "used"

    def entry_strings(self, key: str) -> tuple[str, str, str, str]:
        """(entry dir, entry.json, used, packs dir) of ``key`` as plain strings: listings of
        thousands of entries (``ls``) would spend most of their time building Paths."""
        entry = os.path.join(self._entries, key[:2], key)
        return (entry, os.path.join(entry, "entry.json"), os.path.join(entry, "used"),
                os.path.join(entry, "packs"))

    # -- elsewhere -------------------------------------------------------------------------------
    def miss_file(self, key: str) -> Path:
        return self.misses_dir / f"{key}.json"

    def stats_shard(self, n: int) -> Path:
        return self.stats_dir / f"shard-{n}.json"

    @staticmethod
    def is_stats_shard(name: str) -> bool:
        return _SHARD_RE.fullmatch(name) is not None

    def lock_base(self, name: str) -> Path:
        """Where the lock called ``name`` lives (a key, ``stats-<n>``, ``evict``), without suffix."""
        return self.locks_dir / name

    def quarantine_path(self, key: str, pack: Path) -> Path:
        stamp = f"{int(time.time())}-{secrets.token_hex(2)}"
        return self.quarantine_dir / f"{key}-{pack.stem}-{stamp}.pack"

    def aside_path(self, entry: Path) -> Path:
        """A unique name in ``tmp/`` for an entry being removed (rename first, then delete)."""
        return self.tmp_dir / f"{entry.name}.evict-{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}"

    # -- listings --------------------------------------------------------------------------------
    def keys(self) -> Iterator[str]:
        """Every key with an entry directory, sorted."""
        try:
            prefixes = sorted(os.listdir(self.entries_dir))
        except OSError:
            return
        for prefix in prefixes:
            if not _PREFIX_RE.fullmatch(prefix):
                continue
            try:
                keys = sorted(os.listdir(self.entries_dir / prefix))
            except OSError:
                continue
            for key in keys:
                if key.startswith(prefix) and _KEY_RE.fullmatch(key):
                    yield key

    def pack_paths(self, key: str, *, strict: bool = False) -> list[Path]:
        """The pack files of ``key``; an unreadable directory raises with ``strict``, else is empty."""
        packs_dir = self.packs_dir(key)
        try:
            names = os.listdir(packs_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError:
            if strict:
                raise
            return []
        return [packs_dir / n for n in sorted(names) if PACK_RE.fullmatch(n)]
