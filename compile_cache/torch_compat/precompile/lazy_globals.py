"""Reading a precompile entry without importing what only a compile calls (torch 2.13).

Every ``CompiledFxGraph`` in a precompile entry holds ``fx_kwargs["get_decomp_fn"] =
torch._inductor.decomposition.select_decomp_table``, so unpickling the entry imports that module
(with ``torch.ao.quantization.fx``): its import builds the whole decomposition table
(``core_aten_decompositions()``, which materialises every composite-implicit op through
``torch.export``), 0.2-0.5 s of CPU, on a start that loads everything and never calls it (a
loaded graph's ``fx_kwargs`` are read only for flags such as ``is_inference``).

:func:`loads` unpickles such an entry with that one global replaced by :class:`LazyGlobal`, a
stand-in that imports the module and calls the function the first time it is called, so
anything that does call it gets torch's own table. A stand-in pickles again as a call of
``pkgutil.resolve_name("torch._inductor.decomposition:select_decomp_table")``: any process that
reads it back (torch's own ``pickle.loads`` included) gets torch's function itself, and
:func:`loads` the stand-in again (a train entry saved by a process that loaded the forward
entry lazily holds that spelling: read eagerly, it imported the module on every later start). When the
module is already imported (a process that compiled), the real function is returned, as
``pickle`` would.

:func:`lazy_entry_reads` makes torch's own read of an entry (``DiskDynamoStore.read``, inside
``torch.compile`` with ``caching_precompile``) use :func:`loads`, for the current thread only and
only inside the ``with``; other threads and other reads are untouched.

Capability ``dynamo.lazy_decomp_table``: torch's source still defines
``select_decomp_table()`` (no parameters) at the top level of ``torch._inductor.decomposition``
(read as text: probing must not import it), none of the files that hand a graph's
``get_decomp_fn`` on compares it by identity, and ``DiskDynamoStore.read`` unpickles the entry with
``torch._dynamo.package``'s module-level ``pickle.loads``. Without it entries are read with
``pickle`` as before (the slow path: the import happens, nothing else changes).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import pkgutil
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import available, capability, module_source

logger = logging.getLogger("compile_cache")

__all__ = ["CAPABILITY", "LAZY_GLOBALS", "LazyGlobal", "lazy_entry_reads", "loads"]

CAPABILITY = "dynamo.lazy_decomp_table"
_MODULE, _NAME = "torch._inductor.decomposition", "select_decomp_table"
#: The globals read lazily: (module, name) -> the stand-in.
LAZY_GLOBALS: dict[tuple[str, str], LazyGlobal] = {}


class LazyGlobal:
    """A module-level function of torch, imported at its first call (see the module docstring)."""

    def __init__(self, module: str, name: str) -> None:
        self.__module__ = module  # what the function reports: introspection only
        self.__name__ = self.__qualname__ = name
        self._target = f"{module}:{name}"
        self._lock = threading.Lock()
        self._resolved: Callable[..., Any] | None = None

    def resolve(self) -> Callable[..., Any]:
        """Torch's function (imports its module the first time)."""
        if self._resolved is None:
            with self._lock:
                if self._resolved is None:
                    self._resolved = pkgutil.resolve_name(self._target)
        return self._resolved

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Any reader resolves the same name to torch's own function (no compile_cache needed).
        return pkgutil.resolve_name, (self._target,)

    def __copy__(self) -> LazyGlobal:
        return self  # a function is copied as itself (copy's atomic types)

    def __deepcopy__(self, memo: dict[int, Any]) -> LazyGlobal:
        return self  # torch deep-copies a loaded backend (PrecompileContext.record_artifact)

    def __repr__(self) -> str:
        return f"<lazy {self._target}>"


LAZY_GLOBALS[(_MODULE, _NAME)] = LazyGlobal(_MODULE, _NAME)


def _resolve_name_lazily(target: str) -> Any:
    """``pkgutil.resolve_name(target)``, except that a lazy global's name gives its stand-in
    while its module is not imported: an entry written by a process that had read one lazily
    (a loaded backend saved again with a new one) spells the global that way."""
    module, _, name = target.partition(":")
    stand_in = LAZY_GLOBALS.get((module, name))
    if stand_in is not None and module not in sys.modules:
        return stand_in
    return pkgutil.resolve_name(target)


class _LazyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("pkgutil", "resolve_name"):
            return _resolve_name_lazily
        stand_in = LAZY_GLOBALS.get((module, name))
        if stand_in is not None and module not in sys.modules:
            return stand_in
        return super().find_class(module, name)


