"""Tensor facts: the layout codes the fingerprint encodes, and the signature of a graph's inputs.

``torch._mkldnn`` is a layout object torch may drop; it is looked up when the fingerprint's
reference backend first needs the table, never at ``import compile_cache``. A torch without it
has no tensor of that layout, so nothing is lost (no capability to report).
:func:`input_signature` names what a compiled graph is for (capture by use's *slot*).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

__all__ = ["OTHER_LAYOUT", "input_signature", "layout_codes"]

#: The code of a layout not in the table (the native backend uses the same numbers).
OTHER_LAYOUT = 255
_LAYOUT_NAMES = (
    ("strided", 0),
    ("sparse_coo", 1),
    ("sparse_csr", 2),
    ("sparse_csc", 3),
    ("sparse_bsr", 4),
    ("sparse_bsc", 5),
    ("_mkldnn", 6),
    ("jagged", 7),
)


def layout_codes() -> dict[Any, int]:
    """torch layout -> the code the fingerprint encodes (``csrc/fingerprint.cpp`` agrees)."""
    import torch

    return {
        getattr(torch, name): code for name, code in _LAYOUT_NAMES if hasattr(torch, name)
    }


def input_signature(values: Iterable[Any], *extra: object) -> str:
    """16 hex digits naming what a graph is for: its inputs' shapes, strides, dtypes, device
    types and ``requires_grad`` (never tensor values), primitive inputs, and ``extra`` (grad
    mode, forward or backward). Graphs of one code for other inputs get other signatures."""
    import torch

    parts: list[str] = [repr(e) for e in extra]
    for value in values:
        if isinstance(value, torch.Tensor):
            try:
                parts.append(f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}"
                             f"{value.device.type}{int(value.requires_grad)}")
            except Exception:  # sparse, nested: no strides
                parts.append(f"T?{value.dtype}{value.device.type}")
        elif isinstance(value, (bool, int, float, str, type(None))):
            parts.append(repr(value))
        else:
            parts.append(type(value).__qualname__ + ":" + str(value)[:40])
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
