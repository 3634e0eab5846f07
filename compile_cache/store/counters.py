"""The store's counters: names (:class:`Counter`), the pending counts, and the shard files.

Each process adds to one of :data:`STATS_SHARDS` shard files (chosen by host and pid), under a
short lock, read-modify-write; the totals sum the shards. A count that cannot be written now
(lock busy, read-only or vanished store, I/O error) is kept in memory and goes out with the next
one. What each counter means is in :mod:`.stats`.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import math
import os
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from .._paths import HOSTNAME, is_temp_name
from ..locks import optional_lock
from ._io import json_bytes
from .fs import StoreFS
from .layout import Layout

__all__ = ["COUNTERS", "MAX_COUNT", "STATS_SHARDS", "Counter", "Counters", "add_counts", "bad_counts",
           "shard_index"]

logger = logging.getLogger("compile_cache")

STATS_SHARDS = 8
#: Seconds a shard whose lock could not be taken is tried without waiting.
BUSY_BACKOFF = 30.0


class Counter(str, enum.Enum):
    """Every counter the store keeps (see :mod:`.stats` for their meaning)."""

    HITS = "hits"
    PARTIAL_HITS = "partial_hits"
    MISSES = "misses"
    LOCAL_HITS = "local_hits"
    ERRORS = "errors"
    CORRUPT = "corrupt"
    INCOMPATIBLE = "incompatible"
    PUBLISHES = "publishes"
    BYTES_PUBLISHED = "bytes_published"
    BYTES_RESTORED = "bytes_restored"
    SECONDS_SAVED = "seconds_saved"
    COMPILE_SECONDS = "compile_seconds"
    EVICTIONS = "evictions"
    EVICTED_BYTES = "evicted_bytes"
    BACKEND_FALLBACKS = "backend_fallbacks"
    CAPTURE_FALLBACKS = "capture_fallbacks"
    STORED_BYTES = "stored_bytes"
    SIZE_RECOUNTS = "size_recounts"
    SIGNATURE_MISMATCH = "signature_mismatch"
    LOAD_FAILURES = "load_failures"
    LOCK_FALLBACKS = "lock_fallbacks"
    UNTRUSTED = "untrusted"
    PRECOMPILE_HITS = "precompile_hits"
    PRECOMPILE_DECLINED = "precompile_declined"
    PRECOMPILE_LOAD_ERRORS = "precompile_load_errors"
    PRECOMPILE_UNPROVEN = "precompile_unproven"
    # a store on object storage (compile_cache.store.remote)
    REMOTE_ERRORS = "remote_errors"
    REMOTE_DOWNLOADS = "remote_downloads"
    BYTES_DOWNLOADED = "bytes_downloaded"
    REMOTE_UPLOADS = "remote_uploads"
    BYTES_UPLOADED = "bytes_uploaded"


#: Every counter's name, in :class:`Counter`'s order.
COUNTERS: tuple[str, ...] = tuple(c.value for c in Counter)
_NAMES = frozenset(COUNTERS)
#: The one count that is not a number but a mapping (error kind -> count).
ERRORS_BY_KIND = "errors_by_kind"
GARBAGE_SHARD = {"errors": 1, ERRORS_BY_KIND: {"stats_file": 1}}


def shard_index() -> int:
    """The shard this process writes (host and pid hashed)."""
    return zlib.crc32(f"{HOSTNAME}:{os.getpid()}".encode()) % STATS_SHARDS


#: A counter's value beyond this (an integer a float still holds exactly: 2**53, some 9 PB or
#: 285 million years of seconds) is no count of ours: a shard holding one is garbage.
MAX_COUNT = float(2**53)


def _count(value: object) -> float | int | None:
    """``value`` if it is a count: a finite number (not a bool) within :data:`MAX_COUNT`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        if not math.isfinite(value) or abs(value) > MAX_COUNT:
            return None
    except OverflowError:  # an int too large for a float
        return None
    return value


def _bounded(value: float) -> float | int:
    return max(-MAX_COUNT, min(MAX_COUNT, value)) if abs(value) > MAX_COUNT else value


