"""Dynamo's private API: compile counters, guard failures, cache entries, config.

What compile_cache reads or sets inside ``torch._dynamo`` (torch 2.8 to 2.13), each behind a
capability (see :mod:`compile_cache.torch_compat`):

``dynamo.counters``        ``torch._dynamo.utils.counters``: FX-graph and AOTAutograd cache
                           hits/misses, which tell the session that a forward compiled something
                           worth publishing. Also checked in use: a Dynamo graph compiled with
                           Inductor, caches on, and none of those counters moved means their
                           names changed, and nothing would ever be published.
``dynamo.guard_failures``  ``torch._dynamo.utils.guard_failures``: per-block recompile detection.
``dynamo.cache_entries``   ``torch._dynamo.eval_frame._debug_get_cache_entry_list``:
                           compiled entries per code object (``region_stats``, eager reasons).
``dynamo.config``          ``torch._dynamo.config.recompile_limit`` and ``.disable``.
``dynamo.optimized_module``  ``torch._dynamo.eval_frame.OptimizedModule``: refuse a model that
                           ``torch.compile`` already wrapped.
``dynamo.isolate_recompiles``  ``torch.compile(isolate_recompiles=True)`` and
                           ``eval_frame._get_cache_entries_for_region``: one compile per group, with
                           its own recompile bucket for its code and its resume functions.
``dynamo.resume_functions``  ``resume_execution.ContinueExecutionCache.cache`` and
                           ``counters["frames"]``: the part of a block after a graph break that hits
                           the recompile limit (and runs uncompiled) is seen and reported.
``dynamo.module_by_name``  ``symbolic_convert._import_module``: the module Dynamo reads an inlined
                           function's globals from (by the name in them, cached for the process):
                           a block whose module is not that one (two modules loaded under one
                           name) would be guarded against another module's values.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import threading
from typing import Any

from . import available, capability, mark_missing

log = logging.getLogger("compile_cache")

__all__ = [
    "CompileCounters",
    "cache_entries",
    "check_counters",
    "compile_disabled",
    "compile_group",
    "foreign_globals",
    "frames_seen",
    "guard_failures",
    "import_compile_stack",
    "is_optimized_module",
    "raise_recompile_limit",
    "recompile_limit",
    "resume_codes_at_limit",
]

# The counter names torch's caches bump (torch/_inductor/codecache.py, autograd_cache.py).
_INDUCTOR = "inductor"
_AOT = "aot_autograd"
_FX_HIT, _FX_MISS, _FX_BYPASS = "fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"
_AOT_HIT, _AOT_MISS, _AOT_BYPASS = "autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"


@capability(
    "dynamo.counters",
    needs="torch._dynamo.utils.counters (fxgraph_cache_hit/miss, autograd_cache_hit/miss)",
    breaks="compile_cache cannot see that a forward compiled, so nothing is published",
)
def _probe_counters() -> str | None:
    from torch._dynamo import utils

    counters = getattr(utils, "counters", None)
    if counters is None:
        return "torch._dynamo.utils has no attribute 'counters'"
    if not hasattr(counters, "__getitem__"):
        return f"torch._dynamo.utils.counters is a {type(counters).__name__}, not a mapping"
    return None


@dataclasses.dataclass(frozen=True)
class CompileCounters:
    """Hit/miss counts of torch's local FX-graph and AOTAutograd caches at one moment.

    Take a snapshot before a compile and ``diff`` one after: a local-cache hit shows as
    ``fxgraph_hit >= 1`` and ``fxgraph_miss == 0``. ``graphs`` counts the graphs Dynamo handed
    to a backend (its ``unique_graphs``). All zero where the counters capability is missing.
    """

    fxgraph_hit: int = 0
    fxgraph_miss: int = 0
    fxgraph_bypass: int = 0
    autograd_hit: int = 0
    autograd_miss: int = 0
    autograd_bypass: int = 0
    graphs: int = 0

    @classmethod
    def snapshot(cls) -> CompileCounters:
        """Read ``torch._dynamo.utils.counters`` now."""
        if not available("dynamo.counters"):
            return cls()
        from torch._dynamo.utils import counters

        ind = counters[_INDUCTOR]
        aot = counters[_AOT]
        return cls(
            fxgraph_hit=int(ind[_FX_HIT]),
            fxgraph_miss=int(ind[_FX_MISS]),
            fxgraph_bypass=int(ind[_FX_BYPASS]),
            autograd_hit=int(aot[_AOT_HIT]),
            autograd_miss=int(aot[_AOT_MISS]),
            autograd_bypass=int(aot[_AOT_BYPASS]),
            graphs=int(counters["stats"]["unique_graphs"]),
        )

    def diff(self, before: CompileCounters) -> CompileCounters:
        """The counts added since ``before``."""
        return CompileCounters(
            **{
                f.name: getattr(self, f.name) - getattr(before, f.name)
                for f in dataclasses.fields(self)
            }
        )

    @property
    def hit(self) -> bool:
        """True when the compile hit the local FX-graph cache and missed nothing."""
        return self.fxgraph_hit > 0 and self.fxgraph_miss == 0

    @property
    def cache_lookups(self) -> int:
        """FX-graph and AOTAutograd cache lookups of any outcome."""
        return (self.fxgraph_hit + self.fxgraph_miss + self.fxgraph_bypass + self.autograd_hit
                + self.autograd_miss + self.autograd_bypass)

    def as_dict(self) -> dict[str, int]:
        """Plain dict, for logs and JSON."""
        return dataclasses.asdict(self)


def check_counters(diff: CompileCounters) -> None:
    """For a forward compiled with Inductor: if Dynamo compiled graphs while torch's caches are
    on but no cache counter moved, the counter names changed: the counters capability is
    marked missing (one warning), since nothing would ever be published."""
    if diff.graphs <= 0 or diff.cache_lookups > 0:
        return
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is None:
        return
    if not getattr(inductor_config, "fx_graph_cache", False) or getattr(
        inductor_config, "force_disable_caches", False
    ):
        return  # torch's caches are off: no counter is expected to move
    mark_missing(
        "dynamo.counters",
        f"Dynamo compiled {diff.graphs} graph(s) with Inductor but none of torch's cache "
        f"counters ({_FX_HIT}, {_FX_MISS}, {_AOT_HIT}, ...) moved: their names changed",
    )


@capability(
    "dynamo.guard_failures",
    needs="torch._dynamo.utils.guard_failures",
    breaks="per-block recompiles of identical blocks are not detected (no RegionRecompileWarning)",
)
def _probe_guard_failures() -> str | None:
    from torch._dynamo import utils

    if not isinstance(getattr(utils, "guard_failures", None), dict):
        return "torch._dynamo.utils.guard_failures is gone or not a dict"
    return None


_NO_FAILURES: dict[Any, list[str]] = {}


def guard_failures() -> dict[Any, list[str]]:
    """Dynamo's code object -> recompile reasons (read-only use); empty where it is missing."""
    if not available("dynamo.guard_failures"):
        return _NO_FAILURES
    from torch._dynamo.utils import guard_failures as failures

    return failures


