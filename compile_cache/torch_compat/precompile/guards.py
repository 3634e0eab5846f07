"""The guard filter of compile_cache's precompile: keep every guard that can be saved, drop only
what our key pins, and decline the rest.

Dynamo calls ``guard_filter_fn`` with every guard of a traced frame (``GuardFilterEntry``,
``torch/_dynamo/types.py``). What the filter drops is dropped from the in-process cache entry
too, not only from what is saved (``torch/_dynamo/guards.py``, ``CheckFunctionManager``), so a
filter that drops a value guard makes the *running* process wrong. That is what
``torch.compiler.keep_portable_guards_unsafe`` does: it keeps only global-state, shape-env and
tensor-match guards, and drops every constant, attribute, ``training``, argument-count and
optional-argument guard.

:func:`classify_guard` decides per guard:

* **keep** every guard Dynamo can serialise and does not drop by itself under
  ``caching_precompile``: constant and equality matches on attributes, arguments and globals,
  type matches, sequence lengths (``*args``), dict keys (``**kwargs``), ``__defaults__``,
  ``training``, tensor matches, global state, grad mode, the hooks-dict checks;
* **drop** a guard that cannot be serialised (``CheckFunctionManager.
  UNSUPPORTED_SERIALIZATION_GUARD_TYPES``) or that Dynamo drops itself under
  ``caching_precompile`` (identity guards: ``ID_MATCH``, ``CLOSURE_MATCH``, ``BUILTIN_MATCH``,
  ``CLASS_MATCH``, ``MODULE_MATCH``, ...), but only where compile_cache's key pins what it checks:
  Python modules, torch / standard-library / builtin callables (the environment key pins torch
  and Python), module-level classes, functions and enum members reachable under their qualname
  (Dynamo re-checks the source of every inlined function when it loads an entry), ``nn.Module``
  objects (the fingerprint pins class and structure; the value guards on their attributes stay)
  and what is reached through the module's class (``type(self)``: the fingerprint pins class and
  ``forward`` code);
* **drop and record by identity** (a *pin*, :mod:`.pins`) what a block stores or reaches that
  the key does not pin: a function, builtin, class or module object stored on the block
  (transformers' ``GELUActivation.act = nn.functional.gelu``, ``ACT2FN``), a global Python
  function not found under its qualname (an ``lru_cache`` helper's ``__wrapped__``, a function
  in a closure cell), what is reached from ``__import__('torch')``. The pin holds the object's
  description (module, qualified name and code digest, or the torch op): checked by identity at
  every call in process, against the publisher's before an entry loads. A source on the block
  (``self...``) is a pin only in the frame of the region's own call (:func:`compiling_code`), where
  ``self`` is the block;
* **drop and pin its class** a type guard on an object stored on the block whose class is
  defined in a function (kernels' private kernel functions): torch cannot save it, and the pin
  ``type(<source>)`` checks the same class by identity at every call, by description (module,
  qualified name, the code it defines) before an entry loads;
* **decline** anything else (a value reached from another frame's locals, a locally defined
  class reached elsewhere, an object that has no portable description, ...): the filter raises
  :class:`~compile_cache.errors.PrecompileDeclined` and the region compiles without precompile.
  Keeping such a guard is no option: torch 2.13 then fails the compile
  (``check_fn.guards_state must not be None``, ``torch/_dynamo/convert_frame.py``).
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import inspect
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import PrecompileDeclined
from .pins import builtin_shadow_source
from .pins import on_block as pins_on_block
from .pins import on_call as pins_on_call
from .values import ValueRecorder, describe_value, hasattr_name, record_key

__all__ = [
    "DECLINE",
    "DECLINED",
    "DROP",
    "GUARD_TREATMENTS",
    "KEEP",
    "PINNED_TYPE",
    "PINNED_TYPE_OF",
    "RECORDED",
    "GuardDecision",
    "GuardReport",
    "classify_guard",
    "compiling_code",
    "environ_differs",
    "environ_reads",
    "guard_builder_types",
    "local_type",
    "make_guard_filter",
    "pin_of",
    "treatment",
    "unsupported_guard_types",
]

KEEP, DROP, DECLINE = "keep", "drop", "decline"

#: Treatments of the allow-list (:data:`GUARD_TREATMENTS`).
RECORDED = "kept, value and presence recorded"
PINNED_TYPE = "dropped, pinned"
DECLINED = "declined"

#: Every guard type Dynamo can emit (a ``GuardBuilder`` method; torch 2.13 to 2.15), with the one
#: treatment precompile gives it, and why. A type not in the table declines: precompile changes
#: nothing it has not proven.
#:
#: * ``RECORDED``: the guard is kept (saved with the entry, checked at every call). Where its
#:   source is rebuilt from the loading process (a global, a class attribute: torch re-reads the
#:   expected value when it rebuilds the guard), the value it was traced with, presence or
#:   absence included (``HASATTR``), is recorded and compared before load
#:   (:func:`.values.describe_value`); one whose value has no portable description declines.
#: * ``PINNED_TYPE``: an identity guard, which Dynamo cannot save (or drops itself under
#:   ``caching_precompile``). Dropped only with a check of equal strength: a pin
#:   (:mod:`.pins`), compared by identity at every call in the running process and by portable
#:   description before load, or, for torch / standard-library objects and modules, the
#:   environment key (nothing in a process rebinds them once compiled: torch's own modules and
#:   builtins). What :func:`classify_guard` cannot pin so declines.
#: * ``DECLINED``: the group compiles without precompile (warned and counted).
GUARD_TREATMENTS: dict[str, tuple[str, str]] = {
    # values: the check is on a constant the guard holds (re-read from a live source at rebuild)
    "EQUALS_MATCH": (RECORDED, "the value (primitives, enums, dtypes, tuples of them); another "
                               "value on a global or a class declines"),
    "CONSTANT_MATCH": (RECORDED, "the constant"),
    "CONSTANT_SUBCLASS_MATCH": (RECORDED, "the constant, by its type and value"),
    "BOOL_MATCH": (RECORDED, "the bool"),
    "NONE_MATCH": (RECORDED, "None or not"),
    "NOT_NONE_MATCH": (RECORDED, "None or not"),
    "TYPE_MATCH": (RECORDED, "the class by qualified name (lineage in the entry name); a "
                             "locally defined class on the block: its class pinned"),
    "HASATTR": (RECORDED, "presence or absence of the attribute"),
    "NOT_PRESENT_IN_GENERIC_DICT": (RECORDED, "the attribute's absence: held by the guard"),
    "SEQUENCE_LENGTH": (RECORDED, "the length"),
    "TUPLE_ITERATOR_LEN": (RECORDED, "on the call's objects (pickled by value); declined on a "
                                     "global (no portable description)"),
    "RANGE_ITERATOR_MATCH": (RECORDED, "on the call's objects (pickled by value); declined on a "
                                       "global"),
    "COUNT_ITERATOR_MATCH": (RECORDED, "on the call's objects (pickled by value); declined on a "
                                       "global"),
    "DICT_KEYS_MATCH": (RECORDED, "the keys, in order"),
    "MAPPING_KEYS_CHECK": (RECORDED, "the keys, in order"),
    "DICT_CONTAINS": (RECORDED, "the key and whether it is in: held by the guard"),
    "DICT_NOT_CONTAINS": (RECORDED, "the key and whether it is in: held by the guard"),
    "SET_CONTAINS": (RECORDED, "the item and whether it is in: held by the guard"),
    "SET_NOT_CONTAINS": (RECORDED, "the item and whether it is in: held by the guard"),
    "EMPTY_NN_MODULE_HOOKS_DICT": (RECORDED, "emptiness: held by the guard"),
    "TENSOR_MATCH": (RECORDED, "a call's tensor: pickled with the entry; a global's metadata"),
    "DISPATCH_KEY_SET_MATCH": (RECORDED, "a call's dispatch keys (pickled by value); declined on "
                                         "a global"),
    "DUPLICATE_INPUT": (RECORDED, "which inputs alias: held by the guard"),
    "SHAPE_ENV": (RECORDED, "the symbolic-shape guards: held by the guard"),
    "GLOBAL_STATE": (RECORDED, "grad mode, autocast, thread count...: held by the guard"),
    "GRAD_MODE": (RECORDED, "held by the guard"),
    "DETERMINISTIC_ALGORITHMS": (RECORDED, "held by the guard"),
    "TORCH_FUNCTION_STATE": (RECORDED, "held by the guard"),
    "DEFAULT_DEVICE": (RECORDED, "held by the guard"),
    "AUTOGRAD_SAVED_TENSORS_HOOKS": (RECORDED, "held by the guard"),
    "FUNCTORCH_STACK_MATCH": (RECORDED, "held by the guard"),
    "DUAL_LEVEL": (RECORDED, "held by the guard"),
    # identities: a pin or the environment key, else declined
    "ID_MATCH": (PINNED_TYPE, "identity: pinned, or the environment key for torch's objects"),
    "CLOSURE_MATCH": (PINNED_TYPE, "a function's identity: pinned"),
    "FUNCTION_MATCH": (PINNED_TYPE, "a function's identity: pinned"),
    "BUILTIN_MATCH": (PINNED_TYPE, "a builtin's identity: environment key; a name a module "
                                   "global could shadow: its absence pinned"),
    "CLASS_MATCH": (PINNED_TYPE, "a class's identity: pinned"),
    "MODULE_MATCH": (PINNED_TYPE, "a module: torch's and Python's by the environment key; "
                                  "others pinned, with the names they hold"),
    # no faithful saved form
    "NN_MODULE": (DECLINED, "carries the module's training flag inside an identity check"),
    "DICT_VERSION": (DECLINED, "a process-local version counter"),
    "WEAKREF_ALIVE": (DECLINED, "a process-local object"),
    "FAKE_SCRIPT_TYPE_MATCH": (DECLINED, "a TorchScript object's type"),
    "TENSOR_SUBCLASS_METADATA_MATCH": (DECLINED, "a tensor subclass's metadata"),
    "DTENSOR_SPEC_MATCH": (DECLINED, "a DTensor's placement"),
    "OPAQUE_OBJ_GUARD_FN_MATCH": (DECLINED, "an opaque object's own guard function"),
    "FSDP_TRAINING_STATE": (DECLINED, "FSDP's per-process training state"),
}

#: Kept guard types whose expected value torch re-reads from the source when it rebuilds a
#: loaded entry's guards (``GuardBuilder``: ``self.get(guard.name)``): on a source that is not
#: pickled with the entry (a global, what is reached through a class) their value must be
#: recorded, or the rebuilt guard compares the live value with itself.
_READS_LIVE = frozenset({
    "EQUALS_MATCH", "CONSTANT_MATCH", "CONSTANT_SUBCLASS_MATCH", "BOOL_MATCH", "TYPE_MATCH",
    "HASATTR", "SEQUENCE_LENGTH", "TUPLE_ITERATOR_LEN",
    "RANGE_ITERATOR_MATCH", "COUNT_ITERATOR_MATCH", "DICT_KEYS_MATCH", "MAPPING_KEYS_CHECK",
    "DISPATCH_KEY_SET_MATCH", "TENSOR_MATCH",
})


def treatment(guard_type: str) -> str:
    """The allow-list's treatment of ``guard_type`` (:data:`GUARD_TREATMENTS`); an unknown type
    is declined."""
    return GUARD_TREATMENTS.get(guard_type, (DECLINED, ""))[0]


def guard_builder_types() -> frozenset[str]:
    """Every guard type the installed torch's ``GuardBuilder`` can emit (its upper-case methods)."""
    from torch._dynamo.guards import GuardBuilder

    return frozenset(name for name, value in vars(GuardBuilder).items()
                     if name.isupper() and callable(value))

