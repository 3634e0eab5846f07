"""``nn.Module``'s call slots that compile_cache installs into (torch's private attributes).

``nn.Module.compile()`` puts its compiled function in ``module._compiled_call_impl``, which
``Module.__call__`` runs instead of ``_call_impl`` (hooks and ``forward``) when set. The region
runner (:mod:`compile_cache.regions`) is installed there, so the model is compiled in place:
class, ``state_dict()`` keys, parameters and hooks stay. These helpers are the only code that
reads or writes that slot by name.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compiled_call", "eager_call", "set_compiled_call"]

_SLOT = "_compiled_call_impl"


def compiled_call(module: Any) -> Any:
    """What ``module.compile()`` (or compile_cache) installed as the module's call, or None."""
    return module.__dict__.get(_SLOT)


def set_compiled_call(module: Any, call: Any) -> None:
    """Installs ``call`` as the module's compiled call (None: back to the eager ``_call_impl``)."""
    setattr(module, _SLOT, call)


def eager_call(module: Any, *args: Any, **kwargs: Any) -> Any:
    """The module's eager call: its hooks and ``forward``, as without a compiled call."""
    return module._call_impl(*args, **kwargs)
