"""Make ``accelerate.Accelerator.prepare`` use compile_cache's regional compilation.

With ``TorchDynamoPlugin(use_regional_compilation=True)``, accelerate's ``prepare_model`` calls
``accelerate.utils.compile_regions``, which returns a shallow copy of the model with blocks wrapped
in ``OptimizedModule``s (state-dict keys gain ``._orig_mod``; instance-bound forwards and hooks of
the copy can point at the original, so the uncompiled model runs). ``install()`` swaps the name
``compile_regions`` that ``accelerate.accelerator`` calls for ``compile_cache.compile_regions``,
with the same keyword arguments (``TorchDynamoPlugin.to_kwargs()``): the model is compiled in
place and ``prepare`` returns it. ``uninstall()`` puts accelerate's function back.

``install(fsdp2=True)`` also replaces ``compile_regions_fsdp2`` (the FSDP2 prepare path), which
accelerate already does in place; ours is in place as well, but that path is not tested here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from torch import nn

from ..api import compile_regions

logger = logging.getLogger("compile_cache")

__all__ = ["install", "installed", "uninstall"]

_LOCK = threading.Lock()
_SAVED: dict[str, Any] = {}


def _normalise(kwargs: dict[str, Any]) -> dict[str, Any]:
    """accelerate's DynamoBackend enum becomes the lower-case backend name torch.compile takes."""
    out = dict(kwargs)
    backend = out.get("backend")
    if backend is not None and not isinstance(backend, str) and hasattr(backend, "value"):
        out["backend"] = str(backend.value).lower()
    elif isinstance(backend, str) and type(backend) is not str:  # a str-valued enum member
        out["backend"] = str(getattr(backend, "value", backend)).lower()
    return out


def _accelerate_compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """accelerate's calling convention, compile_cache's compile: returns ``module`` itself."""
    return compile_regions(module, **_normalise(compile_kwargs))


def install(*, fsdp2: bool = False) -> None:
    """Route ``Accelerator.prepare``'s regional compilation to ``compile_cache.compile_regions``.

    Idempotent. Raises ImportError when accelerate is not installed.
    """
    import accelerate.accelerator as acc

    names = ["compile_regions"] + (["compile_regions_fsdp2"] if fsdp2 else [])
    with _LOCK:
        for name in names:
            current = getattr(acc, name)
            if current is _accelerate_compile_regions:
                continue
            _SAVED[name] = current
            setattr(acc, name, _accelerate_compile_regions)
            logger.info("compile_cache: accelerate.accelerator.%s now uses compile_cache", name)


def uninstall() -> None:
    """Restore accelerate's own functions (only where ours is still the one installed)."""
    import accelerate.accelerator as acc

    with _LOCK:
        for name, original in list(_SAVED.items()):
            if getattr(acc, name, None) is _accelerate_compile_regions:
                setattr(acc, name, original)
            del _SAVED[name]


def installed() -> bool:
    """Whether ``Accelerator.prepare`` currently uses compile_cache's regional compilation."""
    import accelerate.accelerator as acc

    return getattr(acc, "compile_regions", None) is _accelerate_compile_regions
