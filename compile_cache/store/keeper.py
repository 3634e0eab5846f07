"""What happens to an entry's files besides reading them: use marks, ``entry.json``, quarantine.

:class:`Keeper` marks an entry used (the ``used`` file's mtime: the LRU clock), writes an entry's
``entry.json`` once, sets a bad pack aside (quarantine, counted), and turns an I/O error into a
warning and a counted error: a training job never fails because its cache could not be written.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._paths import HOSTNAME
from ._io import errno_name, torch_version, warn_once
from .counters import Counters, check_names
from .fs import StoreFS
from .layout import Layout
from .pack import FORMAT_VERSION

__all__ = ["Keeper"]

logger = logging.getLogger("compile_cache")


class Keeper:
    """The upkeep of the store's entries: ``fs`` its files, ``layout`` its paths, ``counters``.

    ``use_listeners`` are called with each key marked used (a store on object storage records
    the use there too); the local store knows nothing of them.
    """

    def __init__(self, fs: StoreFS, layout: Layout, counters: Counters) -> None:
        self.fs, self.layout, self.counters = fs, layout, counters
        self.use_listeners: list[Callable[[str], None]] = []

    def io_error(self, what: str, exc: BaseException, path: Path | None = None) -> None:
        """An I/O error while doing ``what``: warned once per kind, counted, never raised."""
        kind = errno_name(exc)
        where = f" ({path})" if path else ""
        warn_once(self.fs.root, f"io-{what}-{kind}",
                  f"compile cache: could not {what}{where}: {kind}: {exc}; going on without caching it")
        self.counters.bump(errors=1, errors_by_kind={kind: 1})

    def untrusted(self, message: str) -> None:
        """A directory or pack the trust rule refuses: a miss, warned once, counted."""
        warn_once(self.fs.root, "untrusted", f"compile cache: {message}; treated as a miss")
        self.counters.bump(untrusted=1)

    def touch_used(self, key: str) -> None:
        """Mark ``key`` used now (LRU): the ``used`` file's mtime, created with the store's mode."""
        if self.fs.read_only:
            return
        for listener in self.use_listeners:
            listener(key)
        used = self.layout.used_file(key)
        try:
            self.fs.touch(used)
        except PermissionError:
            # Another member's file without group write (an older store): replace it by ours.
            with contextlib.suppress(OSError):
                self.fs.write(used, b"", fsync=False)
        except OSError:
            pass

    def quarantine(self, path: Path, key: str) -> Path | None:
        """Move the pack at ``path`` aside (uncounted but for its bytes); where it went, or
        None (read-only store, already gone)."""
        if self.fs.read_only:
            return None
        target = self.layout.quarantine_path(key, path)
        try:
            size = self.fs.lstat(path).st_size
            self.fs.mkdirs(self.layout.quarantine_dir)
            self.fs.rename(path, target)
        except OSError:
            return None
        self.counters.bump(stored_bytes=-size)
        return target

    def corrupt(self, path: Path, key: str, exc: BaseException) -> None:
        """The pack at ``path`` failed a check (``exc``): quarantined, warned once, counted."""
        moved = self.quarantine(path, key)
        where = f"moved to {moved}" if moved else "left in place (read-only store)"
        warn_once(self.fs.root, "corrupt", f"compile cache: pack {path} is unusable ({exc}); "
                  f"treated as a miss and {where}")
        self.counters.bump(corrupt=1)

    def set_aside(self, path: Path, key: str, reason: str, counter: str) -> Path | None:
        """Quarantine a pack its user found unusable (``reason``), counted under ``counter``
        (a :class:`~.counters.Counter` name: another raises ValueError before anything moves)."""
        check_names({counter: 1})
        moved = self.quarantine(path, key)
        where = f"moved to {moved}" if moved else "left in place (read-only store or already gone)"
        warn_once(self.fs.root, f"quarantine-{counter}",
                  f"compile cache: pack {path} is unusable ({reason}); treated as a miss and {where}")
        self.counters.bump({counter: 1})
        return moved

    @staticmethod
    def entry_record(key: str, entry_info: Mapping[str, Any] | None, *,
                     made: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The ``entry.json`` record of ``key``: when, which torch, which host (now and here, or
        ``made``'s ``created``, ``torch`` and ``host``: a pack header's), plus ``entry_info``."""
        made = made or {}
        record: dict[str, Any] = {"created": made["created"] if "created" in made else time.time(),
                                  "torch": made["torch"] if "torch" in made else torch_version(),
                                  "host": made["host"] if "host" in made else HOSTNAME}
        record.update(entry_info or {})
        record.update(key=key, format=FORMAT_VERSION)
        return record

    @staticmethod
    def entry_record_of(key: str, header: Mapping[str, Any]) -> dict[str, Any] | None:
        """The ``entry.json`` record of ``key`` that a checked pack's ``header`` carries (its
        ``entry``, the publisher's ``entry_info``, with the header's time, torch and host), or
        None for a pack written without one (by an earlier version, or without ``entry_info``)."""
        entry = header.get("entry")
        return Keeper.entry_record(key, entry, made=header) if isinstance(entry, dict) else None

    def write_entry_json(self, entry: Path, data: bytes) -> int:
        """Write ``entry.json`` unless a good one exists; the bytes this added to the store."""
        path = entry / "entry.json"
        current, garbage = self.fs.read_json(path)
        if current is not None:
            return 0
        return len(data) if self.fs.write(path, data, exclusive=not garbage) and not garbage else 0
