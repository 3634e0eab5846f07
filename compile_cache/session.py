"""A model's link to the store: restore before compiling, capture what forwards compiled, publish.

The data flows one way: model -> fingerprint -> key -> store (restore) -> torch.compile -> first
forward -> capture -> store (publish). ``compile_regions`` opens the session (:func:`open_session`)
before it compiles (Dynamo looks for precompiled entries when ``torch.compile`` wraps a function,
so restoring must come first) and has it hear of each call's end after. This module knows
neither the disk layout (``compile_cache.store``) nor torch's cache internals
(``compile_cache.artifacts``, ``compile_cache.torch_compat``).

The distributed warm-up works through the session's public methods: :attr:`CacheSession.entry_info`,
:meth:`~CacheSession.tagged` (metadata for the packs it publishes), :meth:`~CacheSession.lock`,
:meth:`~CacheSession.entry` and :attr:`~CacheSession.store` (broadcast mode reads and publishes
the packs it sends and receives there).
"""

from __future__ import annotations

import contextlib
import functools
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

from . import _warnings, artifacts, capture, config, local_dirs, publisher, recovery
from .errors import CompileCacheError, ConfigError, UnsafeStoreError
from .precompiled import PrecompileTracker
from .report import CacheReport
from .session_publish import SessionPublisher
from .store import EntryInfo, Store, generations, misses
from .torch_compat import autotune, cache_use, dynamic_shapes, dynamo, inductor_cache, isa

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


def precompile_requested(precompile: bool | None, compile_kwargs: dict[str, Any] | None = None) -> bool:
    """``precompile`` if given, else ``COMPILE_CACHE_PRECOMPILE``, else
    ``config.PRECOMPILE_DEFAULT``. The default alone applies to Inductor only (``compile_kwargs``'
    backend): another backend saves no compiled code with a precompile entry, so there precompile
    is simply not used, neither warned about nor counted as declined, and the key is the same as
    with ``precompile=False``."""
    if precompile is not None:
        return bool(precompile)
    wanted = bool(config.PRECOMPILE.value())
    if wanted and config.PRECOMPILE.raw() is None and compile_kwargs is not None:
        return compile_kwargs.get("backend", "inductor") == "inductor"
    return wanted


