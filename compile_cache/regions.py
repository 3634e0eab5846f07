"""Compiled call paths installed in place, and watching them run: eager runs and recompiles.

:func:`install` applies a :class:`~compile_cache.plan.RegionPlan`:

* Every module compiled with ``.compile()`` compiles the same function, ``Module._call_impl``, so
  all of them share one Dynamo code object and one cache: a block, the embeddings and the head
  each fail the others' guards, recompile, and the recompiles switch on automatic dynamic shapes.
  Here each group gets its **own code object** (a copy of a small trampoline, named after the
  group's class and fingerprint, so logs and profile-guided state name it too). Identical blocks
  share one compiled graph; different groups never see each other's guards.
* The model is compiled **in place**: a runner is installed as the module's
  ``_compiled_call_impl``, where ``nn.Module.compile()`` puts its compiled function. Class,
  ``state_dict()`` keys, parameters, hooks and instance-bound ``forward``s stay and are traced by
  Dynamo (the trampoline calls ``self._call_impl``). Only this module installs there (through
  :mod:`compile_cache.torch_compat.module_calls`); :func:`observe_calls` is how others (the session) see a call end.
* The trampoline runs ``if not torch.compiler.is_compiling(): <report>``. Dynamo folds that branch
  away in compiled code, so it runs only when the region executes **uncompiled** (recompile limit
  hit, frame skipped, compile disabled): that is reported with a ``RegionEagerWarning`` once per
  group and counted, never silent. Recompiles between identical blocks (a per-block attribute
  read by ``forward``) are reported with a ``RegionRecompileWarning``.
* Hooks: Dynamo guards a hook dict only if it was non-empty at trace time
  (``skip_nnmodule_hook_guards``), so a hook added later where the traced code saw none (on the
  block, a submodule, or globally with ``register_module_forward_hook`` & co.) would be skipped,
  silently. ``_TRACED_EMPTY`` remembers, per group code and module class, which hook dicts a trace
  saw empty (precompiled groups, whose code may come from a store: those empty at install, and
  the global ones). While such a dict holds a hook, the block runs eagerly (``_call_impl``: hooks
  and forward), warned once per group and counted; compiled again once the hook is removed. A
  new trace (a changed class, as ``fully_shard`` makes) sees the hooks: it stays compiled. Per
  call this costs a look at torch's hook counter (``RemovableHandle.next_id``, bumped by every
  registration); the hook dicts are read only when it moved.
* Each group is one ``torch.compile`` call with its own recompile bucket (``isolate_recompiles``),
  so the resume functions after a graph break (shared by every model of a block class) count only
  its entries. Blocks that take a transformers KV cache are called through
  :class:`~compile_cache.torch_compat.kv.calls.CacheCalls`: one entry per phase (prefill, decode)
  whatever the number of layers; the recompile limit allows the group size x phases. With
  precompile, a group is one precompiled function instead (:mod:`compile_cache.precompiled`;
  its decode steps a second one, its other calls with a KV cache a third, with the update
  traced into the graph: one entry per block).
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.utils.hooks import RemovableHandle

from . import _warnings
from .keys import region_devices
from .plan import RegionPlan, abbreviate, check_module, varying_attributes
from .precompiled import (
    CACHE_SUFFIX,
    VIEWS_SUFFIX,
    BoundCall,
    CacheRoutedCall,
    GroupPrecompiler,
    PrecompileSetup,
    RegionPrecompileWarning,
    compile_plain,
)
from .torch_compat import cudagraphs, dynamo, module_calls
from .torch_compat import precompile as pc
from .torch_compat.cache_use import owner_stack
from .torch_compat.kv import cache as kv_cache
from .torch_compat.kv import calls as kv_calls

logger = logging.getLogger("compile_cache")

__all__ = ["PrecompileSetup", "RegionEagerWarning", "RegionPrecompileWarning", "RegionRecompileWarning",
           "get_plan", "install", "observe_calls", "region_stats", "validate_kwargs"]


class RegionEagerWarning(RuntimeWarning):
    """A compiled region ran its uncompiled (eager) code: the model is slower than it should be."""


class RegionRecompileWarning(RuntimeWarning):
    """A group of identical blocks recompiled per block (a per-block attribute read by forward)."""


_COMPILE_KWARGS = frozenset(
    p.name for p in inspect.signature(torch.compile).parameters.values() if p.name != "model"
)
PER_CALL_RECOMPILE_LIMIT = "recompile_limit" in _COMPILE_KWARGS

_LOCK = threading.Lock()
_PLANS: weakref.WeakKeyDictionary[nn.Module, RegionPlan] = weakref.WeakKeyDictionary()
# (code name, id of the blocks' module namespace) -> the group's function, and that namespace
# (held, so that its id is never reused while the function lives).
_FUNCTIONS: dict[tuple[str, int], tuple[types.FunctionType, dict[str, Any] | None]] = {}


def _trampoline(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Dynamo folds this branch away in compiled code: it runs only when the region runs eagerly.
    if not torch.compiler.is_compiling():
        _ran_eager(self)
    return self._call_impl(*args, **kwargs)


def _region_function(code_name: str, scope: dict[str, Any] | None = None) -> types.FunctionType:
    """One function, with its own code object, per group: Dynamo caches per code object.

    Same fingerprint and same module namespace (``scope``: the globals of the blocks' code),
    same code object, even across models and calls, so a second instance of an architecture
    reuses the compiled graphs (guards permitting). Two modules loaded under one name have the
    same fingerprint but not the same namespace: they never share a function or compiled code.
    """
    key = (code_name, 0 if scope is None else id(scope))
    with _LOCK:
        found = _FUNCTIONS.get(key)
        if found is None:
            code = _trampoline.__code__.replace(co_name=code_name)
            if hasattr(code, "co_qualname"):
                code = code.replace(co_qualname=code_name)
            found = _FUNCTIONS[key] = (types.FunctionType(code, _trampoline.__globals__, code_name),
                                       scope)
    return found[0]


def _block_functions(module: nn.Module) -> list[Any]:
    """The Python functions a block's call may run as its own code: its and its submodules'
    class methods (properties, static and class methods included), below ``torch.nn``, and
    functions stored on the instances (an instance-bound ``forward``)."""
    found: list[Any] = []
    seen: set[type] = set()
    for sub in module.modules():
        found.extend(v for v in vars(sub).values() if inspect.isfunction(v))
        for cls in type(sub).__mro__:
            if cls in seen or cls.__module__.split(".", 1)[0] in ("torch", "builtins"):
                continue
            seen.add(cls)
            for value in vars(cls).values():
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if isinstance(value, property):
                    found.extend(f for f in (value.fget, value.fset) if inspect.isfunction(f))
                elif inspect.isfunction(value):
                    found.append(value)
    return found


def _blocks_scope(module: nn.Module) -> dict[str, Any] | None:
    """The module namespace of the block's ``forward`` (what its code reads as globals)."""
    forward = getattr(type(module).forward, "__globals__", None)
    return forward if isinstance(forward, dict) else None


class _GroupState:
    """Runtime bookkeeping of one group or compiled part: eager runs and per-block recompiles."""

    def __init__(self, label: str, code: types.CodeType, size: int,
                 varying: tuple[str, ...] = ()) -> None:
        self.label = label
        self.varying = varying
        self._code = code
        self.pf: pc.PrecompiledFunction | None = None  # the group's, with precompile
        self.decode_pf: pc.PrecompiledFunction | None = None  # its decode steps' (layer view)
        self.cache_pf: pc.PrecompiledFunction | None = None  # its calls with the update traced
        self.size = size
        self.eager_calls = 0
        self.block_recompiles = 0
        self.limit = 0
        self.warned_eager = False
        self.warned_causes: set[str] = set()  # report_eager's causes warned already
        self.warned_recompile = False
        self.started = False
        self.last_compiled: _RegionRunner | None = None
        self.region = -1  # the group's recompile bucket (dynamo.compile_group), -1: shared
        self.plain_region: int | None = None  # with precompile: the KV-cache calls' bucket
        self.cache_calls: kv_calls.CacheCalls | None = None  # blocks that take a KV cache
        self.takes_cache = False
        self.eager_resumes: set[str] = set()
        #: Why the group's code cannot be compiled against its own module's globals (two modules
        #: loaded under one name: dynamo.foreign_globals); the blocks then run eagerly, warned.
        self.foreign: str | None = None

    @property
    def code_name(self) -> str:
        """The group's code name (plan.py), whatever code object Dynamo caches it under."""
        return self._code.co_name

    @property
    def code(self) -> types.CodeType:
        """The code object Dynamo caches this group under (a precompiled function's may change
        when it declines)."""
        return self.pf.code if self.pf is not None else self._code

    def cache_entries(self) -> int:
        counts = [dynamo.cache_entries(self.code, self.region)]
        if self.plain_region is not None:  # precompiled, and its KV-cache calls compiled plain
            counts.append(dynamo.cache_entries(self._code, self.plain_region))
        for pf in (self.decode_pf, self.cache_pf):  # its decode steps, its traced cache calls
            if pf is not None:
                counts.append(dynamo.cache_entries(pf.code))
        return -1 if min(counts) < 0 else sum(counts)

    def check_resumes(self) -> None:
        """Something compiled during a call of this group. The part of a block after a graph
        break is a resume function; at the recompile limit Dynamo runs it uncompiled for good,
        which the trampoline does not see. Report each such one once."""
        if self.region < 0:
            return  # shared bucket: entries of other models would count
        limit = self.limit or dynamo.recompile_limit() or 8
        for name, entries in dynamo.resume_codes_at_limit(self.region, limit):
            if name not in self.eager_resumes:
                self.eager_resumes.add(name)
                self.report_eager(None, f"the part after a graph break ({name}, {entries} compiled "
                                  f"entries) hit the recompile limit ({limit}), for good")

    def on_recompile(self, reasons: list[str], runner: _RegionRunner) -> None:
        """The group's code recompiled during ``runner``'s call. Counted as a per-block recompile
        when the group's previous call (by another member) compiled too and the failing guards
        are not about the inputs (shapes, dtypes, grad mode: torch's business)."""
        previous, self.last_compiled = self.last_compiled, runner
        if previous is None or previous is runner:
            return
        # One reason per cache entry Dynamo tried, newest first: the first is the entry the
        # previous member's call just compiled, and its failing guard is what differs now.
        guard = _guard_summary(reasons[0]) if reasons else ""
        if not guard or (_INPUT_CHANGE.search(guard) and not (  # a per-layer cache's size()
                self.takes_cache and "mismatch" not in guard and kv_cache.cache_guard(guard))):
            return  # the inputs or the global state changed (grad mode, train/eval): torch's
        self.block_recompiles += 1
        if self.warned_recompile:
            return
        self.warned_recompile = True
        cause, fix = recompile_cause(guard, self.varying, "\n".join(reasons), self.takes_cache)
        msg = (
            f"compile_cache: identical blocks of {self.label} recompile per block: {cause}. "
            f"Each block gets its own compiled entry, up to the recompile limit "
            f"({self.limit or self.size}, at least the group size x phases); past it the blocks "
            f"run uncompiled. {fix}. TORCH_LOGS=recompiles shows details."
        )
        _warnings.warn(msg, RegionRecompileWarning)

    def report_eager(self, module: nn.Module | None, reason: str | None = None,
                     cause: str | None = None) -> None:
        """Count an eager run and warn: once per group for Dynamo's reasons (``reason`` None),
        once per group and ``cause`` when given (hooks), else each time (a new ``reason``)."""
        with _LOCK:
            self.eager_calls += 1
            if cause is not None:
                if cause in self.warned_causes:
                    return
                self.warned_causes.add(cause)
            elif self.warned_eager and reason is None:
                return
            else:
                self.warned_eager = True
        reason = reason or _eager_reason(self)
        if self.takes_cache and "recompile limit" in reason:
            reason += kv_cache.LIMIT_HINT
        what = f" ({type(module).__name__})" if module is not None else ""
        _warnings.warn(f"compile_cache: region {self.label}{what} ran UNCOMPILED: {reason}. The "
                       f"model still computes the right values, but eagerly.", RegionEagerWarning)


# Guard failures that come from the inputs (not from differences between blocks): a tensor's
# size, stride, dtype, device or grad, Dynamo's global state (grad mode, autocast). A size or
# stride guard Dynamo words as code (``args[0].stride()[0] == 8``) is one too.
_INPUT_CHANGE = re.compile(r"size mismatch|stride mismatch|dtype|device|requires_grad|dispatch key|"
                           r"GLOBAL_STATE|grad_mode|ndim|rank|storage_offset|"
                           r"\.(?:size|stride)\(\)|\.shape\b", re.IGNORECASE)
#: Dynamo's global-state guard (grad mode, autocast, deterministic algorithms...).
_GLOBAL_STATE = re.compile(r"GLOBAL_STATE|grad_mode", re.IGNORECASE)

#: A guard on the call's arguments (Dynamo strips ``L[...]``: ``len(args) == 1``,
#: ``kwargs['position_bias'] is None``; older wordings keep it: ``L['args'][1] == 0``).
_ARGUMENT_GUARD = re.compile(r"(?:(?<![\w.'\]])|(?<=\['))(args|kwargs)\b")
#: A guard on an argument's value (a Python number, string or flag the blocks are called with:
#: ``args[1] == 0``, ``kwargs['is_causal'] == True``), not on whether or how it is passed.
_ARGUMENT_VALUE = re.compile(
    r"^(?:L\[')?(?:args|kwargs)'?\]?(?:\[[^\]]+\])+\s*(?:==|!=|<=|>=|<|>)\s*\S")


def recompile_cause(guard: str, varying: tuple[str, ...], reasons: str = "",
                    takes_cache: bool = False) -> tuple[str, str]:
    """(cause, fix) of a per-block recompile whose failing guard is ``guard`` (one line, as
    Dynamo words it), for a group whose members differ in the ``varying`` attributes.

    The guard decides the words: grad mode is grad mode, a tensor's size or stride is an input
    change, an argument's value or presence is a difference between the calls; only a guard on
    the blocks themselves is "per-block values" (issue 35: T5's grad mode and BART's
    ``len(args) == 1`` were blamed on ``is_causal`` and ``layer_idx``)."""
    if takes_cache:
        advice = kv_cache.recompile_advice(guard, _named_attributes(guard, varying))
        if advice is None and not _ARGUMENT_GUARD.search(guard) and not _INPUT_CHANGE.search(guard):
            advice = kv_cache.recompile_advice(reasons, _named_attributes(guard, varying))
        if advice is not None:
            return advice
    if _GLOBAL_STATE.search(guard):
        return (
            f"grad mode or another global setting changed between the calls (failing guard: "
            f"{guard}): torch compiles once per grad mode, as plain torch.compile does",
            "Nothing to change in the blocks; keep training and inference calls apart to avoid "
            "switching back and forth",
        )
    if _INPUT_CHANGE.search(guard):
        return (
            f"the blocks are called with tensors of other sizes, strides, dtypes or devices "
            f"(failing guard: {guard}), an input change rather than a difference between blocks",
            "Call every block of the group with tensors of the same layout (e.g. .contiguous()), "
            "or mark the varying dimension dynamic",
        )
    if _ARGUMENT_VALUE.search(guard):
        return (
            f"the blocks are called with different values of an argument (failing guard: "
            f"{guard}): Dynamo specializes the graph on a Python number, string or flag",
            "Pass every block of the group the same value, or pass a varying number as a tensor",
        )
    if _ARGUMENT_GUARD.search(guard):
        return (
            f"the blocks are called with different arguments (failing guard: {guard}): a "
            f"tensor in one call and None in another, another number of positional arguments "
            f"or other keyword arguments",
            "Call every block of the group with the same kinds of arguments to share one graph",
        )
    return (
        f"per-block values{_named_attributes(guard, varying)}; failing guard: {guard}",
        "Make forward not depend on per-block attributes to share one graph",
    )


def _named_attributes(guard: str, varying: tuple[str, ...]) -> str:
    """The varying attributes the failing guard reads, else all of them, worded."""
    named = [a for a in varying if re.search(rf"\b{a.rsplit('.', 1)[-1]}\b", guard)]
    attrs = named or list(varying)
    what = "read by forward" if named else "that differ per block"
    return f" (attribute(s) {what}: {', '.join(attrs)})" if attrs else ""


def _guard_summary(reason: str) -> str:
    first = reason.splitlines()[0] if reason else ""
    first = re.sub(r"^\S+: ", "", first)  # compile id
    return first.split("#", 1)[0].strip()


def _eager_reason(state: _GroupState) -> str:
    if dynamo.compile_disabled():
        return "torch.compile is disabled (TORCH_COMPILE_DISABLE or Dynamo's disable setting)"
    entries = state.cache_entries()
    limit = state.limit or dynamo.recompile_limit()
    if limit is not None and entries >= limit:
        return (
            f"its code {state.code.co_name} has {entries} compiled entries, the recompile limit "
            f"(torch.compile's recompile_limit={limit}) stops further compiles"
        )
    return (
        f"Dynamo did not compile or skipped the frame {state.code.co_name} "
        f"({entries} compiled entries; torch.compiler stance or an error; "
        f"TORCH_LOGS=graph_breaks,recompiles shows why)"
    )


def _ran_eager(module: nn.Module) -> None:
    runner = _installed(module)
    if isinstance(runner, _RegionRunner):
        runner.state.report_eager(module)


# The hook dicts torch's ``_call_impl`` reads on every module, and what one of their hooks is.
_HOOK_KINDS = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}
# torch's global ones (``torch.nn.modules.module``), with the function that registers into each.
_GLOBAL = "<global>."
_GLOBAL_HOOKS = {
    "_global_forward_pre_hooks": "register_module_forward_pre_hook",
    "_global_forward_hooks": "register_module_forward_hook",
    "_global_backward_pre_hooks": "register_module_full_backward_pre_hook",
    "_global_backward_hooks": "register_module_full_backward_hook",
}
_GLOBAL_NAMES = frozenset(_GLOBAL + attr for attr in _GLOBAL_HOOKS)

