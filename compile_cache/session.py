"""A model's link to the store: restore before compiling, capture what forwards compiled, publish.

The data flows one way: model -> fingerprint -> key -> store (restore) -> torch.compile -> first
forward -> capture -> store (publish). ``compile_regions`` opens the session (:func:`open_session`)
before it compiles (Dynamo looks for precompiled entries when ``torch.compile`` wraps a function,
so restoring must come first) and has it hear of each call's end after. This module knows
neither the disk layout (``compile_cache.store``) nor torch's cache internals
(``compile_cache.artifacts``, ``compile_cache.torch_compat``).

The distributed warm-up works through the session's public methods: :attr:`CacheSession.entry_info`,
:meth:`~CacheSession.tagged` (metadata for the packs it publishes), :meth:`~CacheSession.lock`,
:meth:`~CacheSession.entry`, :meth:`~CacheSession.packs_to_send` and
:meth:`~CacheSession.publish_received`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import _warnings, artifacts, capture, config, publisher
from ._sizes import format_size
from .errors import CompileCacheError, UnsafeStoreError
from .report import CacheReport
from .store import EntryInfo, Store, generations
from .torch_compat import cache_use, dynamo, isa

logger = logging.getLogger("compile_cache")

__all__ = [
    "CacheReport",
    "CacheSession",
    "flush",
    "last_report",
    "open_session",
    "precompile_requested",
    "session_for",
]


_last_report: CacheReport | None = None
_report_lock = threading.Lock()


def last_report() -> CacheReport | None:
    """The report of the most recent ``compile_regions`` that used a store, updated as it runs."""
    return _last_report


def precompile_requested(precompile: bool | None) -> bool:
    """``precompile`` if given, else ``COMPILE_CACHE_PRECOMPILE`` (default off)."""
    if precompile is not None:
        return bool(precompile)
    return bool(config.PRECOMPILE.value())


class CacheSession:
    """One model's link to the store: restores at open, publishes what the model's regions used.

    Capture by use (:mod:`compile_cache.capture`): the end of every compile that added to the
    usage of one of the model's region groups (a forward frame, or the backward torch compiles
    lazily inside ``loss.backward()``) queues a publish on the background
    :mod:`~compile_cache.publisher`, off the training step; so does the end of a forward that
    compiled. Whatever is still unpublished at interpreter exit is published then (bounded).
    :meth:`flush` waits for it (the warm-up and the CLI use it).
    """

    def __init__(
        self, store: Store, key: str, model: nn.Module, precompile: bool, plan: Any = None
    ) -> None:
        self.store = store
        self.key = key
        self.precompile = precompile
        self.report = CacheReport(key=key, store=str(store.root), precompile=precompile)
        self._entry_info = {
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "torch": torch.__version__,
            "device": _device_of(model),
            # For `compile-cache ls`: the region groups, e.g. "GPT2Block x4".
            "regions": ", ".join(
                f"{g.class_name.rsplit('.', 1)[-1]} x{g.size}" for g in getattr(plan, "groups", ())
            ),
        }
        kwargs = getattr(plan, "compile_kwargs", None) or {}
        #: Inductor compiles bump torch's cache counters: checked to notice renamed counters.
        self._inductor = kwargs.get("backend", "inductor") == "inductor"
        #: The region groups' code names: whose usage this model's packs carry.
        self.owners: tuple[str, ...] = tuple(
            [g.code_name for g in getattr(plan, "groups", ())]
            + [p.code_name for p in getattr(plan, "compiled_rest", ())]
        )
        self._capture: artifacts.Capture | None = None  # the diff fallback (or precompile files)
        self._by_use = False
        self._known: dict[str, tuple[str, int, int, str]] = {}  # restored files and digests
        self._published_generation: int | None = None
        self._pending_seconds = 0.0  # forward seconds since the last publish (the diff fallback)
        self._published_seconds = 0.0  # the owners' compile seconds already published
        self._extra: dict[str, str] = {}  # precompile files: member -> path
        self._counters = dynamo.CompileCounters.snapshot()
        self._lock = threading.RLock()  # the report and counters (after_forward publishes a diff)
        self._publish_lock = threading.Lock()
        self._tags: dict[str, Any] = {}  # header metadata of packs published now (tagged())

    # -- before compiling -------------------------------------------------------------------
    def restore(self, *, count: bool = True) -> None:
        """Writes the key's current generation into the local Inductor/Triton dirs; counts hit
        or miss.

        Only the members of the newest unit per (region group, slot), for the model's region
        groups, plus what every pack carries (:mod:`compile_cache.store.generations`); a pack
        without a manifest is applied whole. Called at open, and again by the distributed flow
        once another rank has published (then ``count=False`` adds to the report and counts only
        a hit, since the miss was counted). Idempotent: files already there are left alone.
        """
        start = time.perf_counter()
        before = self.report.restored_packs
        packs = self.store.load(self.key)
        selection = generations.select([p.info for p in packs], self.owners or None)
        if not count:
            self.report.restored_packs = self.report.restored_files = 0
            self.report.restored_bytes = 0
        for pack in packs:
            subset = {name: pack.members[name] for name, src in selection.sources.items()
                      if src == pack.info.name and name in pack.members}
            if not subset:
                continue
            try:
                result = artifacts.restore(subset)
            except (CompileCacheError, OSError) as exc:
                self._error("restore", f"pack {pack.info.name}: {exc}")
                continue
            self.report.restored_packs += 1
            self.report.restored_files += len(result.written) + len(result.present)
            self.report.restored_bytes += sum(len(data) for data in subset.values())
            for name, (real, size, mtime) in result.files.items():
                digest = selection.wanted.get(name) or hashlib.sha256(subset[name]).hexdigest()
                self._known[name] = (real, size, mtime, digest)
        if selection.superseded_units:
            logger.info("compile_cache: %d superseded unit(s) of %s not restored",
                        selection.superseded_units, self.key[:12])
        self.report.restore_seconds += time.perf_counter() - start
        answers: dict[str, bool] = {}
        for pack in packs:
            published = pack.info.metadata.get("isa_probe")
            if isinstance(published, dict):
                answers.update((k, v) for k, v in published.items() if isinstance(v, bool))
        if self.report.restored_packs and answers:
            artifacts.trust_restored_isa_answers(answers)
        if count and self.report.restored_packs:
            self.store.record_hit(self.key, nbytes=self.report.restored_bytes)
        elif count:
            self.store.record_miss(self.key)
        elif self.report.restored_packs > before:
            self.store.record_hit(self.key, nbytes=self.report.restored_bytes)
        self._counters = dynamo.CompileCounters.snapshot()

    def start_capture(self) -> None:
        """Capture by use where torch allows it, else (warned once, counted) the directory diff.

        Another backend than Inductor keeps the diff, as it always had: what it writes into the
        local dirs (a custom backend may) is all a pack can know of it.
        """
        if not self._inductor:
            self.report.capture = "directory diff"
            self._capture = artifacts.Capture()
            return
        if capture.install():
            self._by_use = True
            self.report.capture = "by use"
            cache_use.on_compiled(_on_compiled)
            publisher.get().at_exit(_publish_at_exit)
            _live.add(self)
            if self.precompile:  # Dynamo's precompile entries: still found by a diff (#13)
                self._capture = artifacts.Capture()
        else:
            self.report.capture = "directory diff"
            self.store.record_capture_fallback()
            self._capture = artifacts.Capture()

    # -- after forwards ---------------------------------------------------------------------
    def after_forward(self, seconds: float) -> None:
        """Counts what a forward compiled and queues its publish; a forward that compiled
        nothing costs a few lookups."""
        now = dynamo.CompileCounters.snapshot()
        if now == self._counters:
            return
        with self._lock:
            diff = now.diff(self._counters)
            self._counters = now
            self.report.fxgraph_hits += diff.fxgraph_hit
            self.report.fxgraph_misses += diff.fxgraph_miss
            if self._inductor:
                dynamo.check_counters(diff)
            self._pending_seconds += seconds
            if self._by_use:
                self._prepare_precompile()
                self.submit_publish()
                return
            if diff.fxgraph_miss == 0 and diff.autograd_miss == 0:
                return
            self._publish_diff(self._capture or artifacts.Capture())
            self._capture = artifacts.Capture()

    def submit_publish(self) -> None:
        """Queues a publish of what the model used on the background publisher."""
        if self._by_use and not self.store.read_only:
            publisher.get().submit(self._publish_by_use, key=("publish", id(self)))

    def flush(self, timeout: float | None = None) -> bool:
        """Publishes what is not published yet and waits for it; True when done in time."""
        if not self._by_use:
            return True
        self._prepare_precompile()
        self.submit_publish()
        return publisher.get().drain(timeout)

    def _prepare_precompile(self) -> None:
        """With precompile: torch writes its Dynamo entries (on this thread, outside any compile)
        and the files they added are carried by every pack of the model."""
        if not self.precompile or self._capture is None:
            return
        try:
            dynamo.save_precompile_entries()
            changed = self._capture.changed()
        except OSError as exc:
            self._error("capture", str(exc))
            return
        self._extra.update((name, str(path)) for name, path in changed.items()
                           if name.startswith("inductor/dynamo/"))

    def _publish_by_use(self) -> None:
        """Publishes, as one pack, every member the model's groups used that the store lacks,
        with the manifest of the whole usage (runs on the publisher's thread)."""
        with self._publish_lock:
            found = capture.usage(self.owners, self._known, self._extra)
            if found.generation == self._published_generation or not found.units:
                return
            entry = self.store.entry(self.key)
            members, manifest = capture.resolve(
                found, generations.held(entry.packs if entry is not None else ()))
            self._published_generation = found.generation
            if not members:
                logger.info("compile_cache: the store has everything %s used", self.key[:12])
                return
            answers = artifacts.isa_probe_answers() or {}
            self._write_pack(members, {
                generations.MANIFEST_KEY: manifest,
                "isa_probe": {k: v for k, v in answers.items() if k in manifest["always"]} or None,
            })

    def _publish_diff(self, diff: artifacts.Capture) -> None:
        """The fallback: publishes the files the local dirs gained that the store lacks."""
        try:
            members = diff.collect()
        except OSError as exc:
            self._error("capture", str(exc))
            return
        entry = self.store.entry(self.key)
        held = generations.held(entry.packs if entry is not None else ())
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in members.items()}
        members = {n: d for n, d in members.items() if not generations.holds(held, n, digests[n])}
        if not members:
            logger.info("compile_cache: what this process compiled is already in the store")
            return
        # No units: a diff cannot tell whose files these are; each is kept at its newest bytes.
        manifest = generations.make_manifest([], members, {n: digests[n] for n in members})
        self._write_pack(members, {generations.MANIFEST_KEY: manifest,
                                   "isa_probe": artifacts.isa_probe_answers()})

    def _write_pack(self, members: dict[str, bytes], metadata: dict[str, Any]) -> None:
        with self._lock:
            seconds, self._pending_seconds = self._pending_seconds, 0.0
            if self._by_use:  # the compiles' own wall time, from torch's compile callbacks
                compiled = cache_use.compile_seconds(self.owners)
                seconds, self._published_seconds = compiled - self._published_seconds, compiled
            metadata = {"fxgraph_misses": self.report.fxgraph_misses,
                        "precompile": self.precompile, **metadata, **self._tags}
        info = self.store.publish(self.key, members, metadata=metadata,
                                  entry_info=self._entry_info, compile_seconds=seconds)
        if info is not None:
            with self._lock:
                self.report.published_packs += 1
                self.report.published_bytes += info.size
            logger.info("compile_cache: published %s (%s)", info.name, format_size(info.size))

    def known_members(self) -> frozenset[str]:
        """Member names held by the key's packs now (from the headers the store already read)."""
        entry = self.store.entry(self.key)
        if entry is None:
            return frozenset()
        return frozenset(name for pack in entry.packs for name in pack.member_names)

    def pack_metadata(self) -> list[dict[str, Any]]:
        """The header metadata of the key's packs now (for the distributed warm-up's checks)."""
        entry = self.store.entry(self.key)
        return [dict(p.metadata) for p in entry.packs] if entry is not None else []

    def precompile_failed(self, name: str, exc: BaseException) -> None:
        """Loading precompiled code failed: warn, count, and let the caller compile normally."""
        self._error(
            "precompile",
            f"precompiled code for {name or '<root>'} did not load ({type(exc).__name__}: {exc})",
        )

    def _error(self, kind: str, message: str) -> None:
        self.report.errors.append(f"{kind}: {message}")
        self.store.record_error(kind)
        _warnings.warn(f"compile_cache: {kind} failed, compiling instead: {message}")

    # -- what the distributed warm-up uses ---------------------------------------------------------
    @property
    def entry_info(self) -> dict[str, Any]:
        """What the key's ``entry.json`` records (model class, torch, device, regions)."""
        return dict(self._entry_info)

    @property
    def location(self) -> str:
        """The store's directory."""
        return str(self.store.root)

    @property
    def tags(self) -> dict[str, Any]:
        """The metadata the packs published now are tagged with (see :meth:`tagged`)."""
        return dict(self._tags)

    @contextlib.contextmanager
    def tagged(self, **metadata: Any) -> Iterator[None]:
        """Tag the packs published inside the block with ``metadata`` (merged into their header
        metadata); the earlier tags come back after it. The distributed warm-up tags its packs
        with the signature of its example inputs."""
        previous = dict(self._tags)
        self._tags.update(metadata)
        try:
            yield
        finally:
            self._tags = previous

    def lock(self, timeout: float | None) -> Any:
        """The store's lock of this key (only avoids duplicate compiles; never needed for
        correctness)."""
        return self.store.lock(self.key, timeout=timeout)

    def entry(self) -> EntryInfo | None:
        """The key's entry in the store now (its packs' names and metadata), or None."""
        return self.store.entry(self.key)

    def packs_to_send(self, receiver_packs: list[set[str]]) -> list[dict[str, Any]]:
        """The key's packs that at least one receiver lacks (``receiver_packs``: the pack names
        each receiver holds), as plain data for ``broadcast_object_list``."""
        out = []
        for pack in self.store.load(self.key):
            if receiver_packs and all(pack.info.name in have for have in receiver_packs):
                continue
            out.append(
                {
                    "members": pack.members,
                    "metadata": dict(pack.header.get("metadata") or {}),
                    "compile_seconds": pack.info.compile_seconds,
                }
            )
        logger.info("compile_cache: broadcasting %d pack(s) of %s", len(out), self.key[:12])
        return out

    def publish_received(self, packs: list[dict[str, Any]]) -> int:
        """Publish packs another rank sent (``packs_to_send``'s form) into this store; how many."""
        count = 0
        for pack in packs:
            self.store.publish(
                self.key,
                pack["members"],
                metadata=pack.get("metadata"),
                entry_info=self._entry_info,
                compile_seconds=float(pack.get("compile_seconds") or 0.0),
            )
            count += 1
        return count

    # -- wiring -----------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        """Makes this the session :func:`session_for` finds for ``model``."""
        _sessions[model] = self


