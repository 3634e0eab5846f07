"""Torch's local cache directories, and loading what is cached there.

Where Inductor (and Triton under it) keeps compiled code, and its precompiled headers
(:func:`local_dirs`, the one place that knows); and the one hook around torch's load of a cached FX graph, so that an entry whose files torch cannot load
is a miss that compiles, never a crash.

Also the two facts a capture needs about files in them: the pack member name of a path
(:func:`member_name`) and a compiled library's bytes read under torch's own lock for it
(:func:`read_locked`, ``codecache.get_lock_dir`` and ``torch.utils._filelock``; part of the
``cache_use.capture`` capability).

``inductor.cache_dir``: ``torch._inductor.runtime.cache_dir_utils.cache_dir`` (torch's own
resolution, when that module is loaded) and ``torch._environment.is_fbcode``. ``import
torch._inductor`` costs about a second in a cold process and restore runs before torch pays it,
so while the module is not loaded, torch's rule (torch 2.8 to 2.13) is replicated here:
``TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>`` (``/var/tmp`` in fbcode), made
absolute. Without the capability the replicated rule is used throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import logging
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import available, capability

__all__ = [
    "LOAD_ERRORS",
    "KernelFile",
    "LocalDirs",
    "cache_dir",
    "guard_cache_loads",
    "local_dirs",
    "member_name",
    "preload",
    "read_locked",
    "redirect_header_dir",
]

log = logging.getLogger("compile_cache")

_CACHE_DIR_MODULE = "torch._inductor.runtime.cache_dir_utils"


@capability(
    "inductor.cache_dir",
    needs=f"{_CACHE_DIR_MODULE}.cache_dir",
    breaks="packs are restored to and captured from compile_cache's copy of torch's rule "
    "(TORCHINDUCTOR_CACHE_DIR, else <tmp>/torchinductor_<user>)",
)
def _probe_cache_dir() -> str | None:
    import importlib

    module = importlib.import_module(_CACHE_DIR_MODULE)
    if not callable(getattr(module, "cache_dir", None)):
        return f"{_CACHE_DIR_MODULE} has no cache_dir()"
    return None


def _is_fbcode() -> bool:
    try:
        from torch._environment import is_fbcode
    except ImportError:
        return False
    return bool(is_fbcode())


def _replicated_rule() -> str:
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env is None:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            getuid = getattr(os, "getuid", None)
            user = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
        user = re.sub(r'[\\/:*?"<>|]', "_", user)
        base = "/var/tmp" if _is_fbcode() else tempfile.gettempdir()
        env = os.path.join(base, "torchinductor_" + user)
    return os.path.abspath(env)


def cache_dir() -> str:
    """Torch's Inductor cache dir, without importing ``torch._inductor`` when it is not loaded."""
    if sys.modules.get(_CACHE_DIR_MODULE) is not None and available("inductor.cache_dir"):
        return str(sys.modules[_CACHE_DIR_MODULE].cache_dir())
    return _replicated_rule()


def member_name(path: str) -> str | None:
    """``inductor/<path relative to torch's cache dir>`` (real paths), or None outside it."""
    root = os.path.realpath(cache_dir())
    real = os.path.realpath(path)
    if real == root or os.path.commonpath([root, real]) != root:
        return None
    return "inductor/" + os.path.relpath(real, root).replace(os.sep, "/")


@dataclasses.dataclass
class KernelFile:
    """A compiled library torch loaded: its path, torch's key for it (its lock name), stat."""

    path: str
    key: str
    size: int
    mtime_ns: int


def read_locked(kernel: KernelFile, timeout: float = 30.0) -> bytes | None:
    """The library's bytes, read under torch's own lock for its key (which torch holds while it
    links the file in place), or None when it is gone, not a regular file, or locked too long."""
    from torch._inductor.codecache import get_lock_dir
    from torch.utils._filelock import FileLock

    try:
        with FileLock(os.path.join(get_lock_dir(), kernel.key + ".lock"), timeout=timeout):
            st = os.lstat(kernel.path)
            if not stat.S_ISREG(st.st_mode):
                return None
            with open(kernel.path, "rb") as f:
                return f.read()
    except Exception as exc:
        log.debug("compile_cache: cannot read %s: %s", kernel.path, exc)
        return None


@dataclasses.dataclass(frozen=True)
class LocalDirs:
    """Where torch and Triton keep compiled code on this node (absolute paths).

    ``inductor``: Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>``).
    ``triton``: where Inductor's Triton kernels go (``TRITON_CACHE_DIR``, else
    ``<inductor>/triton``, where Inductor points Triton: then nested, captured as ``inductor/``).
    """

    inductor: Path
    triton: Path

    @property
    def headers(self) -> Path:
        """Torch's default Inductor dir (``<tmp>/torchinductor_<user>``), whatever
        ``TORCHINDUCTOR_CACHE_DIR`` says: Inductor keeps its precompiled headers there."""
        saved = os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        try:
            return Path(_replicated_rule())
        finally:
            if saved is not None:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved

    @property
    def triton_home(self) -> Path:
        """Triton's own dir for everything not compiled by Inductor: ``TRITON_CACHE_DIR``, else
        ``~/.triton`` (its ``cache`` inside)."""
        env = os.environ.get("TRITON_CACHE_DIR")
        return Path(os.path.abspath(env)) if env else Path.home() / ".triton"


def local_dirs(*, from_torch: bool = False) -> LocalDirs:
    """Where torch's and Triton's local caches are now: the one function that knows.

    ``from_torch``: the Inductor dir as torch resolves it when ``torch._inductor`` is loaded
    (:func:`cache_dir`, which also creates it: where a compile writes); by default torch's rule,
    creating nothing (what the local-dir check looks at before torch does).
    """
    inductor = Path(cache_dir() if from_torch else _replicated_rule())
    triton_env = os.environ.get("TRITON_CACHE_DIR")
    return LocalDirs(inductor, Path(os.path.abspath(triton_env)) if triton_env else inductor / "triton")


