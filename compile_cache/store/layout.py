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

A store on object storage (``s3://bucket/prefix``...) has the same shape under its URL
(:class:`RemoteLayout`), minus what only a filesystem needs (locks, tmp), plus append-only
objects where a directory store rewrites a file::

    <url>/v1/entries/<key[:2]>/<key>/entry.json, packs/<content-hash>.pack
    <url>/v1/entries/<key[:2]>/<key>/used/<ns>-<host>-<pid>-<rand>   one empty object per use
    <url>/v1/stats/<host>-<pid>-<rand>.json            one process's counters (only it writes it)
    <url>/v1/quarantine/<key>-<pack>-<time>.pack       packs that failed their checks

and a local read-through tier that is an ordinary directory store (see :mod:`.remote`).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .. import config
from .._paths import HOSTNAME
from .fs import StoreFS

__all__ = ["LAYOUT_DIR", "PACK_RE", "REMOTE_PACK_RE", "Layout", "RemoteEntry", "RemoteLayout"]

LAYOUT_DIR = "v1"
PACK_RE = re.compile(r"([0-9a-f]{32})\.pack")
#: A pack object on object storage: ``<hash>.pack``, or ``<hash>.pack.zst`` compressed
#: (:mod:`.compression`; a reader of an older version ignores that name: a miss, never a loss).
REMOTE_PACK_RE = re.compile(r"([0-9a-f]{32})\.pack(\.zst)?")
_SHARD_RE = re.compile(r"shard-\d+\.json")
_PREFIX_RE = re.compile(r"[0-9a-f]{2}")
_KEY_RE = re.compile(r"[0-9a-f]{8,128}")


class Layout:
    """Every path of the store at ``root``, and the listings that follow the layout."""

    def __init__(self, root: Path, fs: StoreFS | None = None) -> None:
        self.root = root
        #: Every file operation under ``root`` (:mod:`.fs`: no link inside the store is followed).
        self.fs = fs if fs is not None else StoreFS(root, config.SHARED.value())
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
            prefixes = sorted(self.fs.listdir(self.entries_dir))
        except OSError:
            return
        for prefix in prefixes:
            if not _PREFIX_RE.fullmatch(prefix):
                continue
            try:
                keys = sorted(self.fs.listdir(self.entries_dir / prefix))
            except OSError:
                continue
            for key in keys:
                if key.startswith(prefix) and _KEY_RE.fullmatch(key):
                    yield key

    def pack_paths(self, key: str, *, strict: bool = False) -> list[Path]:
        """The pack files of ``key``; an unreadable directory raises with ``strict``, else is empty."""
        packs_dir = self.packs_dir(key)
        return [packs_dir / n for n in self.pack_file_names(key, strict=strict)]

    def pack_file_names(self, key: str, *, strict: bool = False) -> list[str]:
        """The names of ``key``'s pack files, sorted: the one listing of a key's packs (a
        directory listing NFS may serve from its attribute cache; callers may list again)."""
        try:
            names = self.fs.listdir(self.entry_strings(key)[3])
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError:
            if strict:
                raise
            return []
        return [n for n in sorted(names) if PACK_RE.fullmatch(n)]


@dataclass
class RemoteEntry:
    """One key's objects in an object-storage store, from one listing."""

    key: str
    packs: dict[str, int] = field(default_factory=dict)  # content hash -> size
    compressed: set[str] = field(default_factory=set)  # packs stored as <hash>.pack.zst
    entry_json: int | None = None  # its size, None if absent
    uses: list[str] = field(default_factory=list)  # use-object names, oldest first
    size: int = 0  # every object of the entry
    newest: float = 0.0  # newest modification time the listing gave

    @property
    def last_used(self) -> float:
        """The newest use record's time (its name starts with the time in ns), else ``newest``."""
        now = time.time()
        for name in reversed(self.uses):
            head = name.split("-", 1)[0]
            if head.isdigit() and len(head) <= 20:  # ns since 1970 (a longer one is garbage)
                if int(head) / 1e9 <= now + 60:  # one in the future is not trusted: skipped
                    return int(head) / 1e9
        return min(self.newest, now)


class RemoteLayout:
    """Every object name of a store on object storage (relative to its URL)."""

    base = LAYOUT_DIR
    entries_dir = f"{LAYOUT_DIR}/entries"
    stats_dir = f"{LAYOUT_DIR}/stats"
    quarantine_dir = f"{LAYOUT_DIR}/quarantine"

    def entry_dir(self, key: str) -> str:
        return f"{self.entries_dir}/{key[:2]}/{key}"

    def pack_object(self, key: str, name: str, compressed: bool = False) -> str:
        """The object of pack ``name`` (``compressed``: its ``.pack.zst`` form)."""
        return f"{self.entry_dir(key)}/packs/{name}.pack{'.zst' if compressed else ''}"

    def pack_object_of(self, entry: RemoteEntry, name: str) -> str:
        """The object a listing showed for pack ``name`` of ``entry`` (compressed when both are)."""
        return self.pack_object(entry.key, name, name in entry.compressed)

    def entry_json(self, key: str) -> str:
        return f"{self.entry_dir(key)}/entry.json"

    def use_object(self, key: str) -> str:
        return f"{self.entry_dir(key)}/used/{time.time_ns()}-{HOSTNAME}-{os.getpid()}-{secrets.token_hex(3)}"

    def use_dir(self, key: str) -> str:
        return f"{self.entry_dir(key)}/used"

    def stats_object(self) -> str:
        """This process's own counters object (a name no other process uses)."""
        return f"{self.stats_dir}/{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}.json"

    def quarantine_object(self, key: str, name: str) -> str:
        return f"{self.quarantine_dir}/{key}-{name}-{int(time.time())}-{secrets.token_hex(2)}.pack"

    def entries(self, listing: Mapping[str, object]) -> dict[str, RemoteEntry]:
        """The entries an ``entries_dir`` listing (name -> ObjectInfo) shows, by key."""
        out: dict[str, RemoteEntry] = {}
        prefix = self.entries_dir + "/"
        for name, info in listing.items():
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].split("/")
            if len(parts) < 3 or not _PREFIX_RE.fullmatch(parts[0]) or not _KEY_RE.fullmatch(parts[1]) \
                    or not parts[1].startswith(parts[0]):
                continue
            entry = out.setdefault(parts[1], RemoteEntry(parts[1]))
            size = int(getattr(info, "size", 0))
            entry.size += size
            entry.newest = max(entry.newest, float(getattr(info, "mtime", 0.0)))
            rest = parts[2:]
            if rest == ["entry.json"]:
                entry.entry_json = size
            elif len(rest) == 2 and rest[0] == "packs" and (m := REMOTE_PACK_RE.fullmatch(rest[1])):
                if m.group(2):  # compressed: the form a download prefers
                    entry.compressed.add(m.group(1))
                    entry.packs[m.group(1)] = size
                elif m.group(1) not in entry.compressed:
                    entry.packs[m.group(1)] = size
            elif len(rest) == 2 and rest[0] == "used":
                entry.uses.append(rest[1])
        for entry in out.values():
            entry.uses.sort(key=lambda n: (len(n.split("-", 1)[0]), n))
        return dict(sorted(out.items()))
