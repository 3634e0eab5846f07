"""Regional compilation keyed by fingerprint: compile each repeated block once, in place.

``compile_regions(model)`` finds the *regions* of a model: maximal subtrees whose fingerprint
(``fingerprint_tree(model, attributes=False)``) occurs at least twice, wherever they sit
(``ModuleList``, ``Sequential``, ``ModuleDict``, plain attributes, nested stacks). Regions with the
same digest form a *group*; lists that mix block types give one group per type. The parts outside
the regions are compiled separately where that pays, and left eager where it cannot (see
``plan_regions`` and ``RegionPlan.describe()``).

Why not ``accelerate.utils.compile_regions`` or ``nn.Module.compile()`` as they are:

* Every module compiled with ``.compile()`` compiles the same function, ``Module._call_impl``, so
  all of them share one Dynamo code object and one cache: a block, the embeddings and the head
  each fail the others' guards, recompile, and the recompiles switch on automatic dynamic shapes.
  Here each group gets its **own code object** (a copy of a small trampoline, named after the
  group's class and fingerprint, so logs and profile-guided state name it too). Identical blocks
  share one compiled graph; different groups never see each other's guards.
* The model is compiled **in place**: the trampoline is installed as the module's
  ``_compiled_call_impl``, exactly where ``nn.Module.compile()`` puts its compiled function. Class,
  ``state_dict()`` keys, parameters, hooks and instance-bound ``forward``s stay where they are and
  are traced by Dynamo (the trampoline calls ``self._call_impl``).
* The trampoline runs ``if not torch.compiler.is_compiling(): <report>``. Dynamo folds that branch
  away in compiled code, so it runs only when the region executes **uncompiled** (recompile limit
  hit, frame skipped, compile disabled): that is reported with a ``RegionEagerWarning`` once per
  group and counted, never silent.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import re
import threading
import types
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import _warnings
from .fingerprint import fingerprint_tree
from .torch_compat import dynamo

logger = logging.getLogger("compile_cache")

__all__ = [
    "RegionEagerWarning",
    "RegionGroup",
    "RegionPlan",
    "RegionRecompileWarning",
    "RestPart",
    "compile_regions",
    "get_plan",
    "plan_regions",
    "region_stats",
]


class RegionEagerWarning(RuntimeWarning):
    """A compiled region ran its uncompiled (eager) code: the model is slower than it should be."""


class RegionRecompileWarning(RuntimeWarning):
    """A group of identical blocks recompiled per block (a per-block attribute read by forward)."""


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

# Why a part outside the regions is compiled or left eager; the keys go to to_dict().
REASONS: dict[str, str] = {
    "whole": "compiled: the model has no repeated blocks, so it is compiled whole",
    "part": "compiled: a module outside the regions, compiled on its own",
    "single": (
        "compiled on its own: its fingerprint repeats, but only inside other regions or on "
        "blocks with other hooks / instance forwards"
    ),
    "contains_regions": (
        "eager: contains regions; compiling it would trace the regions again inside its graph "
        "(nested compile), so only its own glue code runs eagerly"
    ),
    "torch_nn_leaf": (
        "eager: a single torch.nn op; `.compile()` on it is a no-op (Dynamo skips torch/nn frames) "
        "and compiling it alone would cost a compile for nothing to fuse"
    ),
    "container": "eager: a container with no forward of its own; its children are planned one by one",
    "disabled": "eager: compile_regions(..., disable=True)",
}


@dataclass(frozen=True)
class RegionGroup:
    """Regions that share one fingerprint, hence one Dynamo code object and one compiled graph."""

    fingerprint: str
    class_name: str
    names: tuple[str, ...]
    variant: str = ""  # set when hooks or instance forwards split blocks of one fingerprint

    @property
    def size(self) -> int:
        return len(self.names)

    @property
    def code_name(self) -> str:
        """The name of the group's code object, as Dynamo logs (``TORCH_LOGS=recompiles``) show it."""
        return _code_name("region", self.class_name, self.fingerprint, self.variant)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "class_name": self.class_name,
            "names": list(self.names),
            "variant": self.variant,
            "code_name": self.code_name,
        }


