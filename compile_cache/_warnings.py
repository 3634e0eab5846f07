"""One way to warn: the warning points at the user's line and is not also logged.

``warnings.warn(..., stacklevel=N)`` needs the caller to know how deep it sits, and compile_cache
warns from deep inside torch's call stack (a forward hook, Dynamo's frame evaluation, a store
method called by the session). :func:`warn` walks the stack instead, to the first frame outside
compile_cache and outside torch, so the warning names the line of the user's code that led to
it (Python 3.11 has no ``skip_file_prefixes``). A warning is shown, never logged as well: the
house rule is one or the other, so nothing shows twice.
"""

from __future__ import annotations

import os
import sys
import warnings

from .redact import shown

__all__ = ["warn"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _internal_prefixes() -> tuple[str, ...]:
    prefixes = [_PACKAGE_DIR]
    torch = sys.modules.get("torch")  # never imported here: only skipped if already loaded
    torch_file = getattr(torch, "__file__", None)
    if torch_file:
        prefixes.append(os.path.dirname(os.path.abspath(torch_file)) + os.sep)
    generated = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # Inductor's generated wrapper modules
    if generated:
        prefixes.append(os.path.abspath(generated) + os.sep)
    return tuple(prefixes)


def _is_internal(filename: str, prefixes: tuple[str, ...]) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string> run by torch
        return True
    return os.path.abspath(filename).startswith(prefixes)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the *caller* point at user code."""
    prefixes = _internal_prefixes()
    frame = sys._getframe(2)  # frame i here is stacklevel i for the caller's warnings.warn
    level = 2
    last_level = level
    while frame is not None:
        if not _is_internal(frame.f_code.co_filename, prefixes):
            return level
        last_level = level
        frame = frame.f_back
        level += 1
    return last_level  # nothing but compile_cache and torch (a background thread): the outermost


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame of user code, with
    every credential redacted and every control character but newline and tab escaped
    (:func:`~compile_cache.redact.shown`: a store's text may hold terminal escapes)."""
    warnings.warn(shown(message), category, stacklevel=user_stacklevel())
