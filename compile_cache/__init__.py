"""compile_cache: make torch.compile a one-time cost.

Regional compilation keyed by a native fingerprint of the module tree, and an on-disk artifact
store that lets a fresh process, rank or node restore what an earlier compile produced.

The public names below are loaded on first use (PEP 562): ``import compile_cache`` imports
neither torch nor the compile stack, so the store's command line starts in well under a second.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from .errors import (
    BackendUnavailableError,
    CompileCacheError,
    ConfigError,
    CorruptPackError,
    DistributedSetupError,
    LockTimeoutError,
    StoreError,
    UnsafePathError,
    UnsafeStoreError,
)
from .fingerprint import Fingerprint, fingerprint, fingerprint_tree

logging.getLogger("compile_cache").addHandler(logging.NullHandler())

__version__ = "0.1.0"

#: public name -> the module that defines it (imported when the name is first read)
_LAZY: dict[str, str] = {
    "compile_regions": "api",
    "compile": "whole",
    "enable": "process_store",
    "CompiledFunction": "whole",
    "warm_up": "api",
    "warm": "whole",
    "CacheReport": "session",
    "CacheMissWarning": "explain",
    "last_report": "session",
    "RegionPlan": "plan",
    "plan_regions": "plan",
    "get_plan": "regions",
    "region_stats": "regions",
    "RegionEagerWarning": "regions",
    "RegionRecompileWarning": "regions",
    "RegionPrecompileWarning": "precompiled",
    "PrecompileReviewWarning": "precompiled",
    "Store": "store",
    "backend": "fingerprint",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if name != "backend":  # chosen once, but read through the module so a failure is not cached
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BackendUnavailableError",
    "CacheMissWarning",
    "CacheReport",
    "CompiledFunction",
    "PrecompileReviewWarning",
    "RegionEagerWarning",
    "RegionPlan",
    "RegionPrecompileWarning",
    "RegionRecompileWarning",
    "Store",
    "compile",
    "compile_regions",
    "enable",
    "get_plan",
    "last_report",
    "plan_regions",
    "region_stats",
    "CompileCacheError",
    "ConfigError",
    "CorruptPackError",
    "DistributedSetupError",
    "Fingerprint",
    "LockTimeoutError",
    "StoreError",
    "UnsafePathError",
    "UnsafeStoreError",
    "backend",
    "fingerprint",
    "fingerprint_tree",
    "warm",
    "warm_up",
]
