"""Process-wide state of compile_cache, and one way to reset it (for tests and notebooks).

compile_cache keeps a little state per process, on purpose: one-time warnings, what torch's ISA
probe answered, the background prefetch run, the last reports. :func:`reset_process_state` puts
every such module back as a fresh process would have it, through each module's own ``_reset()``
(so tests never poke module globals). Hooks installed into torch stay installed, and Dynamo's own
caches are torch's business (Dynamo's own reset).
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["STATEFUL_MODULES", "reset_process_state"]

#: The modules with process-wide state, each with a ``_reset()``.
STATEFUL_MODULES: tuple[str, ...] = (
    "compile_cache.torch_compat",
    "compile_cache.torch_compat.isa",
    "compile_cache.torch_compat.cache_use",
    "compile_cache.torch_compat.autotune",
    "compile_cache.torch_compat.cpp_header",
    "compile_cache.capture",
    "compile_cache.artifacts",
    "compile_cache.local_dirs",
    "compile_cache.prefetch",
    "compile_cache.store",
    "compile_cache.locks.modes",
    "compile_cache.session",
    "compile_cache.precompiled",
    "compile_cache.recovery",
    "compile_cache.distributed.warm_up_report",
    "compile_cache.distributed.hazards",
    "compile_cache.distributed.rendezvous",
    "compile_cache.integrations.accelerate",
)


def reset_process_state() -> None:
    """Reset every stateful module that is loaded (modules not imported yet are fresh anyway)."""
    for name in STATEFUL_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        reset = getattr(importlib.import_module(name), "_reset", None)
        if reset is None:
            raise AssertionError(f"{name} is listed as stateful but has no _reset()")
        reset()