# (group code name, module class) -> the hook dicts (names from _hook_slots) that some trace of
# that code saw empty: Dynamo does not guard those, so code traced then skips a hook added there
# later. Class None: precompiled groups, whose code may have been traced in another process and
# whose loaded guards may not check the class. Process-wide, like Dynamo's cache per code object.
_TRACED_EMPTY: dict[tuple[str, type | None], frozenset[str]] = {}
_trace_version = 0  # bumped whenever _TRACED_EMPTY grows, so that every runner looks again


def _hook_slots(module: nn.Module) -> tuple[tuple[str, dict, str], ...]:
    """Where the hooks that apply to a block live, as ``(name, namespace, attr)``: its own and
    its submodules' dicts (name ``"<path>.<attr>"``, path empty for the block) and torch's global
    ones (``"<global>.<attr>"``). Read through the namespace, so a replaced dict is seen too."""
    slots = [(f"{path}.{attr}" if path else attr, sub.__dict__, attr)
             for path, sub in module.named_modules() for attr in _HOOK_KINDS]
    slots += [(_GLOBAL + attr, vars(_nn_module), attr) for attr in _GLOBAL_HOOKS]
    return tuple(slots)


def _note_traced(key: tuple[str, type | None], empty: frozenset[str]) -> None:
    """Code of ``key`` may have been traced while the ``empty`` hook dicts were empty."""
    global _trace_version
    with _LOCK:
        known = _TRACED_EMPTY.get(key, frozenset())
        if not empty <= known:
            _TRACED_EMPTY[key] = known | empty
            _trace_version += 1