# model -> its session, for warm_up(); weak so a dropped model frees its session, and outside the
# module's __dict__ so copy.deepcopy(model) does not try to copy locks.
_sessions: weakref.WeakKeyDictionary[nn.Module, CacheSession] = weakref.WeakKeyDictionary()


def session_for(model: nn.Module) -> CacheSession | None:
    """The session ``compile_regions`` attached to ``model`` (None without a store)."""
    try:
        return _sessions.get(model)
    except TypeError:  # not weak-referenceable
        return None


# Sessions that capture by use: the compile-end listener and the exit hook find them here.
_live: weakref.WeakSet[CacheSession] = weakref.WeakSet()


def _on_compiled(owners: set[str]) -> None:
    """A compile added to the usage of ``owners``: queue the publish of every session that has
    one of them (runs inside torch's compile, so it only queues)."""
    for session in list(_live):
        # With precompile, Dynamo's entries are written only outside a compile (after_forward).
        if owners.intersection(session.owners) and not session.precompile:
            session.submit_publish()


def _publish_at_exit() -> None:
    for session in list(_live):
        session._prepare_precompile()
        session.submit_publish()


def flush(timeout: float | None = None) -> bool:
    """Publishes what every session has not published yet and waits at most ``timeout``
    seconds for it; True when everything was written."""
    return all([session.flush(timeout) for session in list(_live)])


