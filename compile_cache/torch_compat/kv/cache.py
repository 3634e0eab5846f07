"""transformers' KV cache inside compiled regions: one compiled graph per group and phase.

A transformers decoder layer calls ``cache.update(k, v, self.layer_idx)``, which indexes a Python
list, ``cache.layers[layer_idx]``. Dynamo specialises a list index (even a symbolic int is forced
back to a constant, ``torch/_dynamo/variables/lists.py``), so each traced block reads its own
``cache.layers[i]`` and guards on it (``kwargs['cache'].layers[0].is_initialized == False``): N
identical blocks need N entries per phase, the group hits the recompile limit and decode runs
uncompiled. The region runner (``regions.py``) therefore calls a block that gets a cache through
:meth:`.calls.CacheCalls.call`, which takes one of three paths:

* **The eager update** (a graph break). While a region runs (:data:`SCOPE`), ``Cache.update`` and
  the other per-layer cache methods run eagerly (``torch._dynamo.disable``), with
  ``torch._dynamo.config.nested_graph_breaks`` on, so the rest of the block resumes inside the
  group's compile unit (in a Dynamo *resume function*): no traced code reads ``cache.layers``,
  and the group keeps one entry per phase whatever the number of layers. It works for every
  Cache class, and it costs a second frame per block call. The eager update also records which
  layer the block updated (thread-local), which is what proves the next path safe.
* **The layer view** (no graph break). The runner hands the block a view of the cache whose
  ``update(k, v, layer_idx)`` is ``layer.update(k, v)`` of the one layer bound to the view; every
  other attribute is the cache's own. The traced code never indexes ``cache.layers``, and Dynamo
  guards the ignored index by type only, so all blocks share one graph of one frame. It is taken
  only for decode steps (one new token) and only when proven: an earlier call of the *same*
  block with the *same* cache object went through the eager update and updated exactly one
  layer, with ``update``, and nothing else; the cache is exactly a ``DynamicCache`` or
  ``StaticCache`` without offloading, and that layer exactly a ``DynamicLayer`` or
  ``StaticLayer``. A block that updates other layers in other calls (a shared block called at
  several depths) is never viewed again, and a block whose per-block attributes (``layer_idx``) or
  int arguments changed since the proving call takes the eager update again. After the call the
  view forwards ``update`` to the cache itself, so a view that a block returned is a faithful
  stand-in for the cache. (The view and the call paths: :mod:`.calls`.)
* **The traced update** (no graph break; with precompile). A group that precompiles runs the
  calls the view does not serve (the prefill above all) with :data:`SCOPE` off
  (:func:`run_traced`): Dynamo traces ``update`` into the graph, specialises on the layer index
  and guards on ``cache.layers[i]``, so the group's precompiled cache-calls function holds one
  entry per block and phase (the recompile limit allows group size x :data:`PHASES`). The eager
  update's graph break cannot precompile (its second frame is a resume function, entered with
  the resume functions of the frames around it, ``__nested_resume_fns``, whose identity its
  graph relies on and no saved guard can check); this path has no break and no resume
  function, so a fresh node loads the prefill instead of tracing it. The blocks' FX graphs are
  identical (the layer index only picks which layer's tensors are the graph's inputs): the
  publisher pays one Dynamo trace per block, the FX graph cache serves all but the first. It
  proves the view for the decode steps too: for the caches and layers the view serves, every
  ``update`` shows (a ``DynamicLayer``'s binds new tensors, a ``StaticLayer``'s adds to its
  ``cumulative_length``), so the layers that changed during the call are the layers it updated;
  exactly one is a binding, as one eager ``update`` is (:func:`.calls._updated_layers`). Other
  caches prove nothing, and their decode steps take this path too (per-block entries). Groups
  of more than :data:`.calls.TRACED_MAX_BLOCKS` blocks keep the eager update.

The patch is scoped: outside our regions (a user's own ``torch.compile(model.forward)``,
transformers' compiled decode) Dynamo traces ``update`` into its graph as before (it guards on
:data:`SCOPE`). If the scope flag is wrong (another thread), only speed changes, never values.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from .. import available, capability

log = logging.getLogger("compile_cache")

__all__ = [
    "CACHE_ARGUMENTS",
    "SCOPE",
    "cache_guard",
    "disable_generate_autocompile",
    "install",
    "is_cache",
    "recompile_advice",
    "run_in_region",
    "run_traced",
    "uninstall",
]

#: Names transformers gives a block's KV-cache argument (``cache`` since 5.x).
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
#: Compiled entries per block and cache kind where per-block entries remain (the recompile limit
#: allows group size x PHASES): prefill, the prefill of a second prompt length (where the prompt
#: length turns dynamic), the first decode step, and the decode steps after it (where a
#: DynamicCache's KV length turns dynamic). The traced update (module doc) keeps the prefill's
#: per block, and the decode steps' of a cache the view does not serve.
PHASES = 4
#: Appended to an eager-run warning of blocks that take a cache, at the recompile limit.
LIMIT_HINT = (
    " (blocks with a KV cache: each cache kind, batch size and prompt-length pattern adds entries, "
    "and with dynamic=False a DynamicCache adds one per decode step; pass a larger "
    "recompile_limit=, or keep dynamic unset)"
)
#: Cache methods that index per-layer state with a layer index (each runs eagerly in a region).
CACHE_METHODS = ("update", "update_conv_state", "update_recurrent_state", "update_indexer")
_MARK = "__compile_cache_kv_original__"
_LOCK = threading.RLock()


@capability(
    "dynamo.nested_graph_breaks",
    needs="torch._dynamo.config.nested_graph_breaks and torch._dynamo.disable(reason=...)",
    breaks="blocks called with a KV cache (generate()) compile one entry per block and phase, "
    "with a RegionRecompileWarning; past the recompile limit they run uncompiled",
)
def _probe_nested() -> str | None:
    import torch
    from torch._dynamo import config

    if not isinstance(getattr(config, "nested_graph_breaks", None), bool):
        return "torch._dynamo.config has no bool 'nested_graph_breaks'"
    if "reason" not in inspect.signature(torch._dynamo.disable).parameters:
        return "torch._dynamo.disable takes no 'reason'"
    return None


@capability(
    "dynamo.maybe_mark_dynamic",
    needs="torch._dynamo.maybe_mark_dynamic",
    breaks="generate() with a DynamicCache compiles one more decode entry per group (the first "
    "decode step before the KV length turns dynamic)",
)
def _probe_mark_dynamic() -> str | None:
    import torch

    if not callable(getattr(torch._dynamo, "maybe_mark_dynamic", None)):
        return "torch._dynamo has no maybe_mark_dynamic"
    return None


class _Scope:
    """``active`` is True while a compile_cache region runs (read, and guarded, by the patched
    cache methods)."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = False


