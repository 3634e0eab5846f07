"""compile_cache._warnings: a warning points at the user's line and is not logged as well."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest

from compile_cache import _warnings
from compile_cache.store import Store, StoreWarning


def test_a_store_warning_points_at_the_callers_line_and_is_not_logged(
    tmp_path, caplog, fresh_state
) -> None:
    caplog.set_level(logging.DEBUG, logger="compile_cache")
    store = Store(tmp_path / "s", read_only=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        store.publish("ab" * 16, {"inductor/x": b"1"})  # warns from deep inside the store
    (warning,) = [w for w in record if issubclass(w.category, StoreWarning)]
    assert warning.filename == __file__ and warning.lineno == line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # shown once, not twice


def _function_in(directory: str, name: str, body: str, namespace: dict) -> object:
    """A function whose code claims to live in ``directory`` (as a module of that package)."""
    code = compile(f"def {name}():\n    {body}\n", os.path.join(directory, f"{name}.py"), "exec")
    exec(code, namespace)
    return namespace[name]


def test_frames_of_compile_cache_and_torch_are_skipped() -> None:
    import torch

    namespace: dict = {"warn": _warnings.warn}
    package_dir = os.path.dirname(_warnings.__file__)
    torch_dir = os.path.dirname(torch.__file__)
    _function_in(package_dir, "deep_inside", "warn('from deep inside', RuntimeWarning)", namespace)
    through_torch = _function_in(torch_dir, "torch_calls_back", "deep_inside()", namespace)
    with pytest.warns(RuntimeWarning) as record:
        line = sys._getframe().f_lineno + 1
        through_torch()  # user code -> torch -> compile_cache -> warn
    assert record[0].filename == __file__ and record[0].lineno == line