def _device_of(model: nn.Module) -> str:
    for tensor in model.parameters():
        return str(tensor.device.type)
    return "cpu"


_fallbacks_counted: set[str] = set()


def _count_backend_fallback(store: Store) -> None:
    """Counts, once per process and store, that the fingerprint runs on the Python fallback."""
    from .fingerprint import backend_fallbacks  # type: ignore[attr-defined]

    if backend_fallbacks and str(store.root) not in _fallbacks_counted:
        _fallbacks_counted.add(str(store.root))
        store.record_backend_fallback()


def open_session(
    model: nn.Module,
    plan: Any,
    key: str,
    cache_dir: str | os.PathLike[str] | bool | None,
    precompile: bool,
) -> CacheSession | None:
    """Opens the store for ``model``'s ``key`` and restores its packs; None when the store is off.

    A store that cannot be used (I/O errors, a path that vanished) warns once and the job goes on
    without it; a store whose permissions would let others plant code is refused (raises).
    """
    global _last_report
    if cache_dir is False:
        return None
    try:
        store = Store(None if cache_dir is None or cache_dir is True else cache_dir)
    except UnsafeStoreError:
        raise
    except (CompileCacheError, OSError) as exc:
        _warnings.warn(f"compile_cache: store unusable, compiling without it: {exc}")
        return None
    _count_backend_fallback(store)
    session = CacheSession(store, key, model, precompile, plan)
    isa.watch()  # what this process's probe answers goes into its packs
    try:
        session.restore()
    except OSError as exc:
        session._error("restore", str(exc))
    session.start_capture()
    with _report_lock:
        _last_report = session.report
    logger.info("compile_cache: %s", session.report.summary())
    return session


def _reset() -> None:
    """Forget the last report and the counted backend fallbacks (tests)."""
    global _last_report
    with _report_lock:
        _last_report = None
    _fallbacks_counted.clear()