class CacheSession:
    """One model's link to the store: restores at open, publishes what the model's regions used.

    Capture by use (:mod:`compile_cache.capture`): the end of every compile that added to the
    usage of one of the model's region groups (a forward frame, or the backward torch compiles
    lazily inside ``loss.backward()``) queues a publish on the background
    :mod:`~compile_cache.publisher`, off the training step; so does the end of a forward that
    compiled. Whatever is still unpublished at interpreter exit is published then (bounded).
    :meth:`flush` waits for it (the warm-up and the CLI use it). What to publish, and the
    publishing itself, is its :class:`~compile_cache.session_publish.SessionPublisher`
    (:attr:`publishing`).
    """

    def __init__(
        self, store: Store, key: str, model: nn.Module, precompile: bool, plan: Any = None,
        record: dict[str, Any] | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self.precompile = precompile
        self.report = CacheReport(key=key, store=store.location, precompile=precompile)
        self._entry_info = {
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "torch": torch.__version__,
            "device": _device_of(model),
            # For `python -m compile_cache ls`: the region groups, e.g. "GPT2Block x4".
            "regions": ", ".join(
                f"{g.class_name.rsplit('.', 1)[-1]} x{g.size}" for g in getattr(plan, "groups", ())
            ),
            # What went into the key, readably (keys.key_fields): for `explain` and `ls`.
            **(record or {}),
        }
        self._counted: str | None = None  # the outcome counted in the store's stats so far
        kwargs = getattr(plan, "compile_kwargs", None) or {}
        #: Inductor compiles bump torch's cache counters: checked to notice renamed counters.
        self._inductor = kwargs.get("backend") in (None, "inductor")
        self._dynamic_false = kwargs.get("dynamic") is False
        #: The automatic-dynamic record restored (explains a partial hit), and this start's id.
        self._restored_dynamic: dict[str, Any] | None = None
        self._start_id = os.urandom(8).hex()
        #: The region groups' code names: whose usage this model's packs carry.
        self.owners: tuple[str, ...] = tuple(
            [g.code_name for g in getattr(plan, "groups", ())]
            + [p.code_name for p in getattr(plan, "compiled_rest", ())]
        )
        self._capture: artifacts.Capture | None = None  # the diff fallback
        self._counters = dynamo.CompileCounters.snapshot()
        self._lock = threading.RLock()  # the report and counters (after_forward publishes a diff)
        #: With precompile: the groups' precompiled functions, saved after forwards that traced.
        self.precompiled = PrecompileTracker(self.report, store)
        #: What this model's session publishes, and when.
        self.publishing = SessionPublisher(
            store, key, self.report, owners=self.owners, precompile=precompile,
            precompiled=self.precompiled, entry_info=self._entry_info, lock=self._lock,
            on_error=self.record_failure,
        )
        self.publishing.source_files = dynamic_shapes.source_files(model)

    # -- before compiling -------------------------------------------------------------------
    def restore(self, *, count: bool = True) -> None:
        """Writes the key's current generation into the local Inductor/Triton dirs; explains a
        miss.

        Only the members of the newest unit per (region group, slot), for the model's region
        groups, plus what every pack carries (:mod:`compile_cache.store.generations`); a pack
        without a manifest is applied whole. Called at open, and again by the distributed flow
        once another rank has published (then ``count=False``: the restored packs replace the
        report's, and the miss is not explained again). The start's outcome is counted once its
        first forward ends (:meth:`after_forward`). Idempotent: files already there are left alone.
        """
        start = time.perf_counter()
        # On object storage the packs come over while torch's code cache module imports (a
        # restore needs it for its load guard, a compile for itself): the two overlap.
        if self.store.prefetch(self.key) and self._inductor:
            inductor_cache.preload()
        packs = self.store.load(self.key)
        selection = generations.select([p.info for p in packs], self.owners or None)
        parts: list[str] = []  # max-autotune selection-cache parts, merged into torch's file
        if not count:
            self.report.restored_packs = self.report.restored_files = 0
            self.report.restored_bytes = 0
        for pack in packs:
            wanted = [name for name, src in selection.sources.items() if src == pack.info.name]
            if not wanted:
                pack.close()
                continue
            members = pack.members.only(wanted)
            origin = recovery.origin(self.store, pack.info)
            try:
                result = artifacts.restore(members, origin=origin)
                nbytes = sum(members.size(name) for name in members)
                digests = {name: selection.wanted.get(name) or _digest(members, name)
                           for name in result.files}
            except artifacts.UnrestorableMemberError as exc:
                # The pack itself is bad for every node (a label no restore knows, a name no
                # filesystem holds): set it aside once, instead of failing on every start.
                self.report.errors.append(f"restore: pack {pack.info.name}: {exc}")
                self.store.quarantine(pack.info, str(exc))
                continue
            except (CompileCacheError, OSError) as exc:  # this node's local dir (a planted link...)
                self.record_failure("restore", f"pack {pack.info.name}: {exc}")
                continue
            finally:
                pack.close()
            recovery.restored(origin, self.store, pack.info, self.report)
            self.report.restored_packs += 1
            self.report.restored_files += len(result.written) + len(result.present)
            self.report.restored_bytes += nbytes
            for name, (real, size, mtime) in result.files.items():
                self.publishing.known[name] = (real, size, mtime, digests[name])
                if autotune.PART_DIR_SUFFIX + "/" in name:
                    parts.append(real)
        if parts:  # before the first compile reads the selection cache
            autotune.merge_restored_parts(parts)
        if selection.superseded_units:
            logger.info("compile_cache: %d superseded unit(s) of %s not restored",
                        selection.superseded_units, self.key[:12])
        self.report.restore_seconds += time.perf_counter() - start
        if self.report.restored_packs and self._inductor:
            # A restored graph whose library torch cannot load compiles instead (and the pack is
            # set aside): the hook around torch's load of a cached graph.
            inductor_cache.guard_cache_loads(recovery.on_load_failure)
        answers: dict[str, bool] = {}
        for pack in packs:
            published = pack.info.metadata.get("isa_probe")
            if isinstance(published, dict):
                answers.update((k, v) for k, v in published.items() if isinstance(v, bool))
        if self.report.restored_packs and answers:
            artifacts.trust_restored_isa_answers(answers)
        self.precompiled.restored([pack.info.metadata for pack in packs])
        self._install_dynamic()
        if count and not self.report.restored_packs:
            self._explain_miss()
        self._counters = dynamo.CompileCounters.snapshot()

    def _install_dynamic(self) -> None:
        """Puts the restored automatic-dynamic decisions of the model's groups in place before
        the first compile (:mod:`compile_cache.torch_compat.dynamic_shapes`)."""
        if not self.owners:
            return
        state = dynamic_shapes.read_restored(self.owners[0])
        if state is None:
            return
        self._restored_dynamic = state
        self.publishing.dynamic_base = dynamic_shapes.decisions(state)
        turned = dynamic_shapes.install(state)
        self.report.dynamic_inputs = dynamic_shapes.summary(state)
        logger.info("compile_cache: restored automatic-dynamic decisions of %s (%d dynamic "
                    "dimension(s) new to this process)", self.key[:12], turned)

    def start_capture(self) -> None:
        """Capture by use where torch allows it, else (warned once, counted) the directory diff.

        Another backend than Inductor keeps the diff, as it always had: what it writes into the
        local dirs (a custom backend may) is all a pack can know of it.
        """
        if not self._inductor:
            self.report.capture = "directory diff"
            self._capture = artifacts.Capture()
            return
        _warn_unbundled(self._entry_info.get("device"))
        if capture.install():
            self.publishing.by_use = True
            self.report.capture = "by use"
            cache_use.on_compiled(_on_compiled)
            publisher.get().at_exit(_publish_at_exit)
            _live.add(self)
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
            if self._counted is None:
                with self._lock:
                    self._count_outcome()
            return
        with self._lock:
            diff = now.diff(self._counters)
            self._counters = now
            self.report.fxgraph_hits += diff.fxgraph_hit
            self.report.fxgraph_misses += diff.fxgraph_miss
            if self._inductor:
                dynamo.check_counters(diff)
            self._count_outcome()
            if diff.fxgraph_miss and self.report.restored_packs:
                self._explain_partial()
            self.publishing.add_forward_seconds(seconds)
            if self.publishing.by_use:
                self.publishing.prepare_precompile()
                self.publishing.submit()
                return
            saved = self.publishing.prepare_precompile()
            if diff.fxgraph_miss == 0 and diff.autograd_miss == 0 and not saved:
                return
            self.publishing.publish_diff(self._capture or artifacts.Capture())
            self._capture = artifacts.Capture()

    def _count_outcome(self) -> None:
        """Counts this start in the store's stats, once: at the end of its first forward, and
        again only to correct a hit that then compiled something (a partial hit) or a local-cache
        hit that then compiled (a miss)."""
        outcome = self.report.counted_outcome
        if outcome == self._counted:
            return
        if self._counted is None or (self._counted, outcome) in (("hit", "partial"), ("local", "miss")):
            previous, self._counted = self._counted, outcome
            # Written by the background publisher: a stats shard (or, on object storage, a PUT)
            # never holds up the training step. flush() and interpreter exit wait for it.
            publisher.get().submit(functools.partial(
                self.store.record_outcome, self.key, outcome, previous=previous,
                nbytes=self.report.restored_bytes))

    def _explain_partial(self) -> None:
        """The key was in the store, yet this start compiled graphs: why
        (``report.partial_causes``), recorded for ``python -m compile_cache explain``."""
        from .explain import partial_causes  # a start that hits whole needs no explain (issue 38)

        owners = capture.group_codes(self.owners)
        guards = {}
        for code, reasons in list(dynamo.guard_failures().items()):
            name = getattr(code, "co_name", None)
            if isinstance(name, str) and reasons and dynamic_shapes.is_region_code(name, owners):
                guards[name] = [str(r) for r in reasons]
        causes = partial_causes(self._restored_dynamic,
                                dynamic_shapes.snapshot(owners, self.publishing.source_files), guards,
                                graphs=self.report.fxgraph_misses, dynamic_false=self._dynamic_false,
                                publishes=not self.store.fs.read_only)
        self.report.partial_causes = [cause.text() for cause in causes]
        data = {"record": {"model_class": self._entry_info.get("model_class")},
                "restored_packs": self.report.restored_packs,
                "graphs_compiled": self.report.fxgraph_misses, "graphs_hit": self.report.fxgraph_hits,
                "causes": [cause.to_dict() for cause in causes]}
        publisher.get().submit(functools.partial(
            misses.record_partial, self.store, self.key, self._start_id, data))

    def _explain_miss(self) -> None:
        """Names why the key is not in the store (``report.miss_reason``), records the miss for
        ``python -m compile_cache explain``, and warns once when entries of the same model are
        there (a miss the user did not expect)."""
        from .explain import CacheMissWarning, explain

        try:
            explanation = explain(self.key, self._entry_info, misses.entry_records(self.store),
                                  str(self.store.root))
        except OSError as exc:
            logger.debug("compile_cache: could not explain the miss of %s: %s", self.key, exc)
            return
        self.report.miss_reason = explanation.reason
        misses.record_miss(self.store, self.key, self._entry_info, explanation.reason)
        if explanation.candidates and (str(self.store.root), self.key) not in _explained:
            _explained.add((str(self.store.root), self.key))
            _warnings.warn(f"compile_cache: {explanation.reason}", CacheMissWarning)
        else:
            logger.info("compile_cache: %s", explanation.reason)

    def known_members(self) -> frozenset[str]:
        """Member names held by the key's packs now (from the headers the store already read)."""
        entry = self.store.entry(self.key)
        if entry is None:
            return frozenset()
        # Only packs this reader can use: another signer's pack does not stand in for ours.
        return frozenset(
            name for pack in entry.packs if self.store.usable(pack) for name in pack.member_names
        )

    def pack_metadata(self) -> list[dict[str, Any]]:
        """The header metadata of the key's packs now (for the distributed warm-up's checks)."""
        entry = self.store.entry(self.key)
        return [dict(p.metadata) for p in entry.packs] if entry is not None else []

    def flush(self, timeout: float | None = None) -> bool:
        """Publishes what is not published yet and waits for it; True when done in time."""
        return self.publishing.flush(timeout)

    def record_failure(self, kind: str, message: str) -> None:
        """A step failed (restore, capture, publish, a precompile save): noted in the report,
        counted in the store's stats, warned with what it costs."""
        self.report.errors.append(f"{kind}: {message}")
        self.store.record_error(kind)
        cost = ("nothing new was published: the next start compiles again" if kind == "publish"
                else "compiling instead")
        _warnings.warn(f"compile_cache: {kind} failed, {cost}: {message}")

    # -- what the distributed warm-up uses ---------------------------------------------------------
    @property
    def entry_info(self) -> dict[str, Any]:
        """What the key's ``entry.json`` records (model class, torch, device, regions)."""
        return dict(self._entry_info)

    @property
    def location(self) -> str:
        """The store's directory (or URL, for a store on object storage)."""
        return self.store.location

    @property
    def tags(self) -> dict[str, Any]:
        """The metadata the packs published now are tagged with (see :meth:`tagged`)."""
        return dict(self.publishing.tags)

    @contextlib.contextmanager
    def tagged(self, **metadata: Any) -> Iterator[None]:
        """Tag the packs published inside the block with ``metadata`` (merged into their header
        metadata); the earlier tags come back after it. The distributed warm-up tags its packs
        with the signature of its example inputs."""
        previous = dict(self.publishing.tags)
        self.publishing.tags.update(metadata)
        try:
            yield
        finally:
            self.publishing.tags = previous

    def lock(self, timeout: float | None, wait_alive: float | None = None) -> Any:
        """The store's lock of this key (only avoids duplicate compiles; never needed for
        correctness); ``wait_alive``: wait past ``timeout`` while its holder's heartbeat is fresh."""
        return self.store.lock(self.key, timeout=timeout, wait_alive=wait_alive)

    def lock_failed(self, exc: BaseException) -> None:
        """The lock could not be taken (a timeout, a lock file another user made, ENOLCK): the
        caller compiles without it; counted (``lock_fallbacks``)."""
        logger.warning("compile_cache: lock of %s not taken (%s: %s); compiling without it",
                       self.key[:12], type(exc).__name__, exc)
        self.store.record_lock_fallback(exc)

    def entry(self) -> EntryInfo | None:
        """The key's entry in the store now (its packs' names and metadata), or None."""
        return self.store.entry(self.key)

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
            session.publishing.submit()


def _publish_at_exit() -> None:
    for session in list(_live):
        session.publishing.prepare_precompile()
        session.publishing.submit()


def flush(timeout: float | None = None) -> bool:
    """Publishes what every session has not published yet and waits at most ``timeout``
    seconds for it; True when everything was written."""
    done = all([session.flush(timeout) for session in list(_live)])
    return publisher.get().drain(timeout) and done  # counters queued by sessions now gone too


def _digest(members: Any, name: str) -> str:
    digest = hashlib.sha256()
    for chunk in members.chunks(name):
        digest.update(chunk)
    return digest.hexdigest()


def _device_of(model: nn.Module) -> str:
    for tensor in model.parameters():
        return str(tensor.device.type)
    return "cpu"


_unbundled_warned = False


def _warn_unbundled(device: Any) -> None:
    """Warns once per process when a GPU model's Triton kernels would not ride in the packs."""
    global _unbundled_warned
    if _unbundled_warned or device in ("cpu", "meta", None) or autotune.triton_bundling() is not False:
        return
    _unbundled_warned = True
    _warnings.warn(
        "compile_cache: torch._inductor.config.bundle_triton_into_fx_graph_cache is off "
        "(TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE): packs carry no Triton kernels, so a "
        "fresh node compiles every kernel from source. Leave it on (torch's default) to carry them.",
        RuntimeWarning)


_fallbacks_counted: set[str] = set()
_explained: set[tuple[str, str]] = set()  # (store, key) misses warned about in this process


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
    record: dict[str, Any] | None = None,
) -> CacheSession | None:
    """Opens the store for ``model``'s ``key`` and restores its packs; None when the store is off.

    A store that cannot be used (I/O errors, a path that vanished) warns once and the job goes on
    without it; a store whose permissions would let others plant code is refused (raises), and so
    is a bad ``COMPILE_CACHE_*`` value (ConfigError: never a silently disabled store).
    ``record``: what went into the key (:func:`compile_cache.keys.key_fields`), kept in the
    entry's ``entry.json`` and used to explain a miss.
    """
    global _last_report
    if cache_dir is False:
        return None
    local_dirs.secure_local_dirs()  # before anything is restored into them (also done by api)
    try:
        store = Store(None if cache_dir is None or cache_dir is True else cache_dir)
    except (UnsafeStoreError, ConfigError):
        raise
    except (CompileCacheError, OSError) as exc:
        _warnings.warn(f"compile_cache: store unusable, compiling without it: {exc}")
        return None
    _count_backend_fallback(store)
    session = CacheSession(store, key, model, precompile, plan, record)
    isa.watch()  # what this process's probe answers goes into its packs
    try:
        session.restore()
    except OSError as exc:
        session.record_failure("restore", str(exc))
    session.start_capture()
    with _report_lock:
        _last_report = session.report
    logger.info("compile_cache: %s", session.report.summary())
    return session


def _reset() -> None:
    """Forget the last report and the counted backend fallbacks (tests)."""
    global _last_report, _unbundled_warned
    with _report_lock:
        _last_report = None
    _unbundled_warned = False
    _fallbacks_counted.clear()
    _explained.clear()