#: The guards Dynamo drops by itself when ``caching_precompile`` is on at trace time,
#: whatever the filter returned (``torch/_dynamo/guards.py``, ``CheckFunctionManager.__init__``).
_FORCED_TYPES = ("ID_MATCH", "CLOSURE_MATCH", "WEAKREF_ALIVE", "DICT_VERSION")


def unsupported_guard_types() -> frozenset[str]:
    """The guard types Dynamo cannot serialise (``UNSUPPORTED_SERIALIZATION_GUARD_TYPES``)."""
    from torch._dynamo.guards import CheckFunctionManager

    return frozenset(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)


@dataclasses.dataclass(frozen=True)
class GuardDecision:
    """What the filter does with one guard, and why."""

    action: str  # KEEP, DROP or DECLINE
    reason: str


def _module_of(value: Any) -> str:
    if inspect.ismodule(value):
        return value.__name__
    return getattr(value, "__module__", None) or ""


def _is_torch_object(value: Any) -> bool:
    mod = _module_of(value)
    return mod in ("torch", "builtins") or mod.startswith("torch.")


def _is_stdlib_object(value: Any) -> bool:
    """Defined by Python's standard library (the environment key pins the Python version)."""
    return _module_of(value).split(".", 1)[0] in sys.stdlib_module_names