SCOPE = _Scope()
_TLS = threading.local()  # .record: the eager updates of this thread's region call; .inside


def _layer_index(name: str, args: tuple, kwargs: dict) -> Any:
    if name == "update":  # update(key_states, value_states, layer_idx, ...)
        return args[2] if len(args) > 2 else kwargs.get("layer_idx")
    return None


def _eager(orig: Callable[..., Any], cls_name: str, name: str) -> Callable[..., Any]:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_TLS, "inside", False):  # a subclass calling super().update(): one update
            return orig(self, *args, **kwargs)
        record = getattr(_TLS, "record", None)
        if record is not None:
            record.append((self, name, _layer_index(name, args, kwargs)))
        _TLS.inside = True
        try:
            return orig(self, *args, **kwargs)
        finally:
            _TLS.inside = False

    import torch

    return torch._dynamo.disable(
        functools.wraps(orig)(run),
        reason=f"compile_cache: {cls_name}.{name} (the KV cache, indexed by layer) runs eagerly "
        "between a region's graphs, so identical blocks share one graph",
    )


def _patched(orig: Callable[..., Any], cls_name: str, name: str) -> Callable[..., Any]:
    eager = _eager(orig, cls_name, name)

    @functools.wraps(orig)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if SCOPE.active:  # Dynamo guards on this flag; the thread-local is read eagerly only
            return eager(self, *args, **kwargs)
        return orig(self, *args, **kwargs)

    setattr(method, _MARK, orig)
    return method


def _cache_classes() -> list[type]:
    module = sys.modules.get("transformers.cache_utils")
    if module is None:
        return []
    out, todo = [], [module.Cache]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def install() -> bool:
    """Patch transformers' ``Cache`` classes loaded now (idempotent; call it again for classes
    defined later). False when transformers is not loaded or the capability is missing (then
    nothing is patched and the blocks compile per block, as before)."""
    if "transformers.cache_utils" not in sys.modules or not available("dynamo.nested_graph_breaks"):
        return False
    with _LOCK:
        for cls in _cache_classes():
            for name in CACHE_METHODS:
                fn = cls.__dict__.get(name)
                if callable(fn) and not hasattr(fn, _MARK):
                    setattr(cls, name, _patched(fn, cls.__qualname__, name))
    return True


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    with _LOCK:
        for cls in _cache_classes():
            for name in CACHE_METHODS:
                fn = cls.__dict__.get(name)
                if fn is not None and hasattr(fn, _MARK):
                    setattr(cls, name, getattr(fn, _MARK))