# -- where Inductor keeps its precompiled headers ----------------------------------------------------
_CODECACHE = "torch._inductor.codecache"


@capability(
    "inductor.header_dir",
    needs=f"{_CODECACHE}._HEADER_DIR and _HEADER_LOCK_DIR",
    breaks="when torch's default dir (<tmp>/torchinductor_<user>) is not safe, its precompiled "
    "headers cannot be moved to a private directory (the other local dirs still are)",
)
def _probe_header_dir() -> str | None:
    import importlib

    module = importlib.import_module(_CODECACHE)
    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):
        if not isinstance(getattr(module, name, None), str):
            return f"{_CODECACHE} has no string {name}"
    return None


def redirect_header_dir(directory: str) -> bool:
    """Make Inductor build and read its precompiled headers under ``directory``; whether it could.

    Torch keeps them in its default dir, computed once at import and not moved by
    ``TORCHINDUCTOR_CACHE_DIR``; a header built by another user would be compiled into every
    kernel of this process.
    """
    if not available("inductor.header_dir"):
        return False
    import importlib

    module = importlib.import_module(_CODECACHE)
    module._HEADER_DIR = directory
    module._HEADER_LOCK_DIR = os.path.join(directory, "locks")
    return True


# -- a restored entry torch cannot load is a miss, not a crash ---------------------------------------
@capability(
    "inductor.load_guard",
    needs=f"{_CODECACHE}.FxGraphCache.cache_hit_post_compile and CppCodeCache.load_async",
    breaks="a restored library that torch cannot load (one dlopen refuses) raises in the job "
    "instead of being built again (restore still refuses incomplete libraries)",
)
def _probe_load_guard() -> str | None:
    import importlib

    module = importlib.import_module(_CODECACHE)
    cache = getattr(module, "FxGraphCache", None)
    if not callable(getattr(cache, "cache_hit_post_compile", None)):
        return f"{_CODECACHE}.FxGraphCache has no cache_hit_post_compile"
    if not callable(getattr(getattr(module, "CppCodeCache", None), "load_async", None)):
        return f"{_CODECACHE}.CppCodeCache has no load_async"
    return None


#: What a cached entry whose files are broken raises while torch loads it: dlopen/import of a
#: library (ImportError, OSError), a build torch attempts for it (CppCompileError, a
#: RuntimeError), an unpickling error.
LOAD_ERRORS: tuple[type[BaseException], ...] = (ImportError, OSError, EOFError, RuntimeError, ValueError)
_GUARD_MARK = "__compile_cache_load_guard__"
_load_handlers: list[Callable[[BaseException], bool]] = []


def _handled(exc: BaseException) -> bool:
    return any(handle(exc) for handle in list(_load_handlers))


def preload() -> None:
    """Import torch's code cache module now (quietly: :func:`guard_cache_loads` says whether it
    works): a restore from object storage overlaps its downloads with this import, which a
    restore's load guard and a compile both need."""
    import importlib

    with contextlib.suppress(Exception):
        importlib.import_module(_CODECACHE)


def guard_cache_loads(handler: Callable[[BaseException], bool]) -> bool:
    """Call ``handler(exc)`` when torch fails to load compiled code from its local cache; when it
    returns True (it removed the broken files the error names), torch goes on as if they had
    never been there. Two points, installed once per process:

    * ``CppCodeCache.load_async``: loading a C++ library (a cache hit's kernel, or a fresh
      compile whose library a restore already put in place) retries once, and torch builds the
      removed library;
    * ``FxGraphCache.cache_hit_post_compile``: a cached graph that fails to load otherwise is a
      miss, and torch compiles it.

    Returns whether the hooks are in place.
    """
    if not available("inductor.load_guard"):
        return False
    import importlib
    import pickle

    module = importlib.import_module(_CODECACHE)
    if handler not in _load_handlers:
        _load_handlers.append(handler)
    errors = (*LOAD_ERRORS, pickle.UnpicklingError)

    fx = module.FxGraphCache
    current = fx.__dict__.get("cache_hit_post_compile")
    original_hit = getattr(current, "__func__", current)
    if not getattr(original_hit, _GUARD_MARK, False):

        def cache_hit_post_compile(graph: Any, cache_info: Any, constants: Any) -> Any:
            try:
                return original_hit(graph, cache_info, constants)
            except errors as exc:
                if _handled(exc):
                    log.info("compile_cache: a cached graph did not load (%s); compiling it", exc)
                    return None, cache_info
                raise

        setattr(cache_hit_post_compile, _GUARD_MARK, True)
        cache_hit_post_compile.__wrapped__ = original_hit  # type: ignore[attr-defined]
        fx.cache_hit_post_compile = staticmethod(cache_hit_post_compile)

    cpp = module.CppCodeCache
    current = cpp.__dict__.get("load_async")
    original_load = getattr(current, "__func__", current)
    if not getattr(original_load, _GUARD_MARK, False):

        def load_async(cls: Any, *args: Any, **kwargs: Any) -> Any:
            load = original_load(cls, *args, **kwargs)

            def guarded_load() -> Any:
                try:
                    return load()
                except errors as exc:
                    if _handled(exc):  # the library is gone now: torch builds it
                        log.info("compile_cache: a cached library did not load (%s); building it", exc)
                        return load()
                    raise

            return guarded_load

        setattr(load_async, _GUARD_MARK, True)
        load_async.__wrapped__ = original_load  # type: ignore[attr-defined]
        cpp.load_async = classmethod(load_async)
    return True