@capability(
    "dynamo.cache_entries",
    needs="torch._dynamo.eval_frame._debug_get_cache_entry_list",
    breaks="region_stats() reports cache_entries=-1 and eager-run warnings cannot name the "
    "recompile limit",
)
def _probe_cache_entries() -> str | None:
    from torch._dynamo import eval_frame

    if not callable(getattr(eval_frame, "_debug_get_cache_entry_list", None)):
        return "torch._dynamo.eval_frame has no _debug_get_cache_entry_list"
    return None


def cache_entries(code: Any, region: int = -1) -> int:
    """How many compiled entries Dynamo holds for ``code`` (in the recompile bucket of the
    ``region`` :func:`compile_group` returned, when given); -1 when it cannot tell."""
    if not available("dynamo.cache_entries"):
        return -1
    if region >= 0:
        if not available("dynamo.isolate_recompiles"):
            return -1
        from torch._dynamo.eval_frame import _get_cache_entries_for_region

        try:
            return len(_get_cache_entries_for_region(code, region))
        except Exception:
            return -1
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    try:
        return len(_debug_get_cache_entry_list(code))
    except Exception:
        return -1


@capability(
    "dynamo.isolate_recompiles",
    needs="torch.compile(isolate_recompiles=...) and "
    "torch._dynamo.eval_frame._get_cache_entries_for_region",
    breaks="identical blocks compile with one torch.compile call each, so the code after a graph "
    "break (a resume function, shared by every model of the block's class) counts one recompile "
    "limit for all of them",
)
def _probe_isolate() -> str | None:
    import inspect

    import torch
    from torch._dynamo import eval_frame

    if "isolate_recompiles" not in inspect.signature(torch.compile).parameters:
        return "torch.compile takes no 'isolate_recompiles'"
    if not callable(getattr(eval_frame, "_get_cache_entries_for_region", None)):
        return "torch._dynamo.eval_frame has no _get_cache_entries_for_region"
    return None