def is_cache(value: object) -> bool:
    """True for a transformers ``Cache`` (never imports transformers)."""
    module = sys.modules.get("transformers.cache_utils")
    return module is not None and isinstance(value, module.Cache)


class _NestedGraphBreaks:
    """``torch._dynamo.config.nested_graph_breaks = True`` while at least one region call runs,
    in any thread. Reference-counted under a lock: a plain ``config.patch`` per call would let one
    thread switch the flag off under another thread's trace, and Dynamo asserts on that. It is
    set from outside the traced code: torch's traceable ``patch_dynamo_config`` used as a ``with``
    inside the frame becomes a graph break itself."""

    __slots__ = ("depth", "saved")

    def __init__(self) -> None:
        self.depth = 0
        self.saved = False

    def __enter__(self) -> None:
        with _LOCK:
            if self.depth == 0:
                from torch._dynamo import config

                self.saved = config.nested_graph_breaks
                config.nested_graph_breaks = True
            self.depth += 1

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            self.depth -= 1
            if self.depth == 0:
                from torch._dynamo import config

                config.nested_graph_breaks = self.saved


_NESTED = _NestedGraphBreaks()


def run_in_region(fn: Callable[..., Any], args: tuple, kwargs: dict, record: list | None = None) -> Any:
    """``fn(*args, **kwargs)`` as a region call: with :data:`SCOPE` active (the patched cache
    methods run eagerly) and nested graph breaks on; ``record``, when given, receives this
    thread's eager cache updates of the call (``(cache, method, layer index)``, what
    :mod:`.calls` learns from)."""
    if record is not None:
        previous = getattr(_TLS, "record", None)
        _TLS.record = record
    outer = SCOPE.active
    SCOPE.active = True
    # kernels' context variables, which a traced stand-in for its wrapper leaves set when the
    # call raises (.wrapped_forward; not imported here: loaded once it patched a class)
    wrapped = sys.modules.get(__package__ + ".wrapped_forward")
    kernels_state = wrapped.saved() if wrapped is not None else None
    try:
        with _NESTED:
            return fn(*args, **kwargs)
    except BaseException:
        if kernels_state:
            wrapped.restore(kernels_state)  # type: ignore[union-attr]
        raise
    finally:
        SCOPE.active = outer
        if record is not None:
            _TLS.record = previous


def run_traced(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with the cache update traced into the graph (the traced update,
    module doc): :data:`SCOPE` off for the call, though an outer region may have it on, and no
    nested graph breaks asked for."""
    outer = SCOPE.active
    SCOPE.active = False
    try:
        return fn(*args, **kwargs)
    finally:
        SCOPE.active = outer


_GUARD_ON_CACHE = re.compile(
    r"(?:\['(?:{0})'\]|\b(?:{0})\b)(?:\.\w+)*\.layers\[\d+\]".format("|".join(CACHE_ARGUMENTS))
)


def cache_guard(reasons: str) -> str:
    """The first failing guard in Dynamo's recompile ``reasons`` that reads a KV cache per layer
    (``kwargs['cache'].layers[0].is_initialized == False``), or "" when the cause is another."""
    for line in reasons.splitlines():
        line = re.sub(r"^\s*\S+: ", "", line.strip())
        if _GUARD_ON_CACHE.search(line):
            return line.split("#", 1)[0].strip()
    return ""


def recompile_advice(reasons: str, named: str) -> tuple[str, str] | None:
    """(cause, fix) for a RegionRecompileWarning whose failing guard reads a KV cache per layer;
    None when the recompile has another cause. ``named``: the per-block attributes, worded."""
    guard = cache_guard(reasons)
    if not guard:
        return None
    return (
        f"the compiled code reads the KV cache at each block's own layer index{named} (failing "
        f"guard: {guard})",
        "For training or scoring, call the model with use_cache=False; for generation use "
        "model.generate() with a DynamicCache or cache_implementation='static' and without "
        "fullgraph=True: compile_cache then keeps the cache update out of the traced code",
    )


def disable_generate_autocompile(model: Any) -> bool:
    """Turn off transformers' own compile of the decode step (``generation_config.
    disable_compile``): with a static cache on a GPU, ``generate`` would wrap the whole forward in
    ``torch.compile``, trace through our regions and run decode mostly eagerly. True if set now."""
    config = getattr(model, "generation_config", None)
    if config is None or not hasattr(config, "disable_compile") or config.disable_compile:
        return False
    config.disable_compile = True
    log.info("compile_cache: set %s.generation_config.disable_compile = True (the regions are "
             "compiled; transformers' own decode compile would trace through them)",
             type(model).__name__)
    return True
