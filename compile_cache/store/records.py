"""What the store hands out: records of packs, entries, verify and import runs, eviction plans."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CorruptPackError, StoreError
from .layout import Layout
from .pack import read_pack_header_from

__all__ = ["CompactReport", "EntryInfo", "EvictionPlan", "ImportReport", "Pack", "PackInfo", "VerifyReport"]


@dataclass(frozen=True)
class PackInfo:
    """One pack on disk: which key, its content hash, size and header facts."""

    key: str
    name: str
    path: Path
    size: int
    created: float
    members: int
    data_bytes: int
    compile_seconds: float
    signed: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    member_names: tuple[str, ...] = ()
    #: The id of the key that signed it (``Store.signer``), None for unsigned/older packs.
    signer: str | None = None

    @classmethod
    def from_header(cls, key: str, name: str, path: Path, size: int, header: dict[str, Any], signed: bool) -> PackInfo:
        """The facts of the pack ``name`` of ``key`` at ``path`` from its parsed ``header``."""
        table = header.get("members") or []
        return cls(
            key=key,
            name=name,
            path=path,
            size=size,
            created=float(header.get("created") or 0.0),
            members=len(table),
            data_bytes=sum(int(m.get("size", 0)) for m in table if isinstance(m, dict)),
            compile_seconds=float(header.get("compile_seconds") or 0.0),
            signed=signed,
            metadata=dict(header.get("metadata") or {}),
            member_names=tuple(
                m["name"] for m in table if isinstance(m, dict) and isinstance(m.get("name"), str)
            ),
            signer=header.get("signer") if isinstance(header.get("signer"), str) else None,
        )


@dataclass(frozen=True)
class Pack:
    """A loaded, verified pack: ``members`` maps safe relative names to bytes.

    ``members`` reads from the open pack file on demand (a
    :class:`~compile_cache.store.reader.PackMembers`: ``chunks(name)`` streams a member,
    ``size(name)``/``info(name)`` read only the member table); :meth:`close` closes the file.
    """

    members: Mapping[str, bytes]
    header: dict[str, Any]
    info: PackInfo

    def close(self) -> None:
        """Close the pack file now (also done when the pack is garbage-collected)."""
        close = getattr(self.members, "close", None)
        if close is not None:
            close()


@dataclass(frozen=True)
class EntryInfo:
    """One cache entry (a key): its ``entry.json`` metadata, packs, total size and times."""

    key: str
    metadata: dict[str, Any]
    packs: tuple[PackInfo, ...]
    size: int
    created: float
    last_used: float
    path: Path

    @classmethod
    def read(cls, layout: Layout, key: str) -> EntryInfo | None:
        """The entry of ``key`` as it is on disk now (headers only, no checksums), or None."""
        entry, entry_json, used, packs_dir = layout.entry_strings(key)
        fs = layout.fs
        try:
            scan = fs.files(entry)
        except OSError:  # gone, unreadable (EACCES, ESTALE) or a link: nothing to list
            return None
        metadata, _garbage = fs.read_json(entry_json)
        size = sum(st.st_size for _name, st in scan)  # regular files only, as lstat says
        mtimes: list[float] = []
        packs: list[PackInfo] = []
        for name in layout.pack_file_names(key):
            path = os.path.join(packs_dir, name)
            try:
                with fs.open_read(path, trust=False) as fh:
                    st = os.fstat(fh.fileno())
                    header, signed, _ = read_pack_header_from(fh)
                size += st.st_size
                mtimes.append(st.st_mtime)
                packs.append(PackInfo.from_header(key, name[:-5], Path(path), st.st_size, header, signed))
            except (OSError, CorruptPackError, TypeError, ValueError, AttributeError):
                continue  # a broken header is skipped here (load counts and quarantines it)
        try:
            last_used = fs.lstat(used).st_mtime
        except OSError:
            last_used = max(mtimes, default=0.0)
        try:
            created = float((metadata or {}).get("created") or 0.0)
        except (TypeError, ValueError):
            created = 0.0
        created = created or min(
            [p.created for p in packs] or [last_used]
        )
        return cls(key=key, metadata=metadata or {}, packs=tuple(packs), size=size,
                   created=created, last_used=last_used, path=Path(entry))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for ``ls --json``)."""
        return {
            "key": self.key,
            "metadata": self.metadata,
            "packs": [
                {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(p).items()}
                for p in self.packs
            ],
            "size": self.size,
            "created": self.created,
            "last_used": self.last_used,
            "path": str(self.path),
        }