def _describe_hooks(names: tuple[str, ...]) -> str:
    """``("fc1._forward_hooks", ...)`` -> ``"a forward hook on its submodule fc1, ..."``."""
    parts = []
    for name in names:
        if name.startswith(_GLOBAL):
            attr = name[len(_GLOBAL):]
            kind = _HOOK_KINDS.get(attr.replace("_global", "", 1), attr)
            parts.append(f"a global {kind} (torch.nn.modules.module.{_GLOBAL_HOOKS.get(attr, attr)})")
            continue
        path, _, attr = name.rpartition(".")
        where = f"on its submodule {path}" if path else "on the module itself"
        parts.append(f"a {_HOOK_KINDS.get(attr, attr)} {where}")
    return ", ".join(dict.fromkeys(parts))


def _hooks_reason(names: tuple[str, ...]) -> str:
    return (
        f"{_describe_hooks(names)} was registered after its compiled code was traced without one, "
        f"and torch does not guard on hooks that were absent then (Dynamo's "
        f"skip_nnmodule_hook_guards): the compiled code would skip the hook. The module runs "
        f"eagerly while the hook is registered, so the hook fires; register hooks before "
        f"compile_regions (or before the first forward) to keep it compiled"
    )


class _RegionRunner:
    """Installed as ``module._compiled_call_impl``: calls the compiled trampoline.

    Around each call it compares the length of Dynamo's guard-failure list for the group's code
    (two dict lookups) to notice recompiles caused by differences between blocks, and names the
    group as the owner of whatever torch compiles meanwhile (capture by use). On the root,
    ``on_end`` (set by :func:`observe_calls`) hears of every call's end, outside compiled code.

    Hooks (the module doc): torch's hook counter ``RemovableHandle.next_id`` and the version of
    ``_TRACED_EMPTY`` are compared per call; only when one moved are the block's hook dicts
    looked at. While a hook sits where a trace of the group's code saw none (``hooked``), the
    block runs eagerly through ``module._call_impl`` (hooks and forward), warned once per group.
    """

    __slots__ = ("compiled", "state", "key", "owner", "failures", "on_end", "module", "hook_slots",
                 "hook_id", "hook_version", "hooked", "copy_out", "__weakref__")

    def __init__(self, compiled: Any, state: _GroupState, key: tuple, module: nn.Module) -> None:
        self.compiled = compiled
        self.state = state
        self.key = key
        #: What the compiles during a call belong to (capture by use): the group's code name.
        self.owner = state.code_name
        # Dynamo appends the reasons of every recompile here, keyed by the original code object.
        self.failures = dynamo.guard_failures()
        self.on_end: Callable[[float], None] | None = None
        # The compiled call already holds the module (a bound method or BoundCall): no new cycle.
        self.module = module
        #: The hook dicts its compiled code may have traced (the block's, its submodules', global).
        self.hook_slots = _hook_slots(module)
        self.hook_id = -1  # RemovableHandle.next_id when the hooks were last looked at
        self.hook_version = -1  # _trace_version then
        #: The hook dicts that hold a hook where a trace of the group's code saw none (eager).
        self.hooked: tuple[str, ...] = ()
        #: CUDA graphs with regions: outputs leave as copies (torch_compat.cudagraphs).
        self.copy_out = False
        if state.pf is not None:
            # The precompiled code may come from another process (a store), traced with the hooks
            # the plan saw on the group (its fingerprint holds them) and, presumably, no global ones.
            _note_traced(self._trace_key(), frozenset(n for n, ns, attr in self.hook_slots
                                                      if not ns.get(attr)) | _GLOBAL_NAMES)

    def _trace_key(self) -> tuple[str, type | None]:
        return self.state.code_name, (None if self.state.pf is not None else type(self.module))

    def _look_at_hooks(self) -> tuple[str, ...]:
        """The hook dicts that now hold a hook where a trace of the group's code saw none."""
        self.hook_id = RemovableHandle.next_id
        self.hook_version = _trace_version
        key = self._trace_key()
        unguarded = _TRACED_EMPTY.get(key)
        if not unguarded:
            return ()
        try:
            added = tuple(n for n, ns, attr in self.hook_slots if ns.get(attr) and n in unguarded)
            if added and self.state.pf is None and self.state.cache_entries() == 0:
                # Dynamo holds no compiled code for the group (torch._dynamo.reset()): the next
                # call traces afresh, hooks included.
                with _LOCK:
                    _TRACED_EMPTY.pop(key, None)
                return ()
        except Exception:  # never fail a forward over this: keep the compiled path, as torch would
            logger.debug("compile_cache: could not look at the hooks of %s", self.state.label,
                         exc_info=True)
            return ()
        return added

    def _note_trace(self) -> None:
        """This call compiled: the code traced saw the block's hook dicts as they are now."""
        _note_traced(self._trace_key(),
                     frozenset(n for n, ns, attr in self.hook_slots if not ns.get(attr)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        on_end = self.on_end
        start = 0.0
        if on_end is not None:  # the observed root: a model forward starts
            start = time.perf_counter()
        state = self.state
        hooked = self.hooked
        if hooked or RemovableHandle.next_id != self.hook_id or _trace_version != self.hook_version:
            was = hooked
            self.hooked = hooked = self._look_at_hooks()
            if hooked:
                state.report_eager(self.module, _hooks_reason(hooked), cause="hooks")
            elif was:
                logger.debug("compile_cache: %s runs compiled again: the hooks added after "
                             "compiling are gone", state.label)
        failures = self.failures.get(state.code)
        before = len(failures) if failures is not None else 0
        frames = dynamo.frames_seen()
        owners = owner_stack()
        owners.append(self.owner)
        try:
            if hooked:  # eagerly: torch runs the module's hooks and forward
                out = module_calls.eager_call(self.module, *args, **kwargs)
            elif state.cache_calls is not None:
                out = state.cache_calls.call(self, self.compiled, args, kwargs)
            else:
                out = self.compiled(*args, **kwargs)
        finally:
            owners.pop()
        if self.copy_out and not hooked:  # out of the cudagraph pool before the next region
            out = cudagraphs.detach_outputs(out)
        if dynamo.frames_seen() != frames:  # Dynamo compiled (or refused) a frame in this call
            state.check_resumes()
            if not hooked:
                self._note_trace()
        failures = self.failures.get(state.code)
        if failures is not None and len(failures) > before:
            state.on_recompile(failures[before:], self)
        elif state.started:
            state.last_compiled = None
        else:  # the group's first call compiled it
            state.started = True
            state.last_compiled = self
        if on_end is not None:
            on_end(time.perf_counter() - start)
        return out


class _ForeignRunner(_RegionRunner):
    """A group whose code Dynamo would guard against another module's globals
    (:func:`.torch_compat.dynamo.foreign_globals`): every call runs the block eagerly, counted and warned once."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        on_end = self.on_end
        start = time.perf_counter() if on_end is not None else 0.0
        self.state.report_eager(self.module, _foreign_reason(self.state.foreign or ""),
                                cause="foreign globals")
        out = module_calls.eager_call(self.module, *args, **kwargs)
        if on_end is not None:
            on_end(time.perf_counter() - start)
        return out


def _foreign_globals(members: list[nn.Module]) -> str | None:
    """Why the blocks' code would be guarded against another module's globals, else None."""
    classes = {type(m): m for m in members}
    for member in classes.values():
        reason = dynamo.foreign_globals(_block_functions(member))
        if reason is not None:
            return reason
    return None


def _foreign_reason(reason: str) -> str:
    return (f"{reason}; Dynamo reads and guards an inlined function's globals through the module "
            f"registered under their name, so the compiled code would use that module's values. "
            f"Give each module its own name (or register it in sys.modules before compiling) to "
            f"compile it")


class _ObservedCall:
    """Wraps a compiled root call that is not ours (an earlier ``module.compile()``), so that
    :func:`observe_calls` hears of each call's end outside compiled code."""

    __slots__ = ("wrapped", "on_end")

    def __init__(self, wrapped: Any, on_end: Callable[[float], None]) -> None:
        self.wrapped = wrapped
        self.on_end = on_end

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self.wrapped(*args, **kwargs)
        self.on_end(time.perf_counter() - start)
        return out


def _installed(module: nn.Module) -> Any:
    """What sits in ``module._compiled_call_impl``, seen through an observer."""
    runner = module_calls.compiled_call(module)
    return runner.wrapped if isinstance(runner, _ObservedCall) else runner


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):  # else id() of a new tuple: a second call never matched
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
        return value
    except TypeError:
        return id(value)


def validate_kwargs(kwargs: dict[str, Any]) -> None:
    """TypeError for a keyword ``torch.compile`` does not take, or ``options`` not a dict."""
    unknown = sorted(set(kwargs) - _COMPILE_KWARGS)
    if unknown:
        raise TypeError(
            f"compile_regions() got unknown torch.compile keyword argument(s) {unknown}; "
            f"torch.compile accepts {sorted(_COMPILE_KWARGS)}"
        )
    if kwargs.get("options") is not None and not isinstance(kwargs["options"], dict):
        raise TypeError(f"options must be a dict or None, got {kwargs['options']!r}")


def install(
    model: nn.Module, plan: RegionPlan, *, precompile: PrecompileSetup | None = None
) -> dict[str, pc.PrecompiledFunction]:
    """Give every module ``plan`` compiles its compiled call path, in place (see the module doc).

    ``plan.compile_kwargs`` go to ``torch.compile``; modules compiled earlier with the same
    keywords keep their compiled code, and earlier installs the plan no longer wants are undone.
    With ``precompile``, each group compiles through one precompiled function
    (:mod:`compile_cache.precompiled`); they are returned by code name, for the session to save.
    Blocks that take a KV cache: see :meth:`GroupPrecompiler.call_path`.
    """
    kwargs = dict(plan.compile_kwargs)
    disabled = plan.disabled
    modules = dict(model.named_modules())
    wanted = _wanted(plan)

    # Undo our earlier installs on modules this plan no longer compiles.
    for name, mod in modules.items():
        if name not in wanted and isinstance(_installed(mod), _RegionRunner):
            module_calls.set_compiled_call(mod, None)

    wanted_members: dict[str, list[str]] = {}
    for name, (code_name, _, _) in wanted.items():
        wanted_members.setdefault(code_name, []).append(name)
    frozen = _freeze((kwargs, precompile.store_key if precompile is not None else None))
    copy_out = _copies_outputs(model, kwargs) if not disabled else False
    states: dict[str, _GroupState] = {}
    functions: dict[str, pc.PrecompiledFunction] = {}
    groups = GroupPrecompiler(precompile, _trampoline) if precompile is not None else None
    for name, (code_name, label, size) in wanted.items():
        mod = modules[name]
        scope = _blocks_scope(mod)
        fn = _region_function(code_name, scope)
        state = states.get(code_name)
        if state is None:
            members = [modules[n] for n in wanted_members.get(code_name, [name])]
            varying = varying_attributes(members)
            state = states[code_name] = _GroupState(label, fn.__code__, size, varying)
            state.foreign = _foreign_globals(members)
            _prepare_group(state, mod, kwargs)
        existing = _installed(mod)
        key = (code_name, frozen, 0 if scope is None else id(scope))
        if state.foreign is not None:  # eagerly, warned: Dynamo would read another module
            module_calls.set_compiled_call(mod, _ForeignRunner(None, state, key, mod))
            continue
        if isinstance(existing, _RegionRunner) and existing.key == key and existing.compiled is not None:
            compiled = existing.compiled  # called again with the same keywords: keep it
            state.region = existing.state.region
        else:
            if existing is not None and not isinstance(existing, _RegionRunner):
                logger.info("compile_cache: replacing an earlier compile of %s", name or "<root>")
            call_kwargs = _group_kwargs(kwargs, state)
            if groups is not None:  # one precompiled function per group, called with the member
                probe = kv_calls.CacheCalls.for_block(mod.forward) if state.takes_cache else None
                compiled, region = groups.call_path(code_name, label, call_kwargs, mod, probe, lambda: (
                    compile_plain(fn, mod, key, call_kwargs)), state.cache_calls)  # noqa: B023
                if region is not None:
                    setattr(state, "plain_region" if isinstance(compiled, CacheRoutedCall) else "region",
                            region)
            else:
                compiled, state.region = compile_plain(fn, mod, key, call_kwargs)
        if isinstance(compiled, (BoundCall, CacheRoutedCall)):
            state.pf = compiled.pf
            functions[code_name] = compiled.pf
        if isinstance(compiled, CacheRoutedCall):
            state.decode_pf, state.cache_pf = _routed_functions(compiled, code_name, functions)
        runner = _RegionRunner(compiled, state, key, mod)
        runner.copy_out = copy_out
        module_calls.set_compiled_call(mod, runner)
    if groups is not None:
        groups.finish()
    if states and not PER_CALL_RECOMPILE_LIMIT:
        dynamo.raise_recompile_limit(max(st.limit for st in states.values()))
    if any(st.takes_cache for st in states.values()):
        kv_cache.disable_generate_autocompile(model)
    with _LOCK:
        _PLANS[model] = plan
    logger.info("%s", plan.describe())
    return functions


def _wanted(plan: RegionPlan) -> dict[str, tuple[str, str, int]]:
    """Module name -> (code name, label, group size) of every module the plan compiles."""
    wanted: dict[str, tuple[str, str, int]] = {}
    if not plan.disabled:
        for g in plan.groups:
            for name in g.names:
                wanted[name] = (g.code_name, f"{g.class_name} x{g.size} [{abbreviate(g.names)}]", g.size)
        for p in plan.compiled_rest:
            wanted[p.name] = (p.code_name, f"{p.name or '<root>'} ({p.class_name})", 1)
    return wanted


def _routed_functions(compiled: CacheRoutedCall, code_name: str,
                      functions: dict[str, pc.PrecompiledFunction],
                      ) -> tuple[pc.PrecompiledFunction | None, pc.PrecompiledFunction | None]:
    """Files a KV-cache group's other precompiled functions under their entry names and returns
    them: its decode steps' (the layer view's) and its cache calls' (the update traced into the
    graph: a group of one, or the traced update of a group)."""
    cache = compiled.plain if isinstance(compiled.plain, BoundCall) else compiled.traced_fn
    if cache is not None:
        functions[code_name + CACHE_SUFFIX] = cache.pf
    if compiled.views is not None:
        functions[code_name + VIEWS_SUFFIX] = compiled.views.pf
    return (None if compiled.views is None else compiled.views.pf,
            None if cache is None else cache.pf)


def _copies_outputs(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Regions compiled with CUDA graphs hand on copies of their outputs: in cudagraph trees a
    region's output lives in the tree's pool and a later replay overwrites it, while the next
    region (or the next call of the same group) still reads it (torch #152887, #160281). A model
    whose tensors are all on the CPU gets no CUDA graphs and no copies."""
    if cudagraphs.wants_cudagraphs(kwargs) is False:
        return False
    devices = region_devices(model)
    if devices is not None and set(devices) <= {"cpu", "meta"}:
        return False
    logger.info("compile_cache: CUDA graphs with regional compilation: each region's CUDA outputs "
                "(and the gradients flowing back into it) are copied out of the cudagraph pool")
    return True


def _prepare_group(state: _GroupState, block: nn.Module, kwargs: dict) -> None:
    """The group's recompile limit (its size x phases, at least the user's or torch's limit) and,
    for blocks that take a KV cache, how they are called (the module doc)."""
    state.takes_cache, state.cache_calls = kv_calls.CacheCalls.for_group(
        block.forward, state.size, kwargs, state.varying)
    base = kwargs.get("recompile_limit") or dynamo.recompile_limit() or state.size
    state.limit = max(int(base), state.size * (kv_cache.PHASES if state.takes_cache else 1))


def _group_kwargs(kwargs: dict[str, Any], state: _GroupState) -> dict[str, Any]:
    """``torch.compile`` keywords of one group: the plan's, with the group's recompile limit."""
    call_kwargs = dict(kwargs)
    if PER_CALL_RECOMPILE_LIMIT:
        call_kwargs["recompile_limit"] = state.limit
    return call_kwargs


_clock = threading.local()


def _start_timer(module: nn.Module, args: Any) -> None:
    _clock.start = time.perf_counter()


def _timer_hook(on_end: Callable[[float], None]) -> Any:
    def _after(module: nn.Module, args: Any, output: Any) -> None:
        on_end(time.perf_counter() - getattr(_clock, "start", time.perf_counter()))

    return _after


def observe_calls(model: nn.Module, on_end: Callable[[float], None]) -> None:
    """Call ``on_end(seconds)`` each time a call of ``model`` ends, outside any compiled code.

    A compiled root reports from its runner; an uncompiled root gets a forward pre-hook and
    hook (eager code, whose compiled parts are the regions inside). Replaces an earlier observer.
    """
    old = model.__dict__.pop("_compile_cache_hooks", None)
    for handle in old or ():
        handle.remove()
    runner = module_calls.compiled_call(model)
    if isinstance(runner, (_RegionRunner, _ObservedCall)):
        runner.on_end = on_end
        return
    if runner is not None:  # compiled by someone else: observe around it
        module_calls.set_compiled_call(model, _ObservedCall(runner, on_end))
        return
    handle_pre = model.register_forward_pre_hook(_start_timer)
    handle_post = model.register_forward_hook(_timer_hook(on_end))
    model.__dict__["_compile_cache_hooks"] = (handle_pre, handle_post)


def get_plan(model: nn.Module) -> RegionPlan | None:
    """The plan ``compile_regions`` last applied to ``model``, or None."""
    return _PLANS.get(model)


def region_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """Per compiled group or part of ``model`` (by code name): its cache entries, eager runs and
    recompiles.

    The entries are shared by every model with the same fingerprint; the eager runs and
    per-block recompiles are this model's. ``eager_calls`` above zero means its compiled code
    did not run (a ``RegionEagerWarning`` said why)."""
    check_module(model, "region_stats")
    states: dict[str, _GroupState] = {}
    for mod in model.modules():
        runner = _installed(mod)
        if isinstance(runner, _RegionRunner):
            states.setdefault(runner.key[0], runner.state)
    return {
        name: {
            "members": st.size,
            "cache_entries": st.cache_entries(),
            "eager_calls": st.eager_calls,
            "block_recompiles": st.block_recompiles,
        }
        for name, st in states.items()
    }