def _resolvable(value: Any) -> bool:
    """A function or class that its module exports under its qualname (what pickle would find)."""
    obj: Any = sys.modules.get(getattr(value, "__module__", "") or "")
    if obj is None:
        return False
    for part in (getattr(value, "__qualname__", "") or "").split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return obj is value


def _live_source(entry: Any) -> bool:
    """A source torch rebuilds from the loading process, not from what it pickled with the entry:
    a global, or what is reached through a class (``type(self)``)."""
    return bool(entry.is_global) or _through_type(entry.name) or "G[" in entry.name


def _through_type(name: str) -> bool:
    """The source goes through a class (``type(self)``, ``__class__``, ``__mro__``): what it finds
    is defined by the class, which the fingerprint pins (class qualname and forward code)."""
    return "type(" in name or "__class__" in name or "__mro__" in name


def _torch_drops(entry: Any) -> bool:
    derived = tuple(entry.derived_guard_types or ())
    return entry.guard_type in _FORCED_TYPES or "ID_MATCH" in derived or "DICT_VERSION" in derived


def _serialisable(entry: Any, unsupported: frozenset[str]) -> bool:
    """What ``CheckFunctionManager.serialize_guards`` accepts."""
    if entry.guard_type in ("TYPE_MATCH", "BUILTIN_MATCH"):
        return not getattr(entry.orig_guard, "_unserializable", False)
    derived = tuple(entry.derived_guard_types or ())
    return entry.guard_type not in unsupported and not any(d in unsupported for d in derived)