def add_counts(into: dict[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
    """Adds the known counters of ``delta`` (and ``errors_by_kind``) into ``into``; what a
    file holds besides them, and any value that is no count (not finite, beyond
    :data:`MAX_COUNT`), is ignored (a record read back, not a programming error); sums stay
    within the bound."""
    for name, value in delta.items():
        if name == ERRORS_BY_KIND:
            kinds = into.setdefault(ERRORS_BY_KIND, {})
            if isinstance(value, dict):
                for kind, n in value.items():
                    if _count(n) is not None:
                        kinds[str(kind)] = _bounded(kinds.get(str(kind), 0) + n)
        elif name in _NAMES and _count(value) is not None:
            into[name] = _bounded(into.get(name, 0) + value)
    return into


def bad_counts(data: Mapping[str, Any]) -> bool:
    """Whether a shard read back holds a counter whose value is no count (NaN, infinite,
    beyond :data:`MAX_COUNT`, not a number): such a shard is garbage, counted and fixed as one."""
    for name, value in data.items():
        if name == ERRORS_BY_KIND:
            if not isinstance(value, dict) or any(_count(n) is None for n in value.values()):
                return True
        elif name in _NAMES and _count(value) is None:
            return True
    return False


def check_names(delta: Mapping[str, Any]) -> None:
    """Raise ValueError for a name in ``delta`` that is no :class:`Counter` (a misspelled
    counter would otherwise be dropped without a word)."""
    unknown = [name for name in delta if name not in _NAMES and name != ERRORS_BY_KIND]
    if unknown:
        raise ValueError(f"unknown store counter(s) {sorted(map(str, unknown))}; "
                         f"known: {', '.join(COUNTERS)}")


#: The threads of one process (the job's, the background publisher's) share a store's pending
#: counts and its stats shard: one at a time, or a count one of them adds is lost.
_bump_lock = threading.RLock()


def _new_bump_lock_in_child() -> None:
    global _bump_lock  # a fork while the publisher's thread held it would leave it held
    _bump_lock = threading.RLock()


os.register_at_fork(after_in_child=_new_bump_lock_in_child)

#: Counters with counts added by bump_later, by the process that added them: written at exit.
_unwritten: weakref.WeakKeyDictionary[Counters, int] = weakref.WeakKeyDictionary()


def _write_unwritten() -> None:
    """At exit: the counts :meth:`Counters.bump_later` left for later (this process's only: a
    forked child's copies of its parent's are its parent's to write)."""
    for counters, pid in list(_unwritten.items()):
        if pid == os.getpid():
            with contextlib.suppress(Exception):
                counters.write_pending()


atexit.register(_write_unwritten)


class Counters:
    """The counters of the store whose files are ``fs`` at ``layout``: pending counts, shards.

    ``listeners`` are called with each delta as it is added (a store on object storage writes
    its own counters object too); the local store knows nothing of them.
    """

    #: Shards whose lock could not be taken lately, by path: until when they are not waited for.
    busy_until: ClassVar[dict[str, float]] = {}

    def __init__(self, fs: StoreFS, layout: Layout) -> None:
        self.fs, self.layout = fs, layout
        #: Counts added in this process and not written yet.
        self.pending: dict[str, Any] = {}
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def bump(self, delta: Mapping[str, Any] | None = None, /, **more: Any) -> None:
        """Add ``delta`` (and ``more``) to the persisted counters; kept in memory and retried if
        the write fails. An unknown counter name raises ValueError."""
        delta = {**(delta or {}), **more}
        check_names(delta)
        with _bump_lock:
            self._add(delta)
            self._write()

    def bump_later(self, delta: Mapping[str, Any] | None = None, /, **more: Any) -> None:
        """:meth:`bump`, but the shard is written with the next bump, or at this process's exit,
        not now: a fresh node's restore counts its downloads without a locked read-modify-write
        of a shard (a lock file, a read, a write: 1.5-3 ms) on the way to its first output."""
        delta = {**(delta or {}), **more}
        check_names(delta)
        with _bump_lock:
            self._add(delta)
            _unwritten[self] = os.getpid()

    def write_pending(self) -> None:
        """Write the counts added and not written yet (:meth:`bump_later`), now."""
        with _bump_lock:
            if self.pending:
                self._write()

    def _add(self, delta: dict[str, Any]) -> None:
        add_counts(self.pending, delta)
        for listener in self.listeners:
            listener(dict(delta))

    def _write(self) -> None:
        if self.fs.read_only or not self.fs.is_dir(self.layout.base):
            return  # kept in memory: a vanished store is not re-created just for counters
        n = shard_index()
        shard = self.layout.stats_shard(n)
        busy_key = str(shard)
        # A shard lock that could not be taken lately (a dead holder, judged stale only after a
        # while) is tried without waiting: each counter update must not stall the job 2 s.
        wait = 0.0 if time.monotonic() < self.busy_until.get(busy_key, 0.0) else 2.0
        lock = self.fs.lock_at(self.layout.lock_base(f"stats-{n}"), timeout=wait)
        try:
            with optional_lock(lock) as held:
                if not held:
                    if wait:
                        self.busy_until[busy_key] = time.monotonic() + BUSY_BACKOFF
                    return  # pending deltas go out with the next update
                current, garbage = self.fs.read_json(shard)
                garbage = garbage or (current is not None and bad_counts(current))
                merged = add_counts({}, current or {})
                if garbage:
                    logger.warning("compile cache stats file %s was unreadable; counting from zero", shard)
                    add_counts(merged, GARBAGE_SHARD)
                add_counts(merged, self.pending)
                self.fs.write(shard, json_bytes(merged), fsync=False)
                self.pending = {}
        except OSError as exc:
            logger.debug("could not update stats %s: %s", shard, exc)

    def totals(self) -> dict[str, Any]:
        """Every counter summed over the shards, plus this process's counts not written yet."""
        totals: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        totals[ERRORS_BY_KIND] = {}
        stats_dir = self.layout.stats_dir
        try:
            shard_names = sorted(self.fs.listdir(stats_dir))
        except OSError:
            shard_names = []
        for name in shard_names:
            if not self.layout.is_stats_shard(name):
                continue
            data, garbage = self.fs.read_json(stats_dir / name)
            if garbage or (data is not None and bad_counts(data)):
                add_counts(totals, GARBAGE_SHARD)
                if data is not None:
                    add_counts(totals, data)  # what it holds that is a count still counts
            elif data:
                add_counts(totals, data)
        add_counts(totals, self.pending)
        return totals

    def tracked_size(self) -> tuple[int, bool]:
        """The store's size from its counters (no walk), and whether it was ever calibrated by an
        exact count (if not, the counter misses what was published before it existed)."""
        totals = self.totals()
        return max(0, int(totals["stored_bytes"])), totals["size_recounts"] > 0

    def correct_size(self, exact: int) -> None:
        """Set the size counter to ``exact`` (a walk's result): adds the difference, counts a recount."""
        current = int(self.totals()["stored_bytes"])
        self.bump(stored_bytes=int(exact) - current, size_recounts=1)
        if current != exact:
            logger.debug("compile cache %s: size counter corrected from %d to %d bytes",
                         self.fs.root, current, exact)

    def exact_when_new(self) -> None:
        """The store was made empty just now by this process: its size counter (0, no shard
        yet) is exact. Counted as a recount of 0 bytes, as a walk of the empty tree would be, but
        without the walk, and written with the next update or at exit (:meth:`bump_later`)."""
        self.bump_later({Counter.SIZE_RECOUNTS.value: 1})

    def zero(self, size: int | None = None) -> None:
        """Remove every shard (and forget the counts not written yet); with ``size``, the size
        counter starts again at that exact size (it is not a usage counter)."""
        self.pending = {}
        with contextlib.suppress(OSError):
            for name in self.fs.listdir(self.layout.stats_dir):
                if self.layout.is_stats_shard(name) or is_temp_name(name):
                    with contextlib.suppress(OSError):
                        self.fs.unlink(self.layout.stats_dir / name)
        if size is not None:
            self.correct_size(size)
