"""``torch.compile(backend="inductor")`` on a start that compiles nothing: no compile-only work.

Two costs of a start whose every region group loads from a precompile entry (so never traces
nor compiles) come from what torch prepares for a compile:

* **compile_fx.** ``torch.compile`` wraps Inductor in ``torch._TorchCompileInductorWrapper`` and
  Dynamo asks that wrapper for its configuration at once (``get_compiler_config()``, kept for the
  informational ``OptimizedModule.get_compiler_config()``), which reads it through
  ``torch._inductor.compile_fx.get_patched_config_dict``: that imports compile_fx with its FX
  passes and pattern matcher. Inside :func:`config_without_compile_stack`, ``torch.compile``
  builds a subclass instead (torch looks the class up by its global name at each call) that
  differs in one method: ``get_compiler_config()`` returns the same dict from
  ``torch._inductor.config`` directly (``config.patch(patches)`` + ``get_config_copy()``, the
  body of ``get_patched_config_dict``). Construction, ``__eq__``, ``reset`` and compiling
  (``__call__``: ``compile_fx`` with the same config patches, imported when a graph really
  compiles) are torch's own, so FX-graph keys, AOTAutograd keys and precompile entries are those
  of a plain ``torch.compile`` (tests/test_torch_compat_inductor_backend.py compares them).
* **Kernel templates.** The restored kernels' code imports ``select_algorithm`` (for
  ``extern_kernels``), which imports ``lowering`` and the GEMM kernel modules, and those compile
  about 23 Jinja templates at import (``KernelTemplate._template_from_string``; a third of the
  import), templates only a compile that autotunes a GEMM renders. Inside the same context a
  template is compiled on first use instead (:class:`_LazyTemplate`: the same source, compiled
  by torch's own function the first time any attribute is read, so the same rendered code; its
  hash, the one in keys, is of the source and unchanged). Templates created while the context
  was on stay lazy; those created outside are torch's.

* **The minifier's wrapper.** ``torch.compile`` wraps every backend in
  ``torch._dynamo.repro.after_dynamo.WrapBackendDebug`` (``eval_frame.get_compiler_fn``), and
  importing after_dynamo imports ``torch._dynamo.testing`` and through it AOTAutograd's
  partitioners and networkx (~290 modules), which a start that traces nothing never uses. Inside
  the context ``get_compiler_fn`` is torch's own function recompiled from torch's source with its
  import of ``wrap_backend_debug`` reading :func:`wrap_backend_debug`, which returns torch's
  wrapper when after_dynamo is imported, else :class:`BackendDebug`: the same attributes as
  torch's wrapper (``functools.wraps`` of the backend, ``_torchdynamo_orig_backend``,
  ``_compiler_name``, ``__name__``, ``get_compiler_config``), and a call (a graph compiles)
  builds torch's ``WrapBackendDebug`` of the same backend and name once and calls it: the
  minifier settings (``repro_after``, ``repro_level``) act as in torch's.

Other threads: while the context is on, their ``torch.compile`` and template creations take the
same paths, which behave the same. Capability ``inductor.lazy_compile_stack``: without it
``torch.compile`` and the templates are torch's, and the imports happen as before.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

from . import available, capability

__all__ = ["CAPABILITY", "BackendDebug", "config_without_compile_stack", "wrap_backend_debug"]

CAPABILITY = "inductor.lazy_compile_stack"

#: The name ``torch.compile`` builds its Inductor backend by (a global of ``torch``).
_WRAPPER = "_TorchCompileInductorWrapper"

_AFTER_DYNAMO = "torch._dynamo.repro.after_dynamo"
#: In ``torch._dynamo.eval_frame.get_compiler_fn``: torch's import -> the same name from here.
_GET_COMPILER_FN = (
    ("    from .repro.after_dynamo import wrap_backend_debug\n",
     f"    from {__name__} import wrap_backend_debug\n"),
)

_lock = threading.Lock()
_depth = 0
_original: Any = None


@capability(
    CAPABILITY,
    needs="torch._TorchCompileInductorWrapper (looked up by torch.compile at each call; its "
    "config dict, get_compiler_config() and __call__), torch._inductor.config.patch and "
    "get_config_copy, torch._inductor.codegen.common (KernelTemplate._template_from_string, "
    "indent_except_first, jinja2_env)",
    breaks="every torch.compile imports torch._inductor.compile_fx with its FX passes, and the "
    "kernel modules compile their GEMM templates at import, even on a start that loads every "
    "region from the store and compiles nothing",
)
def _probe() -> str | None:
    import torch
    from torch._inductor import config

    base = getattr(torch, _WRAPPER, None)
    if not isinstance(base, type):
        return f"torch has no class {_WRAPPER}"
    if _WRAPPER not in getattr(getattr(torch.compile, "__code__", None), "co_names", ()):
        return f"torch.compile no longer builds its backend by the global {_WRAPPER}"
    for name in ("get_compiler_config", "__call__", "apply_options"):
        if not callable(getattr(base, name, None)):
            return f"{_WRAPPER} has no {name}()"
    if "get_patched_config_dict" not in base.get_compiler_config.__code__.co_names:
        return f"{_WRAPPER}.get_compiler_config() no longer reads get_patched_config_dict"
    for name in ("patch", "get_config_copy"):
        if not callable(getattr(config, name, None)):
            return f"torch._inductor.config has no {name}()"
    from torch._inductor.codegen import common

    kernel_template = getattr(common, "KernelTemplate", None)
    if not isinstance(vars(kernel_template or object).get("_template_from_string"), staticmethod):
        return "torch._inductor.codegen.common.KernelTemplate has no static _template_from_string"
    if not callable(getattr(common, "jinja2_env", None)) or not callable(
            getattr(kernel_template, "indent_except_first", None)):
        return "torch._inductor.codegen.common has no jinja2_env() or indent_except_first()"
    from .restored_code import UnknownSource

    try:
        _light_get_compiler_fn()
    except UnknownSource as exc:
        return str(exc)
    return None


class BackendDebug:
    """Stands for ``after_dynamo.WrapBackendDebug(backend, name)`` until a graph compiles: the
    attributes torch's wrapper sets, and a call that builds torch's wrapper (importing
    after_dynamo then, once) and calls it."""

    def __init__(self, backend: Any, compiler_name: str | None) -> None:
        functools.wraps(backend)(self)
        self._torchdynamo_orig_backend = backend
        self._compiler_name = compiler_name
        if hasattr(backend, "__name__"):
            self.__name__ = backend.__name__
        if hasattr(backend, "compiler_name"):
            self.__name__ = backend.compiler_name
        if hasattr(backend, "get_compiler_config"):
            self.get_compiler_config = backend.get_compiler_config
        self._torch_wrapper: Any = None

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        wrapper = self._torch_wrapper
        if wrapper is None:
            from torch._dynamo.repro.after_dynamo import WrapBackendDebug

            wrapper = self._torch_wrapper = WrapBackendDebug(self._torchdynamo_orig_backend,
                                                             self._compiler_name)
        return wrapper(gm, example_inputs, **kwargs)


def wrap_backend_debug(backend: Any, compiler_name: str | None) -> Any:
    """torch's ``wrap_backend_debug`` when after_dynamo is imported, else :class:`BackendDebug`."""
    module = sys.modules.get(_AFTER_DYNAMO)
    if module is not None:
        return module.wrap_backend_debug(backend, compiler_name)
    return BackendDebug(backend, compiler_name)