_ROOT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*")
_DYNAMO_GLOBAL = re.compile(r"^G\['_\d+_c\d+'\]")
_FREE_NAME = re.compile(r"(?<![\w.'\"])[A-Za-z_]\w*")


def _root(name: str) -> str:
    """The local a guard source starts from (``self`` of ``self._modules['mlp'].act``)."""
    found = _ROOT_NAME.match(name)
    return found.group(0) if found else ""


def _from_import(name: str) -> bool:
    """A source that starts from ``__import__('<module>')`` and uses no local, only builtins
    (``list(dict.keys(__import__('torch').utils._pytree.SUPPORTED_NODES))[0]``)."""
    free = set(_FREE_NAME.findall(name))
    return "__import__" in free and all(hasattr(builtins, n) for n in free)


def _identity_describable(value: Any) -> bool:
    """An object whose identity a portable description stands for (:func:`.pins.describe`):
    a module (by name), a builtin or torch op (module and name), a Python function or method
    (module, qualified name and code digest), a class found under its qualname."""
    if inspect.ismodule(value) or inspect.isbuiltin(value):
        return True
    if inspect.isfunction(value) or inspect.ismethod(value):
        return isinstance(getattr(value, "__code__", None), types.CodeType)
    if inspect.isclass(value):
        return _resolvable(value) or _is_torch_object(value) or _is_stdlib_object(value)
    return callable(value) and (_is_torch_object(value) or _is_stdlib_object(value)) and bool(
        getattr(value, "__qualname__", None) or getattr(value, "__name__", None))


def _guard_builder_locals() -> dict[str, Any] | None:
    """The locals of Dynamo's ``CheckFunctionManager.__init__`` (``torch/_dynamo/guards.py``) on
    the caller frames of the guard filter; None when torch no longer calls the filter from there."""
    suffix = os.path.join("_dynamo", "guards.py")
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_filename.endswith(suffix) and "f_code" in frame.f_locals:
            return frame.f_locals
        frame = frame.f_back
    return None


def compiling_code() -> types.CodeType | None:
    """The code object Dynamo is building guards for (``CheckFunctionManager(f_code, ...)``,
    ``torch/_dynamo/guards.py``), read from the caller frames of the guard filter; None when
    torch no longer calls the filter from there (then no source on the block is pinned)."""
    found = (_guard_builder_locals() or {}).get("f_code")
    return found if isinstance(found, types.CodeType) else None


def frame_graph_break() -> str | None:
    """Why the frame Dynamo is building guards for ended its graph early (a graph break: Dynamo
    traces what follows as frames of their own), None when it did not; read from
    ``CheckFunctionManager(output_graph=...)``. Unknown (torch moved it) counts as a break."""
    found = _guard_builder_locals()
    graph = (found or {}).get("output_graph")
    reason = getattr(graph, "compile_subgraph_reason", None)
    if reason is None or not hasattr(reason, "graph_break"):
        return "unknown (torch no longer exposes the frame's compile reason)"
    return str(getattr(reason, "reason", "graph break"))[:200] if reason.graph_break else None


