"""compile_cache: make torch.compile a one-time cost.

Regional compilation keyed by a native fingerprint of the module tree, and an on-disk artifact
store that lets a fresh process, rank or node restore what an earlier compile produced.
"""

from __future__ import annotations

import logging

from .cache import CacheReport, last_report
from .distributed import warm_up
from .errors import (
    BackendUnavailableError,
    CompileCacheError,
    ConfigError,
    CorruptPackError,
    LockTimeoutError,
    StoreError,
    UnsafePathError,
    UnsafeStoreError,
)
from .fingerprint import Fingerprint, backend, fingerprint, fingerprint_tree
from .regions import RegionPlan, compile_regions, get_plan, plan_regions, region_stats
from .store import Store

logging.getLogger("compile_cache").addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CacheReport",
    "RegionPlan",
    "Store",
    "compile_regions",
    "get_plan",
    "last_report",
    "plan_regions",
    "region_stats",
    "CompileCacheError",
    "ConfigError",
    "CorruptPackError",
    "Fingerprint",
    "LockTimeoutError",
    "StoreError",
    "UnsafePathError",
    "UnsafeStoreError",
    "backend",
    "fingerprint",
    "fingerprint_tree",
    "warm_up",
]