@functools.cache
def _light_get_compiler_fn() -> Any:
    """torch's ``eval_frame.get_compiler_fn`` recompiled from its source with its import of
    ``wrap_backend_debug`` reading this module's (same file, same line numbers); raises
    restored_code's UnknownSource when torch's function is not the one known."""
    from torch._dynamo import eval_frame

    from .restored_code import recompile

    function = eval_frame.get_compiler_fn
    code = recompile(function, eval_frame, _GET_COMPILER_FN, "def get_compiler_fn(")
    return type(function)(code, function.__globals__, function.__name__, function.__defaults__)


class _LazyTemplate:
    """A Jinja template compiled by torch's ``_template_from_string`` the first time any of its
    attributes is read (``render``, ``module``, ...), then that template's attribute."""

    __slots__ = ("_compile", "_lock", "_source", "_template")

    def __init__(self, compile_template: Any, source: str) -> None:
        self._compile = compile_template
        self._source = source
        self._template: Any = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        template = self._template
        if template is None:
            with self._lock:
                if self._template is None:
                    self._template = self._compile(self._source)
                template = self._template
        return getattr(template, name)


def _lazy_template_from_string(compile_template: Any) -> Any:
    """``KernelTemplate._template_from_string`` returning :class:`_LazyTemplate`\\ s (None, as
    torch's, when jinja2 is missing; the filter torch adds to the shared environment is added at
    once, as torch does)."""
    from torch._inductor.codegen import common

    def template_from_string(source: str) -> Any:
        env = common.jinja2_env()
        if env is None:
            return None
        env.filters["indent_except_first"] = common.KernelTemplate.indent_except_first
        return _LazyTemplate(compile_template, source)

    return staticmethod(template_from_string)


