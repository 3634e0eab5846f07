"""Torch's compile configs, in the portable form the environment key digests.

``configs.portable``: ``save_config_portable()`` of ``torch._inductor.config``,
``torch._functorch.config`` (AOTAutograd) and ``torch._dynamo.config``. Torch's own cache keys
hold these configs, so compile_cache's environment key does too: an artifact is restored only
where they are equal. Dynamo settings that only steer logging, debugging or where files go are
left out (some hold absolute paths, which would split the key per working directory).
"""

from __future__ import annotations

import importlib
from typing import Any

from . import available, capability

__all__ = ["portable_configs"]

_MODULES = {
    "inductor_config": "torch._inductor.config",
    "functorch_config": "torch._functorch.config",
    "dynamo_config": "torch._dynamo.config",
}
_DYNAMO_IGNORE_PREFIXES = (
    "_",
    "base_dir",
    "debug",
    "log",
    "repro",
    "verbose",
    "cprofile",
    "print_",
    "report_",
    "verify_correctness",
    "replay_record",
)


@capability(
    "configs.portable",
    needs="save_config_portable() of torch._inductor.config, torch._functorch.config and "
    "torch._dynamo.config",
    breaks="the environment key cannot tell torch's compile configs apart (artifacts of other "
    "configs are restored; torch's own keys then miss, so the start compiles)",
)
def _probe_portable() -> str | None:
    for module_name in _MODULES.values():
        module = importlib.import_module(module_name)
        if not callable(getattr(module, "save_config_portable", None)):
            return f"{module_name} has no save_config_portable()"
    return None


def _portable(module: Any) -> dict[str, Any]:
    try:
        return dict(module.save_config_portable(ignore_private_configs=False, readonly_values=True))
    except TypeError:  # torch 2.11 and earlier: no readonly_values; private configs still count
        return dict(module.save_config_portable(ignore_private_configs=False))


def portable_configs() -> dict[str, dict[str, Any] | None]:
    """``{"inductor_config": {...}, "functorch_config": {...}, "dynamo_config": {...}}``;
    each None where the capability is missing."""
    if not available("configs.portable"):
        return dict.fromkeys(_MODULES)
    out: dict[str, dict[str, Any] | None] = {}
    for field, module_name in _MODULES.items():
        data = _portable(importlib.import_module(module_name))
        if field == "dynamo_config":
            data = {k: v for k, v in data.items() if not k.startswith(_DYNAMO_IGNORE_PREFIXES)}
        out[field] = data
    return out
