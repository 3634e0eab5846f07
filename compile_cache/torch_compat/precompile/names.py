"""Names of precompile entries, and the function (code object, module namespace) each one gets.

Dynamo's on-disk id of an entry is ``sha256(fn.__qualname__ + first line)`` of the compiled
function (``torch/_dynamo/package.py``, ``CompilePackage.source_id_from_fn``), and Dynamo
installs a loaded package's globals (resume functions named by the publisher's counter) into the
function's module. So each (store key, group, compile keywords, trampoline code) gets a function
of its own, named by that digest, in a module namespace of its own: no two models or groups share
an entry, and packages of different publishers never meet in one namespace.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import sys
import threading
import types
from typing import Any

from .pins import code_digest

__all__ = ["ENTRY_FORMAT", "INFIX", "advance_unique_ids", "entry_name", "owner_of", "region_function"]

#: In every entry name: bumped when what an entry may rely on changes (the guard filter's rules),
#: so that entries (and recorded declines) of an older compile_cache are not used. 2: the name
#: covers the classes' lineage, and each graph carries the values it was traced under. 3: the
#: allow-list of guard treatments (issue 53): records keyed by guard type and source, presence
#: recorded (HASATTR, a module's names, a builtin's absence from the block's module).
ENTRY_FORMAT = 3
#: Between a group's code name and the digest in the name of its precompiled function.
INFIX = "__pc_"


def entry_name(store_key: str, code_name: str, compile_kwargs: dict[str, Any],
               template: types.FunctionType, lineage: str) -> str:
    """A Python identifier naming one group's precompile entry by the full key: the store key
    (model fingerprint with attributes, plan, compile keywords, environment), the group, the
    keywords its ``torch.compile`` gets (JSON-able, as ``keys.canonical_compile_kwargs`` gives
    them), the trampoline's code and the lineage of the group's classes
    (:func:`compile_cache.fingerprint.class_lineage`: a loaded entry matches classes by name)."""
    material = json.dumps([ENTRY_FORMAT, store_key, code_name, compile_kwargs,
                           code_digest(template.__code__), lineage], sort_keys=True)
    return f"{code_name}{INFIX}{hashlib.sha256(material.encode()).hexdigest()[:20]}"


def owner_of(name: str) -> str:
    """The group's code name of a function ``name`` (itself, or its precompiled function's)."""
    return name.split(INFIX, 1)[0]


_NAMESPACE = "compile_cache._precompiled"
_MODULE_ATTRIBUTES = frozenset({"__name__", "__spec__", "__loader__", "__package__", "__path__",
                                "__file__", "__cached__"})
_FUNCTIONS: dict[str, types.FunctionType] = {}
_LOCK = threading.Lock()


def region_function(template: types.FunctionType, name: str) -> types.FunctionType:
    """A copy of ``template`` named ``name`` (``__qualname__``, code object), living in a module
    namespace of its own (``compile_cache._precompiled.<name>``, registered in ``sys.modules``).

    Dynamo names an entry from the qualname and installs a loaded package's globals into the
    function's module: a namespace per entry keeps packages of other publishers apart.
    """
    with _LOCK:
        fn = _FUNCTIONS.get(name)
        if fn is None:
            module_name = f"{_NAMESPACE}.{name}"
            namespace = types.ModuleType(module_name)
            # Not __file__: inspect.getmodule() maps the template's file to its own module (Dynamo
            # records the module of every inlined source and imports it when it loads an entry).
            namespace.__dict__.update(
                (k, v) for k, v in template.__globals__.items() if k not in _MODULE_ATTRIBUTES
            )
            namespace.__package__ = _NAMESPACE
            sys.modules[module_name] = namespace
            code = template.__code__.replace(co_name=name, co_qualname=name)
            fn = types.FunctionType(code, namespace.__dict__, name, template.__defaults__,
                                    template.__closure__)
            fn.__qualname__ = name
            _FUNCTIONS[name] = fn
        return fn


#: Globals Dynamo names with its process-wide counter: ``<prefix>_<n>``, ``__compiled_fn`` with
#: a uuid after the number.
_COUNTER_LOCK = threading.Lock()
_UNIQUE_NAME = re.compile(r"^(?:__|torch_dynamo_resume).*?_(\d+)(?:_[0-9a-f]{8}(?:_[0-9a-f]{4}){3}_[0-9a-f]{12})?$")


def advance_unique_ids(scope: dict[str, Any]) -> None:
    """Move torch's ``unique_id`` counter past every counter-named global in ``scope``, so that
    the next trace in this process does not pick a name a loaded package installed there."""
    import torch._dynamo.bytecode_transformation as bt

    top = -1
    for name in list(scope):
        match = _UNIQUE_NAME.match(name)
        if match:
            top = max(top, int(match.group(1)))
    if top < 0:
        return
    with _COUNTER_LOCK:
        current = next(bt._unique_id_counter)
        bt._unique_id_counter = itertools.count(max(current, top + 1))
