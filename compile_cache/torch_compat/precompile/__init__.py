"""Dynamo's caching precompile, used so that it is never wrong (torch 2.13's private API).

Precompile saves Dynamo's traced bytecode and guards (a *package*) next to Inductor's
artifacts, so a later start skips tracing. compile_cache uses it per region group:

* **Guards** (:mod:`.guards`): every guard that can be saved is kept, in process and
  on disk; only identity guards that the store key pins are dropped; a region whose guards
  cannot be saved faithfully declines precompile and compiles normally (:class:`PrecompiledFunction`
  does it, the caller warns and counts).
* **Scope**: ``torch._dynamo.config.caching_precompile`` (and, with it,
  ``torch._functorch.config.force_non_lazy_backward_lowering``, so a training graph's backward
  is compiled, and saved, inside the call) is set only around our own ``torch.compile()`` and
  around our own region calls. The user's other compiles and the Dynamo config digest of the
  environment key never see it. When the user turned it on process-wide
  (``TORCH_CACHING_PRECOMPILE=1``), Dynamo's forced drop of identity guards would apply to our
  regions too: they then compile and run with it off (:func:`compile_isolated`).
* **Pins** (:mod:`.pins`): the globals whose identity guards had to be dropped are
  checked at every call, and against the publisher's record before an entry loads.
* **Values** (:mod:`.values`): each graph carries the values its kept guards were
  traced with; before torch reads an entry, each graph proves them in the scope torch rebuilds
  its guards in, and a graph that does not is taken out of the entry (that call traces again).
  Torch rebuilds a loaded entry's guards from the loading process, so without this a value read
  through a module or a class would be compared with itself.
* **Modes**: ``mode=`` is folded into ``options`` (torch takes one or the other; the guard
  filter needs ``options``).
* **Naming** (:mod:`.names`): Dynamo's on-disk id is
  ``sha256(fn.__qualname__ + first line)`` of the compiled function. Each (store key, group,
  compile keywords, trampoline code) gets its own function, code object and module namespace
  named by that digest, so no two models or groups share an entry, and the globals a loaded
  package installs (resume functions named by the publisher's counter) never meet another
  package's.
* **Saving** (:meth:`PrecompiledFunction.save`): ``DynamoCache.save(package)`` when the package
  is faithful and holds something new; never ``torch.compiler.save_cache_artifacts()`` with the
  flag on (it saves every package of the process, the user's too, and marks one ``bypassed`` for
  good when a backend is missing).
* **A torch 2.13 bug worked around** (:func:`_advance_unique_ids`): a loaded package installs
  globals named by the publisher's ``unique_id`` counter (``__builtins_dict___0``); the next
  trace in the loading process picks the same name and fails (``Name '__builtins_dict___0'
  already exists in scope``). After a load the counter moves past them.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import re
import shutil
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from ...errors import PrecompileDeclined
from .. import available, capability, mark_missing
from .guards import GuardReport, environ_differs, make_guard_filter, unsupported_guard_types
from .isolation import IsolatedCall, compile_group_isolated, compile_isolated
from .lazy_globals import lazy_entry_reads
from .names import ENTRY_FORMAT, entry_name, region_function
from .names import advance_unique_ids as _advance_unique_ids
from .pins import Pins, class_pins, verify
from .values import check_entry, graph_digest

logger = logging.getLogger("compile_cache")

__all__ = [
    "CAPABILITY",
    "ENTRY_FORMAT",
    "IsolatedCall",
    "PrecompiledFunction",
    "compile_group_isolated",
    "compile_isolated",
    "entry_name",
    "global_flag_on",
    "region_function",
    "usable",
]

CAPABILITY = "dynamo.precompile"


@capability(
    CAPABILITY,
    needs="torch._dynamo.config.caching_precompile, torch._functorch.config."
    "force_non_lazy_backward_lowering, torch._dynamo.package (CompilePackage, DynamoCache), "
    "torch._dynamo.precompile_context.PrecompileContext, torch._dynamo.types.GuardFilterEntry, "
    "CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES, "
    "torch._C._dynamo.eval_frame._reset_precompile_entries, "
    "torch._dynamo.bytecode_transformation._unique_id_counter, and config overrides that hold "
    "per thread (a ContextVar per setting, as torch 2.13 has them)",
    breaks="precompile is off: regions compile normally and Dynamo traces at every start",
)
def _probe_precompile() -> str | None:
    import torch._dynamo.bytecode_transformation as bt
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    from torch._dynamo.package import CompilePackage, DynamoCache
    from torch._dynamo.precompile_context import PrecompileContext
    from torch._dynamo.types import GuardFilterEntry

    if not hasattr(dynamo_config, "caching_precompile"):
        return "torch._dynamo.config has no 'caching_precompile'"
    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return "torch._functorch.config has no 'force_non_lazy_backward_lowering'"
    for owner, names in ((CompilePackage, ("source_id_from_fn", "install", "uninstall")),
                         (DynamoCache, ("save", "load", "path_prefix")),
                         (PrecompileContext, ("serialize_artifact_by_key",))):
        for name in names:
            if not callable(getattr(owner, name, None)):
                return f"{owner.__name__} has no {name}()"
    fields = {f.name for f in dataclasses.fields(GuardFilterEntry)}
    wanted = {"name", "has_value", "value", "guard_type", "derived_guard_types", "is_global",
              "orig_guard"}
    if not wanted <= fields:
        return f"GuardFilterEntry lacks {sorted(wanted - fields)}"
    unsupported_guard_types()
    from torch._C._dynamo.eval_frame import _reset_precompile_entries  # noqa: F401

    if not isinstance(getattr(bt, "_unique_id_counter", None), itertools.count):
        return "torch._dynamo.bytecode_transformation._unique_id_counter is not an itertools.count"
    # A region call switches caching_precompile (and suppress_errors) on for its own compile.
    # Where an override is process-wide (torch 2.11 and earlier), another thread's compile in
    # that window would drop its ID_MATCH and closure guards: a compiled frame reused for the
    # wrong objects. Precompile needs the override to hold for the calling thread only.
    entry = getattr(dynamo_config, "_config", {}).get("caching_precompile")
    if not isinstance(getattr(entry, "user_override", None), contextvars.ContextVar):
        return ("torch's config overrides are process-wide, not per thread: a region call's "
                "caching_precompile would reach other threads' compiles")
    return None


def usable() -> bool:
    """Whether this torch offers what precompile needs (warns once when it does not)."""
    return available(CAPABILITY)


def global_flag_on() -> bool:
    """Whether ``caching_precompile`` is on for the whole process (``TORCH_CACHING_PRECOMPILE``)."""
    config = sys.modules.get("torch._dynamo.config")
    return bool(getattr(config, "caching_precompile", False))


# --------------------------------------------------------------------------------------------
# The compiled function


def _package_of(compiled: Any) -> Any:
    """The CompilePackage ``torch.compile`` created (the OptimizeContext in the wrapper's closure)."""
    closure = getattr(compiled, "__closure__", None) or ()
    names = getattr(getattr(compiled, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, closure, strict=False):
        if name == "self":
            package = getattr(cell.cell_contents, "_package", None)
            if package is not None:
                return package
    mark_missing(CAPABILITY, "torch.compile's wrapper no longer exposes its CompilePackage")
    raise PrecompileDeclined("torch.compile's wrapper exposes no CompilePackage (torch moved it)")


@functools.cache
def _counters() -> Any:
    from torch._dynamo.utils import counters  # imported once: read in every region call

    return counters


def _counter_frames(which: str = "ok") -> int:
    """Frames Dynamo has traced in this process (``counters["frames"]``: ``ok``, or ``total``
    with those whose compile failed)."""
    return _counters()["frames"][which]


def _counter(name: str) -> int:
    return int(_counters()["dynamo_cache"][name])


class PrecompiledFunction:
    """``torch.compile(fn, **compile_kwargs)`` whose Dynamo package is loaded from and saved to
    ``<inductor cache>/dynamo/<id>/entry``, with guards that never make it wrong.

    Call it like the compiled function. ``status`` is ``"loaded"`` (an entry was installed: the
    calls it covers trace nothing), ``"new"`` (no entry yet: what the calls trace is saved by
    :meth:`save`), ``"declined"`` (``declined`` says why) or ``"failed"`` (an entry did not load,
    ``load_error`` says why): the function then runs a copy compiled without precompile, with every default guard.
    ``declined`` given at construction declines at once (another backend, the process-wide flag).
    Listeners added with :meth:`on_decline` hear of a decline that happens during a call.
    """

    def __init__(self, fn: types.FunctionType, compile_kwargs: dict[str, Any], *,
                 declined: str | None = None, record: dict[str, Any] | None = None,
                 block: Any = None, pin_block: bool = True) -> None:
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config
        from torch._dynamo.package import CompilePackage

        self.fn = fn
        self.compile_kwargs = dict(compile_kwargs)
        self.report = GuardReport()
        self.declined: str | None = None
        self.load_error: str | None = None
        self.loaded = False
        self.package: Any = None
        self._listeners: list[Callable[[PrecompiledFunction], None]] = []
        self._trace_listeners: list[Callable[[PrecompiledFunction], None]] = []
        self._configs = dynamo_config, functorch_config
        #: The code object Dynamo caches the running compile under (guard failures, entries).
        self.code: types.CodeType = fn.__code__
        self._saved_digest: str | None = None
        self._lock = threading.Lock()
        self.pins = Pins(fn.__globals__)
        if block is not None and pin_block:  # the block's methods, swapped after compiling
            self.pins.add(class_pins(block))
        self._pins_seen = 0
        #: The group's first block (weakly): what a pin on the block is checked on at load.
        self._block = weakref.ref(block) if block is not None else None
        #: Whether identities stored on the block are pinned (a region's block) or decline in
        #: the first frame (a part compiled whole: :func:`.guards.make_guard_filter`).
        self._pin_block = pin_block
        #: False for a decline that depends on this process (a global bound differently): the
        #: store should not remember it for the entry.
        self.decline_persists = True
        self.source_id = CompilePackage.source_id_from_fn(fn)
        self._save_error: str | None = None
        #: Why graphs of the loaded entry were not installed (they trace again), if any.
        self.dropped_graphs: list[str] = []
        if declined is None and global_flag_on():
            declined = ("torch._dynamo.config.caching_precompile is on for the whole process "
                        "(TORCH_CACHING_PRECOMPILE=1); its forced drop of identity guards is not "
                        "safe for compile_cache's regions")
        if declined is not None:
            self._decline(declined)
            return
        self._compile(record)

    def _compile(self, record: dict[str, Any] | None) -> None:
        """``torch.compile`` with precompile: loads the entry on disk, if any and trusted."""
        import torch
        import torch._dynamo.config as dynamo_config
        from torch._guards import TracingContext, tracing

        _load_unsaved_grads()  # before the values check unpickles the entry's guards
        declined = self._check_entry_before_loading(record)
        if declined is not None:
            self._decline(declined)
            return
        _quiet_declines()  # once per function, not in every call of the forward path
        fn = self.fn
        kwargs = dict(self.compile_kwargs)
        options = _mode_options(kwargs)
        options["guard_filter_fn"] = make_guard_filter(self.report, fn.__code__,
                                                       self._end_call_on_decline,
                                                       pin_block=self._pin_block)
        hits, errors = _counter("dynamo_cache_hit"), _counter("dynamo_cache_error")
        scope_before = frozenset(fn.__globals__)
        try:
            # A loaded entry's guards are unpickled inside torch.compile; some sources install a
            # guard as they are (ImportSource: __import__('torch'), Mamba's), which needs a
            # tracing context that torch 2.13 sets up only for entries with a compile id: a
            # throwaway one here, so such an entry loads instead of failing.
            with dynamo_config.patch(caching_precompile=True), tracing(TracingContext(None)), \
                    lazy_entry_reads():
                # torch.compile pops guard_filter_fn out of the dict it is given: pass a copy.
                self.compiled = torch.compile(fn, options=dict(options), **kwargs)
            self.package = _package_of(self.compiled)
            _record_graph_values(self.package, self.report)
        except PrecompileDeclined as exc:
            self._decline(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bad entry can raise anything here
            # torch catches only RuntimeError around installing an entry; undo what a half
            # install left on the code object, and compile without precompile.
            self.load_error = f"{type(exc).__name__}: {exc}"
            _undo_load(fn, scope_before)
            self._decline(f"the precompile entry did not load ({self.load_error})")
            return
        self.loaded = _counter("dynamo_cache_hit") > hits
        if _counter("dynamo_cache_error") > errors:
            self.load_error = "torch could not read the precompile entry (dynamo_cache_error)"
        if self.loaded:
            _advance_unique_ids(fn.__globals__)
            self.pins.add_current((record or {}).get("pins") or (), self._block_now())
            # What the entry on disk holds: a save that adds nothing is skipped (pickling the
            # same package again gives other bytes, which would republish at every start).
            self._saved_digest = self.content_digest()

    def reload(self, record: dict[str, Any] | None) -> bool:
        """Loads an entry that appeared on disk after this function compiled (another rank
        published it meanwhile), when nothing has been traced, loaded or declined yet. True
        when it tried (``status`` says how it went)."""
        from torch._dynamo.package import DynamoCache

        with self._lock:
            if self.declined is not None or self.loaded or self.package is None:
                return False
            if any(c.guarded_codes for c in self.package._codes.values()):
                return False
            if not os.path.exists(os.path.join(DynamoCache.path_prefix(), self.source_id, "entry")):
                return False
            self._compile(record)
            return True

    def _check_entry_before_loading(self, record: dict[str, Any] | None) -> str | None:
        """An entry on disk loads only with the publisher's record: every pin names here what it
        named there, and each graph proves the values it was traced under
        (:func:`.values.check_entry`: the graphs that do not are taken out of the
        entry, and those calls trace again). An entry with no record is removed (traced again)."""
        from torch._dynamo.package import DynamoCache

        entry_dir = os.path.join(DynamoCache.path_prefix(), self.source_id)
        path = os.path.join(entry_dir, "entry")
        if not os.path.exists(path):
            return None
        pins, graphs = (record or {}).get("pins"), (record or {}).get("values")
        if not isinstance(pins, dict) or not isinstance(graphs, dict):
            logger.info("compile_cache: precompile entry %s has no record of its pins and values; "
                        "tracing it again", self.fn.__qualname__)
            shutil.rmtree(entry_dir, ignore_errors=True)
            return None
        block = self._block_now()
        reason = verify(pins, self.fn.__globals__, *(() if block is None else (block,)))
        if reason is None:
            reason = environ_differs((record or {}).get("environ") or {})
        if reason is not None:
            self.decline_persists = False
            return reason
        self.report.environ.update((record or {}).get("environ") or {})
        try:
            checked = check_entry(path, graphs)
        except Exception as exc:  # noqa: BLE001 - an unreadable entry is traced again
            logger.info("compile_cache: precompile entry %s could not be checked (%s: %s); tracing "
                        "it again", self.fn.__qualname__, type(exc).__name__, exc)
            shutil.rmtree(entry_dir, ignore_errors=True)
            # in the report: the group says why it traced although the store had its entry
            self.dropped_graphs = [f"the entry could not be checked ({type(exc).__name__}: {exc})"]
            return None
        self.report.values.adopt(checked.kept)
        self.dropped_graphs = list(checked.dropped)
        if checked.dropped:
            logger.info("compile_cache: %d graph(s) of precompile entry %s not loaded, traced "
                        "again: %s", len(checked.dropped), self.fn.__qualname__,
                        "; ".join(checked.dropped))
        return None

    def _block_now(self) -> Any:
        return self._block() if self._block is not None else None

    def _end_call_on_decline(self) -> None:
        """The guard filter declines the region's own frame: nothing of the call has run, so
        the error ends the call (errors not suppressed) instead of Dynamo running the frame,
        and tracing the frames it calls, eagerly; :meth:`__call__` then runs it without
        precompile. Restored by :meth:`__call__`."""
        self._configs[0].suppress_errors = False

    # -- state ---------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """``loaded``, ``new`` (traced here, saved for the next start), ``unused`` (no entry
        loaded and nothing traced yet), ``failed`` (an entry did not load) or ``declined``."""
        if self.declined is not None:
            return "failed" if self.load_error is not None else "declined"
        if self.loaded:
            return "loaded"
        return "new" if self.traced else "unused"

    def on_decline(self, listener: Callable[[PrecompiledFunction], None]) -> None:
        """Call ``listener(self)`` when a later call declines precompile."""
        self._listeners.append(listener)

    def on_first_trace(self, listener: Callable[[PrecompiledFunction], None]) -> None:
        """Call ``listener(self)`` when a call traces while the status is ``unused``."""
        self._trace_listeners.append(listener)

    # -- calling -------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.declined is not None:
            return self.compiled(*args, **kwargs)
        if self.pins.watching:  # every call: a global rebound since the trace declines
            moved = self.pins.changed(args[0] if args else None, args[1:], kwargs)
            if moved is not None:
                self.decline_persists = False
                self._decline_during_call(moved)
                return self.compiled(*args, **kwargs)
        # caching_precompile on for our own traces only (a ContextVar in torch 2.13: per
        # thread): Dynamo records the package and AOTAutograd bundles its entry as the
        # package's backend, while the FX graph cache stays in use; the backward of a training
        # graph compiles now, inside the call, not lazily at .backward() with the flag off.
        # A frame whose guards cannot be saved makes the guard filter raise. With errors
        # suppressed (for this thread, this call) that frame runs eagerly and the call finishes
        # once: running the whole call again would repeat what the frames before it already did
        # (a buffer updated in place, random numbers drawn, a KV cache appended to).
        dynamo_config, functorch_config = self._configs
        old = (dynamo_config.caching_precompile, dynamo_config.suppress_errors,
               functorch_config.force_non_lazy_backward_lowering)
        dynamo_config.caching_precompile = dynamo_config.suppress_errors = True
        functorch_config.force_non_lazy_backward_lowering = True
        traced, tried = _counter_frames(), _counter_frames("total")
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as exc:
            # Dynamo re-raises the filter's PrecompileDeclined wrapped (InternalTorchDynamoError)
            if not (_caused_by(exc, PrecompileDeclined) or not self.report.safe):
                raise
            if _counter_frames() != traced:  # a frame of this call ran: never run it twice
                self._decline_during_call()
                raise
        else:
            failed = (_counter_frames("total") - tried) - (_counter_frames() - traced)
            if self.report.safe and not failed:
                if len(self.report.pins) != self._pins_seen:  # new frames traced
                    self._pins_seen = len(self.report.pins)
                    self.pins.add(self.report.pins)
                if _counter_frames() != traced:  # this call compiled: its entry is saved now,
                    first = bool(self._trace_listeners)
                    self._save_after_compile()  # as part of the compile, not in a step's hook
                    if first:
                        for listener in self._trace_listeners:
                            listener(self)
                        self._trace_listeners = []
                return out
            # A frame ran eagerly (its guards could not be saved, or its compile failed: torch
            # logged why): the output is right; compile without precompile from now on.
            self._decline_during_call(None if not self.report.safe else
                                      f"{failed} frame(s) failed to compile and ran eagerly "
                                      "(torch._dynamo logged why)")
            return out
        finally:
            (dynamo_config.caching_precompile, dynamo_config.suppress_errors,
             functorch_config.force_non_lazy_backward_lowering) = old
        self._decline_during_call()  # declined before any frame of this call ran: run it plain
        return self.compiled(*args, **kwargs)

    def _decline_during_call(self, reason: str | None = None) -> None:
        with self._lock:
            if self.declined is not None:
                return
            if self.report.graph_break:  # the path that breaks declines, not the saved entry
                self.decline_persists = False
            self._decline(reason or "; ".join(self.report.declined) or "declined")
        for listener in list(self._listeners):
            listener(self)

    def _decline(self, reason: str) -> None:
        """Compile a copy of the function without precompile (fresh code object, default
        guards); every later call runs it."""
        self.declined = reason
        logger.debug("compile_cache: precompile declined for %s: %s", self.fn.__qualname__, reason)
        name = f"{self.fn.__qualname__}__noprecompile"
        code = self.fn.__code__.replace(co_name=name, co_qualname=name)
        plain = types.FunctionType(code, self.fn.__globals__, name, self.fn.__defaults__,
                                   self.fn.__closure__)
        plain.__qualname__ = name
        self.code = code
        self.compiled = compile_isolated(plain, **self.compile_kwargs)
        self.package = None

    # -- saving --------------------------------------------------------------------------------
    def why_not_saveable(self) -> str | None:
        """None when the package can be saved faithfully, else the reason."""
        from torch._dynamo.precompile_context import PrecompileContext

        if self.declined is not None or not self.report.safe:
            return "declined: " + (self.declined or "; ".join(self.report.declined))
        codes = list(self.package._codes.values())
        if not any(c.guarded_codes for c in codes):
            return "nothing traced into the package yet"
        if any(c.bypassed for c in codes):
            return "torch bypassed the package (a guard or value could not be serialised)"
        for code in codes:
            for backend_id in code.backend_ids:
                if PrecompileContext.serialize_artifact_by_key(backend_id) is None:
                    return f"backend {backend_id} not recorded yet"
        return None

    def save(self, *, blocking: bool = True, at: str = "forward") -> tuple[bool, str]:
        """Writes the entry when it is faithful and holds something new: (written, why).

        Called right after a call that traced (as part of that compile; not blocking: a busy
        function is saved later) and again, cheaply, after forwards: an unchanged entry costs
        one digest, not a serialisation."""
        from torch._dynamo.package import DynamoCache

        if not self._lock.acquire(blocking=blocking):
            return False, "busy"
        try:
            digest = self.content_digest()
            if digest is not None and digest == self._saved_digest:
                return False, "unchanged"
            reason = self.why_not_saveable()
            if reason is not None:
                return False, reason
            DynamoCache.save(self.package)  # write_atomic into <cache_dir>/dynamo/<id>/entry
            self._saved_digest = digest
            SAVES[at] = SAVES.get(at, 0) + 1
            return True, "written"
        finally:
            self._lock.release()

    def _save_after_compile(self) -> None:
        try:
            self.save(blocking=False, at="compile")
        except Exception as exc:  # noqa: BLE001 - never fail the user's call for a cache save
            self._save_error = f"{type(exc).__name__}: {exc}"

    def take_save_error(self) -> str | None:
        """Why the last save at the end of a compile failed (once), else None."""
        error, self._save_error = self._save_error, None
        return error

    @property
    def traced(self) -> bool:
        """Whether the package holds a graph (traced here, or loaded)."""
        return self.package is not None and any(c.guarded_codes for c in self.package._codes.values())

    def graph_records(self) -> dict[str, dict[str, str]]:
        """The values each graph of the package was traced under (graph digest -> {guard source:
        value}), for the entry's record in the store."""
        if self.package is None:
            return {}
        digests = [graph_digest(guarded.guards_state)
                   for entry in self.package._codes.values() for guarded in entry.guarded_codes]
        return self.report.values.records_for(digests)

    @property
    def saved_digest(self) -> str | None:
        """The :meth:`content_digest` of the entry on disk (saved here, or loaded), else None."""
        return self._saved_digest

    def content_digest(self) -> str | None:
        """A digest of what the package holds: every frame's guards and bytecode, per code."""
        if self.package is None:
            return None
        h = hashlib.sha256()
        for code, entry in self.package._codes.items():
            h.update(code.co_name.encode())
            for guarded in entry.guarded_codes:
                h.update(hashlib.sha256(guarded.guards_state).digest())
                h.update(hashlib.sha256(guarded.dynamo_code.co_code).digest())
            h.update(repr(sorted(entry.function_names)).encode())
        return h.hexdigest()

    def entry_path(self) -> str:
        """Where :meth:`save` writes the entry (under torch's local Inductor cache dir)."""
        from torch._dynamo.package import DynamoCache

        return os.path.join(DynamoCache.path_prefix(), self.source_id, "entry")


#: Entries written, by where: ``compile`` (right after the call that traced them, as part of
#: that compile) or ``forward`` (by the forward's hook: only when that save was skipped).
SAVES: dict[str, int] = {}


def _record_graph_values(package: Any, report: GuardReport) -> None:
    """File the values of each frame the guard filter saw under the graph Dynamo then adds to
    ``package`` (``CompilePackage.add_guarded_code``, called right after the frame's guards)."""
    add = package.add_guarded_code

    def add_guarded_code(guards_state: bytes, dynamo_code: types.CodeType) -> None:
        add(guards_state, dynamo_code)
        report.values.graph_added(guards_state)
        _record_module_globals(package, dynamo_code, report)

    package.add_guarded_code = add_guarded_code


#: A Python module Dynamo's bytecode loads under a name of this process
#: (``torch/_dynamo/codegen.py``, ``create_load_python_module``: ``___module_<name>_<id>_c<n>``).
_MODULE_GLOBAL = re.compile(r"^___module_\w+_\d+_c\d+$")


def _record_module_globals(package: Any, code: types.CodeType, report: GuardReport) -> None:
    """Make a saved frame install the modules its bytecode loads by a process-local name.

    Dynamo's bytecode loads a module that the frame's globals do not hold under its own name
    (``collections``, to rebuild transformers' ``ModelOutput``, an ``OrderedDict``) from a global
    it installs as ``___module_collections_<id>_c<n>``; torch 2.13 does not record it with the
    package (unlike ``__import_<module>`` aliases), so a loaded entry fails with ``NameError`` on
    another process. Each such name is recorded as the package's import source (installed at
    load as ``importlib.import_module(name)``); one that is not a module declines precompile."""
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(n for n in c.co_names if _MODULE_GLOBAL.match(n))
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    if not names:
        return
    entry = getattr(package, "_current_entry", None)
    scope = getattr(sys.modules.get(getattr(entry, "python_module", "")), "__dict__", {})
    for name in sorted(names):
        module = scope.get(name)
        if isinstance(module, types.ModuleType) and sys.modules.get(module.__name__) is module:
            package.add_import_source(name, module.__name__)
        else:
            reason = (f"the traced bytecode loads {name}, a global Dynamo installed in this "
                      "process only, that is not an importable module (a loaded entry would not "
                      "find it)")
            if reason not in report.declined:
                report.declined.append(reason)


def _mode_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the options of ``mode`` folded in (``mode`` popped from ``kwargs``):
    torch.compile takes either a mode or options, and precompile needs options for its filter.
    The options given win over the mode's, as torch applies them."""
    options = dict(kwargs.pop("options", None) or {})
    mode = kwargs.pop("mode", None)
    if mode is None or mode == "default":
        return options
    from torch._inductor import list_mode_options

    return {**list_mode_options(mode, kwargs.get("dynamic")), **options}


def _undo_load(fn: types.FunctionType, scope_before: frozenset[str]) -> None:
    """Leave nothing of a load that raised half-way: torch installs a package's globals into the
    function's namespace as it goes (import aliases, resume functions, backends, and the builtins
    dict, which ``CompilePackage.uninstall`` does not know of) and entries on its code object.
    The names that load added are removed, torch's unique-id counter is moved past them, and
    the code's entries are reset, so the trace that follows (the declined copy shares the
    namespace) never meets them: before, a numpy class attribute's failed load made that trace
    raise ``Name '__builtins_dict___0' already exists in scope``."""
    scope = fn.__globals__
    _advance_unique_ids(scope)
    for name in set(scope) - scope_before:
        scope.pop(name, None)
    _reset_precompile_entries(fn.__code__)


def _reset_precompile_entries(code: types.CodeType) -> None:
    try:
        from torch._C._dynamo.eval_frame import _reset_precompile_entries as reset

        reset(code)
    except Exception:  # noqa: BLE001 - the declined copy has its own code object anyway
        logger.debug("compile_cache: could not reset precompile entries", exc_info=True)


class _DropDeclines(logging.Filter):
    """Drops torch's log of a suppressed compile error that is our guard filter's decline: the
    RegionPrecompileWarning says it once (torch would log it with a traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not _caused_by(exc, PrecompileDeclined)


_DROP_DECLINES = _DropDeclines()


def _quiet_declines() -> None:
    logger_ = logging.getLogger("torch._dynamo.convert_frame")
    if _DROP_DECLINES not in logger_.filters:
        logger_.addFilter(_DROP_DECLINES)
    _quiet_guard_pickling()


#: What torch warns when a guard's value is read off a non-leaf tensor's ``.grad``.
_GRAD_WARNING = r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"


def _quiet_guard_pickling() -> None:
    """Torch pickles a traced frame's guard state for the package
    (``torch._dynamo.guards.pickle_guards_state``), reading each guarded tensor's ``.grad``, a
    non-leaf's included, which warns: a warning plain ``torch.compile`` (nothing saved) never
    gives, once per training frame. Silenced around that pickling, only while
    ``caching_precompile`` is on (our own compiles)."""
    import warnings

    import torch._dynamo.config as dynamo_config
    import torch._dynamo.guards as dynamo_guards

    original = getattr(dynamo_guards, "pickle_guards_state", None)
    if original is None or getattr(original, "_compile_cache_quiet", False):
        return

    @functools.wraps(original)
    def pickle_guards_state(*args: Any, **kwargs: Any) -> Any:
        if not dynamo_config.caching_precompile:
            return original(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_GRAD_WARNING, category=UserWarning)
            return original(*args, **kwargs)

    pickle_guards_state._compile_cache_quiet = True  # type: ignore[attr-defined]
    dynamo_guards.pickle_guards_state = pickle_guards_state


def _load_unsaved_grads() -> None:
    """Torch pickles a guarded tensor with its ``.grad`` (``GuardsStatePickler``); a ``.grad``
    that no guard reads is not in the guard tree and is saved as a ``_Missing`` placeholder,
    which unpickling then assigns to the rebuilt fake tensor's ``.grad``: ``TypeError: assigned
    grad expected to be a Tensor or None``, and the entry cannot load. That is every graph traced
    after a backward left gradients on the parameters (T5: ``generate()`` after a training step
    without ``zero_grad``). A grad no guard reads is rebuilt as None: the guards built from the
    tensor never look at it (a guard that did would have put it in the tree, saved for real)."""
    import torch._dynamo.guards as dynamo_guards

    pickler = getattr(dynamo_guards, "GuardsStatePickler", None)
    missing = getattr(dynamo_guards, "_Missing", None)
    original = getattr(pickler, "_unpickle_tensor", None)
    if original is None or missing is None or getattr(original, "_compile_cache_grads", False):
        return
    unpickle = original.__func__

    def _unpickle_tensor(cls: type, *args: Any) -> Any:
        if args and isinstance(args[-1], missing):
            args = (*args[:-1], None)
        return unpickle(cls, *args)

    _unpickle_tensor._compile_cache_grads = True  # type: ignore[attr-defined]
    pickler._unpickle_tensor = classmethod(_unpickle_tensor)


def _caused_by(exc: BaseException | None, kind: type) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
