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

accelerate reaches ``compile_regions`` only when the plugin's backend is not ``"no"``, and
``"no"`` is ``TorchDynamoPlugin``'s default (``ACCELERATE_DYNAMO_BACKEND`` unset): with
``TorchDynamoPlugin(use_regional_compilation=True)`` alone nothing is compiled, and nothing of
compile_cache runs to say so. While installed, ``Accelerator.prepare`` and ``prepare_model``
check for that and warn once (pass ``backend="inductor"``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from torch import nn

from .. import _warnings
from ..api import compile_regions

logger = logging.getLogger("compile_cache")

__all__ = ["install", "installed", "uninstall"]

_LOCK = threading.Lock()
_SAVED: dict[str, Any] = {}
_PREPARE_METHODS = ("prepare", "prepare_model")
_warned_no_backend = False


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


def _warn_if_nothing_compiles(accelerator: Any) -> None:
    """Warn once per process when regional compilation is asked for with backend "no"."""
    global _warned_no_backend
    plugin = getattr(getattr(accelerator, "state", None), "dynamo_plugin", None)
    if _warned_no_backend or not getattr(plugin, "use_regional_compilation", False):
        return
    backend = getattr(plugin, "backend", None)
    if str(getattr(backend, "value", backend)).lower() != "no":
        return
    _warned_no_backend = True
    _warnings.warn(
        "compile_cache: TorchDynamoPlugin(use_regional_compilation=True) has backend 'no' (its "
        "default when ACCELERATE_DYNAMO_BACKEND is unset), so accelerate compiles nothing and "
        "never calls compile_cache: the model runs eagerly, and last_report() and region_stats() "
        "stay empty. Pass TorchDynamoPlugin(backend='inductor', use_regional_compilation=True) "
        "or set ACCELERATE_DYNAMO_BACKEND=inductor."
    )


#: Marks the wrappers this module put on ``Accelerator`` (read back to unwrap them).
_MARK = "_compile_cache_checked"


def _checked(method: Any) -> Any:
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        _warn_if_nothing_compiles(self)
        return method(self, *args, **kwargs)

    prepare.__wrapped__ = method  # type: ignore[attr-defined]
    prepare.__name__, prepare.__doc__ = method.__name__, method.__doc__
    setattr(prepare, _MARK, True)
    return prepare


def install(*, fsdp2: bool = False) -> None:
    """Route ``Accelerator.prepare``'s regional compilation to ``compile_cache.compile_regions``,
    and warn once when the plugin's backend "no" means nothing would be compiled.

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
        for name in _PREPARE_METHODS:
            current = getattr(acc.Accelerator, name)
            if not getattr(current, _MARK, False):
                _SAVED[f"Accelerator.{name}"] = current
                setattr(acc.Accelerator, name, _checked(current))


def uninstall() -> None:
    """Restore accelerate's own functions (only where ours is still the one installed)."""
    import accelerate.accelerator as acc

    with _LOCK:
        for name, original in list(_SAVED.items()):
            if name.startswith("Accelerator."):
                method = name.split(".", 1)[1]
                if getattr(getattr(acc.Accelerator, method), _MARK, False):
                    setattr(acc.Accelerator, method, original)
            elif getattr(acc, name, None) is _accelerate_compile_regions:
                setattr(acc, name, original)
            del _SAVED[name]


def _reset() -> None:
    """Forget that the backend-"no" warning was shown (tests)."""
    global _warned_no_backend
    _warned_no_backend = False


def installed() -> bool:
    """Whether ``Accelerator.prepare`` currently uses compile_cache's regional compilation."""
    import accelerate.accelerator as acc

    return getattr(acc, "compile_regions", None) is _accelerate_compile_regions
