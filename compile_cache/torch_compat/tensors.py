"""Tensor facts the fingerprint encodes that torch names privately: the layout codes.

``torch._mkldnn`` is a layout object torch may drop; it is looked up when the fingerprint's
reference backend first needs the table, never at ``import compile_cache``. A torch without it
has no tensor of that layout, so nothing is lost (no capability to report).
"""

from __future__ import annotations

from typing import Any

__all__ = ["OTHER_LAYOUT", "layout_codes"]

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
