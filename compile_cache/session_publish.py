"""How a :class:`~compile_cache.session.CacheSession` publishes: what its region groups used
(capture by use, on the background :mod:`~compile_cache.publisher`), or, where torch lacks a
hook, the files the local dirs gained (the directory diff). A pack carries only what the store
lacks, by content, with the manifest of the whole usage (:mod:`compile_cache.store.generations`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from . import artifacts, capture, publisher
from ._sizes import format_size
from .precompiled import PrecompileTracker
from .report import CacheReport
from .store import Store, generations
from .torch_compat import cache_use, dynamic_shapes

logger = logging.getLogger("compile_cache")

__all__ = ["SessionPublisher"]


class SessionPublisher:
    """What one :class:`~compile_cache.session.CacheSession` publishes, and when; the session
    holds one (``session.publishing``) and tells it what happened: restored files
    (:attr:`known`), capture by use (:attr:`by_use`), forward seconds, the tags of
    :meth:`~compile_cache.session.CacheSession.tagged`.

    ``lock`` is the session's (it guards the report); ``on_error(kind, message)`` warns and
    counts a failed step (:meth:`~compile_cache.session.CacheSession.record_failure`).
    """

    def __init__(
        self, store: Store, key: str, report: CacheReport, *, owners: tuple[str, ...], precompile: bool,
        precompiled: PrecompileTracker, entry_info: dict[str, Any], lock: Any,
        on_error: Callable[[str, str], None],
    ) -> None:
        self.store = store
        self.key = key
        self.report = report
        self.owners = owners
        self.precompile = precompile
        self.precompiled = precompiled
        self.entry_info = entry_info
        #: Capture by use (else the directory diff): set by the session's start_capture.
        self.by_use = False
        #: Restored files and digests (name -> (real path, size, mtime, digest)).
        self.known: dict[str, tuple[str, int, int, str]] = {}
        #: Header metadata of the packs published now (CacheSession.tagged()).
        self.tags: dict[str, Any] = {}
        #: Publish torch's key details of the FX graphs used (:func:`graph_metadata`; the
        #: process store, whose ``explain`` names the field a missed graph differs in).
        self.graph_fields = False
        #: The automatic-dynamic decisions the store is known to hold (restored, or published by
        #: this process): a record that gains none does not make a pack on its own.
        self.dynamic_base: set[tuple[str, str, str, int]] = set()
        #: The model's source files (scope the record's resume functions; None: all of them).
        self.source_files: frozenset[str] | None = None
        self._lock = lock
        self._on_error = on_error
        self._publish_lock = threading.Lock()
        self._published_generation: int | None = None
        self._pending_seconds = 0.0  # forward seconds since the last publish (the diff fallback)
        self._published_seconds = 0.0  # the owners' compile seconds already published
        #: With precompile: group -> the members of its saved Dynamo entry (every pack's usage)
        self._extra: dict[str, dict[str, bytes]] = {}
        self._extra_paths: dict[str, str] = {}  # group -> its entry file, read when publishing
        self._extra_read: dict[str, tuple[int, int]] = {}  # entry file -> (size, mtime) read

    def add_forward_seconds(self, seconds: float) -> None:
        """A forward took ``seconds`` (the diff fallback's compile time; under the session's lock)."""
        self._pending_seconds += seconds

    def submit(self) -> None:
        """Queues a publish of what the model used on the background publisher."""
        if self.by_use and not self.store.read_only:
            publisher.get().submit(self._publish_reporting_failure, key=("publish", id(self)))

    def _publish_reporting_failure(self) -> None:
        """:meth:`_publish_by_use`, whose failure (a torch internal that moved, say) is the
        session's to report: warned, in the report's errors and counted in ``stats``, never
        only a log line on the publisher's thread."""
        try:
            self._publish_by_use()
        except Exception as exc:
            self._on_error("publish", f"{type(exc).__name__}: {exc}")

    def flush(self, timeout: float | None = None) -> bool:
        """Publishes what is not published yet and waits for it; True when done in time."""
        if self.by_use:
            self.prepare_precompile()
            self.submit()
        return publisher.get().drain(timeout)  # also the counters queued (the start's outcome)

    def prepare_precompile(self) -> bool:
        """With precompile: makes sure each group's Dynamo entry that holds something new is
        saved, and notes the entries to publish as the groups' precompile units, which every
        later pack's manifest names; True when one changed. Cheap (digests): the entries are
        saved at the end of the compiles and read by the publisher."""
        if not self.precompile:
            return False
        saved = self.precompiled.save_changed(self._on_error)
        self._extra_paths.update(saved)
        return bool(saved)

    def read_extra(self) -> None:
        """Reads the noted precompile entries (on the publisher's thread): a replaced entry keeps
        its name, and its newest bytes win. An entry file unchanged since it was read (same
        size and mtime) is not read again."""
        for group, path in dict(self._extra_paths).items():
            try:
                info = os.stat(path)
            except OSError:
                continue  # gone (pruned): what was read before stays
            stamp = (info.st_size, info.st_mtime_ns)
            if self._extra_read.get(path) == stamp and group in self._extra:
                continue
            members = artifacts.read_members([path])
            if members:
                self._extra[group] = members
                self._extra_read[path] = stamp

    def _publish_by_use(self) -> None:
        """Publishes, as one pack, every member the model's groups used that the store lacks,
        with the manifest of the whole usage (runs on the publisher's thread)."""
        with self._publish_lock:
            self.read_extra()
            found = capture.usage(self.owners, self.known, self._extra, self.source_files)
            if found.generation == self._published_generation or not found.units:
                return
            members, manifest = capture.resolve(found, self._held())
            self._published_generation = found.generation
            if not members:
                logger.info("compile_cache: the store has everything %s used", self.key[:12])
                return
            gained = set()
            if found.dynamic is not None:
                gained = dynamic_shapes.decisions(found.dynamic[1]) - self.dynamic_base
                if set(members) == {found.dynamic[0]} and not gained:
                    # Only the record's sizes changed (a value seen once more): it travels with
                    # the next pack that publishes for another reason, never alone.
                    logger.info("compile_cache: the store has every graph %s used; its "
                                "automatic-dynamic record gained no decision", self.key[:12])
                    return
            answers = artifacts.isa_probe_answers() or {}
            self._write_pack(members, {
                generations.MANIFEST_KEY: manifest,
                "isa_probe": {k: v for k, v in answers.items() if k in manifest["always"]} or None,
                **self.precompiled.metadata(),
                **(graph_metadata(cache_use.fx_lookups(self.owners)) if self.graph_fields else {}),
            })
            self.dynamic_base |= gained

    def publish_diff(self, diff: artifacts.Capture) -> None:
        """The fallback: publishes the files the local dirs gained that the store lacks."""
        try:
            members = diff.collect()
        except OSError as exc:
            self._on_error("capture", str(exc))
            return
        self.read_extra()
        for group_members in self._extra.values():
            members.update(group_members)
        held = self._held()
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in members.items()}
        members = {n: d for n, d in members.items() if not generations.holds(held, n, digests[n])}
        if not members:
            logger.info("compile_cache: what this process compiled is already in the store")
            return
        # No units: a diff cannot tell whose files these are; each is kept at its newest bytes.
        manifest = generations.make_manifest([], members, {n: digests[n] for n in members})
        self._write_pack(members, {generations.MANIFEST_KEY: manifest,
                                   "isa_probe": artifacts.isa_probe_answers(),
                                   **self.precompiled.metadata()})

    def _held(self) -> Any:
        """What the key's packs hold, by content (only packs this reader can use)."""
        entry = self.store.entry(self.key)
        return generations.held([p for p in entry.packs if self.store.usable(p)] if entry else ())

    def _write_pack(self, members: dict[str, bytes], metadata: dict[str, Any]) -> None:
        with self._lock:
            seconds, self._pending_seconds = self._pending_seconds, 0.0
            if self.by_use:  # the compiles' own wall time, from torch's compile callbacks
                compiled = cache_use.compile_seconds(self.owners)
                seconds, self._published_seconds = compiled - self._published_seconds, compiled
            metadata = {"fxgraph_misses": self.report.fxgraph_misses,
                        "precompile": self.precompile, **metadata, **self.tags}
        info = self.store.publish(self.key, members, metadata=metadata,
                                  entry_info=self.entry_info, compile_seconds=seconds,
                                  member_info=artifacts.library_sizes(members))
        if info is not None:
            with self._lock:
                self.report.published_packs += 1
                self.report.published_bytes += info.size
            logger.info("compile_cache: published %s (%s)", info.name, format_size(info.size))


def graph_metadata(lookups: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Pack metadata of the FX graphs looked up: ``fx_graphs`` (fx key -> {field: hash}) and
    ``fx_values`` (hash -> torch's printed value, shared by the graphs: most fields are equal)."""
    graphs: dict[str, dict[str, str]] = {}
    values: dict[str, str] = {}
    for key, lookup in lookups.items():
        graphs[key] = {name: digest for name, (digest, _value) in lookup["fields"].items()}
        values.update((digest, value) for digest, value in lookup["fields"].values())
    return {"fx_graphs": graphs, "fx_values": values} if graphs else {}