@dataclass(frozen=True)
class RestPart:
    """A part of the model outside the regions: compiled on its own, or left eager (``reason``)."""

    name: str
    class_name: str
    compiled: bool
    reason: str
    fingerprint: str = ""
    variant: str = ""

    @property
    def code_name(self) -> str:
        return _code_name("part", self.class_name, self.fingerprint, self.variant)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "class_name": self.class_name,
            "compiled": self.compiled,
            "reason": self.reason,
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class RegionPlan:
    """What ``compile_regions`` compiles: the region groups and every part outside them."""

    root_class: str
    groups: tuple[RegionGroup, ...]
    rest: tuple[RestPart, ...]
    disabled: bool = False
    compile_kwargs: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def compiled_rest(self) -> tuple[RestPart, ...]:
        return tuple(p for p in self.rest if p.compiled)

    @property
    def eager_rest(self) -> tuple[RestPart, ...]:
        return tuple(p for p in self.rest if not p.compiled)

    @property
    def compiled_names(self) -> tuple[str, ...]:
        """Qualified names of every module that gets its own compiled code."""
        if self.disabled:
            return ()
        names = [n for g in self.groups for n in g.names]
        return tuple(names + [p.name for p in self.compiled_rest])

    @property
    def expected_graphs(self) -> int:
        """Distinct compiled frames for static inputs when no block recompiles: one per group and
        one per compiled part (a graph break adds graphs within a frame)."""
        return 0 if self.disabled else len(self.groups) + len(self.compiled_rest)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (CLI, logs, the artifact store's metadata)."""
        return {
            "root_class": self.root_class,
            "disabled": self.disabled,
            "groups": [g.to_dict() for g in self.groups],
            "rest": [p.to_dict() for p in self.rest],
            "expected_graphs": self.expected_graphs,
        }

    def describe(self) -> str:
        """A human-readable plan: each group, each compiled part, each eager part and why."""
        lines = [f"Regional compilation plan for {self.root_class}"]
        if self.disabled:
            lines.append("  disabled (disable=True): nothing is compiled")
        lines.append(f"  {len(self.groups)} region group(s):")
        for g in self.groups:
            lines.append(
                f"    {g.class_name} x{g.size}  fingerprint {g.fingerprint[:16]}  "
                f"[{_abbrev(g.names)}]"
            )
        compiled = self.compiled_rest
        lines.append(f"  {len(compiled)} other part(s) compiled on their own:")
        for p in compiled:
            lines.append(f"    {p.name or '<root>'} ({p.class_name}): {p.reason}")
        eager = self.eager_rest
        lines.append(f"  {len(eager)} part(s) left eager:")
        for p in eager:
            lines.append(f"    {p.name or '<root>'} ({p.class_name}): {p.reason}")
        lines.append(f"  expected compiled frames with static inputs: {self.expected_graphs}")
        return "\n".join(lines)

    __str__ = describe


def _abbrev(names: tuple[str, ...], keep: int = 3) -> str:
    if len(names) <= keep + 1:
        return ", ".join(names)
    return ", ".join(names[:keep]) + f", ... {names[-1]}"


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _code_name(kind: str, class_name: str, fingerprint: str, variant: str = "") -> str:
    short = re.sub(r"\W", "_", class_name.rsplit(".", 1)[-1])
    return f"{kind}_{short}_{fingerprint[:12]}" + (f"_{variant}" if variant else "")


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
)