def _describe(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def classify_guard(entry: Any, unsupported: frozenset[str] | None = None, *,
                   region_frame: bool = False) -> GuardDecision:
    """Keep, drop or decline one ``GuardFilterEntry`` (see the module docstring).
    ``region_frame``: the guards are those of the region's own call, where ``self`` is the block
    (not of another frame Dynamo traced on its own)."""
    from torch import nn

    unsupported = unsupported_guard_types() if unsupported is None else unsupported
    gtype = entry.guard_type
    if local_type(entry) is not None and _local_type_pinnable(entry, region_frame):
        # An object stored on the block, or a module global, whose class is defined in a
        # function (kernels' kernel functions, ``_create_func_module.<locals>.Func``): torch
        # cannot save the type guard (pickle finds no class by that name), so it is dropped and
        # its class pinned (``type(<source>)``): checked by identity at every call, as the guard
        # did, and by module, qualified name and code before an entry loads (.pins.describe).
        return GuardDecision(DROP, PINNED_TYPE_OF)
    listed = _by_the_allow_list(entry, unsupported)
    if listed is not None:
        return listed
    if not entry.has_value:
        return GuardDecision(DECLINE, f"{gtype} on {entry.name} (no value to judge)")
    value = entry.value
    if entry.is_global and _DYNAMO_GLOBAL.match(entry.name):
        # G['_139751808275920_c65'].Tensor (CLIP): a global Dynamo installed under a name of
        # this process; a saved entry does not install it again, so a loaded graph would fail
        # (NameError: ___module_collections_<id>_c65).
        return GuardDecision(DECLINE, f"{gtype} on {entry.name}, a global Dynamo installed in "
                             f"this process only (a loaded entry would not find it)")
    if entry.is_global:
        if inspect.ismodule(value):
            if _is_torch_object(value) or _is_stdlib_object(value):
                return GuardDecision(DROP, "global module identity (environment key)")
            # the module's identity in process (as Dynamo's guard), the names it holds before
            # load: getattr(module, "X", default) or hasattr was traced with X absent
            return GuardDecision(DROP, PINNED)
        if inspect.isbuiltin(value) or (
            callable(value) and (_is_torch_object(value) or _is_stdlib_object(value))
        ):
            return GuardDecision(DROP, "global torch/stdlib/builtin callable (environment key)")
        if (inspect.isclass(value) or inspect.isfunction(value)) and _resolvable(value):
            return GuardDecision(DROP, "global class/function by qualname (source checked at load)")
        if isinstance(value, enum.Enum) and _resolvable(type(value)):
            return GuardDecision(DROP, "enum member of a global enum class")
        if _identity_describable(value):
            return GuardDecision(DROP, PINNED)
        return GuardDecision(DECLINE, f"{gtype} on global {entry.name} ({_describe(value)})")
    if _from_import(entry.name) and _identity_describable(value):
        # __import__('torch').utils._pytree...: reached from a module by name
        return GuardDecision(DROP, PINNED)
    # Locals: self, args, kwargs and what is reached from them.
    if isinstance(value, nn.Module) and gtype != "NN_MODULE":
        # NN_MODULE also carries the module's `training` check inside it: dropping it would
        # drop that value guard too, so it declines.
        return GuardDecision(DROP, "nn.Module identity (fingerprint: class and structure)")
    if _through_type(entry.name) and (
        inspect.isclass(value) or inspect.isfunction(value) or isinstance(value, types.CodeType)
    ):
        # The fingerprint pins the class as it was defined; a property, method or class
        # attribute swapped after compiling is not in it: checked at every call (a pin).
        if region_frame and pins_on_block(entry.name) and _identity_describable(value):
            return GuardDecision(DROP, PINNED)
        return GuardDecision(DECLINE, f"{gtype} on {entry.name} ({_describe(value)}): defined by "
                             f"a class, in a frame where it cannot be checked at each call")
    if inspect.ismethod(value) and isinstance(value.__self__, nn.Module):
        cls_attr = inspect.getattr_static(type(value.__self__), value.__func__.__name__, None)
        if cls_attr is value.__func__:
            if region_frame and pins_on_block(entry.name):
                return GuardDecision(DROP, PINNED)
            return GuardDecision(DECLINE, f"{gtype} on {entry.name}: a module's method, in a "
                                 f"frame where it cannot be checked at each call")
    if _identity_describable(value):
        # an object the call passes itself (a function argument) is not pinned: a group called
        # with another each time would decline at once; only what its class defines is
        if region_frame and pins_on_block(entry.name) and not pins_on_call(entry.name):
            return GuardDecision(DROP, PINNED)
        where = ("reached from the call's arguments, not from the block" if region_frame else
                 "in a frame Dynamo traced apart from the region's call (after a graph break)")
        return GuardDecision(DECLINE, f"{gtype} on {entry.name} ({_describe(value)}), {where}: "
                             f"its identity cannot be checked at each call")
    return GuardDecision(DECLINE, f"{gtype} on {entry.name} ({_describe(value)})")


def _by_the_allow_list(entry: Any, unsupported: frozenset[str]) -> GuardDecision | None:
    """The decision :data:`GUARD_TREATMENTS` makes alone (an unknown or declined type, a kept
    one), None for an identity type (:func:`classify_guard` decides how it is pinned)."""
    gtype = entry.guard_type
    for kind in (gtype, *(entry.derived_guard_types or ())):
        if kind not in GUARD_TREATMENTS:
            return GuardDecision(DECLINE, f"{kind} on {entry.name}: a guard type precompile does "
                                 f"not know (not in its allow-list)")
    if entry.has_value and entry.value is os.environ and environ_reads(entry.name) is None:
        # os.environ.get("X", default): Dynamo guards the mapping's type and code, none of its
        # keys, so a variable set only where an entry loads would go unseen
        return GuardDecision(DECLINE, f"{gtype} on {entry.name}: os.environ is read in the traced "
                             f"code, from a module whose variable names cannot be found")
    if treatment(gtype) == DECLINED:
        return GuardDecision(DECLINE, f"{gtype} on {entry.name}: {GUARD_TREATMENTS[gtype][1]}")
    if gtype in ("TYPE_MATCH", "BUILTIN_MATCH") and getattr(entry.orig_guard, "_unserializable", False):
        # (a TYPE_MATCH on the block in the region's own frame became a pin on the class
        # before: classify_guard, _local_type_pin)
        return GuardDecision(DECLINE, f"{gtype} on a locally defined class ({entry.name})")
    if treatment(gtype) != RECORDED:
        return None
    if not _serialisable(entry, unsupported) or _torch_drops(entry):
        return GuardDecision(DECLINE, f"{gtype} on {entry.name}: kept by the allow-list, but "
                             f"torch cannot save it here")
    if gtype in _READS_LIVE and _live_source(entry) and describe_value(
            gtype, entry.value if entry.has_value else None, entry.name,
            attr=hasattr_name(entry)) is None:
        return GuardDecision(DECLINE, f"{gtype} on {entry.name} ({_describe(entry.value)}): "
                             f"rebuilt from the loading process, and its value has no "
                             f"portable description to prove it")
    return GuardDecision(KEEP, "serialisable")


#: The reason of a dropped identity guard that becomes a pin (:mod:`.pins`).
PINNED = "recorded by identity (a pin: checked at each call and before an entry loads)"
#: The reason of a dropped type guard on a locally defined class whose class becomes a pin
#: (source ``type(<guard's source>)``; :func:`local_type`).
PINNED_TYPE_OF = "its class recorded by identity (a pin on type(...): a locally defined class)"


def local_type(entry: Any) -> type | None:
    """The locally defined class a ``TYPE_MATCH`` guard checks, which torch cannot save
    (``GuardBuilder.TYPE_MATCH`` marks the guard ``_unserializable``: with the class on torch
    2.15, with True up to 2.14, where the class is the value's), else None."""
    if entry.guard_type != "TYPE_MATCH":
        return None
    found = getattr(entry.orig_guard, "_unserializable", None)
    if found is True and entry.has_value:
        found = type(entry.value)
    return found if inspect.isclass(found) and found.__qualname__ != found.__name__ else None


def _local_type_pinnable(entry: Any, region_frame: bool) -> bool:
    """Whether the class of a type guard on a locally defined class can be pinned: the source
    is on the block in the region's own frame (not the call's arguments), or a global of a
    module reached by its name (``G['__import_<module>'].name``, in any frame)."""
    if entry.is_global:
        return entry.name.startswith("G['__import_") or region_frame
    return region_frame and pins_on_block(entry.name) and not pins_on_call(entry.name)


def pin_of(entry: Any, decision: GuardDecision) -> tuple[str, Any] | None:
    """(source, object) of the pin a dropped guard becomes, None for a drop the key covers."""
    if decision.reason == PINNED_TYPE_OF:
        return f"type({entry.name})", local_type(entry)
    if _pinnable(entry, decision):
        return entry.name, entry.value
    return None


def _pinnable(entry: Any, decision: GuardDecision) -> bool:
    """A dropped guard on a global function, class, builtin or enum member that a rebinding
    could change (not global modules, nor Python's own builtins dict), or on an object stored
    on the block or reached from ``__import__`` (:data:`PINNED`)."""
    if decision.reason == PINNED:
        return True
    value = entry.value
    return (entry.is_global and entry.has_value
            and (callable(value) or isinstance(value, enum.Enum))
            and not inspect.ismodule(value)
            and not entry.name.startswith("G['__builtins_dict__"))


def _whole_part_pin_decline(entry: Any, region_frame: bool) -> str | None:
    """Why a pin of a part compiled whole (``pin_block=False``) declines, None when it is kept.

    Kept: a pin on a global or on ``__import__('<module>')`` in the part's own frame
    (``G['__import_transformers_dot_models_dot_gpt2_dot_modeling_gpt2'].create_causal_mask.
    __closure__[1].cell_contents``: the function transformers' ``deprecate_kwarg`` wraps),
    checked by identity at each call of the part and, by module, qualified name and code digest,
    before an entry loads (a frame that graph-breaks declines as a whole: :func:`make_guard_filter`).
    Declined: a pin on the block (graph breaks are common in a whole model; declined in the
    part's first frame, before any of the call runs) and a pin in a frame traced apart (its ``G``
    is another module's globals, not the part's scope the pins are evaluated in)."""
    if pins_on_block(entry.name):
        return "a part compiled whole is not pinned on the block (declined in its first frame, before it runs)"
    if not region_frame:
        return ("a pin in a frame Dynamo traced apart from the part's call (after a graph "
                "break) cannot be checked in the part's scope")
    return None


_IMPORT_ALIAS = re.compile(r"^G\['__import_(\w+)'\]\.")
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]{2,}$")


