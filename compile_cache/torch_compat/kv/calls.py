"""How one group's blocks are called with a transformers KV cache: the eager update between two
graphs, the update traced into the graph (a group that precompiles), or a view of the one layer a
block was proven to update (the paths are described in :mod:`.cache`, which patches the Cache
classes and holds the scope they read)."""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

from .. import available
from . import wrapped_forward
from .cache import CACHE_ARGUMENTS, install, is_cache, run_in_region, run_traced

log = logging.getLogger("compile_cache")

__all__ = ["TRACED_MAX_BLOCKS", "CacheCalls", "is_view"]

#: The largest group whose calls the view does not serve take the traced update when the group
#: precompiles (one entry per block and phase, :mod:`.cache`); a larger group keeps the eager
#: update (two frames traced at each start, whatever its size). The traced update's costs grow
#: with the group: the publisher traces one frame per block, a fresh node loads one graph per
#: block, Dynamo tries a block's call against the entries of the other blocks before its own,
#: and the recompile limit is the group size x PHASES. 64 covers the usual decoder depths (32 for
#: 7-8B models) and bounds those costs; it is a judgement, not a measured crossover.
TRACED_MAX_BLOCKS = 64


# -- the layer view ----------------------------------------------------------------------------


class _LayerView:
    """Mixed in before the cache's class: ``update`` goes to the bound layer while the region call
    runs (``_cc_layer``), to the cache afterwards; every other attribute is the cache's own."""

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        layer = self._cc_layer
        if layer is None:
            return self._cc_cache.update(key_states, value_states, layer_idx, *args, **kwargs)
        return layer.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_cc_"):
            raise AttributeError(name)
        return getattr(self._cc_cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cc_cache, name, value)


_VIEW_CLASSES: dict[type, type] = {}
_VIEWABLE: list[tuple[frozenset[type], frozenset[type], type | None]] = []
_VIEW_PREFIX = "LayerView_"


def _viewable_types() -> tuple[frozenset[type], frozenset[type], type | None]:
    """(cache classes, layer classes) a view serves exactly, and DynamicLayer."""
    if not _VIEWABLE:
        module = sys.modules["transformers.cache_utils"]
        names = [n for n in ("DynamicCache", "StaticCache", "DynamicLayer", "StaticLayer")
                 if isinstance(getattr(module, n, None), type)]
        _VIEWABLE.append((
            frozenset(getattr(module, n) for n in names if n.endswith("Cache")),
            frozenset(getattr(module, n) for n in names if n.endswith("Layer")),
            getattr(module, "DynamicLayer", None),
        ))
    return _VIEWABLE[0]


def _view_class(cls: type) -> type:
    """The view class of cache class ``cls``: a module-level name (``LayerView_DynamicCache``),
    so that a precompiled entry's type guard on it pickles by reference and finds it again in a
    fresh process (:func:`__getattr__`)."""
    view_cls = _VIEW_CLASSES.get(cls)
    if view_cls is None:
        name = f"{_VIEW_PREFIX}{cls.__name__}"
        view_cls = type(name, (_LayerView, cls), {"__module__": __name__, "__qualname__": name})
        _VIEW_CLASSES[cls] = view_cls
        globals()[name] = view_cls
    return view_cls


