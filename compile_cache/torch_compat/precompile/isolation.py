"""Compiling a region with Dynamo's process-wide ``caching_precompile`` off.

When the user turned precompile on for the whole process (``TORCH_CACHING_PRECOMPILE=1``),
Dynamo drops identity guards of every compile it makes; compile_cache's regions that do not use
its own precompile must keep every guard, so they compile and run with the flag off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["IsolatedCall", "compile_group_isolated", "compile_isolated"]


class IsolatedCall:
    """Calls a compiled function with ``caching_precompile`` off while the process has it on:
    Dynamo's forced drop of identity guards must not reach compile_cache's regions."""

    __slots__ = ("compiled",)

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch._dynamo.config as dynamo_config

        if not dynamo_config.caching_precompile:
            return self.compiled(*args, **kwargs)
        dynamo_config.caching_precompile = False
        try:
            return self.compiled(*args, **kwargs)
        finally:
            dynamo_config.caching_precompile = True


def compile_isolated(fn: Callable[..., Any], **compile_kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(fn, ...)`` with ``caching_precompile`` off at compile and at every trace."""
    import torch
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(caching_precompile=False):
        return IsolatedCall(torch.compile(fn, **compile_kwargs))


def compile_group_isolated(fn: Callable[..., Any], key: Any,
                           **compile_kwargs: Any) -> tuple[Any, int] | None:
    """:func:`.dynamo.compile_group` with ``caching_precompile`` off at compile and at every call."""
    import torch._dynamo.config as dynamo_config

    from .. import dynamo

    with dynamo_config.patch(caching_precompile=False):
        group = dynamo.compile_group(fn, key, **compile_kwargs)
    return None if group is None else (IsolatedCall(group[0]), group[1])
