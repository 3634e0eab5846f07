"""kernels' ``use_kernelized_func`` wrapper inside compiled regions: the eager cache update's
graph break resumes in the block again.

transformers 5.25 requires ``kernels`` (0.19), whose ``use_kernelized_func`` decorator (on
``LlamaAttention`` and the attention classes of other models) replaces the class's ``forward``
by ``new_forward``: it puts a dispatch map in a context variable (which kernel each of the
layer's kernel functions runs, for this instance), then calls the class's own forward inside
``try: ... finally: reset`` (``kernels/_internals/layer/layer.py``). Dynamo cannot resume a graph
break inside a ``try`` block, and the eager KV-cache update (:mod:`.cache`) is a graph break inside
that forward: Dynamo then breaks the block's graph at the attention call and traces the
attention's frame on its own, once per block (it reads ``self.layer_idx``), and those frames
cannot precompile.

:func:`install` gives each class of a block's tree whose ``forward`` is that wrapper a forward
that, while traced (``torch.compiler.is_compiling()``):

* where none of the instance's private kernel functions is kernelized (``kernelize`` gives each
  a ``forward`` of its own), calls the class's own forward directly. Traced, a kernel function
  then calls the function it wraps whatever the dispatch map holds, so the map changes nothing;
  and it cannot be saved with a precompiled entry: it is keyed by ``id()`` of kernels' function
  objects, and those are instances of classes kernels defines in a function
  (``_create_func_module.<locals>.Func``), which torch rebuilds as plain modules when it loads
  an entry's guards. The stand-in reads only ``"forward" in <function>.__dict__``; the type
  guards on kernels' function objects become pins on their classes
  (:mod:`..precompile.guards`);
* where one is kernelized, inside a region traced with the eager update (:data:`.cache.SCOPE`
  active; Dynamo guards on the flag), does what ``new_forward`` does without the ``try``: the
  same dispatch map from the instance's private wrappers, set, the class's own forward called,
  reset. Elsewhere (your own ``torch.compile``, the traced update) kernels' ``new_forward``.

Every call not traced runs kernels' ``new_forward`` itself. The kernel functions read the same
map either way, so the same kernels run. An exception inside the traced call skips the reset:
:func:`.cache.run_in_region` puts the context variables back then (:func:`saved` /
:func:`restore`).

The stand-in is fingerprinted as kernels' ``new_forward`` (``__compile_cache_fingerprint_as__``,
:mod:`compile_cache._reference`), so a key does not depend on whether it is installed yet. Only
a wrapper whose source and closure are kernels' as known (:data:`KNOWN_SOURCE`) is replaced;
capability ``kernels.resumable_forward`` (available where kernels is not installed: nothing to
mend).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import textwrap
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .. import available, capability
from . import cache as kv_cache

log = logging.getLogger("compile_cache")

__all__ = ["CAPABILITY", "KNOWN_SOURCE", "install", "restore", "saved", "uninstall"]

CAPABILITY = "kernels.resumable_forward"
_KERNELS_LAYER = "kernels._internals.layer.layer"
_QUALNAME = "use_kernelized_func.<locals>.decorator.<locals>.new_forward"
_MARK = "__compile_cache_fingerprint_as__"
#: kernels' ``new_forward`` (0.19.1), dedented: a wrapper with any other source is left alone.
KNOWN_SOURCE = '''\
@functools.wraps(orig_forward)
def new_forward(self, *args, **kwargs):
    # Route global function calls to this model's private wrapper
    active_kernel_funcs = dict(_ACTIVE_KERNEL_FUNCS.get() or {})

    for fn in decorator_args:
        name = getattr(fn, "__name__", None) or getattr(fn, "kernel_layer_name", None)
        assert name is not None

        # Private wrapper for eager, selected forward for compile
        kernel_func = self._kernel_funcs[name]
        active_kernel_funcs[id(fn)] = (kernel_func, kernel_func.forward.__func__)

    token = _ACTIVE_KERNEL_FUNCS.set(active_kernel_funcs)
    try:
        return orig_forward(self, *args, **kwargs)
    finally:
        _ACTIVE_KERNEL_FUNCS.reset(token)
'''
#: What a saved context variable holds while compiled code uses it (kernels'
#: ``CompileableContextVar``: the value it reads while compiling, and whether it reads it).
_STATE = ("global_var", "uses_global_var")
_LOCK = threading.RLock()
_PATCHED: dict[type, Callable[..., Any]] = {}  # class -> kernels' new_forward it replaced
_VARS: list[Any] = []  # the context variables the stand-ins set


def _parts(wrapper: Any) -> tuple[Any, Any, tuple] | None:
    """(the class's own forward, the context variable, the kernel functions) of kernels'
    ``new_forward``; None for any other function."""
    # functools.wraps gave it the wrapped forward's names: its code and globals are kernels'
    code = getattr(wrapper, "__code__", None)
    if code is None:
        return None
    # (Python 3.10's code has no co_qualname: its name, in kernels' module, instead)
    qualname = getattr(code, "co_qualname", _QUALNAME if code.co_name == "new_forward" else None)
    if (qualname != _QUALNAME
            or getattr(wrapper, "__globals__", {}).get("__name__") != _KERNELS_LAYER
            or code.co_freevars != ("decorator_args", "orig_forward")):
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in wrapper.__closure__), strict=True))
    var = wrapper.__globals__.get("_ACTIVE_KERNEL_FUNCS")
    if not all(hasattr(var, name) for name in ("get", "set", "reset", *_STATE)):
        return None
    return cells["orig_forward"], var, tuple(cells["decorator_args"])


def _known(wrapper: Any) -> bool:
    try:
        # of its code: inspect would follow __wrapped__ to the wrapped forward's source
        source = textwrap.dedent(inspect.getsource(wrapper.__code__))
    except (OSError, TypeError):
        return False
    return source == KNOWN_SOURCE


@capability(
    CAPABILITY,
    needs="kernels' use_kernelized_func wrapper (kernels/_internals/layer/layer.py new_forward: "
    "its closure's orig_forward and decorator_args, its _ACTIVE_KERNEL_FUNCS) as known",
    breaks="blocks whose attention kernels wraps (transformers >= 5.25) compile once per block "
    "when called with a KV cache, and those calls do not precompile",
)
def _probe() -> str | None:
    module = sys.modules.get(_KERNELS_LAYER)
    if module is None:
        try:
            import importlib

            module = importlib.import_module(_KERNELS_LAYER)
        except Exception:  # noqa: BLE001 - kernels not installed: nothing to mend
            return None
    decorate = getattr(module, "use_kernelized_func", None)
    if not callable(decorate):
        return "kernels has no use_kernelized_func"

    def probe_function() -> None:
        """Stands for a kernel function."""

    probe_function.kernel_layer_name = "compile_cache_probe"  # type: ignore[attr-defined]

    class Probe:
        def forward(self) -> None:
            """Stands for a layer's own forward."""

    try:
        decorate(probe_function)(Probe)
    except Exception as exc:  # noqa: BLE001 - another kernels: its wrapper is not the known one
        return f"kernels' use_kernelized_func cannot be applied as known ({type(exc).__name__})"
    wrapper = Probe.__dict__["forward"]
    if _parts(wrapper) is None or not _known(wrapper):
        return "kernels' use_kernelized_func no longer wraps forward as known"
    return None


def _names(decorator_args: tuple) -> tuple[str, ...]:
    """The names under which kernels keeps an instance's private kernel functions."""
    names = []
    for fn in decorator_args:
        name = getattr(fn, "__name__", None) or getattr(fn, "kernel_layer_name", None)
        assert name is not None
        names.append(name)
    return tuple(names)


def _stand_in(wrapper: Any) -> Callable[..., Any]:
    orig_forward, var, decorator_args = _parts(wrapper)  # type: ignore[misc]
    scope = kv_cache.SCOPE
    names = _names(decorator_args)

    @functools.wraps(wrapper)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        if not torch.compiler.is_compiling():
            return wrapper(self, *args, **kwargs)
        funcs = self._kernel_funcs
        if not any("forward" in funcs[name].__dict__ for name in names):
            # No private kernel function kernelized (kernelize sets an instance's forward):
            # each of them, traced, calls the function it wraps whatever the dispatch map
            # holds, so the class's own forward is the same code without reading the map,
            # whose ids and locally defined classes no saved entry can carry (the module doc)
            return orig_forward(self, *args, **kwargs)
        if not scope.active:
            return wrapper(self, *args, **kwargs)
        # kernels' new_forward without its try/finally (the module doc)
        active_kernel_funcs = dict(var.get() or {})
        for fn in decorator_args:
            name = getattr(fn, "__name__", None) or getattr(fn, "kernel_layer_name", None)
            assert name is not None
            kernel_func = self._kernel_funcs[name]
            active_kernel_funcs[id(fn)] = (kernel_func, kernel_func.forward.__func__)
        token = var.set(active_kernel_funcs)
        out = orig_forward(self, *args, **kwargs)
        var.reset(token)
        return out

    setattr(forward, _MARK, wrapper)
    with _LOCK:
        if not any(v is var for v in _VARS):
            _VARS.append(var)
    return forward


def install(modules: Iterable[Any]) -> int:
    """Replace kernels' wrapper on the classes of ``modules`` (a block's tree) by the stand-in
    (idempotent); the number of classes replaced now. Nothing while the capability is missing."""
    found = 0
    classes = {type(m) for m in modules}
    for cls in classes:
        wrapper = cls.__dict__.get("forward")
        if wrapper is None or getattr(wrapper, _MARK, None) is not None or _parts(wrapper) is None:
            continue
        if not available(CAPABILITY) or not _known(wrapper):
            continue
        with _LOCK:
            if cls.__dict__.get("forward") is wrapper:
                cls.forward = _stand_in(wrapper)
                _PATCHED[cls] = wrapper
                found += 1
    if found:
        log.info("compile_cache: %d attention class(es) wrapped by kernels' use_kernelized_func "
                 "run their forward without the wrapper's try/finally inside traced regions",
                 found)
    return found


def uninstall() -> None:
    """Put kernels' wrappers back (tests)."""
    with _LOCK:
        for cls, wrapper in _PATCHED.items():
            if getattr(cls.__dict__.get("forward"), _MARK, None) is wrapper:
                cls.forward = wrapper
        _PATCHED.clear()


def saved() -> list[tuple[Any, tuple[Any, ...]]]:
    """The state of the context variables the stand-ins set (cheap; empty when none)."""
    if not _VARS:
        return []
    return [(var, tuple(getattr(var, name) for name in _STATE)) for var in list(_VARS)]


def restore(state: list[tuple[Any, tuple[Any, ...]]]) -> None:
    """Put :func:`saved`'s state back (after a region call raised)."""
    for var, values in state:
        for name, value in zip(_STATE, values, strict=True):
            setattr(var, name, value)
