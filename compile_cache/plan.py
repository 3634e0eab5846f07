"""Which blocks of a model repeat, and what happens to every other part: the plan.

``plan_regions(model)`` finds the *regions* of a model: maximal subtrees whose fingerprint
(``fingerprint_tree(model, attributes=False)``) occurs at least twice, wherever they sit
(``ModuleList``, ``Sequential``, ``ModuleDict``, plain attributes, nested stacks). Regions with the
same digest form a *group*; lists that mix block types give one group per type. The parts outside
the regions are compiled separately where that pays, and left eager where it cannot, each with
its reason (:data:`REASONS`, ``RegionPlan.describe()``).

Pure: it reads the module tree and its fingerprints, and compiles nothing. Installing the plan
is :mod:`compile_cache.regions`.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .fingerprint import fingerprint_tree
from .torch_compat import dynamo

__all__ = [
    "REASONS", "RegionGroup", "RegionPlan", "RestPart", "check_module", "plan_regions",
    "varying_attributes", "whole_plan", "is_part_code",
]



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
        "eager: a single torch.nn op (or an nn.Embedding subclass: a lookup, maybe scaled); "
        "`.compile()` on it is a no-op (Dynamo skips torch/nn frames) and compiling it alone "
        "would cost a compile for nothing to fuse"
    ),
    "container": "eager: a container with no forward of its own; its children are planned one by one",
    "no_parameters": (
        "eager: holds no parameters (a rotary embedding, a mask builder: a few small ops); "
        "compiling it would add a graph, and a C++ or Triton compile, per input shape and phase "
        "for no measurable gain"
    ),
    "disabled": "eager: compile_regions(..., disable=True)",
    "whole_model": "compiled whole: compile_cache.compile(model)",
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
                f"[{abbreviate(g.names)}]"
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


def abbreviate(names: tuple[str, ...], keep: int = 3) -> str:
    if len(names) <= keep + 1:
        return ", ".join(names)
    return ", ".join(names[:keep]) + f", ... {names[-1]}"


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_part_code(code_name: str) -> bool:
    """Whether ``code_name`` names the code of a part outside the regions (:class:`RestPart`,
    a whole model's among them), not a region group's."""
    return code_name.startswith("part_")


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


def _embedding_leaf(module: nn.Module) -> bool:
    """A leaf subclass of ``nn.Embedding`` (BART's scaled and positional embeddings, Gemma's):
    a table lookup, maybe scaled, that a compile of its own gains nothing on."""
    return isinstance(module, nn.Embedding) and next(iter(module.children()), None) is None


def _can_be_region(module: nn.Module) -> bool:
    """Composite modules, or modules whose class is not torch.nn's, that can be called (not an
    embedding lookup: :func:`_embedding_leaf`)."""
    if not _has_forward(module):
        return False
    has_children = next(iter(module.children()), None) is not None
    return has_children or not (_is_torch_nn_class(module) or _embedding_leaf(module))


def check_module(model: object, what: str) -> None:
    """TypeError unless ``model`` is an ``nn.Module`` that ``torch.compile`` has not wrapped."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{what} needs a torch.nn.Module, got {type(model).__module__}."
            f"{type(model).__qualname__}: {model!r:.80}"
        )
    if dynamo.is_optimized_module(model):
        raise TypeError(
            f"{what} got a module already wrapped by torch.compile ({type(model).__name__} around "
            f"{type(dynamo.original_module(model)).__name__}); pass the original module (`._orig_mod`)"
        )


def plan_regions(model: nn.Module) -> RegionPlan:
    """Which blocks repeat, and what happens to every other part. Compiles nothing.

    A region is a maximal subtree whose fingerprint (``attributes=False``: per-block settings
    such as ``layer_idx`` do not split a group) occurs at least twice in the model; only callable
    composite modules, or modules whose class is not from ``torch.nn``, qualify (a repeated
    ``nn.Linear`` is one op, not worth a compile). Regions sharing a digest form a group. A part
    outside the regions that holds no parameters (Llama's rotary embedding) stays eager: its few
    small ops gain nothing from a compile, which would cost one C++ build per input shape and
    phase (a cold ``generate()`` on CPU spent about 6 s compiling Llama's).
    """
    check_module(model, "plan_regions")
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
    by_key = _split_by_flags(by_key, modules)
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
        elif _can_be_region(mod) and next(mod.parameters(), None) is None:
            rest.append(part(False, "no_parameters"))
        elif _can_be_region(mod):
            rest.append(part(True, "part"))
        else:
            rest.append(part(False, "torch_nn_leaf"))

    walk("")
    return RegionPlan(_class_name(model), groups, tuple(rest))


def whole_plan(model: nn.Module, reason: str = REASONS["whole"]) -> RegionPlan:
    """A plan that compiles ``model`` whole, as one part (``compile_cache.compile(model)``:
    cross-block fusion, or CUDA graphs over the whole forward). Compiles nothing."""
    check_module(model, "whole_plan")
    digest = fingerprint_tree(model, attributes=False)[""].hex
    part = RestPart("", _class_name(model), True, reason, digest, _call_signature(model))
    return RegionPlan(_class_name(model), (), (part,))


_PRIMITIVES = (int, float, bool, str, type(None))


def _flags(module: nn.Module) -> tuple[tuple[str, bool], ...]:
    """The block's boolean settings (``is_decoder``, ``is_causal`` of any submodule; not
    ``training``): a flag that forward branches on."""
    return tuple(
        (f"{sub_name}.{attr}" if sub_name else attr, value)
        for sub_name, sub in module.named_modules()
        for attr, value in sorted(vars(sub).items())
        if isinstance(value, bool) and not attr.startswith("_") and attr != "training"
    )


def _split_by_flags(by_key: dict[tuple[str, str], list[str]], modules: dict[str, nn.Module]
                    ) -> dict[tuple[str, str], list[str]]:
    """Blocks of one fingerprint whose flags differ (T5's bidirectional encoder and causal
    decoder self-attention) form one group per flag setting: their forwards take other
    branches, so one shared graph would only recompile per block. The variant of such a group
    names its flags; groups whose blocks agree keep theirs."""
    out: dict[tuple[str, str], list[str]] = {}
    for (digest, variant), names in by_key.items():
        settings: dict[tuple, list[str]] = {}
        for name in names:
            settings.setdefault(_flags(modules[name]), []).append(name)
        if len(settings) == 1:
            out[(digest, variant)] = names
            continue
        for flags, members in settings.items():
            tag = "f" + hashlib.sha1(repr(flags).encode()).hexdigest()[:7]
            out[(digest, f"{variant}_{tag}" if variant else tag)] = members
    return out


def varying_attributes(members: list[nn.Module]) -> tuple[str, ...]:
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