def loads(data: bytes) -> Any:
    """``pickle.loads(data)`` with :data:`LAZY_GLOBALS` read lazily while their modules are not
    imported (plain ``pickle.loads`` when the capability is missing)."""
    if not available(CAPABILITY):
        return pickle.loads(data)  # noqa: S301 - torch's own entry format, read as torch reads it
    return _LazyUnpickler(io.BytesIO(data)).load()


_reads = threading.local()
_install_lock = threading.Lock()


class _GatedPickle:
    """``torch._dynamo.package``'s ``pickle``: the module itself, except that ``loads`` is
    :func:`loads` in a thread inside :func:`lazy_entry_reads`."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def loads(self, data: bytes, *args: Any, **kwargs: Any) -> Any:
        if getattr(_reads, "active", False) and not args and not kwargs:
            return loads(data)
        return self._module.loads(data, *args, **kwargs)


@contextlib.contextmanager
def lazy_entry_reads() -> Iterator[None]:
    """Inside it, in this thread, torch reads precompile entries with :func:`loads`."""
    if not available(CAPABILITY):
        yield
        return
    import torch._dynamo.package as package

    with _install_lock:
        if not isinstance(package.pickle, _GatedPickle):
            package.pickle = _GatedPickle(package.pickle)  # type: ignore[assignment]
    before = getattr(_reads, "active", False)
    _reads.active = True
    try:
        yield
    finally:
        _reads.active = before


#: torch's files that hand a graph's ``get_decomp_fn`` on (a loaded graph's reaches none of them
#: on a hit; a recompile would call it): none may compare it by identity. The whole of torch's
#: _inductor, _dynamo and _functorch is checked by tests/test_torch_compat_lazy_globals.py.
_HOLDERS = ("_inductor/output_code.py", "_inductor/compile_fx.py", "_inductor/graph.py",
            "_inductor/lowering.py", "_inductor/pattern_matcher.py")
IDENTITY = re.compile(rf"\bis(?: not)? (?:{_NAME}|get_decomp_fn)\b"
                      rf"|\b(?:{_NAME}|get_decomp_fn) is (?:not )?(?!None\b|not\b)\w")


def identity_comparisons(text: str) -> list[str]:
    """The lines of ``text`` that compare the table's function by identity (only the lines that
    name it are searched: a probe reads torch's largest files)."""
    found, seen = [], set()
    for word in (_NAME, "get_decomp_fn"):
        at = text.find(word)
        while at != -1:
            start = text.rfind("\n", 0, at) + 1
            end = text.find("\n", at)
            end = len(text) if end == -1 else end
            if start not in seen:
                seen.add(start)
                if IDENTITY.search(text, start, end):
                    found.append(text[start:end].strip())
            at = text.find(word, end)
    return found


@capability(
    CAPABILITY,
    needs="torch._inductor.decomposition.select_decomp_table() (a module-level function, not "
    "compared by identity where a graph's get_decomp_fn is handed on), torch._dynamo.package."
    "DiskDynamoStore.read unpickling with the module's pickle.loads",
    breaks="a restored start imports torch._inductor.decomposition (0.2-0.5 s) to read its "
    "precompile entries",
)
def _probe_lazy_decomp_table() -> str | None:
    import torch._dynamo.package as package

    found = module_source(_MODULE)
    if found is None:
        return f"{_MODULE} has no readable source file"
    origin, source = found
    if not re.search(rf"^def {_NAME}\(\)", source, re.MULTILINE):
        return f"{_MODULE} defines no top-level {_NAME}() without parameters"
    torch_dir = os.path.dirname(os.path.dirname(origin))
    for name in _HOLDERS:
        try:
            with open(os.path.join(torch_dir, name), encoding="utf-8") as f:
                if identity_comparisons(f.read()):
                    return f"torch/{name} compares {_NAME} by identity"
        except OSError as exc:
            return f"torch/{name} cannot be read ({exc})"
    store = getattr(package, "DiskDynamoStore", None)
    read = getattr(store, "read", None)
    if read is None:
        return "torch._dynamo.package.DiskDynamoStore has no read()"
    names = getattr(getattr(read, "__code__", None), "co_names", ())
    if "pickle" not in names or "loads" not in names:
        return "DiskDynamoStore.read does not unpickle with pickle.loads"
    if getattr(package, "pickle", None) is not pickle and not isinstance(package.pickle, _GatedPickle):
        return "torch._dynamo.package.pickle is not the pickle module"
    return None
