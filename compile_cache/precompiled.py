"""Precompiled regions: one precompiled function per region group, and what happens to it.

With precompile, :func:`compile_cache.regions.install` compiles each group (and each part
compiled on its own) through one :class:`~compile_cache.torch_compat.precompile.PrecompiledFunction`
that every member calls with itself as ``self``, so all of the group's traces, recompiles for
per-block attributes included, land in one Dynamo package, saved under one entry name. The
entry name comes from the full store key (model fingerprint with attributes, plan, compile
keywords, environment), the group and its keywords: no two models or groups share one.

A group that cannot use precompile compiles normally, with every default guard, and says why:
another backend than Inductor (the others save no compiled code), the user's own
``guard_filter_fn``, the process-wide ``TORCH_CACHING_PRECOMPILE=1``, a guard that cannot be
saved faithfully (seen while tracing), an entry that does not load. Each such group is warned
about (:class:`RegionPrecompileWarning`) and reported to the session, which counts it in the
store's ``stats`` and in ``last_report().precompile_groups``.

Blocks that take a KV cache (:mod:`compile_cache.torch_compat.kv.cache`): their calls without a
cache (training, scoring) run the group's function; their decode steps through the layer view
(one graph, no break) a second one (entry ``<code name>__views``); their other calls that pass a
cache (the prefill, decode steps the view does not serve) a third (entry ``<code name>__cache``),
with the cache update traced into the graph (no graph break): one entry per block and phase,
proven like the others (their guards on the cache are on the call's arguments and per-block
attributes, saved with the entry; values read through a module are checked at load). That is
also how a block compiled on its own (a group of one, ``fullgraph=True``) is called. A group of
more than :data:`~compile_cache.torch_compat.kv.calls.TRACED_MAX_BLOCKS` blocks, or whose
``__cache`` function declined, updates the cache eagerly between two graphs instead, and those
calls compile without precompile (:data:`KV_CACHE_DECLINE`: :class:`CacheRoutedCall` sends them
to :func:`compile_plain`), reported once a cache is passed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from . import _warnings
from .capture import CACHE_SUFFIX, VIEWS_SUFFIX
from .fingerprint import class_lineage
from .keys import canonical_compile_kwargs, region_devices
from .plan import is_part_code
from .store.stats import record_precompile
from .torch_compat import cudagraphs
from .torch_compat import precompile as pc
from .torch_compat.kv import calls as kv_calls
from .torch_compat.kv.cache import is_cache
from .torch_compat.kv.calls import is_view

logger = logging.getLogger("compile_cache")

__all__ = [
    "CACHE_SUFFIX",
    "KV_CACHE_DECLINE",
    "VIEWS_SUFFIX",
    "BoundCall",
    "CacheNotedCall",
    "CacheRoutedCall",
    "GroupPrecompiler",
    "PrecompileEvent",
    "PrecompileSetup",
    "PrecompileReviewWarning",
    "PrecompileTracker",
    "RegionPrecompileWarning",
    "compile_plain",
    "isolate_from_global_flag",
]


class RegionPrecompileWarning(RuntimeWarning):
    """A region does not use precompile (it compiles normally, so Dynamo traces it at each start)."""


class PrecompileReviewWarning(UserWarning):
    """Precompile was asked for while it is under review (``config.PRECOMPILE_DEFAULT`` says
    why it is off by default); shown once per process."""


#: Why the calls that pass a KV cache to a group's blocks, other than decode steps through the
#: layer view, compile without precompile when the group updates the cache eagerly (more than
#: TRACED_MAX_BLOCKS blocks).
KV_CACHE_DECLINE = (
    "its blocks take a KV cache: calls that update it eagerly between two graphs (prefill, and "
    "every call the layer view does not serve; compile_cache.torch_compat.kv.cache) compile "
    "without precompile, since the frame after that graph break is entered with the resume "
    "functions of the frames around it (__nested_resume_fns), whose identity its graph relies "
    "on and no saved guard can check; decode steps through the layer view and calls without a "
    "cache (training, scoring, use_cache=False) precompile. A group of at most "
    f"{kv_calls.TRACED_MAX_BLOCKS} blocks traces the update into the graph instead and "
    "precompiles those calls too (one entry per block)"
)


@dataclasses.dataclass(frozen=True)
class PrecompileEvent:
    """One group's precompile outcome.

    ``status``: ``loaded`` (its entry came from the store: tracing skipped), ``new`` (no entry
    yet: what it traces is saved), ``declined`` / ``failed`` (compiled without precompile:
    ``detail`` says why), or ``load_error`` (torch could not read an entry; comes on its own).
    ``persist``: a decline found while tracing, the same on every node for this entry, which the
    store remembers so that later starts decline at once instead of tracing twice.
    """

    code_name: str
    label: str
    entry: str
    status: str
    detail: str = ""
    persist: bool = False
    #: Graphs of the restored entry not installed (values not proven here): traced again.
    unproven: int = 0
    #: The group traced although the store held its entry (its graphs not installed, or the
    #: entry unreadable): the start's outcome is "hit, traced again".
    traced_again: bool = False


@dataclasses.dataclass(frozen=True)
class PrecompileSetup:
    """What install needs for precompile: the store key the entries are named by, who hears of
    each group's outcome (the session: report and counters), and what the store records of each
    entry (entry name -> ``{"declined": why}`` or ``{"pins": {source: description}}``)."""

    store_key: str
    on_event: Callable[[PrecompileEvent], None] | None = None
    records: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: Asked for (argument or COMPILE_CACHE_PRECOMPILE), not only the default: then a group
    #: that declines before compiling (another backend, your guard filter) is warned about;
    #: otherwise it is logged and counted (precompile does not apply to it).
    explicit: bool = True


class BoundCall:
    """A member's compiled call path: the group's precompiled function, called with the member."""

    __slots__ = ("module", "pf")

    def __init__(self, pf: pc.PrecompiledFunction, module: nn.Module) -> None:
        self.pf = pf
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.pf(self.module, *args, **kwargs)


class CacheRoutedCall:
    """A member of a group whose blocks take a KV cache. A decode step through the layer view
    (:func:`compile_cache.torch_compat.kv.calls.is_view`) runs the group's precompiled decode
    function (``views``), another call that passes a cache ``plain``: the group's plain compile
    (every default guard; the eager cache update between two graphs) or, for blocks called
    without the eager update, the group's precompiled cache-calls function (a
    :class:`BoundCall`); a call without one the group's precompiled function. The three never
    share compiled code, so a call can never pick a graph traced for another kind of call.
    ``traced_call`` (for :class:`~compile_cache.torch_compat.kv.calls.CacheCalls`, which calls it with
    the cache update traced into the graph): the group's precompiled cache-calls function, while
    it has not declined; ``plain`` then serves what it cannot."""

    __slots__ = ("precompiled", "plain", "probe", "views", "on_cache", "traced_fn")

    def __init__(self, precompiled: BoundCall, plain: Any, probe: Any,
                 views: BoundCall | None = None,
                 on_cache: Callable[[], None] | None = None,
                 traced: BoundCall | None = None) -> None:
        self.precompiled = precompiled
        self.plain = plain
        self.probe = probe  # kv_calls.CacheCalls of the block: where its cache argument is
        self.views = views
        #: Called at the first call that passes a cache (then the group is a KV-cache group in
        #: the report; a block that could take one but never gets one, an encoder, is not).
        self.on_cache = on_cache
        self.traced_fn = traced

    @property
    def pf(self) -> pc.PrecompiledFunction:
        return self.precompiled.pf

    @property
    def traced_call(self) -> BoundCall | None:
        """The group's precompiled cache-calls function for a call whose cache update Dynamo
        traces into the graph; None when the group has none or it declined (a declined one would
        trace every block at every start: the eager update traces two frames)."""
        traced = self.traced_fn
        return traced if traced is not None and traced.pf.declined is None else None

    @property
    def __self__(self) -> nn.Module:  # the block, as a bound method has it (kv_calls reads it)
        return self.precompiled.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.probe.cache_of(args, kwargs)
        if self.views is not None and is_view(cache):
            return self.views(*args, **kwargs)
        if is_cache(cache):
            if self.on_cache is not None:
                on_cache, self.on_cache = self.on_cache, None
                on_cache()
            return self.plain(*args, **kwargs)
        return self.precompiled(*args, **kwargs)


class CacheNotedCall:
    """A member of a group whose blocks take a KV cache and whose precompile was declined before
    compiling (another backend, a recorded decline): every call runs the group's plain compile,
    and the first that passes a cache (or its layer view) calls ``on_cache``, so that the report
    and the warnings say the group's cache calls compile without precompile, as
    :class:`CacheRoutedCall` does, and only once a cache is really passed."""

    __slots__ = ("plain", "probe", "module", "on_cache")

    def __init__(self, plain: Any, probe: Any, module: nn.Module,
                 on_cache: Callable[[], None]) -> None:
        self.plain = plain
        self.probe = probe  # kv_calls.CacheCalls of the block: where its cache argument is
        self.module = module
        self.on_cache: Callable[[], None] | None = on_cache

    @property
    def __self__(self) -> nn.Module:  # the block, as a bound method has it (kv_calls reads it)
        return self.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.on_cache is not None:
            cache = self.probe.cache_of(args, kwargs)
            if is_cache(cache) or is_view(cache):
                on_cache, self.on_cache = self.on_cache, None
                on_cache()
        return self.plain(*args, **kwargs)


_FUNCTIONS: dict[str, pc.PrecompiledFunction] = {}  # entry name -> its function, process-wide
_LOCK = threading.Lock()


def _declined_up_front(compile_kwargs: dict[str, Any], module: nn.Module | None = None) -> str | None:
    backend = compile_kwargs.get("backend", "inductor")
    if backend != "inductor":
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
        return (f"backend {name!r}: precompile needs backend='inductor' (other backends save no "
                f"compiled code with the entry)")
    if "guard_filter_fn" in (compile_kwargs.get("options") or {}):
        return "options['guard_filter_fn'] is given: compile_cache does not replace your filter"
    devices = None if module is None else region_devices(module)
    return cudagraphs.precompile_decline(compile_kwargs, devices)  # torch's load drops them


class GroupPrecompiler:
    """Hands out one precompiled function per group during one install, and reports them."""

    def __init__(self, setup: PrecompileSetup, template: types.FunctionType) -> None:
        self.setup = setup
        self.template = template
        self.functions: dict[str, pc.PrecompiledFunction] = {}
        self._declines: dict[str, list[str]] = {}  # reason -> group labels, warned at finish()
        self._routed: set[str] = set()  # groups whose cache calls compile plain (reported once)

    def function(self, code_name: str, label: str, compile_kwargs: dict[str, Any],
                 module: nn.Module) -> pc.PrecompiledFunction:
        """The group's precompiled function (created once per entry name in a process)."""
        pf = self.functions.get(code_name)
        if pf is not None:
            return pf
        # canonical keywords, as the store key has them: equal settings name one entry
        name = pc.entry_name(self.setup.store_key, code_name,
                             canonical_compile_kwargs(compile_kwargs), self.template,
                             class_lineage(module))
        with _LOCK:
            pf = _FUNCTIONS.get(name)
            if pf is None:
                record = self.setup.records.get(name) or {}
                declined = _declined_up_front(compile_kwargs, module)
                if declined is None and isinstance(record.get("declined"), str):
                    declined = f"{record['declined']} (found by an earlier start, recorded in the store)"
                fn = pc.region_function(self.template, name)
                # a part outside the regions (a whole model: compile_cache.compile) is not
                # pinned on the block, and a call whose own frame graph-breaks declines before
                # it runs: its graph breaks would put a decline after frames ran
                pf = _FUNCTIONS[name] = pc.PrecompiledFunction(
                    fn, compile_kwargs, declined=declined, record=_record_of(record), block=module,
                    pin_block=not is_part_code(code_name))
        self.functions[code_name] = pf
        pf.on_decline(lambda f: self._declined_later(code_name, label, f))
        if pf.status == "unused":
            pf.on_first_trace(lambda f: self._first_trace(code_name, label, name, f))
        status, detail = pf.status, pf.declined or _unproven_detail(pf)
        if pf.load_error and status != "failed":
            self._event(PrecompileEvent(code_name, label, name, "load_error", pf.load_error))
            _warn_traced_again(label, f"its restored entry could not be loaded ({pf.load_error})")
        if not (status == "unused" and code_name.endswith((VIEWS_SUFFIX, CACHE_SUFFIX))):
            # a decode-steps or cache-calls function is in the report once used (or loaded)
            self._event(PrecompileEvent(code_name, label, name, status, detail,
                                        unproven=len(pf.dropped_graphs)))
        # Declined for CUDA graphs: warned even when precompile is only the default, since the
        # mode's promise (CUDA graphs) is kept at the cost of a trace per start.
        if status == "failed" or (status == "declined" and (
                self.setup.explicit or cudagraphs.is_decline(detail))):
            self._declines.setdefault(detail, []).append(label)
        elif status == "declined":
            logger.info("compile_cache: precompile is off for %s: %s", label, detail)
        return pf

    def route_cache_calls(self, code_name: str, label: str, reason: str) -> None:
        """A group's first call that passes a KV cache (such calls compile without precompile):
        in the report (``cache_calls``), counted once as a decline, warned when precompile was
        asked for. Not before: a block that could take a cache but is never given one (an
        encoder layer, ``use_cache=False``) is not a KV-cache block."""
        with _LOCK:
            if code_name in self._routed:
                return
            self._routed.add(code_name)
        self._event(PrecompileEvent(code_name, label, "", "cache_calls", reason))
        if self.setup.explicit:
            _warnings.warn(f"compile_cache: precompile is off for some KV-cache calls of "
                           f"{label}: {reason}.", RegionPrecompileWarning)
        else:
            logger.info("compile_cache: precompile is off for %s's cache calls: %s", label, reason)

    def finish(self) -> None:
        """One warning per reason for the groups that declined while compiling."""
        for reason, labels in self._declines.items():
            _warnings.warn(
                f"compile_cache: precompile is off for {', '.join(labels)}: {reason}. "
                f"Compiled normally instead (Dynamo traces it at each start).",
                RegionPrecompileWarning,
            )
        self._declines.clear()

    def _first_trace(self, code_name: str, label: str, name: str, pf: pc.PrecompiledFunction) -> None:
        """The group traced its first graph: new, or traced again because the graphs of its
        restored entry were not installed (warned: a precompiled start was expected)."""
        detail = _unproven_detail(pf)
        if detail:
            _warn_traced_again(label, detail)
        self._event(PrecompileEvent(code_name, label, name, "new", detail, traced_again=bool(detail)))

    def _declined_later(self, code_name: str, label: str, pf: pc.PrecompiledFunction) -> None:
        _warnings.warn(
            f"compile_cache: precompile is off for {label}: {pf.declined}. It compiles "
            f"normally from this call on, with every guard Dynamo keeps (Dynamo traces it at "
            f"each start).",
            RegionPrecompileWarning,
        )
        self._event(PrecompileEvent(code_name, label, pf.fn.__qualname__, "declined",
                                    pf.declined or "", persist=pf.decline_persists))

    def call_path(self, code_name: str, label: str, compile_kwargs: dict[str, Any],
                  module: nn.Module, probe: Any, plain: Callable[[], tuple[Any, int]],
                  cache_calls: Any = None) -> tuple[Any, int | None]:
        """``(module's compiled call path, the recompile bucket of its plain compile or None)``:
        the group's precompiled function (a :class:`BoundCall`); for blocks that take a KV
        cache (``probe``: their kv_calls.CacheCalls) a :class:`CacheRoutedCall` that sends the
        calls that pass one to ``plain()`` (:func:`compile_plain`) and, when the group's decode
        steps go through the layer view (``cache_calls``: the group's kv_calls.CacheCalls, with
        ``use_views``), those steps to the group's precompiled decode function; or ``plain()``
        alone when the group declined precompile up front (as blocks with a cache compiled
        before; a :class:`CacheNotedCall` around it, for the report). The calls that pass a
        cache precompile as the group's ``__cache`` function, with the update traced into the
        graph: always without the eager update (``cache_calls`` None), else when
        ``cache_calls.traced_updates`` (the routed call's ``traced_call``). The calls that update
        the cache eagerly decline precompile (reported, unless the ``__cache`` function's own
        decline sent them there: that is reported already)."""
        bound = BoundCall(self.function(code_name, label, compile_kwargs, module), module)
        if probe is None:
            return bound, None
        compiled, region = plain()
        on_cache = functools.partial(self.route_cache_calls, code_name, label, KV_CACHE_DECLINE)
        if bound.pf.declined:  # every call plain; its cache calls reported all the same
            return CacheNotedCall(compiled, probe, module, on_cache), region
        decode = None
        if cache_calls is not None and cache_calls.use_views:
            pf = self.function(code_name + VIEWS_SUFFIX, f"{label} (decode steps)", compile_kwargs,
                               module)
            decode = BoundCall(pf, module)
            cache_calls.decode_entry_loaded = lambda: pf.status == "loaded"
        if cache_calls is None or cache_calls.traced_updates:
            # The cache update traced into the graph (no graph break: one block, or the traced
            # update of a group): its cache calls precompile as a third function.
            pf = self.function(code_name + CACHE_SUFFIX, f"{label} (KV-cache calls)",
                               compile_kwargs, module)
            if cache_calls is None:
                return CacheRoutedCall(bound, BoundCall(pf, module), probe, decode, None), region
            return CacheRoutedCall(bound, compiled, probe, decode, None, BoundCall(pf, module)), region
        return CacheRoutedCall(bound, compiled, probe, decode, on_cache), region

    def _event(self, event: PrecompileEvent) -> None:
        if self.setup.on_event is not None:
            self.setup.on_event(event)


