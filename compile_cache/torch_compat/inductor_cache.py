"""Torch's local cache directories: where Inductor (and Triton under it) keeps compiled code.

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

import dataclasses
import getpass
import logging
import os
import re
import stat
import sys
import tempfile

from . import available, capability

__all__ = ["KernelFile", "cache_dir", "member_name", "read_locked"]

_CACHE_DIR_MODULE = "torch._inductor.runtime.cache_dir_utils"
log = logging.getLogger("compile_cache")


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