def _callable_id(fn: object) -> str:
    """Stable identity of a hook or forward: where its code lives, not which object it is."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return f"{type(fn).__module__}.{type(fn).__qualname__}"
    return f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"


def _call_signature(module: nn.Module) -> str:
    """Hooks and instance-bound ``forward``s inside a block, as a short digest ("" if none).

    Dynamo does not guard on module hooks (``skip_nnmodule_hook_guards``), so blocks that differ
    only in their hooks must not share a code object: one block's graph would run without the
    other's hooks. Blocks with different signatures go to different groups.
    """
    parts = []
    for name, sub in module.named_modules():
        items = []
        for attr in _HOOK_DICTS:
            hooks = sub.__dict__.get(attr)
            if hooks:
                items.append(f"{attr}={','.join(_callable_id(h) for h in hooks.values())}")
        if "forward" in sub.__dict__:
            items.append(f"forward={_callable_id(sub.__dict__['forward'])}")
        hf_hook = sub.__dict__.get("_hf_hook")
        if hf_hook is not None:
            items.append(f"_hf_hook={type(hf_hook).__module__}.{type(hf_hook).__qualname__}")
        if items:
            parts.append(f"{name}:{';'.join(items)}")
    if not parts:
        return ""
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:8]


def _has_forward(module: nn.Module) -> bool:
    """False for ModuleList/ModuleDict and other containers that cannot be called."""
    if "forward" in module.__dict__:
        return True
    return type(module).forward is not nn.Module.forward


def _is_torch_nn_class(module: nn.Module) -> bool:
    mod = type(module).__module__
    return mod == "torch.nn" or mod.startswith("torch.nn.")


def _can_be_region(module: nn.Module) -> bool:
    """Composite modules, or modules whose class is not torch.nn's, that can be called."""
    if not _has_forward(module):
        return False
    has_children = next(iter(module.children()), None) is not None
    return has_children or not _is_torch_nn_class(module)


def _check_module(model: object, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{what} needs a torch.nn.Module, got {type(model).__module__}."
            f"{type(model).__qualname__}: {model!r:.80}"
        )
    if dynamo.is_optimized_module(model):
        raise TypeError(
            f"{what} got a module already wrapped by torch.compile ({type(model).__name__} around "
            f"{type(model._orig_mod).__name__}); pass the original module (`._orig_mod`)"
        )


