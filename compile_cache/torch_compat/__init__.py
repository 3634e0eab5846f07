"""The one boundary around torch's private API: every ``torch._*`` use of compile_cache is here.

Each module of this package declares the *capabilities* it provides: a name, what it needs from
torch, and what degrades without it. When torch moves a private name, the capability that needs
it goes missing, and that is loud, never silent:

* the first time compile_cache needs a missing capability it warns once (a
  :class:`TorchCompatWarning` pointing at the user's line) and takes the documented fallback;
* ``python -m compile_cache doctor`` lists every capability with ``available``/``MISSING``;
* ``compile_cache.last_report().degraded`` names the missing capabilities a compile ran without.

Capabilities are probed lazily (on first need, or by :func:`capabilities`), so importing
compile_cache imports no private torch module. Modules: :mod:`.dynamo` (counters, guard
failures, cache entries, recompile limit, the OptimizedModule check), :mod:`.precompile`
(Dynamo's caching precompile, with its guard filter, entry names and pins),
:mod:`.inductor_cache` (torch's local cache dirs), :mod:`.isa` (Inductor's CPU instruction-set
probe: the hook and the background builds), :mod:`.cache_use` (which cache entries a compile
used: capture by use), :mod:`.autotune` (the autotune results its kernels used), :mod:`.cudagraphs`
(CUDA graphs under precompile and regional compilation), :mod:`.pgo` (Dynamo's job profile),
:mod:`.dynamic_shapes` (the regions' automatic-dynamic decisions), :mod:`.cpp_header` (Inductor's
precompiled header, built only when needed), :mod:`.inductor_backend` (``torch.compile``'s Inductor
backend without its compile stack until a graph compiles), :mod:`.restored_code` (restored Inductor
code without the code generator's imports), :mod:`.c10d` (the default c10d store),
:mod:`.configs` (the config digests of the environment key), :mod:`.tensors` (tensor layouts),
:mod:`.kv` (transformers' KV cache inside compiled regions: :mod:`.kv.cache`, nested graph
breaks; :mod:`.kv.calls`, how a block with a cache is called: the eager update or a layer view).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .. import _warnings

__all__ = [
    "Capability",
    "CapabilityStatus",
    "TorchCompatWarning",
    "available",
    "capabilities",
    "capability",
    "degraded",
    "mark_missing",
    "module_source",
]

#: The modules that declare capabilities (imported by capabilities(), never at package import).
MODULES = ("dynamo", "precompile", "inductor_cache", "isa", "c10d", "configs", "kv.cache", "kv.wrapped_forward", "cache_use",
           "cpp_header", "autotune", "cudagraphs", "pgo", "dynamic_shapes", "inductor_backend",
           "restored_code")


class TorchCompatWarning(RuntimeWarning):
    """A private torch API compile_cache relies on is missing: a feature runs degraded."""


@dataclass(frozen=True)
class Capability:
    """Something compile_cache takes from torch's private API, and what breaks without it."""

    name: str
    needs: str  # the private torch names it uses
    breaks: str  # what happens without it (the fallback)
    probe: Callable[[], str | None]  # None when available, else why it is missing


@dataclass(frozen=True)
class CapabilityStatus:
    """One row of :func:`capabilities`."""

    name: str
    available: bool
    detail: str  # when missing: why, and what breaks; else what it needs

    def __iter__(self):  # (name, available, detail), as a tuple
        return iter((self.name, self.available, self.detail))


_REGISTRY: dict[str, Capability] = {}
_missing: dict[str, str] = {}  # name -> reason, for capabilities found missing in this process
_probed: set[str] = set()
_warned: set[str] = set()
_lock = threading.Lock()


def capability(name: str, *, needs: str, breaks: str) -> Callable[[Callable[[], str | None]], Callable[[], str | None]]:
    """Declares a capability; the decorated function probes it (None = available, else why not)."""

    def register(probe: Callable[[], str | None]) -> Callable[[], str | None]:
        _REGISTRY[name] = Capability(name, needs, breaks, probe)
        return probe

    return register


def module_source(module: str) -> tuple[str, str] | None:
    """(file, text) of the source of torch's module ``module``, found without importing it (a
    probe must not pay the import it is there to avoid), or None when it has no readable source
    file. For probes that check torch's code as text."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return spec.origin, f.read()
    except OSError:
        return None


def _probe(name: str) -> str | None:
    """The capability's missing reason (cached once probed), or None when available."""
    with _lock:
        if name in _probed:
            return _missing.get(name)
    cap = _REGISTRY[name]
    try:
        reason = cap.probe()
    except Exception as exc:  # a probe that fails is a missing capability, not a crash
        reason = f"{type(exc).__name__}: {exc}"
    with _lock:
        _probed.add(name)
        if reason is not None:
            _missing.setdefault(name, reason)
        return _missing.get(name)


def available(name: str) -> bool:
    """Whether capability ``name`` works with this torch; warns once per process if it does not.

    Call it where the capability is needed: a missing one warns (pointing at the user's line)
    the first time, then callers take their fallback quietly.
    """
    if name in _probed and name not in _missing:  # the common case, without the lock
        return True
    reason = _probe(name)
    if reason is None:
        return True
    _warn_missing(name)
    return False


def mark_missing(name: str, reason: str) -> None:
    """Records that ``name`` turned out not to work (seen in use, e.g. counters that never move)
    and warns once."""
    with _lock:
        _probed.add(name)
        _missing.setdefault(name, reason)
    _warn_missing(name)


def _warn_missing(name: str) -> None:
    with _lock:
        if name in _warned:
            return
        _warned.add(name)
        reason = _missing.get(name, "unknown")
    cap = _REGISTRY[name]
    _warnings.warn(
        f"compile_cache: torch capability {name!r} is missing ({reason}); {cap.breaks}. "
        f"It needs {cap.needs}; `python -m compile_cache doctor` lists every capability.",
        TorchCompatWarning,
    )


def _load_all() -> None:
    for module in MODULES:
        importlib.import_module(f"{__name__}.{module}")


def capabilities() -> list[CapabilityStatus]:
    """Every capability, probed now (imports torch): ``(name, available, detail)`` rows.

    Probing here does not warn; it is what ``doctor`` shows.
    """
    _load_all()
    rows = []
    for name, cap in sorted(_REGISTRY.items()):
        reason = _probe(name)
        if reason is None:
            rows.append(CapabilityStatus(name, True, f"uses {cap.needs}"))
        else:
            rows.append(CapabilityStatus(name, False, f"{reason}; {cap.breaks}"))
    return rows


def degraded() -> list[str]:
    """Names of the capabilities found missing in this process so far (for ``last_report()``)."""
    with _lock:
        return sorted(_missing)


def _reset() -> None:
    """Forget what was probed and warned (tests; a process that patched torch)."""
    with _lock:
        _missing.clear()
        _probed.clear()
        _warned.clear()