class PrecompileTracker:
    """A store session's precompile side: what the store records of each entry, the groups'
    precompiled functions, their outcomes in the report and the store's counters.

    Records (entry name -> ``{"declined": why}``: an earlier start found its guards cannot be
    saved faithfully; ``{"pins": {source: description}}``: the globals it relies on, as its
    publisher bound them) travel in the packs' metadata: the newest record of an entry wins, as
    its bytes do.
    """

    METADATA = "precompile_entries"

    def __init__(self, report: Any, store: Any) -> None:
        self.report = report
        self.store = store
        self.records: dict[str, dict[str, Any]] = {}
        self.functions: dict[str, pc.PrecompiledFunction] = {}  # code name -> function
        self._new: dict[str, dict[str, Any]] = {}  # found here: into the next publish
        self._sent: dict[str, str] = {}  # code name -> digest of the entry this store was given

    def restored(self, metadata: list[dict[str, Any]]) -> None:
        """The metadata of the packs a restore applied, oldest first. An entry that appeared
        since the groups compiled (another rank published it) loads now."""
        for meta in metadata:
            records = meta.get(self.METADATA)
            if isinstance(records, dict):
                self.records.update((k, v) for k, v in records.items() if isinstance(v, dict))
        for code_name, pf in self.functions.items():
            if not pf.reload(_record_of(self.records.get(pf.fn.__qualname__))):
                continue
            group = self.report.precompile_groups.setdefault(code_name, {"label": code_name})
            group.update(status=pf.status, reason=pf.declined or _unproven_detail(pf))
            self._count(pf.status, unproven=len(pf.dropped_graphs))
            if pf.declined:
                _warnings.warn(f"compile_cache: precompile is off for {group['label']}: "
                               f"{pf.declined}. Compiled normally instead.", RegionPrecompileWarning)

    def track(self, functions: dict[str, pc.PrecompiledFunction]) -> None:
        """The groups' precompiled functions (code name -> function), to save and reload."""
        self.functions.update(functions)

    def save_changed(self, on_error: Callable[[str, str], None]) -> dict[str, str]:
        """Saves each group's entry that holds something new (normally already saved at the end
        of the compile that traced it: then this only compares digests), and returns (group ->
        entry path) every entry this store has not been given yet in its current version: also
        one that another model's session saved (the same block class in one process shares its
        compiled code, so this model traced nothing), which the store would otherwise never
        get. The publisher reads the files, off the training step."""
        out: dict[str, str] = {}
        for code_name, pf in self.functions.items():
            failed = pf.take_save_error()
            if failed is not None:
                on_error("precompile", f"saving the entry of {code_name}: {failed}")
            try:
                pf.save()
            except Exception as exc:  # noqa: BLE001 - torch's pickling can raise anything
                on_error("precompile", f"saving the entry of {code_name}: {exc}")
                continue
            digest = pf.saved_digest
            if pf.declined is not None or digest is None or self._sent.get(code_name) == digest:
                continue  # a declined group's entry on disk is not what its calls run now
            out[code_name] = pf.entry_path()
            self._sent[code_name] = digest
            self._new[pf.fn.__qualname__] = {"pins": pf.pins.described(),
                                             "values": pf.graph_records(),
                                             "environ": dict(pf.report.environ)}
        return out

    def metadata(self) -> dict[str, Any]:
        """What a publish adds to its pack's metadata."""
        return {self.METADATA: dict(self._new)} if self._new else {}

    def event(self, event: PrecompileEvent) -> None:
        """A group's outcome: into the report and the counters (warned by GroupPrecompiler)."""
        if event.status == "cache_calls":  # the group precompiles; its cache calls do not
            group = self.report.precompile_groups.setdefault(event.code_name, {})
            group["cache_calls"] = f"compiled without precompile: {event.detail}"
            self._count("declined")
            return
        if event.status != "load_error":
            self.report.precompile_groups.setdefault(event.code_name, {}).update(
                label=event.label, status=event.status, reason=event.detail)
        if event.persist:
            self._new[event.entry] = {"declined": event.detail}
        if event.traced_again or event.status == "load_error":
            self.report.precompile_traced_again += 1
        self._count(event.status, unproven=event.unproven)

    def _count(self, status: str, unproven: int = 0) -> None:
        if unproven:
            self.report.precompile_unproven += unproven
            record_precompile(self.store, unproven=unproven)
        if status == "loaded":
            self.report.precompile_hits += 1
            record_precompile(self.store, hits=1)
        elif status == "declined":
            self.report.precompile_declined += 1
            record_precompile(self.store, declined=1)
        elif status in ("failed", "load_error"):
            self.report.precompile_load_errors += 1
            record_precompile(self.store, load_errors=1)