def environ_reads(source: str) -> dict[str, str | None] | None:
    """The environment variables a module that reads ``os.environ`` in traced code may read, with
    their values here: every upper-case string constant of its code (``"TRANSFORMERS_SDPA_FORCE_
    GQA"``). Dynamo guards none of the variables (``os.environ.get`` is traced through), so they
    are recorded with the entry and compared before it loads. None when the reading module
    cannot be found from the guard's source (``G['__import_<module>'].os.environ``)."""
    found = _IMPORT_ALIAS.match(source)
    module = sys.modules.get(found.group(1).replace("_dot_", ".")) if found else None
    if module is None:
        return None
    # (and its module-level strings: ``ENV = "MY_FLAG"`` read as ``os.environ.get(ENV)``)
    names = {v for v in vars(module).values() if isinstance(v, str) and _ENV_NAME.match(v)}
    stack: list[Any] = [v for v in vars(module).values() if inspect.isfunction(v) or inspect.isclass(v)]
    codes: list[types.CodeType] = []
    for value in stack:
        if inspect.isclass(value):
            if getattr(value, "__module__", None) == module.__name__:
                codes += [f.__code__ for f in vars(value).values() if inspect.isfunction(f)]
        elif getattr(value, "__module__", None) == module.__name__:
            codes.append(value.__code__)
    while codes:
        code = codes.pop()
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                codes.append(const)
            elif isinstance(const, str) and _ENV_NAME.match(const):
                names.add(const)
    return {name: os.environ.get(name) for name in sorted(names)}