@functools.cache
def _wrapper_class() -> type:
    """torch's Inductor wrapper, but for a ``get_compiler_config()`` that needs no compile_fx."""
    import torch

    base = getattr(torch, _WRAPPER)

    class InductorWrapper(base):  # type: ignore[misc, valid-type]
        """``torch._TorchCompileInductorWrapper`` whose ``get_compiler_config()`` reads
        ``torch._inductor.config`` under the wrapper's patches without importing compile_fx."""

        def get_compiler_config(self) -> dict[str, Any]:
            from torch._inductor import config

            with config.patch(self.config):
                return config.get_config_copy()

    InductorWrapper.__module__ = __name__
    InductorWrapper.__qualname__ = "InductorWrapper"
    return InductorWrapper


def __getattr__(name: str) -> Any:
    """``InductorWrapper`` by name, so that a pickled instance loads in any process."""
    if name == "InductorWrapper":
        return _wrapper_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _enter() -> bool:
    """Puts the subclass and the lazy templates in place (or counts one more user); False when
    torch's global is not torch's own class (someone else replaced it: all left as it is)."""
    global _depth, _original
    import torch
    from torch._dynamo import eval_frame
    from torch._inductor.codegen.common import KernelTemplate

    wrapper = _wrapper_class()
    with _lock:
        if _depth == 0:
            if getattr(torch, _WRAPPER) is not wrapper.__bases__[0]:
                return False
            original = vars(KernelTemplate)["_template_from_string"]
            _original = getattr(torch, _WRAPPER), original, eval_frame.get_compiler_fn
            setattr(torch, _WRAPPER, wrapper)
            KernelTemplate._template_from_string = _lazy_template_from_string(original.__func__)
            eval_frame.get_compiler_fn = _light_get_compiler_fn()
        _depth += 1
        return True


def _exit() -> None:
    global _depth, _original
    import torch
    from torch._dynamo import eval_frame
    from torch._inductor.codegen.common import KernelTemplate

    with _lock:
        _depth -= 1
        if _depth == 0:
            setattr(torch, _WRAPPER, _original[0])
            KernelTemplate._template_from_string = _original[1]
            eval_frame.get_compiler_fn = _original[2]
            _original = None


@contextlib.contextmanager
def config_without_compile_stack() -> Iterator[None]:
    """Within it, ``torch.compile(backend="inductor")`` imports ``torch._inductor.compile_fx``
    only when a graph compiles (see the module doc). Reentrant and safe across threads: the
    global goes back to torch's class when the outermost use ends."""
    if not available(CAPABILITY) or not _enter():
        yield
        return
    try:
        yield
    finally:
        _exit()