_GROUPS: dict[Any, tuple[Any, int]] = {}
_GROUPS_LOCK = threading.Lock()


def compile_group(fn: Any, key: Any, **compile_kwargs: Any) -> tuple[Any, int] | None:
    """``torch.compile(fn, isolate_recompiles=True, ...)`` and the id of its recompile bucket
    (what :func:`cache_entries` and the recompile limit count), made once per ``key`` and
    keywords; None where torch lacks it."""
    if not available("dynamo.isolate_recompiles"):
        return None
    import torch

    key = (key, compile_kwargs.get("recompile_limit"))
    with _GROUPS_LOCK:
        group = _GROUPS.get(key)
        if group is None:
            compiled = torch.compile(fn, isolate_recompiles=True, **compile_kwargs)
            group = _GROUPS[key] = (compiled, int(getattr(compiled, "_isolate_recompiles_id", -1)))
    return group


@capability(
    "dynamo.resume_functions",
    needs="torch._dynamo.resume_execution.ContinueExecutionCache.cache and "
    "torch._dynamo.utils.counters['frames']",
    breaks="the part of a block after a graph break (the KV-cache update) that reaches the "
    "recompile limit runs uncompiled without a RegionEagerWarning",
)
def _probe_resume() -> str | None:
    from torch._dynamo import utils
    from torch._dynamo.resume_execution import ContinueExecutionCache

    if not isinstance(getattr(getattr(ContinueExecutionCache, "cache", None), "values", None), dict):
        return "ContinueExecutionCache.cache has no dict 'values'"
    if not hasattr(getattr(utils, "counters", None), "__getitem__"):
        return "torch._dynamo.utils has no counters"
    return None


_FRAMES: list[Any] = []


def frames_seen() -> int:
    """Frames Dynamo tried to convert so far (``counters["frames"]["total"]``; a cache hit does
    not count): a change during a call means something compiled or was refused. 0 when missing."""
    if not _FRAMES:
        if not available("dynamo.resume_functions"):
            return 0
        from torch._dynamo.utils import counters

        _FRAMES.append(counters)
    return int(_FRAMES[0]["frames"]["total"])


def resume_codes_at_limit(region: int, limit: int) -> list[tuple[str, int]]:
    """Resume functions (the code after a graph break) with at least ``limit`` entries in the
    recompile bucket ``region``: Dynamo runs them uncompiled from now on. ``(name, entries)``."""
    if not available("dynamo.resume_functions"):
        return []
    from torch._dynamo.resume_execution import ContinueExecutionCache

    found = []
    for by_key in list(ContinueExecutionCache.cache.values.values()):
        for code in list(by_key.values()):
            entries = cache_entries(code, region)
            if entries >= limit:
                found.append((code.co_name, entries))
    return found


@capability(
    "dynamo.config",
    needs="torch._dynamo.config.recompile_limit and .disable",
    breaks="large groups of identical blocks may reach torch's recompile limit and run eagerly "
    "(each such run is warned), and eager-run warnings cannot say why",
)
def _probe_config() -> str | None:
    from torch._dynamo import config

    for name in ("recompile_limit", "disable"):
        if not hasattr(config, name):
            return f"torch._dynamo.config has no {name!r}"
    return None


def recompile_limit() -> int | None:
    """torch's global recompile limit (``torch._dynamo.config.recompile_limit``), or None."""
    if not available("dynamo.config"):
        return None
    from torch._dynamo import config

    return int(config.recompile_limit)


def raise_recompile_limit(needed: int) -> None:
    """Raise the global recompile limit to ``needed`` (older torch without a per-call limit)."""
    if not available("dynamo.config"):
        return
    from torch._dynamo import config

    if config.recompile_limit < needed:
        log.info("compile_cache: raising torch's recompile limit to %d", needed)
        config.recompile_limit = needed