@dataclass
class VerifyReport:
    """What :meth:`Store.verify` found (and, with ``fixed``, removed or quarantined).

    :meth:`fix` fixes what the scan listed, and only that (``verify --fix`` shows the scan,
    then runs it): corrupt packs quarantined, the rest removed, superseded packs compacted.
    """

    checked_entries: int = 0
    checked_packs: int = 0
    corrupt_packs: list[tuple[Path, str]] = field(default_factory=list)
    incompatible_packs: list[Path] = field(default_factory=list)
    #: Packs signed with another key (or unsigned, with a key set): another reader's, not a problem.
    other_signer_packs: list[Path] = field(default_factory=list)
    #: Directories and packs another user owns or can write: refused by every load.
    untrusted: list[tuple[Path, str]] = field(default_factory=list)
    #: Packs this node could not check (a local I/O error: EMFILE, EIO...): left as they are.
    unchecked: list[tuple[Path, str]] = field(default_factory=list)
    #: What ``fix`` could not do (a compaction that hit ENOSPC...): the store is not OK.
    not_fixed: list[tuple[Path, str]] = field(default_factory=list)
    orphaned_temp: list[Path] = field(default_factory=list)
    stale_locks: list[Path] = field(default_factory=list)
    bad_entries: list[Path] = field(default_factory=list)
    bad_stats: list[Path] = field(default_factory=list)
    empty_entries: list[Path] = field(default_factory=list)
    old_quarantine: list[Path] = field(default_factory=list)
    #: Entries whose packs hold superseded generations (not a problem; ``fix`` compacts them).
    compactable: list[CompactReport] = field(default_factory=list)
    #: Bytes the size counter (the cap's measure) is off by: counted minus found; ``fix`` zeroes it.
    size_drift: int = 0
    fixed: bool = False
    #: Fixes what the scan listed (set by the scan; None for a report built by hand).
    fixer: Callable[[VerifyReport], None] | None = field(default=None, repr=False, compare=False)

    def fix(self) -> VerifyReport:
        """Fix what this report lists (once); return it, with ``fixed`` set and what fixing
        found on the way added (an entry left empty, compactions done, ``old_quarantine``).
        Raises :class:`StoreError` on a read-only store, or for a report no scan made."""
        if self.fixed:
            return self
        if self.fixer is None:
            raise StoreError("this verify report was not made by a scan of a store: nothing to fix with")
        self.fixer(self)
        self.fixed = True
        return self

    @property
    def ok(self) -> bool:
        """No problem found (packs of another format version, or signed with another key, are
        not a problem: they are other readers')."""
        return not (
            self.corrupt_packs or self.orphaned_temp or self.stale_locks or self.bad_entries
            or self.bad_stats or self.empty_entries or self.untrusted or self.unchecked
            or self.not_fixed
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for ``verify --json``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "fixer":
                continue
            value = getattr(self, f.name)
            if isinstance(value, list):
                value = [v.to_dict() if isinstance(v, CompactReport)
                         else [str(v[0]), v[1]] if isinstance(v, tuple) else str(v) for v in value]
            out[f.name] = value
        out["ok"] = self.ok
        return out


@dataclass
class ImportReport:
    """What :meth:`Store.import_archive` did: keys seen, packs written, packs already present."""

    keys: list[str] = field(default_factory=list)
    packs_added: int = 0
    packs_present: int = 0


@dataclass(frozen=True)
class EvictionPlan:
    """The entries an eviction removes, chosen once (:meth:`Store.plan_eviction`); :meth:`execute`
    removes exactly those (an entry published after the plan was made is never among them)."""

    entries: tuple[EntryInfo, ...] = ()
    #: Removes the entries given (the store's own; set by the store that planned it).
    run: Callable[[tuple[EntryInfo, ...]], list[EntryInfo]] | None = field(
        default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        """Bytes the plan frees."""
        return sum(e.size for e in self.entries)

    def execute(self) -> list[EntryInfo]:
        """Remove the planned entries; return those removed (one gone meanwhile is skipped).
        Raises :class:`StoreError` on a read-only store."""
        if self.run is None:
            raise StoreError("this eviction plan was not made by a store: nothing to execute it with")
        return self.run(self.entries)


@dataclass
class CompactReport:
    """One entry's compaction: the packs merged into one that holds the current generation."""

    key: str
    merged: list[Path] = field(default_factory=list)
    written: Path | None = None
    bytes_before: int = 0
    bytes_after: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"key": self.key, "merged": [str(p) for p in self.merged],
                "written": None if self.written is None else str(self.written),
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after}