def environ_differs(recorded: dict[str, str | None]) -> str | None:
    """Why this process's environment differs from what an entry was traced under, else None."""
    for name, value in recorded.items():
        here = os.environ.get(name)
        if here != value:
            return (f"the environment variable {name} is {'unset' if here is None else repr(here)} "
                    f"here but was {'unset' if value is None else repr(value)} where the entry was "
                    f"traced (read through os.environ in traced code)")
    return None


#: A builtin the traced code called, through the frame's builtins dict (Dynamo names it by
#: its counter): ``G['__builtins_dict___0']['max']``.
_BUILTINS_DICT = re.compile(r"^G\['__builtins_dict___\d+'\]\['(\w+)'\]$")


def _pin_builtin_absence(report: GuardReport, name: str, region_frame: bool) -> str | None:
    """The traced code called the builtin ``name``: a module global of that name (``max = min``)
    would shadow it, and Dynamo's saved guards do not say the name was absent from the module's
    globals. In the region's own frame that absence becomes a pin on the block's module (checked
    at every call and before load); elsewhere it cannot be checked: why it declines."""
    graph = (_guard_builder_locals() or {}).get("output_graph")
    if not region_frame:  # a frame traced apart: its own module's globals, found by name
        scope = getattr(graph, "global_scope", None)
        owner = scope.get("__name__") if isinstance(scope, dict) else None
        if not isinstance(owner, str) or getattr(sys.modules.get(owner), "__dict__", None) is not scope:
            return ("a builtin called in a frame Dynamo traced apart from the region's call, "
                    "whose module cannot be found by name: whether a module global shadows it "
                    "cannot be checked there")
        report.pins.setdefault(f"__import__('sys').modules[{owner!r}].__dict__.get({name!r})",
                               scope.get(name))
        return None
    scope = getattr(graph, "local_scope", None)
    module = scope.get("self") if isinstance(scope, dict) else None
    forward = getattr(getattr(module, "forward", None), "__globals__", None)
    if not isinstance(forward, dict):
        return "a builtin called where the block's module globals cannot be read"
    report.pins.setdefault(builtin_shadow_source(name), forward.get(name))
    return None