def __getattr__(name: str) -> type:
    """``LayerView_<Cache>`` for the cache classes a view serves (what unpickling a precompiled
    entry asks for before any view was made in this process)."""
    if name.startswith(_VIEW_PREFIX) and "transformers.cache_utils" in sys.modules:
        caches, _, _ = _viewable_types()
        for cls in caches:
            if cls.__name__ == name[len(_VIEW_PREFIX):]:
                return _view_class(cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_view(cache: Any, layer: Any) -> Any:
    view = object.__new__(_view_class(type(cache)))
    view.__dict__.update(_cc_cache=cache, _cc_layer=layer)
    return view


def is_view(value: Any) -> bool:
    """Whether ``value`` is a layer view (the decode path of :meth:`CacheCalls.call`)."""
    return isinstance(value, _LayerView)


# -- how one group's blocks are called with a cache -----------------------------------------------


class CacheCalls:
    """The cache argument of one group's blocks, and the two call paths (see the module doc).

    ``bindings`` maps a block's runner to what its eager calls proved: ``(weakref to the cache,
    layer index, call signature)``, or None once the block updated anything else (never viewed
    again). The view ignores the index the traced code passes, so it is taken only when nothing
    that could choose another index changed since the proving call: the call signature is the
    block's ``attributes`` (those that differ between the group's blocks: ``self_attn.
    layer_idx``) and the int, bool and str arguments of the call. A change means the eager
    update again, which proves the binding anew.
    ``use_views = False`` keeps the eager update everywhere (``benchmarks/bench_generate.py``
    compares the two paths).

    The traced update (:mod:`.cache`) is taken instead of the eager update when the runner's
    compiled call offers one (its ``traced_call`` attribute: the group's precompiled cache-calls
    function, None once that declined) and ``traced_updates`` (groups of at most
    :data:`TRACED_MAX_BLOCKS` blocks). It learns bindings for the view from what changed in the
    cache (:func:`_updated_layers`).
    """

    use_views = True

    def __init__(self, name: str, position: int | None, first: str = "") -> None:
        self.name = name  # the cache argument: its name, and its position when positional
        self.position = position
        self.first = first  # the first argument (hidden states: its dim 1 counts new tokens)
        self.bindings: weakref.WeakKeyDictionary[Any, tuple[Any, int, tuple] | None] = (
            weakref.WeakKeyDictionary()
        )
        self.attributes: tuple[str, ...] = ()  # dotted names, relative to the block
        self.mark_dynamic = available("dynamo.maybe_mark_dynamic")
        #: True once the group's decode steps run a precompiled entry loaded from disk: it holds
        #: the dynamic KV length already, and its saved guards expect unmarked tensors (torch
        #: rebuilds the marking guards without the marks), so marking would miss it.
        self.decode_entry_loaded: Callable[[], bool] = _never
        #: Whether calls the view does not serve may take the traced update (class doc).
        self.traced_updates = False
        self.view_calls = 0
        self.eager_update_calls = 0
        self.traced_update_calls = 0

    @classmethod
    def for_block(cls, forward: Callable[..., Any]) -> CacheCalls | None:
        """For a block whose ``forward`` takes a KV-cache argument, else None."""
        try:
            params = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):
            return None
        for index, param in enumerate(params):
            if param.name in CACHE_ARGUMENTS:
                positional = param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
                return cls(param.name, index if positional else None, params[0].name)
        return None

    @classmethod
    def for_group(cls, forward: Callable[..., Any], size: int, compile_kwargs: dict[str, Any],
                  attributes: tuple[str, ...]) -> tuple[bool, CacheCalls | None]:
        """(whether a group's blocks take a KV cache, the CacheCalls their runners use). None
        keeps the per-block compile: one block (``size`` 1) has no identical blocks to share
        with, ``fullgraph=True`` allows no graph break, and this torch may lack nested breaks.
        ``attributes``: those that differ between the blocks (the class doc)."""
        calls = cls.for_block(forward)
        if calls is None:
            return False, None
        if size < 2 or compile_kwargs.get("fullgraph") or not install():
            return True, None
        block = getattr(forward, "__self__", None)
        if block is not None and hasattr(block, "modules"):
            # kernels' attention wrapper: its try/finally would stop the update's graph break
            # from resuming in the block (.wrapped_forward)
            wrapped_forward.install(block.modules())
        calls.attributes = tuple(attributes)
        calls.traced_updates = size <= TRACED_MAX_BLOCKS
        calls.mark_dynamic &= compile_kwargs.get("dynamic") is not False  # dynamic=False: as asked
        return True, calls

    def cache_of(self, args: tuple, kwargs: dict) -> Any:
        """The call's cache argument: a KV cache (generation), a layer view (a decode step this
        class routes), or None (training, scoring, ``use_cache=False``)."""
        if self.position is not None and len(args) > self.position:
            return args[self.position]
        return kwargs.get(self.name)

    def call(self, runner: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` for ``runner``'s block, through the view, the traced update
        (``fn.traced_call``, when offered) or the eager update."""
        cache = self.cache_of(args, kwargs)
        if not is_cache(cache):  # training or scoring (use_cache=False): nothing to do
            return fn(*args, **kwargs)
        signature = self._signature(getattr(fn, "__self__", None), args, kwargs)
        view = self._view(runner, cache, signature, args, kwargs)
        if view is not None:
            if self.position is not None and len(args) > self.position:
                args = args[: self.position] + (view,) + args[self.position + 1:]
            else:
                kwargs = {**kwargs, self.name: view}
            self.view_calls += 1
            try:
                return run_in_region(fn, args, kwargs)
            finally:
                view.__dict__["_cc_layer"] = None
        traced = getattr(fn, "traced_call", None) if self.traced_updates else None
        if traced is not None:
            before = _layer_states(cache)
            out = run_traced(traced, args, kwargs)
            self.traced_update_calls += 1
            self._learn(runner, cache, _updated_layers(cache, before), signature)
            return out
        record: list = []
        out = run_in_region(fn, args, kwargs, record)
        self.eager_update_calls += 1
        self._learn(runner, cache, record, signature)
        return out

    def _signature(self, block: Any, args: tuple, kwargs: dict) -> tuple:
        """What could make the traced code pass another layer index (the class doc)."""
        attrs = []
        for dotted in self.attributes:
            value = block
            for part in dotted.split("."):
                value = getattr(value, part, _MISSING)
            attrs.append(value if type(value) in _SIGNATURE_TYPES else id(value))
        return (
            tuple(attrs),
            tuple((i, a) for i, a in enumerate(args) if type(a) in _SIGNATURE_TYPES),
            tuple((k, v) for k, v in kwargs.items() if type(v) in _SIGNATURE_TYPES),
        )

    def _learn(self, runner: Any, cache: Any, record: list[tuple[Any, str, Any]],
               signature: tuple) -> None:
        if not record:
            return  # the block did not touch the cache in this call: nothing learned
        known = self.bindings.get(runner, ())
        if known is None:
            return
        caches, layers, _ = _viewable_types()
        binding = None
        if len(record) == 1:
            obj, name, index = record[0]
            if (obj is cache and name == "update" and type(index) is int and type(cache) in caches
                    and not getattr(cache, "offloading", False) and 0 <= index < len(cache.layers)
                    and type(cache.layers[index]) in layers):
                binding = (weakref.ref(cache), index, signature)
        if binding is None or (known and known[1] != binding[1]):
            self.bindings[runner] = None  # updated something else: the eager update from now on
            log.debug("compile_cache: %s keeps the eager cache update (%s)", runner, record)
        else:
            self.bindings[runner] = binding

    def _view(self, runner: Any, cache: Any, signature: tuple, args: tuple, kwargs: dict) -> Any:
        binding = self.bindings.get(runner)
        if binding is None or binding[0]() is not cache or not self.use_views:
            return None
        if binding[2] != signature:
            return None  # an attribute or argument that could choose the layer changed
        first = args[0] if args else kwargs.get(self.first)
        if getattr(first, "ndim", 0) < 2 or first.shape[1] != 1:
            return None  # not a decode step of one token (prefill keeps the eager update)
        layers = cache.layers
        index = binding[1]
        if index >= len(layers):
            return None
        layer = layers[index]
        _, viewable, dynamic_layer = _viewable_types()
        if not layer.is_initialized or type(layer) not in viewable:
            return None
        if self.mark_dynamic and type(layer) is dynamic_layer and not self.decode_entry_loaded():
            _mark_kv_length(layer, first.shape[1], args, kwargs)
        return _make_view(cache, layer)


def _layer_states(cache: Any) -> list[tuple[Any, ...]] | None:
    """What a traced update could change in ``cache``: per layer ``(layer, keys, values,
    is_initialized, length)``, the tensors held (not ids) so that a freed tensor's id cannot come
    back as a new one's. None unless the cache is exactly a ``DynamicCache`` or ``StaticCache``
    without offloading whose layers are exactly ``DynamicLayer`` or ``StaticLayer``: the layers
    whose every ``update`` shows. A ``DynamicLayer``'s binds new ``keys`` and ``values``; a
    ``StaticLayer``'s writes them in place, which under ``no_grad`` does not even move their
    version counters when the write is in a compiled graph (AOTAutograd bumps only mutations
    "seen by autograd"), but always adds the tokens to ``cumulative_length`` (``length``: its
    value, read with one host copy per device)."""
    caches, viewable, dynamic_layer = _viewable_types()
    if type(cache) not in caches or getattr(cache, "offloading", False):
        return None
    layers = list(cache.layers)
    if any(type(layer) not in viewable for layer in layers):
        return None
    lengths = _static_lengths([i for i, layer in enumerate(layers) if type(layer) is not dynamic_layer],
                              layers)
    if lengths is None:
        return None
    return [(layer, layer.keys, layer.values, layer.is_initialized, lengths.get(index))
            for index, layer in enumerate(layers)]


def _static_lengths(indices: list[int], layers: list[Any]) -> dict[int, int] | None:
    """``cumulative_length`` of the layers at ``indices`` (None when one is neither an int nor
    a tensor)."""
    import torch

    out: dict[int, int] = {}
    by_device: dict[Any, list[int]] = {}
    for index in indices:
        length = getattr(layers[index], "cumulative_length", None)
        if type(length) is int:
            out[index] = length
        elif isinstance(length, torch.Tensor) and length.numel() == 1:
            by_device.setdefault(length.device, []).append(index)
        else:
            return None
    for group in by_device.values():
        values = torch.stack([layers[i].cumulative_length.reshape(()) for i in group]).tolist()
        out.update(zip(group, values, strict=True))
    return out


def _updated_layers(cache: Any, before: list[tuple[Any, ...]] | None) -> list[tuple]:
    """The layers a traced update changed, as the eager update records them (``(cache,
    "update", index)``): a layer whose tensors, initialisation or length changed, or one
    appended and initialised. Unprovable (``before`` None, a layer replaced or removed, a layer
    or cache now of another type): one record with no index, which ends the block's binding, as
    an eager update of another cache does."""
    unprovable = [(cache, "update", None)]
    after = None if before is None else _layer_states(cache)
    if before is None or after is None or len(after) < len(before):
        return unprovable
    changed = []
    for index, now in enumerate(after):
        if index >= len(before):
            if now[3]:  # appended (a cache without a config makes its layers as they are used)
                changed.append(index)
            continue
        then = before[index]
        if now[0] is not then[0]:
            return unprovable
        if now[1] is not then[1] or now[2] is not then[2] or now[3:] != then[3:]:
            changed.append(index)
    return [(cache, "update", index) for index in changed]


_MISSING = object()
_SIGNATURE_TYPES = (int, bool, str, type(None))


def _never() -> bool:
    return False


def _mark_kv_length(layer: Any, new_tokens: int, args: tuple, kwargs: dict) -> None:
    """A DynamicCache grows by one token per step: mark the KV length dynamic (the layer's keys
    and values, and each dim of a tensor argument as long as the keys will be: the attention
    mask) before the first decode compile, so decode gets one entry, not a static one for the
    first step and a dynamic one after it. Only a hint: Dynamo keeps a size static where the code
    needs it static, so a dim marked by coincidence costs nothing."""
    import torch

    mark = torch._dynamo.maybe_mark_dynamic
    keys = layer.keys
    if keys.ndim < 2:
        return
    mark(keys, keys.ndim - 2)
    mark(layer.values, layer.values.ndim - 2)
    total = keys.shape[-2] + new_tokens
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            for dim in range(1, value.ndim):
                if value.shape[dim] == total:
                    mark(value, dim)
