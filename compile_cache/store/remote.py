"""A store on object storage: a local read-through tier plus the objects under a URL.

A :class:`~compile_cache.store.Store` opened on ``s3://bucket/prefix`` (or ``gs://``, ``az://``,
``memory://``) is an ordinary directory store, its *local tier* (``COMPILE_CACHE_LOCAL_TIER``,
default ``$XDG_CACHE_HOME/compile_cache/remote``, one directory per URL by its hash, bounded by the store's size
cap), with a :class:`RemoteTier` behind it, composed by :class:`~.tiered.TieredStore`. The
tier works with the local store's parts (:meth:`RemoteTier.attach`: its files, counters and pack
checks), never with the store itself:

* **load**: list the key's packs under the URL, download those the local tier lacks (streamed,
  refused above ``COMPILE_CACHE_MAX_PACK_SIZE``; a compressed object of up to 16 MiB into memory,
  expanded and checked there), check each as a load does (limits, checksum, signature, members,
  its content name) before it is put in place; then restore from local disk. Two requests in
  all for an entry of one pack: the local ``entry.json`` is written from the record its pack's
  header carries (a pack of an earlier version, without one: a third request, for the URL's).
  A pack a prefetch brought into memory is fsynced by its thread a few seconds later
  (:meth:`RemoteTier.sync`), not on the way to the first output. A pack is downloaded once per
  node. A corrupt object is counted (``corrupt``), warned about
  once, and moved to the URL's quarantine (or, read-only, skipped by this process).
* **publish**: write locally, then put each pack the URL lacks, zstd-compressed as
  ``<hash>.pack.zst`` (:mod:`.compression`; ``COMPILE_CACHE_PACK_COMPRESSION=0``: ``<hash>.pack``
  as it is). Packs are named by their content, so a put is a plain put; ``If-None-Match``
  (where the backend has it) only saves a duplicate upload, correctness never depends on it.
  A download expands a compressed pack (bounded by its frame header) before its checks; the
  local tier holds packs uncompressed, and ``.pack`` objects of earlier versions still load.
* **last use**: one empty, append-only object per use (``used/<time>-<host>-<pid>-<rand>``, at
  most one per key and process an hour): no read-modify-write.
* **stats**: every process writes its own counters object; ``stats`` sums them.
* **faults**: a request that fails its retries (:mod:`.backend`) is a miss: one warning, a
  counter (``remote_errors``), and the job goes on from what the local tier holds. Maintenance
  (``ls``, ``verify``, ``prune``...) raises :class:`~compile_cache.store.backends.RemoteError`.

The object names are :class:`~compile_cache.self.local.layout.RemoteLayout`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import io
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .. import config, publisher
from .._paths import temp_path
from ..errors import ConfigError, CorruptPackError, StoreError, UnsafeStoreError
from . import compression, maintenance
from ._io import MAX_JSON_BYTES, json_bytes, json_object, make_private_dirs, parse_json, warn_once
from .backends import RemoteError, TooLargeError, is_url, open_backend, redact
from .compression import SUFFIX
from .counters import COUNTERS, add_counts
from .layout import RemoteEntry, RemoteLayout
from .pack import (
    MAX_HEADER_BYTES,
    PREFIX_SIZE,
    PackLimitError,
    read_pack_header_from,
)
from .parts import StoreParts
from .records import EntryInfo, EvictionPlan, PackInfo

__all__ = ["RemoteTier", "local_tier_base", "local_tier_dir", "remote_location"]

logger = logging.getLogger("compile_cache")

#: A key's use is recorded at most this often per process (its LRU time, not a counter).
USE_EVERY = 3600.0
#: Counters of the local tier alone (its size and its own evictions), not the URL's.
_LOCAL_ONLY = frozenset({"stored_bytes", "size_recounts", "evictions", "evicted_bytes"})
#: Packs up to this size are put with If-None-Match from memory; larger ones are streamed.
_CONDITIONAL_PUT_MAX = 64 << 20
#: A compressed pack object up to this size is downloaded into memory and expanded straight
#: into its temp file (fewer file calls on the download's thread, each a GIL round trip while
#: the job's thread imports); a larger one goes through a temp file of its own. At most
#: 1 + PARALLEL_GETS downloads at once: 80 MiB of memory at worst (issue 15's bound is 300 MB).
_IN_MEMORY_MAX = 16 << 20
#: A compressed pack held in memory is expanded in memory, checked there and written with one
#: call when it declares at most this many bytes (a larger one streams through its temp file):
#: at most (1 + PARALLEL_GETS) x (16 + 32) MiB of memory at once, within issue 15's bound.
_EXPAND_IN_MEMORY_MAX = 32 << 20
#: A prefetch of at most this many packs leaves their fsync for later (:meth:`RemoteTier.sync`),
#: each file open until then; more are synced one by one before they are put in place.
_DEFER_SYNC_MAX = 8
#: Seconds after its result is out that a prefetch thread syncs the packs it left unsynced: the
#: start's restore and first forward write files meanwhile, and an fsync beside them (an ext4
#: journal commit) delayed them.
SYNC_DELAY_S = 3.0
#: A fetch's pack downloads at once, at most (the first on the calling thread, the others on
#: threads of their own): a fresh node's start waits for the slowest pack, not for their sum.
PARALLEL_GETS = 4
#: Seconds the background bookkeeping (a process's counters object, its use records) waits
#: before it is written: a start's dozen counter updates go out as one PUT, after the start's
#: first output rather than during it (each request takes the GIL from the job's thread).
#: Exit, SIGTERM, ``stats`` and listings in the process write what waits at once.
WRITE_DELAY_S = 3.0


_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def _tier_parts(url: str) -> tuple[str, ...]:
    """The directories of ``url``'s tier below the cache dir's ``compile_cache/remote``: the
    scheme, the bucket (a name that is not a plain one goes by its hash) and a hash of the whole
    URL, so that two URLs never share a tier and a listing shows whose tier is whose."""
    scheme, _, rest = url.rstrip("/").partition("://")
    bucket = rest.split("/", 1)[0]
    if not _SAFE_NAME.fullmatch(bucket) or ".." in bucket:
        bucket = "b-" + hashlib.sha256(bucket.encode()).hexdigest()[:16]
    scheme = scheme.lower() if _SAFE_NAME.fullmatch(scheme) else "other"
    return scheme, bucket, hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def local_tier_base(url: str) -> tuple[Path, tuple[str, ...]]:
    """(a directory of the user's, the tier's directories below it) for the store at ``url``:
    ``COMPILE_CACHE_LOCAL_TIER`` and a hash of the URL, else the XDG cache (or ``~/.cache``) and
    ``compile_cache/remote/<scheme>/<bucket>/<hash of the URL>`` (:func:`_tier_parts`)."""
    chosen = (config.LOCAL_TIER.value() or "").strip()
    if chosen:
        return Path(chosen).expanduser().absolute(), _tier_parts(url)[-1:]
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base, ("compile_cache", "remote", *_tier_parts(url))


def local_tier_dir(url: str) -> Path:
    """The local tier of the store at ``url`` (:func:`local_tier_base`): under the user's cache
    dir, never a shared temporary directory; two URLs never share a tier."""
    base, parts = local_tier_base(url)
    return base.joinpath(*parts)


def remote_location(path: str | os.PathLike[str] | None = None) -> tuple[RemoteTier | None, Any, str | None]:
    """For a store on object storage (the ``path`` argument or ``COMPILE_CACHE_DIR`` is a URL
    such as ``s3://bucket/prefix``): ``(RemoteTier, its local tier directory, source)``; for a
    directory: ``(None, path, None)``. fsspec is imported only here, and only for a URL."""
    text, source = (path, "argument") if path is not None else (config.DIR.value(), "COMPILE_CACHE_DIR")
    if not is_url(text):
        return None, path, None
    tier = RemoteTier(str(text).strip())
    return tier, tier.local_root, source


@dataclass
class _Received:
    """One pack object downloaded and checked (:meth:`RemoteTier._receive`), not yet in place:
    its temp files (``raw`` as it came, ``tmp`` expanded; the same file for an uncompressed
    pack; ``raw`` None for a compressed pack downloaded into memory, whose bytes ``data`` keeps
    only when it has a problem, for the URL's quarantine), the bytes that crossed the network,
    and what went wrong (``gone``: the object vanished; ``problem``: refused by its expansion or
    by the checks a load makes, ``keep``: left in the bucket for readers with larger limits),
    and the checked pack's header (None with a problem, or for a pack this reader skips).
    ``unsynced``: ``tmp`` written but not fsynced, still open, for :meth:`RemoteTier.sync`."""

    name: str
    obj: str
    raw: Path | None
    tmp: Path
    size: int = 0
    gone: bool = False
    problem: BaseException | None = None
    keep: bool = False
    data: bytes | None = None
    header: dict[str, Any] | None = None
    unsynced: IO[bytes] | None = None

    def discard(self, fs: Any) -> None:
        """Remove the temp files (what was renamed into place is gone from here already)."""
        for path in {self.raw, self.tmp} - {None}:
            with contextlib.suppress(FileNotFoundError):
                fs.unlink(path)

    def abandon(self, fs: Any) -> None:
        """:meth:`discard`, and close what is still open: nothing of it will be used."""
        unsynced, self.unsynced = self.unsynced, None
        if unsynced is not None:
            unsynced.close()
        self.discard(fs)


#: Tiers with writes left for later (:meth:`RemoteTier.write_pending`), and the lock that makes
#: their writes one at a time (a reader that flushes waits for the background's write).
_pending: weakref.WeakSet[RemoteTier] = weakref.WeakSet()
_write_lock = threading.Lock()
#: Guards what count and record_use leave and write_pending takes (held for no request).
_state_lock = threading.Lock()
_exit_registered = False


def _new_write_lock_in_child() -> None:
    global _write_lock, _state_lock  # a fork while another thread held one would leave it held
    _write_lock, _state_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_new_write_lock_in_child)


def _submit_all_pending() -> None:
    """Queue every tier's waiting writes on the publisher now (its exit drain then writes them)."""
    for tier in list(_pending):
        tier.submit_pending()


def write_all_pending(url: str | None = None) -> None:
    """Write the writes left for later of every tier (of ``url``), now, in this thread: what
    reads a URL's counters or use records (``stats``, listings) sees this process's own (also
    a write under way on another thread: it is waited for)."""
    with _write_lock:
        pass
    for tier in list(_pending):
        if url is None or tier.url == url:
            tier.write_pending()


class _Background:
    """``fn()`` on a daemon thread of its own; :meth:`result` waits for it, and returns or
    raises what it did (in a process forked meanwhile, which has no such thread: runs it now).
    ``then(result)``, if given, runs on the same thread ``then_after`` seconds after the result
    is out (after a success only; in a forked process at once): what the caller need not wait
    for. It may not run at all if the process ends first (a daemon thread)."""

    def __init__(self, fn: Callable[[], Any], then: Callable[[Any], None] | None = None,
                 then_after: float = 0.0) -> None:
        self._fn = fn
        self._then = then
        self._then_after = then_after
        self._pid = os.getpid()
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compile-cache-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # raised in the caller's thread, by result()
            self._error = exc
            return
        finally:
            self._done.set()
        if self._then is not None:
            time.sleep(self._then_after)
            self._then(self._result)

    def result(self) -> Any:
        if self._pid != os.getpid():
            result = self._fn()
            if self._then is not None:
                self._then(result)
            return result
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class RemoteTier:
    """The objects of a store under ``url`` (see the module docstring)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        #: The URL as shown (never with a ``user:password@`` part).
        self.display = redact(self.url)
        self.backend = open_backend(self.url)
        self.layout = RemoteLayout()
        base, parts = local_tier_base(self.url)
        self.local_root = base.joinpath(*parts)
        #: Whether this process made the local tier just now (then it is empty: its size is
        #: known, 0, without the walk a tier of unknown size gets at its first cap check).
        self.made_local = False
        try:
            group = bool(config.SHARED.value())
        except ConfigError:  # the store that opens this tier names the bad value
            group = False
        try:  # private, like every store directory, and reached without following a link
            self.made_local = make_private_dirs(base, parts, group)
        except UnsafeStoreError:
            raise
        except OSError:  # not makeable: the store finds out and says why
            pass
        self._counts: dict[str, Any] = {}
        self._stats_object = self.layout.stats_object()
        self._used: dict[str, float] = {}
        self._skip: set[tuple[str, str]] = set()  # corrupt packs this process could not set aside
        self._local: StoreParts | None = None
        self._prefetches: dict[str, _Background] = {}  # key -> the network half, under way
        self._dirty = False  # counts not written yet (count)
        self._uses: list[tuple[str, str]] = []  # use objects not written yet (record_use)
        self._timer_pid: int | None = None  # the process whose timer will write them (_later)

    def attach(self, local: StoreParts) -> None:
        """Work with the local tier ``local`` (its files, counters and pack checks): done once,
        by the tiered store that composes the two."""
        self._local = local

    @property
    def local(self) -> StoreParts:
        """The local tier's parts (see :meth:`attach`)."""
        if self._local is None:
            raise StoreError(f"{self!r} is not attached to a local tier")
        return self._local

    def __repr__(self) -> str:
        return f"RemoteTier({self.display!r})"

    def _fault(self, what: str, exc: BaseException) -> None:
        """A fault is a miss: one warning per store and process, and a counter."""
        warn_once(self.local.root, "remote-fault", f"compile cache {self.display}: {what} failed ({exc}); "
                  "treated as a miss, the job goes on without the object store")
        self.local.counters.bump(remote_errors=1)

    def _entry(self, key: str) -> RemoteEntry | None:
        """The packs of ``key`` (one listing of its ``packs/``: not of its use records, of which
        a busy entry gathers thousands; ``entry_json`` and ``uses`` stay unknown here)."""
        listing = self.backend.list(f"{self.layout.entry_dir(key)}/packs")
        return self.layout.entries(listing).get(key)

    # -- what a job does ---------------------------------------------------------------------
    def prefetch(self, key: str) -> bool:
        """Start bringing ``key``'s packs over in the background: the listing, the downloads,
        their expansion into temp files and the checks a load makes run on a thread of their own
        while the caller goes on (a start imports torch's code cache meanwhile); the next
        :meth:`fetch` of ``key`` waits for them, then puts each pack that passed in place (or
        counts and sets it aside), in the caller's thread. True if
        started: only with a backend whose requests may run on other threads
        (:attr:`~.backends.base.RetryingBackend.parallel`). Every module the thread uses is
        imported here, first: a thread that imports can deadlock with the user's own imports."""
        if not getattr(self.backend, "parallel", False) or key in self._prefetches:
            return False
        self.backend.preload()
        compression.zstd()
        self._prefetches[key] = _Background(functools.partial(self._gather, key, defer_sync=True),
                                            then=self.sync, then_after=SYNC_DELAY_S)
        return True

    def fetch(self, key: str, *, strict: bool = False) -> int:
        """Download the packs of ``key`` the local tier lacks, each checked before it is put in
        place; returns the bytes downloaded. A fault is a miss (``strict``: raises).

        The network half (:meth:`_gather`: one listing, then the packs side by side, each
        checked as it arrives; ``entry.json`` from their headers) is the one :meth:`prefetch`
        started, if it did; each pack is put in place (or counted and set aside) here, in the
        calling thread, and vouched for (:meth:`~.checker.PackChecker.vouch`): the load that
        follows does not read it whole again. The packs a prefetch expanded in memory are
        fsynced later, by its thread (:meth:`sync`)."""
        moved = stored = downloaded = 0
        started = self._prefetches.pop(key, None)
        try:
            gathered = started.result() if started is not None else self._gather(key)
            if gathered is None:
                return 0
            results, local_json, entry_json = gathered
            for got in results:
                size = self._settle(key, got)
                if size:
                    moved += size
                    placed = self.local.fs.lstat(self.local.layout.pack_path(key, got.name))
                    stored += placed.st_size
                    downloaded += 1
                    if got.header is not None:  # checked whole here, from the bytes written
                        self.local.checker.vouch(placed)
            if (entry_json is not None and json_object(entry_json)[0] is not None
                    and self.local.fs.write(local_json, entry_json, exclusive=True, fsync=False)):
                stored += len(entry_json)  # the local tier's size counts it, as a publish's does
        except RemoteError as exc:
            if strict:
                raise
            self._fault(f"restoring {key[:12]}", exc)
            return 0
        except OSError as exc:  # the local tier: full, read-only
            self.local.keeper.io_error("download", exc, self.local.layout.packs_dir(key))
            return 0
        finally:
            if downloaded or stored:  # also what was put in place before a fault
                # bytes_downloaded: what crossed the network (compressed); stored_bytes: the local tier's.
                # Written with the next update or at exit: not on the way to the first output.
                self.local.counters.bump_later(remote_downloads=downloaded, bytes_downloaded=moved,
                                               stored_bytes=stored)
        return moved

    def _gather(self, key: str, *, defer_sync: bool = False) -> tuple[list[Any], Path, bytes | None] | None:
        """The network half of :meth:`fetch` (safe on another thread: it imports, counts and
        warns nothing): list ``key``'s packs and bring those the local tier lacks into temp
        files (:meth:`_receive`); (the results, where entry.json goes, its bytes or None), or
        None when nothing is missing. ``entry.json`` comes from the first pack whose header
        carries its record (:meth:`~.keeper.Keeper.entry_record_of`: no request), else, if the
        local tier lacks it, from the URL (packs published before headers carried it). Raises
        RemoteError or OSError, its temp files removed."""
        entry = self._entry(key)
        if entry is None:
            return None
        present = {p.stem for p in self.local.layout.pack_paths(key)}
        missing = [n for n in entry.packs if n not in present and (key, n) not in self._skip]
        if not missing:
            return None
        self.local.fs.mkdirs(self.local.layout.packs_dir(key))
        local_json = self.local.layout.entry_json(key)
        # The largest first: it takes longest, and goes on the connection the listing opened.
        missing.sort(key=lambda n: -entry.packs[n])
        defer_sync = defer_sync and len(missing) <= _DEFER_SYNC_MAX
        results = self._transfer([
            functools.partial(self._receive, key, n, self.layout.pack_object_of(entry, n), entry.packs[n],
                              defer_sync=defer_sync)
            for n in missing])
        records = (self.local.keeper.entry_record_of(key, got.header) for got in results
                   if got.header is not None)
        record = next((r for r in records if r is not None), None)
        if record is not None:
            return results, local_json, json_bytes(record)
        try:
            if self.local.fs.exists(local_json):
                return results, local_json, None
            return results, local_json, self.backend.get(self.layout.entry_json(key), MAX_JSON_BYTES)
        except BaseException:
            self._discard(results)
            raise

    def _transfer(self, jobs: list[Callable[[], Any]]) -> list[Any]:
        """Each job's result, in order. The first job runs in this thread; with a backend that
        allows it (:attr:`~.backends.base.RetryingBackend.parallel`), the others run meanwhile
        on at most :data:`PARALLEL_GETS` threads of their own (the start waits for the slowest
        pack, not for their sum; network I/O and decompression only: they import nothing, see
        :meth:`prefetch`). When a job raises, the jobs not started are cancelled, the
        others waited for and their temp files removed, and it is raised."""
        if len(jobs) < 2 or not getattr(self.backend, "parallel", False):
            results: list[Any] = []
            try:
                for job in jobs:
                    results.append(job())
            except BaseException:
                self._discard(results)
                raise
            return results
        compression.zstd()  # its import, here: never in a worker
        pool = ThreadPoolExecutor(max_workers=min(PARALLEL_GETS, len(jobs) - 1),
                                  thread_name_prefix="compile-cache-get")
        futures = [pool.submit(job) for job in jobs[1:]]
        first: list[Any] = []
        try:
            first.append(jobs[0]())
            pool.shutdown(wait=True)
            return first + [future.result() for future in futures]
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            self._discard(first + [f.result() for f in futures
                                   if not f.cancelled() and f.exception() is None])
            raise

    def _discard(self, results: list[Any]) -> None:
        for got in results:
            if isinstance(got, _Received):
                got.abandon(self.local.fs)

    def sync(self, gathered: tuple[list[Any], Path, bytes | None] | None) -> None:
        """fsync and close the files of a :meth:`_gather` that :meth:`_expand_in_memory` wrote
        without (in place by now, or removed: the descriptor is the file's). The durability of a
        cache copy, not its correctness: a pack that a crash leaves short fails the next load's
        checks (counted as corrupt, set aside) and is downloaded again. On the prefetch thread,
        :data:`SYNC_DELAY_S` after its result: a start neither waits for the disk (an fsync of
        ``bench_remote``'s 1.7 MB pack took 1-11 ms here) nor writes its files beside one."""
        for got in gathered[0] if gathered else ():
            unsynced, got.unsynced = got.unsynced, None
            if unsynced is None:
                continue
            try:
                os.fsync(unsynced.fileno())
            except OSError as exc:
                logger.warning("compile cache %s: pack %s not synced to disk: %s", self.display, got.name, exc)
            finally:
                with contextlib.suppress(OSError):
                    unsynced.close()

    def _download(self, key: str, name: str, obj: str, listed: int | None = None) -> int:
        """One pack object ``obj`` into the local tier (temp file, expanded if compressed,
        checked, fsync, rename); the bytes moved, or 0. The local tier holds packs uncompressed:
        loads read members in place."""
        return self._settle(key, self._receive(key, name, obj, listed))

    def _receive(self, key: str, name: str, obj: str, listed: int | None = None, *,
                 defer_sync: bool = False) -> _Received:
        """The network half of :meth:`_download` (safe in a worker thread: it imports nothing
        and counts nothing): ``obj`` into a temp file beside its target, given the checks a load
        makes (limits, checksum, signature, members, content name: reads and hashing, done here
        rather than on the job's thread). A compressed object ``listed`` at most
        :data:`_IN_MEMORY_MAX` bytes comes into memory (bounded by that) and is expanded,
        checked and written there (:meth:`_expand_in_memory`); a larger one, or an uncompressed
        one, goes through temp files. A problem is returned, not raised, for :meth:`_settle`;
        RemoteError and OSError are raised, the temp files removed."""
        target = self.local.layout.pack_path(key, name)
        tmp = temp_path(target)
        compressed = obj.endswith(SUFFIX)
        in_memory = compressed and listed is not None and 0 <= listed <= _IN_MEMORY_MAX
        raw = None if in_memory else temp_path(target) if compressed else tmp
        got = _Received(name, obj, raw, tmp)
        limit = self.local.checker.limits.max_pack_size
        try:
            if in_memory:
                buffer = io.BytesIO()
                if not self._fetch_into(got, buffer, min(limit, _IN_MEMORY_MAX)):
                    return got
                self._expand_in_memory(got, buffer.getvalue(), key, limit, defer_sync)
            else:
                assert raw is not None
                with self.local.fs.create(raw) as out:  # in the entry, reached through no link
                    if not self._fetch_into(got, out, limit):
                        return got
                    out.flush()
                    if raw == tmp:
                        os.fsync(out.fileno())
                if raw != tmp:
                    got.problem = self._expand(raw, tmp, limit)
                self._check_file(got, key)
            # Over this reader's limits is not broken for every reader: left in place.
            got.keep = isinstance(got.problem, PackLimitError)
        except BaseException:
            got.abandon(self.local.fs)
            raise
        return got

    def _expand_in_memory(self, got: _Received, data: bytes, key: str, limit: int,
                          defer_sync: bool = False) -> None:
        """A compressed pack object downloaded into memory (``data``): expanded in one call
        (bounded: :func:`.compression.expand`), checked in memory, then written into
        ``got.tmp`` with one write and fsynced, or (``defer_sync``) left open for :meth:`sync`.
        Each system call on this thread hands the GIL to the job's thread, which may keep it
        for a switch interval (5 ms) before this thread goes on: a pack checked from a file (two
        dozen reads) took 12-31 ms there for 6 ms of work. A pack that expands past
        :data:`_EXPAND_IN_MEMORY_MAX` streams through the file (fsynced before it is in place)."""
        try:
            expanded = compression.expand(data, limit, _EXPAND_IN_MEMORY_MAX)
        except CorruptPackError as exc:
            got.problem, got.data = exc, data
            return
        if expanded is None:
            got.problem = self._expand_from(io.BytesIO(data).read, got.tmp, limit)
            self._check_file(got, key)
        else:
            got.problem, got.header = self.local.checker.check_data(expanded, key, got.name)
            if got.problem is None:
                out = got.unsynced = self.local.fs.create(got.tmp)  # closed by abandon() on a raise
                out.write(expanded)
                out.flush()
                if not defer_sync:
                    os.fsync(out.fileno())
                    got.unsynced = None
                    out.close()
        if got.problem is not None:
            got.data = data  # for the URL's quarantine

    def _check_file(self, got: _Received, key: str) -> None:
        """The checks a load makes of the pack expanded into ``got.tmp`` (unless it already has
        a problem), and its header when it passes."""
        if got.problem is not None:
            return
        got.problem, got.header = self.local.checker.inspect_file(self.local.fs, got.tmp, key, got.name)

    def _fetch_into(self, got: _Received, out: Any, limit: int) -> bool:
        """Download ``got.obj`` into ``out`` (at most ``limit`` bytes); False when there is
        nothing to expand (``got`` says why: gone, or too large)."""
        try:
            got.size = self.backend.download(got.obj, out, limit)
        except FileNotFoundError:
            got.gone = True  # evicted meanwhile: a miss for this pack
            return False
        except TooLargeError as exc:
            got.problem, got.keep = exc, True
            return False
        return True

    def _settle(self, key: str, got: _Received) -> int:
        """The local half of :meth:`_download`, in the caller's thread: the rename into place of
        a pack that passed its checks (or the pack counted and set aside); the bytes moved, or 0."""
        try:
            if got.gone:
                return 0
            if got.problem is not None:
                local = None if isinstance(got.problem, TooLargeError) else \
                    got.data if got.raw is None else got.raw
                self._corrupt(key, got.name, got.problem, local, got.obj, keep=got.keep)
                return 0
            self.local.fs.rename(got.tmp, self.local.layout.pack_path(key, got.name))
            return got.size
        finally:
            got.discard(self.local.fs)

    def _expand(self, raw: Path, tmp: Path, limit: int) -> CorruptPackError | None:
        """Expand the compressed pack ``raw`` into ``tmp`` (bounded: :func:`.compression.decompress`);
        None, or why it cannot be."""
        with self.local.fs.open_read(raw) as src:
            return self._expand_from(src.read, tmp, limit)

    def _expand_from(self, read: Callable[[int], bytes], tmp: Path, limit: int) -> CorruptPackError | None:
        """Expand the compressed pack read through ``read(n)`` into ``tmp`` (bounded by its
        frame header and ``limit``: :func:`.compression.decompress`), fsynced; None, or why it
        cannot be."""
        try:
            with self.local.fs.create(tmp) as out:
                compression.decompress(read, out, limit)
                out.flush()
                os.fsync(out.fileno())
        except CorruptPackError as exc:
            return exc
        return None

    def _corrupt(self, key: str, name: str, exc: BaseException, local: Path | bytes | None,
                 obj: str, *, keep: bool = False) -> None:
        """A pack object that fails its checks: counted, warned once, moved to the URL's
        quarantine (kept there a week for inspection), or (``keep``, read-only) skipped by this
        process."""
        where = "skipped"
        if not self.local.fs.read_only and not keep and local is not None:
            try:
                if isinstance(local, bytes):  # downloaded into memory
                    self.backend.put(self.layout.quarantine_object(key, name), local)
                else:
                    self.backend.put_file(self.layout.quarantine_object(key, name), str(local))
                self.backend.delete([obj])
                where = "moved to the store's quarantine"
            except RemoteError as err:
                logger.debug("could not set %s aside: %s", name, err)
        if where == "skipped":
            self._skip.add((key, name))
        warn_once(self.local.root, "remote-corrupt", f"compile cache {self.display}: pack {name} of "
                  f"{key[:12]} is unusable ({exc}); treated as a miss and {where}")
        self.local.counters.bump(corrupt=1)

    def push(self, key: str, *, strict: bool = False) -> int:
        """Put the local packs of ``key`` the URL lacks (and its entry.json); returns how many
        were written. A fault is a miss: the packs stay local and go out with the next publish."""
        if self.local.fs.read_only:
            return 0
        written = nbytes = 0
        try:
            entry = self._entry(key) or RemoteEntry(key)
            local_json = self.local.layout.entry_json(key)
            if self.local.fs.exists(local_json):  # a conditional put: kept if it is there
                self.backend.put_if_absent(self.layout.entry_json(key),
                                           self.local.fs.read(local_json, MAX_JSON_BYTES))
            for path in self.local.layout.pack_paths(key):
                if path.stem in entry.packs:  # in either form
                    continue
                size = self._put_pack(key, path)
                if size is None:
                    continue  # another node put the same content first
                written += 1
                nbytes += size
        except RemoteError as exc:
            if strict:
                raise
            self._fault(f"publishing {key[:12]}", exc)
        except (OSError, CorruptPackError) as exc:
            self.local.keeper.io_error("upload", exc, self.local.layout.packs_dir(key))
        if written:
            self.local.counters.bump(remote_uploads=written, bytes_uploaded=nbytes)
        return written

    def _put_pack(self, key: str, path: Path) -> int | None:
        """Put the local pack at ``path``, compressed (``COMPILE_CACHE_PACK_COMPRESSION``) as
        ``<hash>.pack.zst``, or as it is at level 0; the bytes sent, None if another node had
        put it first."""
        lvl = compression.level()
        name = self.layout.pack_object(key, path.stem, compressed=lvl > 0)
        with self.local.fs.open_read(path) as fh:  # no link, no FIFO: a regular file of ours
            size = os.fstat(fh.fileno()).st_size
            if size <= _CONDITIONAL_PUT_MAX:
                data = fh.read(size)
                if lvl:
                    data = compression.compress(data, lvl)
                return len(data) if self.backend.put_if_absent(name, data) else None
            if not lvl:
                self.backend.put_file(name, str(path))
                return size
            self.local.fs.mkdirs(self.local.layout.tmp_dir)
            tmp = temp_path(self.local.layout.tmp_dir / f"push-{path.stem}.pack.zst")
            try:
                with self.local.fs.create(tmp) as out:
                    sent = compression.compress_file(fh, size, out, lvl)
                self.backend.put_file(name, str(tmp))
                return sent
            finally:
                with contextlib.suppress(FileNotFoundError):
                    self.local.fs.unlink(tmp)

    def record_use(self, key: str) -> None:
        """Append one use object for ``key`` (at most one per process and hour); with a
        :attr:`~.backends.base.RetryingBackend.parallel` client, written in the background
        (:meth:`write_pending`): a start waits for no bookkeeping request."""
        now = time.monotonic()
        if self.local.fs.read_only or now - self._used.get(key, -USE_EVERY) < USE_EVERY:
            return
        self._used[key] = now
        name = self.layout.use_object(key)  # named now: its time is the use's
        if getattr(self.backend, "parallel", False):
            with _state_lock:
                self._uses.append((key, name))
                _pending.add(self)
            self._later()
            return
        try:
            self.backend.put(name, b"")
        except RemoteError as exc:
            self._fault(f"recording the use of {key[:12]}", exc)

    def count(self, delta: dict[str, Any]) -> None:
        """Add ``delta`` to this process's counters object (its own: no other process writes it);
        with a :attr:`~.backends.base.RetryingBackend.parallel` client, written in the
        background (:meth:`write_pending`), else now."""
        delta = {k: v for k, v in delta.items() if k not in _LOCAL_ONLY}
        if not delta:
            return  # the local tier's own (its size): nothing to write
        with _state_lock:
            add_counts(self._counts, delta)
        if self.local.fs.read_only:
            return
        if getattr(self.backend, "parallel", False):
            with _state_lock:
                self._dirty = True
                _pending.add(self)
            self._later()
            return
        try:
            self.backend.put(self._stats_object, json_bytes(self._counts))
        except RemoteError as exc:  # kept in memory; the next update writes the totals again
            logger.debug("compile cache %s: counters not written: %s", self.display, exc)

    def _later(self) -> None:
        """Have :meth:`write_pending` run on the background publisher :data:`WRITE_DELAY_S`
        from now (once, however many writes wait meanwhile; at interpreter exit or SIGTERM the
        writes waiting go out at once, and a listing or ``stats`` writes them first)."""
        global _exit_registered
        queue = publisher.get()
        if not _exit_registered:  # after the publisher's own: runs before it at exit
            _exit_registered = True
            atexit.register(write_all_pending)
        queue.at_exit(_submit_all_pending)  # SIGTERM: the publisher's drain runs, not atexit
        with _state_lock:
            if self._timer_pid == os.getpid():
                return  # a write is due already: it takes these too
            self._timer_pid = os.getpid()
        timer = threading.Timer(WRITE_DELAY_S, self.submit_pending)
        timer.name, timer.daemon = "compile-cache-writes", True
        timer.start()

    def submit_pending(self) -> None:
        """Queue :meth:`write_pending` on the background publisher (the delay is over)."""
        with _state_lock:
            self._timer_pid = None
        publisher.get().submit(self.write_pending, key=("compile_cache-remote-writes", id(self)))

    def write_pending(self) -> None:
        """Write what :meth:`count` and :meth:`record_use` left for later: this process's
        counters object (the totals so far) and the use objects. Any thread; one at a time. A
        counters write that fails is kept for the next; a use record that fails is counted
        (``remote_errors``) and logged, not warned: it may end after its job's call returned,
        and the job's own requests warn of a store that is down."""
        failed = 0
        with _write_lock:
            with _state_lock:
                dirty, self._dirty = self._dirty, False
                uses, self._uses = self._uses, []
                _pending.discard(self)
                counts = json_bytes(self._counts) if dirty else b""
            if dirty:
                try:
                    self.backend.put(self._stats_object, counts)
                except RemoteError as exc:
                    with _state_lock:
                        self._dirty = True  # the next update writes the totals again
                    logger.debug("compile cache %s: counters not written: %s", self.display, exc)
            for key, name in uses:
                try:
                    self.backend.put(name, b"")
                except RemoteError as exc:
                    failed += 1
                    logger.debug("compile cache %s: the use of %s not recorded: %s", self.display, key[:12], exc)
        if failed:
            self.local.counters.bump(remote_errors=failed)

    # -- what maintenance does (faults raise) ----------------------------------------------------
    def listing(self) -> dict[str, RemoteEntry]:
        """Every entry under the URL, by key (one listing)."""
        write_all_pending(self.url)  # this process's use records, there first
        return self.layout.entries(self.backend.list(self.layout.entries_dir))

    def has(self, key: str) -> bool:
        try:
            entry = self._entry(key)
        except RemoteError as exc:
            self._fault(f"listing {key[:12]}", exc)
            return bool(self.local.layout.pack_paths(key))
        return bool(entry and entry.packs)

    def entry_info(self, entry: RemoteEntry) -> EntryInfo:
        """An entry as ``ls`` shows it: entry.json and every pack header (ranged reads; the local
        tier's copy when it has one). ``path``s are where the entry lives in the local tier."""
        key = entry.key
        metadata: dict[str, Any] = {}
        if entry.entry_json is not None:
            data = self.backend.get(self.layout.entry_json(key), MAX_JSON_BYTES)
            if data is not None and json_object(data)[0] is not None:
                metadata = parse_json(data)
        packs = []
        for name, size in entry.packs.items():
            local = self.local.layout.pack_path(key, name)
            try:
                if self.local.fs.exists(local):
                    with self.local.fs.open_read(local) as fh:
                        header, signed, _ = read_pack_header_from(fh)
                else:
                    header, signed = self._remote_header(self.layout.pack_object_of(entry, name))
                packs.append(PackInfo.from_header(key, name, local, size, header, signed))
            except (OSError, CorruptPackError, TypeError, ValueError, AttributeError):
                continue  # a broken header: skipped here (a load counts it)
        created = metadata.get("created")
        created = (float(created) if isinstance(created, (int, float)) else 0.0) or min(
            [p.created for p in packs] or [entry.newest])
        return EntryInfo(key=key, metadata=metadata, packs=tuple(packs), size=entry.size,
                         created=created, last_used=entry.last_used, path=self.local.layout.entry_dir(key))

    def _remote_header(self, obj: str) -> tuple[dict[str, Any], bool]:
        """A pack object's header from its first bytes (a second, longer read if it is long;
        a compressed one's first bytes expanded as far as the header needs)."""
        for n in (1 << 16, MAX_HEADER_BYTES + 64):
            try:
                data = self.backend.head(obj, n)
                if compression.is_compressed(data):
                    data = compression.decompress_head(data, MAX_HEADER_BYTES + PREFIX_SIZE + 4)
                header, signed, _ = read_pack_header_from(io.BytesIO(data))
                return header, signed
            except CorruptPackError:
                if n > 1 << 16:
                    raise
        raise CorruptPackError("unreadable pack header")  # not reached

    def entries(self) -> list[EntryInfo]:
        return [self.entry_info(e) for e in self.listing().values()]

    def totals(self) -> dict[str, Any]:
        """Every process's counters object summed (this process's from memory)."""
        write_all_pending(self.url)
        totals: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        totals["errors_by_kind"] = {}
        for full in self.backend.list(self.layout.stats_dir):
            if full == self._stats_object or not full.endswith(".json"):
                continue
            data = self.backend.get(full, MAX_JSON_BYTES)
            if data is not None and json_object(data)[0] is not None:
                add_counts(totals, parse_json(data))
            elif data is not None:
                add_counts(totals, {"errors": 1, "errors_by_kind": {"stats_file": 1}})
        return add_counts(totals, self._counts)

    def summary(self, local: dict[str, Any]) -> dict[str, Any]:
        """``Store.stats`` of a remote store: the URL's counters and footprint, with the local
        tier's size (``local``: the local tier's own summary)."""
        from .._sizes import format_size

        totals = self.totals()
        entries = self.listing()
        size = sum(e.size for e in entries.values())
        lookups = totals["hits"] + totals["partial_hits"] + totals["misses"]
        quarantined = len(self.backend.list(self.layout.quarantine_dir))
        totals.update(
            hit_rate=(totals["hits"] / lookups) if lookups else None, entries=len(entries),
            packs=sum(len(e.packs) for e in entries.values()), size=size, size_human=format_size(size),
            quarantined=quarantined, location=self.display,
            local_tier=local["location"], local_tier_size=local["size"],
            local_tier_size_human=local["size_human"], stored_bytes=local["stored_bytes"],
        )
        for name in ("max_size", "max_size_human", "location_source", "read_only", "read_only_reason"):
            totals[name] = local[name]
        totals["lock_mode"] = "none (object storage: packs are content-named puts)"
        return totals

    def zero(self) -> None:
        write_all_pending(self.url)
        self._counts = {}
        self.backend.delete(list(self.backend.list(self.layout.stats_dir)))

    def objects(self, key: str) -> list[str]:
        """Every object of the entry ``key`` (its packs, entry.json and use records)."""
        write_all_pending(self.url)
        return list(self.backend.list(self.layout.entry_dir(key)))

    def plan_eviction(self, max_size: int | None, older_than: float | None,
                      keys: set[str] | None) -> EvictionPlan:
        """``Store.plan_eviction`` on the URL: the entries chosen from one listing; executing it
        removes them (and the same keys from the local tier), then compacts each kept entry's
        use objects to its newest (deletes only: no read-modify-write)."""
        entries = self.listing()
        usage = sorted(entries.values(), key=lambda e: (e.last_used, e.key))
        chosen: dict[str, int] = {}
        if keys:
            chosen.update((e.key, e.size) for e in usage if e.key in keys)
        if older_than is not None:
            cutoff = time.time() - older_than
            chosen.update((e.key, e.size) for e in usage if e.last_used < cutoff)
        if max_size is not None:
            total = sum(e.size for e in usage if e.key not in chosen)
            for e in usage:
                if total <= max_size:
                    break
                if e.key not in chosen:
                    chosen[e.key] = e.size
                    total -= e.size
        planned = tuple(sorted((self.entry_info(entries[k]) for k in chosen),
                               key=lambda e: (e.last_used, e.key)))
        return EvictionPlan(entries=planned, run=functools.partial(self._evict, entries))

    def _evict(self, listing: dict[str, RemoteEntry], removed: tuple[EntryInfo, ...]) -> list[EntryInfo]:
        self.local.fs.require_writable("evict")
        chosen = {e.key for e in removed}
        for info in removed:
            self.backend.delete(self.objects(info.key))
            if self.local.fs.is_dir(info.path):
                maintenance.remove_entry_dir(self.local, info.path)
        for entry in listing.values():
            if entry.key not in chosen and len(entry.uses) > 1:
                use_dir = self.layout.use_dir(entry.key)
                self.backend.delete(f"{use_dir}/{n}" for n in entry.uses[:-1])
        self.prune_quarantine(maintenance.QUARANTINE_KEEP)
        if removed:
            freed = sum(e.size for e in removed)
            add_counts(self._counts, {"evictions": len(removed), "evicted_bytes": freed})
            self.count({})
        maintenance.recount_size(self.local)
        return list(removed)

    def prune_quarantine(self, keep: float) -> None:
        """Delete the URL's quarantined packs older than ``keep`` seconds."""
        cutoff = time.time() - keep
        old = [n for n, info in self.backend.list(self.layout.quarantine_dir).items() if info.mtime < cutoff]
        self.backend.delete(old)

    def clear(self) -> int:
        """Remove every entry under the URL, its quarantine, and the local tier's entries."""
        entries = self.listing()
        for key in entries:
            self.backend.delete(self.objects(key))
        self.prune_quarantine(-1.0)
        maintenance.clear(self.local)
        return len(entries)