def plan_regions(model: nn.Module) -> RegionPlan:
    """Which blocks repeat, and what happens to every other part. Compiles nothing.

    A region is a maximal subtree whose fingerprint (``attributes=False``: per-block settings
    such as ``layer_idx`` do not split a group) occurs at least twice in the model; only callable
    composite modules, or modules whose class is not from ``torch.nn``, qualify (a repeated
    ``nn.Linear`` is one op, not worth a compile). Regions sharing a digest form a group.
    """
    _check_module(model, "plan_regions")
    fps = fingerprint_tree(model, attributes=False)
    modules = dict(model.named_modules())
    counts = Counter(fps.values())

    def children(name: str) -> list[str]:
        # A shared child is listed (and planned) only under its first name, as named_modules does.
        prefix = name + "." if name else ""
        return [
            prefix + c
            for c, child in modules[name].named_children()
            if modules.get(prefix + c) is child
        ]

    # Top-down: the first repeated, eligible module on each path is a maximal region.
    candidates: list[str] = []
    seen: set[str] = set()

    def find(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        mod = modules[name]
        if name and counts[fps[name]] >= 2 and _can_be_region(mod):
            candidates.append(name)
            return
        for c in children(name):
            find(c)

    find("")
    by_key: dict[tuple[str, str], list[str]] = {}
    for name in candidates:
        by_key.setdefault((fps[name].hex, _call_signature(modules[name])), []).append(name)
    groups = tuple(
        RegionGroup(digest, _class_name(modules[names[0]]), tuple(names), variant)
        for (digest, variant), names in by_key.items()
        if len(names) >= 2
    )
    singles = {names[0]: variant for (_, variant), names in by_key.items() if len(names) == 1}
    in_groups = {n for g in groups for n in g.names}

    rest: list[RestPart] = []
    if not groups:
        rest.append(
            RestPart(
                "", _class_name(model), True, REASONS["whole"], fps[""].hex, _call_signature(model)
            )
        )
        return RegionPlan(_class_name(model), (), tuple(rest))

    def contains_region(name: str) -> bool:
        prefix = name + "." if name else ""
        return any(r.startswith(prefix) for r in in_groups)

    visited: set[str] = set()

    def walk(name: str) -> None:
        if name in visited or name in in_groups:
            return
        visited.add(name)
        mod = modules[name]
        cls, digest = _class_name(mod), fps[name].hex

        def part(compiled: bool, key: str) -> RestPart:
            variant = singles.get(name) or (_call_signature(mod) if compiled else "")
            return RestPart(name, cls, compiled, REASONS[key], digest, variant)

        if contains_region(name):
            rest.append(part(False, "contains_regions"))
            for c in children(name):
                walk(c)
        elif name in singles:
            rest.append(part(True, "single"))
        elif not _has_forward(mod):
            rest.append(part(False, "container"))
            for c in children(name):
                walk(c)
        elif _can_be_region(mod):
            rest.append(part(True, "part"))
        else:
            rest.append(part(False, "torch_nn_leaf"))

    walk("")
    return RegionPlan(_class_name(model), groups, tuple(rest))


# --------------------------------------------------------------------------------------------
# Compiling in place
# --------------------------------------------------------------------------------------------

_COMPILE_KWARGS = frozenset(
    p.name for p in inspect.signature(torch.compile).parameters.values() if p.name != "model"
)
_PER_CALL_RECOMPILE_LIMIT = "recompile_limit" in _COMPILE_KWARGS

_LOCK = threading.Lock()
_PLANS: weakref.WeakKeyDictionary[nn.Module, RegionPlan] = weakref.WeakKeyDictionary()
_FUNCTIONS: dict[str, types.FunctionType] = {}


def _trampoline(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Dynamo folds this branch away in compiled code: it runs only when the region runs eagerly.
    if not torch.compiler.is_compiling():
        _ran_eager(self)
    return self._call_impl(*args, **kwargs)


def _region_function(code_name: str) -> types.FunctionType:
    """One function, with its own code object, per group: Dynamo caches per code object.

    Same fingerprint, same code object, even across models and calls, so a second instance of
    an architecture reuses the compiled graphs (guards permitting).
    """
    fn = _FUNCTIONS.get(code_name)
    if fn is None:
        code = _trampoline.__code__.replace(co_name=code_name)
        if hasattr(code, "co_qualname"):
            code = code.replace(co_qualname=code_name)
        fn = types.FunctionType(code, _trampoline.__globals__, code_name)
        _FUNCTIONS[code_name] = fn
    return fn


class _GroupState:
    """Runtime bookkeeping of one group or compiled part: eager runs and per-block recompiles."""

    def __init__(
        self, label: str, code: types.CodeType, size: int, varying: tuple[str, ...] = ()
    ) -> None:
        self.label = label
        self.varying = varying
        self.code = code
        self.size = size
        self.eager_calls = 0
        self.block_recompiles = 0
        self.limit = 0
        self.warned_eager = False
        self.warned_recompile = False
        self.started = False
        self.last_compiled: _RegionRunner | None = None

    def cache_entries(self) -> int:
        return dynamo.cache_entries(self.code)

    def on_recompile(self, reasons: list[str], runner: _RegionRunner) -> None:
        """The group's code recompiled during ``runner``'s call. Counted as a per-block recompile
        when the group's previous call (by another member) compiled too and the failing guards
        are not about the inputs (shapes, dtypes, grad mode: torch's business)."""
        previous, self.last_compiled = self.last_compiled, runner
        if previous is None or previous is runner:
            return
        if not reasons or all(_INPUT_CHANGE.search(r.splitlines()[0]) for r in reasons):
            return
        self.block_recompiles += 1
        if self.warned_recompile:
            return
        self.warned_recompile = True
        text = "\n".join(reasons)
        guards = _guard_summary(reasons[-1])
        named_attrs = [a for a in self.varying if re.search(rf"\b{a.rsplit('.', 1)[-1]}\b", text)]
        attrs = named_attrs or list(self.varying)
        what = "read by forward" if named_attrs else "that differ per block"
        named = f" (attribute(s) {what}: {', '.join(attrs)})" if attrs else ""
        msg = (
            f"compile_cache: identical blocks of {self.label} recompile per block{named}; failing "
            f"guard: {guards or 'unknown'}. Each block gets its own compiled entry (the "
            f"recompile limit allows at least the group size, {self.size}); make forward not "
            f"depend on per-block attributes to share one graph. TORCH_LOGS=recompiles shows "
            f"details."
        )
        _warnings.warn(msg, RegionRecompileWarning)

    def report_eager(self, module: nn.Module) -> None:
        with _LOCK:
            self.eager_calls += 1
            if self.warned_eager:
                return
            self.warned_eager = True
        reason = _eager_reason(self)
        msg = (
            f"compile_cache: region {self.label} ({type(module).__name__}) ran UNCOMPILED: "
            f"{reason}. The model still computes the right values, but eagerly."
        )
        _warnings.warn(msg, RegionEagerWarning)


# Guard failures that come from the inputs (not from differences between blocks).
_INPUT_CHANGE = re.compile(
    r"size mismatch|stride mismatch|dtype|device|requires_grad|dispatch key|GLOBAL_STATE|"
    r"grad_mode|ndim|rank|storage_offset",
    re.IGNORECASE,
)


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


_PRIMITIVES = (int, float, bool, str, type(None))


def _varying_attributes(members: list[nn.Module]) -> tuple[str, ...]:
    """Primitive attributes (``layer_idx``, ``self_attn.layer_idx``) whose values differ between
    the members of a group: the usual cause of per-block recompiles."""
    if len(members) < 2:
        return ()
    values: dict[str, set] = {}
    for member in members:
        for sub_name, sub in member.named_modules():
            for attr, value in vars(sub).items():
                if attr.startswith("_") or not isinstance(value, _PRIMITIVES):
                    continue
                key = f"{sub_name}.{attr}" if sub_name else attr
                values.setdefault(key, set()).add((type(value).__name__, value))
    return tuple(sorted(k for k, v in values.items() if len(v) > 1))


def _ran_eager(module: nn.Module) -> None:
    runner = _unwrap(module.__dict__.get("_compiled_call_impl"))
    if isinstance(runner, _RegionRunner):
        runner.state.report_eager(module)


class _RegionRunner:
    """Installed as ``module._compiled_call_impl``: calls the compiled trampoline.

    Around each call it compares the length of Dynamo's guard-failure list for the group's code
    (two dict lookups) to notice recompiles caused by differences between blocks.
    """

    __slots__ = ("compiled", "state", "key", "code", "failures", "__weakref__")

    def __init__(self, compiled: Any, state: _GroupState, key: tuple) -> None:
        self.compiled = compiled
        self.state = state
        self.key = key
        self.code = state.code
        # Dynamo appends the reasons of every recompile here, keyed by the original code object.
        self.failures = dynamo.guard_failures()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        failures = self.failures.get(self.code)
        before = len(failures) if failures is not None else 0
        out = self.compiled(*args, **kwargs)
        failures = self.failures.get(self.code)
        state = self.state
        if failures is not None and len(failures) > before:
            state.on_recompile(failures[before:], self)
        elif state.started:
            state.last_compiled = None
        else:  # the group's first call compiled it
            state.started = True
            state.last_compiled = self
        return out


def _unwrap(runner: Any) -> Any:
    """The region runner under an observer the store may have put around a compiled root."""
    return getattr(runner, "__wrapped__", runner)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    try:
        hash(value)
        return value
    except TypeError:
        return id(value)


def _validate_kwargs(kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - _COMPILE_KWARGS)
    if unknown:
        raise TypeError(
            f"compile_regions() got unknown torch.compile keyword argument(s) {unknown}; "
            f"torch.compile accepts {sorted(_COMPILE_KWARGS)}"
        )
    if (
        "options" in kwargs
        and kwargs["options"] is not None
        and not isinstance(kwargs["options"], dict)
    ):
        raise TypeError(f"options must be a dict or None, got {kwargs['options']!r}")


def _check_cache_dir(cache_dir: object) -> None:
    if cache_dir is None or cache_dir is False or isinstance(cache_dir, (str, os.PathLike)):
        return
    raise TypeError(f"cache_dir must be None, False, a str or a PathLike, got {cache_dir!r}")


def compile_regions(
    model: nn.Module,
    *,
    cache_dir: str | os.PathLike[str] | bool | None = None,
    precompile: bool | None = None,
    example_inputs: Any = None,
    distributed: str | None = None,
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """Compile ``model``'s repeated blocks and other parts in place; returns ``model`` itself.

    A drop-in for ``accelerate.utils.compile_regions`` and ``torch.compile`` that accepts every
    ``torch.compile`` keyword (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``,
    ``disable``, ...). The model object, its class, ``state_dict()`` keys, parameters, hooks and
    attributes stay as they are: each compiled module gets a compiled call path the way
    ``nn.Module.compile()`` gives one. Identical blocks share one compiled graph; see
    ``plan_regions`` for what is compiled and what stays eager. Calling it again re-plans and
    keeps what is already compiled with the same keywords.

    Hooks and instance-bound ``forward``s present at the first forward are traced into the
    compiled code. Blocks that differ in them are planned apart (Dynamo does not guard on
    hooks); hooks added or removed *after* the first forward are not noticed by torch: call
    ``compile_regions`` again after changing them.

    ``cache_dir`` chooses the artifact store (``None``: ``COMPILE_CACHE_DIR`` or the default,
    ``False``: no store, a path: that store). With a store, matching packs are restored before
    compiling, so a fresh process or node loads compiled code instead of compiling it; what the
    forwards compile is published. ``precompile=True`` (or ``COMPILE_CACHE_PRECOMPILE=1``) also
    caches Dynamo's traced bytecode, skipping tracing on a hit; it keeps only portable guards, so
    a primitive attribute changed after compiling is not noticed (off by default for that
    reason). ``compile_cache.last_report()`` says what was restored, compiled and published.

    For Inductor on CPU, the test libraries of Inductor's vector-ISA probe that are not already
    there start building in the background, so the first compile does not wait for them one by
    one; torch's probe still makes its own choice (``compile_cache.prefetch``,
    ``COMPILE_CACHE_PREFETCH=0`` turns it off).

    ``example_inputs`` (a tuple of positional inputs, a dict of keywords, or one tensor, shaped
    like the real batches): compile now with :func:`compile_cache.warm_up` instead of at the first
    forward (forward only under ``no_grad`` for a model in eval mode, forward and backward in
    training mode). In a ``torch.distributed`` job, one rank per key compiles and the others
    restore its artifacts; ``distributed`` (``shared``, ``broadcast`` or ``off``; default
    ``COMPILE_CACHE_DISTRIBUTED`` or ``shared``) says how they get them (see
    ``compile_cache.distributed``). Every rank must then call ``compile_regions`` at the same
    point; apply DDP or ``fully_shard`` afterwards.
    """
    _check_module(model, "compile_regions")
    _validate_kwargs(torch_compile_kwargs)
    _check_cache_dir(cache_dir)
    plan = plan_regions(model)
    kwargs = dict(torch_compile_kwargs)
    disabled = bool(kwargs.get("disable", False))
    plan = RegionPlan(plan.root_class, plan.groups, plan.rest, disabled, kwargs)
    modules = dict(model.named_modules())
    wanted: dict[str, tuple[str, str, int]] = {}
    if not disabled:
        for g in plan.groups:
            for name in g.names:
                wanted[name] = (
                    g.code_name,
                    f"{g.class_name} x{g.size} [{_abbrev(g.names)}]",
                    g.size,
                )
        for p in plan.compiled_rest:
            wanted[p.name] = (p.code_name, f"{p.name or '<root>'} ({p.class_name})", 1)

    # Undo our earlier installs on modules this plan no longer compiles.
    for name, mod in modules.items():
        if name not in wanted and isinstance(
            _unwrap(mod.__dict__.get("_compiled_call_impl")), _RegionRunner
        ):
            mod._compiled_call_impl = None

    wanted_members: dict[str, list[str]] = {}
    for name, (code_name, _, _) in wanted.items():
        wanted_members.setdefault(code_name, []).append(name)
    session = None
    use_precompile = False
    if not disabled:
        from . import (
            cache,  # the store's side; regions.py knows neither disk layout nor torch caches
        )

        use_precompile = cache.precompile_requested(precompile) and cache_dir is not False
        session = cache.open_session(model, plan, kwargs, cache_dir, use_precompile)
        use_precompile = use_precompile and session is not None
        from . import distributed as _distributed
        from . import prefetch  # after the restore: restored test libraries need no build

        if example_inputs is None or not _distributed.coordinates(distributed):
            prefetch.start_for(model, kwargs)  # else only the rank that compiles does (warm_up)
    frozen = _freeze((kwargs, use_precompile))
    user_limit = kwargs.get("recompile_limit")
    largest = max((g.size for g in plan.groups), default=1)
    if not disabled and not _PER_CALL_RECOMPILE_LIMIT:
        dynamo.raise_recompile_limit(largest)
    states: dict[str, _GroupState] = {}
    packaged: set[str] = set()  # groups whose precompile package is already installed
    for name, (code_name, label, size) in wanted.items():
        mod = modules[name]
        fn = _region_function(code_name)
        state = states.get(code_name)
        if state is None:
            members = [modules[n] for n in wanted_members.get(code_name, [name])]
            varying = _varying_attributes(members)
            state = states[code_name] = _GroupState(label, fn.__code__, size, varying)
        existing = _unwrap(mod.__dict__.get("_compiled_call_impl"))
        key = (code_name, frozen)
        if isinstance(existing, _RegionRunner) and existing.key == key:
            compiled = existing.compiled  # called again with the same keywords: keep it
        else:
            if existing is not None and not isinstance(existing, _RegionRunner):
                logger.info("compile_cache: replacing an earlier compile of %s", name or "<root>")
            call_kwargs = dict(kwargs)
            if use_precompile:
                call_kwargs = cache.with_precompile(call_kwargs)
            if _PER_CALL_RECOMPILE_LIMIT:
                base = user_limit if user_limit is not None else dynamo.recompile_limit()
                call_kwargs["recompile_limit"] = state.limit = max(int(base or size), size)
            # One precompile package per group: the blocks share the group's code object, so the
            # first block's package installs (and later saves) the entries for all of them; a
            # package per block would deserialize the same entries once per block.
            shares_package = use_precompile and code_name in packaged
            try:
                with dynamo.precompile_disabled() if shares_package else contextlib.nullcontext():
                    compiled = torch.compile(types.MethodType(fn, mod), **call_kwargs)
                packaged.add(code_name)
            except Exception as exc:  # torch's precompile loader does not catch everything
                if not use_precompile:
                    raise
                session.precompile_failed(name, exc)  # type: ignore[union-attr]
                call_kwargs = {k: v for k, v in call_kwargs.items() if k != "options"}
                if kwargs.get("options") is not None:
                    call_kwargs["options"] = dict(kwargs["options"])
                with dynamo.precompile_disabled():
                    compiled = torch.compile(types.MethodType(fn, mod), **call_kwargs)
        mod._compiled_call_impl = _RegionRunner(compiled, state, key)

    if session is not None:
        session.attach(model)
    with _LOCK:
        _PLANS[model] = plan
    logger.info("%s", plan.describe())
    from . import distributed as _distributed  # ranks: one compiles, the others restore

    if example_inputs is not None:
        _distributed.warm_up(model, example_inputs, mode=distributed)
    else:
        _distributed.note_lazy(model, distributed)
    return model


def get_plan(model: nn.Module) -> RegionPlan | None:
    """The plan ``compile_regions`` last applied to ``model``, or None."""
    return _PLANS.get(model)


def region_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """Per compiled group/part of ``model`` (by code name): compiled cache entries (shared by
    every model with the same fingerprint), eager runs and per-block recompiles of this model.
    ``eager_calls`` above zero means its compiled code did not run."""
    _check_module(model, "region_stats")
    states: dict[str, _GroupState] = {}
    for mod in model.modules():
        runner = _unwrap(mod.__dict__.get("_compiled_call_impl"))
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