@dataclasses.dataclass
class GuardReport:
    """What the filter saw for one region: counts per decision, and why precompile was declined."""

    kept: int = 0
    dropped: int = 0
    declined: list[str] = dataclasses.field(default_factory=list)
    dropped_kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    frames: int = 0
    #: Dropped identity guards on globals (source -> the object it named when traced): what a
    #: rebinding (monkeypatching) would change. Checked by the caller: at every call in
    #: process, and against the publisher's when an entry loads.
    pins: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Environment variables read through os.environ in traced code, with their values then.
    environ: dict[str, str | None] = dataclasses.field(default_factory=dict)
    #: The values each traced graph was traced under (:mod:`.values`).
    values: ValueRecorder = dataclasses.field(default_factory=ValueRecorder)
    #: Declined because a part compiled whole graph-broke in its own frame: a decline of the
    #: path that breaks (a training step), not of the entry, whose other paths (the forward)
    #: were saved and load on the next node.
    graph_break: bool = False

    @property
    def safe(self) -> bool:
        """True while no guard had to be declined."""
        return not self.declined


def make_guard_filter(report: GuardReport, region_code: types.CodeType | None = None,
                      on_region_decline: Callable[[], None] | None = None, *,
                      pin_block: bool = True,
                      ) -> Callable[[Sequence[Any]], list[bool]]:
    """A ``guard_filter_fn`` for ``torch.compile(options=...)`` that records into ``report`` and
    raises :class:`PrecompileDeclined` when a guard can neither be kept nor dropped.

    ``region_code``: the region function's code; in its frame ``self`` is the block, so what is
    stored on the block can be pinned. ``on_region_decline`` is called before raising for that
    frame (nothing of the call has run yet: the caller lets the error end the call, which it
    runs again without precompile, instead of Dynamo running the frame eagerly).
    ``pin_block=False`` (a part compiled whole, where graph breaks are common): the part's own
    frame declines, before anything of the call ran, when it graph-breaks (the frames Dynamo
    then traces apart would decline after it ran, and the part would compile twice) or holds a
    pin on the block; a pin on a global is kept there (:func:`_whole_part_pin_decline`)."""
    unsupported = unsupported_guard_types()
    lock = threading.Lock()

    def guard_filter(entries: Sequence[Any]) -> list[bool]:
        out = []
        values: dict[str, str] = {}
        code = compiling_code()
        region_frame = region_code is not None and code is region_code
        breaks = frame_graph_break() if region_frame and not pin_block else None
        with lock:
            report.frames += 1
            declined_before = len(report.declined)
            if breaks is not None:
                why = (f"the part compiled whole graph-breaks in its own frame ({breaks}): Dynamo "
                       "traces what follows as frames of their own (decorator wrappers, other "
                       "modules' functions), whose guards on closed-over functions cannot be "
                       "saved, so they would decline after this frame ran and the part would "
                       "compile twice (declined in its first frame, before it runs)")
                if why not in report.declined:
                    report.declined.append(why)
                report.graph_break = True
            for entry in entries:
                decision = classify_guard(entry, unsupported, region_frame=region_frame)
                if not pin_block and decision.reason in (PINNED, PINNED_TYPE_OF):
                    why = _whole_part_pin_decline(entry, region_frame)
                    if why is not None:
                        decision = GuardDecision(DECLINE, f"{entry.guard_type} on {entry.name}: "
                                                 f"{why}")
                shadow = _BUILTINS_DICT.match(entry.name) if decision.action == DROP else None
                if shadow is not None:
                    why = _pin_builtin_absence(report, shadow.group(1), region_frame)
                    if why is not None:
                        decision = GuardDecision(DECLINE, f"{entry.guard_type} on {entry.name}: {why}")
                if decision.action == DROP:
                    pin = pin_of(entry, decision)
                    if pin is not None:
                        report.pins.setdefault(*pin)
                    report.dropped += 1
                    kinds = report.dropped_kinds
                    kinds[entry.guard_type] = kinds.get(entry.guard_type, 0) + 1
                    out.append(False)
                    continue
                report.kept += 1
                if decision.action == DECLINE and decision.reason not in report.declined:
                    report.declined.append(decision.reason)
                elif entry.has_value:
                    if entry.value is os.environ:
                        report.environ.update(environ_reads(entry.name) or {})
                    source = entry.orig_guard.name
                    described = describe_value(entry.guard_type, entry.value, source,
                                               attr=hasattr_name(entry))
                    if described is not None:  # several guards may share one source
                        values[record_key(entry.guard_type, source)] = described
                out.append(True)
            report.values.frame(values)
            here = report.declined[declined_before:]
        if report.declined:
            if region_frame and on_region_decline is not None:
                on_region_decline()
            raise PrecompileDeclined("; ".join(here or report.declined))
        return out

    return guard_filter
