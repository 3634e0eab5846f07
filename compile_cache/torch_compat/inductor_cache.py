"""Torch's local cache directories: where Inductor (and Triton under it) keeps compiled code.

``inductor.cache_dir``: ``torch._inductor.runtime.cache_dir_utils.cache_dir`` (torch's own
resolution, when that module is loaded) and ``torch._environment.is_fbcode``. ``import
torch._inductor`` costs about a second in a cold process and restore runs before torch pays it,
so while the module is not loaded, torch's rule (torch 2.8 to 2.13) is replicated here:
``TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>`` (``/var/tmp`` in fbcode), made
absolute. Without the capability the replicated rule is used throughout.
"""

from __future__ import annotations

import getpass
import os
import re
import sys
import tempfile

from . import available, capability

__all__ = ["cache_dir"]

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
