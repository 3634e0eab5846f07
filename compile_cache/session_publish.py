"""How a :class:`~compile_cache.session.CacheSession` publishes: what its region groups used
(capture by use, on the background :mod:`~compile_cache.publisher`), or, where torch lacks a
hook, the files the local dirs gained (the directory diff). A pack carries only what the store
lacks, by content, with the manifest of the whole usage (:mod:`compile_cache.store.generations`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from . import artifacts, capture, publisher
from ._sizes import format_size
from .store import generations
from .torch_compat import cache_use

logger = logging.getLogger("compile_cache")

__all__ = ["PublishingSession"]


class PublishingSession:
    """The publishing half of a session (its attributes are set by ``CacheSession.__init__``)."""

    # Set by CacheSession.__init__ / start_capture.
    store: Any
    key: str
    precompile: bool
    report: Any
    owners: tuple[str, ...]
    _by_use: bool
    _capture: artifacts.Capture | None
    _known: dict[str, tuple[str, int, int, str]]
    _extra: dict[str, dict[str, bytes]]
    _extra_paths: dict[str, str]
    _extra_read: dict[str, tuple[int, int]]
    precompiled: Any  # compile_cache.precompiled.PrecompileTracker
    _published_generation: int | None
    _pending_seconds: float
    _published_seconds: float
    _tags: dict[str, Any]
    _entry_info: dict[str, Any]
    _lock: Any
    _publish_lock: Any
    _error: Any  # CacheSession._error(kind, message): warn and count
    def submit_publish(self) -> None:
        """Queues a publish of what the model used on the background publisher."""
        if self._by_use and not self.store.read_only:
            publisher.get().submit(self._publish_by_use, key=("publish", id(self)))

    def flush(self, timeout: float | None = None) -> bool:
        """Publishes what is not published yet and waits for it; True when done in time."""
        if self._by_use:
            self._prepare_precompile()
            self.submit_publish()
        return publisher.get().drain(timeout)  # also the counters queued (the start's outcome)

    def _prepare_precompile(self) -> bool:
        """With precompile: makes sure each group's Dynamo entry that holds something new is
        saved, and notes the entries to publish as the groups' precompile units, which every
        later pack's manifest names; True when one changed. Cheap (digests): the entries are
        saved at the end of the compiles and read by the publisher."""
        if not self.precompile:
            return False
        saved = self.precompiled.save_changed(self._error)
        self._extra_paths.update(saved)
        return bool(saved)

    def _read_extra(self) -> None:
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
            self._read_extra()
            found = capture.usage(self.owners, self._known, self._extra)
            if found.generation == self._published_generation or not found.units:
                return
            members, manifest = capture.resolve(found, self._held())
            self._published_generation = found.generation
            if not members:
                logger.info("compile_cache: the store has everything %s used", self.key[:12])
                return
            answers = artifacts.isa_probe_answers() or {}
            self._write_pack(members, {
                generations.MANIFEST_KEY: manifest,
                "isa_probe": {k: v for k, v in answers.items() if k in manifest["always"]} or None,
                **self.precompiled.metadata(),
            })

    def _publish_diff(self, diff: artifacts.Capture) -> None:
        """The fallback: publishes the files the local dirs gained that the store lacks."""
        try:
            members = diff.collect()
        except OSError as exc:
            self._error("capture", str(exc))
            return
        self._read_extra()
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
            if self._by_use:  # the compiles' own wall time, from torch's compile callbacks
                compiled = cache_use.compile_seconds(self.owners)
                seconds, self._published_seconds = compiled - self._published_seconds, compiled
            metadata = {"fxgraph_misses": self.report.fxgraph_misses,
                        "precompile": self.precompile, **metadata, **self._tags}
        info = self.store.publish(self.key, members, metadata=metadata,
                                  entry_info=self._entry_info, compile_seconds=seconds,
                                  member_info=artifacts.library_sizes(members))
        if info is not None:
            with self._lock:
                self.report.published_packs += 1
                self.report.published_bytes += info.size
            logger.info("compile_cache: published %s (%s)", info.name, format_size(info.size))