def compile_disabled() -> bool:
    """Whether torch.compile is switched off (``TORCH_COMPILE_DISABLE`` or Dynamo's config)."""
    if os.environ.get("TORCH_COMPILE_DISABLE", "") not in ("", "0"):
        return True
    config = sys.modules.get("torch._dynamo.config")
    return bool(getattr(config, "disable", False))


@capability(
    "dynamo.optimized_module",
    needs="torch._dynamo.eval_frame.OptimizedModule",
    breaks="a model already wrapped by torch.compile is not recognised, so compile_regions "
    "plans the wrapper instead of refusing it",
)
def _probe_optimized_module() -> str | None:
    from torch._dynamo import eval_frame

    if not isinstance(getattr(eval_frame, "OptimizedModule", None), type):
        return "torch._dynamo.eval_frame has no class OptimizedModule"
    return None


def is_optimized_module(value: object) -> bool:
    """Whether ``value`` is the wrapper ``torch.compile(module)`` returns."""
    if not available("dynamo.optimized_module"):
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(value, OptimizedModule)


def original_module(value: Any) -> Any:
    """The module a ``torch.compile(module)`` wrapper wraps (``OptimizedModule._orig_mod``)."""
    return value._orig_mod


#: What the first Inductor compile of a process imports lazily (about a second on CPU).
_COMPILE_STACK = (
    "torch._dynamo.convert_frame",
    "torch._functorch.aot_autograd",
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
)


def import_compile_stack() -> None:
    """Imports the compile stack ahead of the first compile; failures are only logged."""
    for name in _COMPILE_STACK:
        try:
            importlib.import_module(name)
        except Exception as exc:  # another torch version: nothing lost, the compile imports it
            log.debug("compile_cache: could not import %s ahead of time: %s", name, exc)


@capability(
    "dynamo.module_by_name",
    needs="torch._dynamo.symbolic_convert._import_module",
    breaks="a block whose module was loaded under a name another module holds (two files "
    "loaded as one name) runs uncompiled, warned, as when Dynamo would read the other module",
)
def _probe_module_by_name() -> str | None:
    from torch._dynamo import symbolic_convert

    if not callable(getattr(symbolic_convert, "_import_module", None)):
        return "torch._dynamo.symbolic_convert has no _import_module"
    return None


def _dynamo_module(name: str) -> Any:
    """The module Dynamo resolves ``name`` to when it guards an inlined function's globals
    (``InliningInstructionTranslator.get_globals_source_and_value``: ``_import_module``, cached
    for the process), or None where that cannot be told without importing anything new."""
    if name not in sys.modules or not available("dynamo.module_by_name"):
        return None
    from torch._dynamo import symbolic_convert

    try:
        return symbolic_convert._import_module(name)
    except Exception:  # noqa: BLE001 - what Dynamo could not import, it cannot guard either
        return None


def foreign_globals(functions: Any) -> str | None:
    """Why Dynamo would guard one of ``functions`` against another module's globals, else None.

    Called from a region's trampoline, a block's code is inlined: Dynamo reads and guards the
    globals it uses as ``G['__import_<module name>'].X``, with the module found by the name in
    the function's globals and cached for the process. When two modules were loaded under one
    name (``importlib.util.spec_from_file_location`` twice, ``sys.modules`` rebound), or the
    module is not importable under its name, that is another module (or an error): its values
    would be read and checked in place of the block's own (measured: 9.9 away from eager)."""
    for fn in functions:
        scope = getattr(fn, "__globals__", None)
        if not isinstance(scope, dict):
            continue
        name = scope.get("__name__")
        if not isinstance(name, str) or name.startswith("namedtuple_") or "torch_package" in name:
            continue  # Dynamo guards such a scope by identity, not by name
        registered = sys.modules.get(name)
        if registered is not None and getattr(registered, "__dict__", None) is not scope:
            return (f"{fn.__qualname__} belongs to a module loaded under the name {name!r}, which "
                    f"sys.modules gives to another module")
        if registered is None:
            return (f"{fn.__qualname__} belongs to a module {name!r} that is not in sys.modules "
                    f"(loaded from a file without registering it)")
        resolved = _dynamo_module(name)
        if resolved is not None and getattr(resolved, "__dict__", None) is not scope:
            return (f"{fn.__qualname__} belongs to a module loaded under the name {name!r}, which "
                    f"Dynamo already resolved to another module in this process")
    return None
