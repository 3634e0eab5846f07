"""CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``, ``options["triton.cudagraphs"]``)
with precompile and with regional compilation.

**Precompile.** Torch 2.13's precompile load (``deserialize_bundled_cache_entry`` in
``torch/_functorch/_aot_autograd/aot_autograd_result.py``) wraps the loaded graphs with
``BoxedBool(torch._inductor.config.triton.cudagraphs)``, the *global* setting, not the mode's
options (torch's own TODO there): a ``reduce-overhead`` group whose entry loads would run
without CUDA graphs, silently. Patching the global config around the load would also need the
load's ``cudagraph_post_compile`` to work from the empty example inputs it is given, which was
not run on a GPU here; so :func:`precompile_decline` says when a group must compile without
precompile instead (the mode wants CUDA graphs, the group's tensors are not CPU-only, and the
global setting differs): the session warns (``RegionPrecompileWarning``) and counts it as a
precompile decline; Dynamo traces the group at each start, Inductor's graphs still come from the
store, and CUDA graphs are kept.

**Regional compilation.** In cudagraph trees, a tensor one compiled function returns lives in
the tree's memory pool and is overwritten by a later replay; fed to the next compiled region it
fails or is silently reused (torch #152887, #160281). :func:`detach_outputs` is the arrangement
compile_cache uses: each region's CUDA tensor outputs leave the region as copies (and the
gradients flowing back into it as copies too), so no region ever holds another's pool memory.
It costs one copy of each region's outputs per call (a transformer block: its hidden state),
never raises, and needs no ``cudagraph_mark_step_begin`` from the user.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from . import available, capability

__all__ = ["DECLINE_PREFIX", "detach_outputs", "is_decline", "precompile_decline", "wants_cudagraphs"]

log = logging.getLogger("compile_cache")

#: Every precompile decline for CUDA graphs starts with this (the session recognizes it).
DECLINE_PREFIX = "CUDA graphs"


@capability(
    "cudagraphs.modes",
    needs="torch._inductor.list_mode_options, torch._inductor.config.triton.cudagraphs",
    breaks="a group whose mode may use CUDA graphs compiles without precompile (CUDA graphs kept)",
)
def _probe() -> str | None:
    import torch._inductor
    import torch._inductor.config as inductor_config

    if not callable(getattr(torch._inductor, "list_mode_options", None)):
        return "torch._inductor has no list_mode_options"
    if not hasattr(inductor_config.triton, "cudagraphs"):
        return "torch._inductor.config.triton has no cudagraphs"
    return None


def _global_setting() -> bool:
    import torch._inductor.config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


def wants_cudagraphs(compile_kwargs: dict[str, Any]) -> bool | None:
    """Whether a normal compile with these ``torch.compile`` keywords uses CUDA graphs: the
    ``options``' ``triton.cudagraphs``, else the mode's (torch's own mode table), else torch's
    global setting; None when unknown (capability missing, or a mode torch does not know)."""
    if compile_kwargs.get("backend", "inductor") not in (None, "inductor"):
        return False
    options = compile_kwargs.get("options") or {}
    if "triton.cudagraphs" in options:
        return bool(options["triton.cudagraphs"])
    if isinstance(options.get("triton"), dict) and "cudagraphs" in options["triton"]:
        return bool(options["triton"]["cudagraphs"])
    if not available("cudagraphs.modes"):
        return None
    mode = compile_kwargs.get("mode")
    if mode not in (None, "default"):
        import torch._inductor

        try:
            table = torch._inductor.list_mode_options(mode, compile_kwargs.get("dynamic"))
        except Exception:
            return None
        if "triton.cudagraphs" in table:
            return bool(table["triton.cudagraphs"])
    return _global_setting()


def _cpu_only(devices: Iterable[str] | None) -> bool:
    found = set(devices or ())
    return bool(found) and found <= {"cpu", "meta"}


def precompile_decline(compile_kwargs: dict[str, Any], devices: Iterable[str] | None) -> str | None:
    """Why a group compiled with these keywords must not load a precompile entry (None: it may).

    Torch's precompile load reads the global ``torch._inductor.config.triton.cudagraphs``: when
    a normal compile with these keywords would decide otherwise (the mode's or the options'
    setting), a loaded entry would run with CUDA graphs dropped, or added. A group whose
    parameters and buffers are all on the CPU (or meta) never gets CUDA graphs, so it keeps
    precompile; ``devices`` unknown counts as a GPU group.
    """
    if _cpu_only(devices):
        return None
    wanted = wants_cudagraphs(compile_kwargs)
    if wanted is None:
        return (f"{DECLINE_PREFIX} may be on for mode={compile_kwargs.get('mode')!r} and torch's "
                f"mode table could not be read: compiled without precompile to keep the mode's "
                f"setting")
    current = _global_setting()
    if current == wanted:
        return None
    return (f"{DECLINE_PREFIX} are {'on' if wanted else 'off'} for "
            f"mode={compile_kwargs.get('mode') or 'default'!r} but torch's precompile load reads "
            f"the global torch._inductor.config.triton.cudagraphs ({current}), not the mode's "
            f"options: compiled without precompile to keep the mode's setting")


def is_decline(reason: str | None) -> bool:
    """True for a reason :func:`precompile_decline` gave."""
    return bool(reason) and str(reason).startswith(DECLINE_PREFIX)


_Copy: Any = None


def _copy_function() -> Any:
    """An autograd function that copies a tensor forward and its gradient backward."""
    global _Copy
    if _Copy is None:
        import torch

        class CopyOut(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, tensor: Any) -> Any:
                return tensor.clone()

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                return None if grad is None else grad.clone()

        _Copy = CopyOut
    return _Copy


def detach_outputs(out: Any) -> Any:
    """``out`` with every CUDA tensor in it (tuples, lists, dicts, dataclass-like
    ``ModelOutput``\\s left as they are but their tensors replaced) copied out of the cudagraph
    pool; anything else is returned as is. Never raises: on an error the output is returned
    unchanged (logged), as torch would have returned it."""
    try:
        return _detach(out, _copy_function())
    except Exception as exc:  # never fail a forward over this
        log.debug("compile_cache: region outputs not copied: %s", exc)
        return out


def _detach(value: Any, copy: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if value.device.type != "cuda":
            return value
        return copy.apply(value) if value.requires_grad else value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_detach(v, copy) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v, copy) for v in value)
    if isinstance(value, dict):
        copied = {k: _detach(v, copy) for k, v in value.items()}
        if type(value) is dict:
            return copied
        for k, v in copied.items():  # ModelOutput and other dict subclasses: in place
            value[k] = v
        return value
    return value