def _warn_traced_again(label: str, why: str) -> None:
    """A restored precompiled entry that did not (all) load: its calls are traced again, which
    a precompiled start exists to skip. Warned, so that losing it is never silent (the report's
    outcome says ``hit, traced again``; ``stats`` counts it)."""
    _warnings.warn(f"compile_cache: precompile traced {label} again: {why}. The outputs are "
                   "right; the start is slower than a precompiled one.", RegionPrecompileWarning)


def _unproven_detail(pf: pc.PrecompiledFunction) -> str:
    if not pf.dropped_graphs:
        return ""
    return (f"{len(pf.dropped_graphs)} restored graph(s) not installed, traced again: "
            + "; ".join(pf.dropped_graphs))


def _record_of(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The part of an entry's record a load proves itself with (pins and per-graph values)."""
    if not isinstance(record, dict) or "pins" not in record:
        return None
    return {"pins": record.get("pins"), "values": record.get("values"),
            "environ": record.get("environ") or {}}


_warned_global_flag = False


def isolate_from_global_flag() -> bool:
    """Whether the process has ``caching_precompile`` on (``TORCH_CACHING_PRECOMPILE=1``): the
    regions then compile and run without it, since its forced drop of identity guards is not
    safe for them. Warned once per process."""
    global _warned_global_flag
    if not pc.global_flag_on():
        return False
    if not _warned_global_flag:
        _warned_global_flag = True
        _warnings.warn(
            "compile_cache: torch._dynamo.config.caching_precompile is on for the whole process "
            "(TORCH_CACHING_PRECOMPILE=1); compile_cache compiles its regions without it, since "
            "it drops identity guards. compile_regions(..., precompile=True) is a precompile "
            "that keeps them.",
            RegionPrecompileWarning,
        )
    return True


def compile_plain(fn: types.FunctionType, module: nn.Module, key: Any,
                  compile_kwargs: dict[str, Any]) -> tuple[Any, int]:
    """A region group compiled without precompile, for ``module``: one ``torch.compile`` per
    group and keywords (``key``), shared like the group's code object, with its own recompile
    bucket where torch has it (the bucket's id, else -1). With the process-wide
    ``caching_precompile`` on, compiled and run with it off (:func:`isolate_from_global_flag`).

    Every path returns the compile bound to ``module`` (a method whose ``__self__`` is the
    block): kv_calls.CacheCalls reads the block's varying attributes (``layer_idx``) through
    ``__self__`` before it lets a decode step take the layer view. Up to c50a859 a torch without
    ``isolate_recompiles`` (2.11) got ``torch.compile(bound method)``, a function without
    ``__self__``: the attributes read as missing, a block moved to another layer kept its view of
    the old one and wrote and read the wrong layer (issue 52, test_generate's
    ``another_layer[attribute]``)."""
    import torch

    from .torch_compat import dynamo

    isolate = isolate_from_global_flag()
    compile_group = pc.compile_group_isolated if isolate else dynamo.compile_group
    group = compile_group(fn, key, **compile_kwargs)
    if group is not None:
        return types.MethodType(group[0], module), group[1]
    if isolate:
        return types.MethodType(pc.compile_isolated(fn, **compile_kwargs), module), -1
    return types.MethodType(torch.compile(fn, **compile_kwargs), module), -1


def _reset() -> None:
    """Forget the process's precompiled functions and warnings (tests)."""
    global _warned_global_flag
    with _LOCK:
        _FUNCTIONS.clear()
    _warned_global_flag = False
