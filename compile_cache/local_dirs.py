"""Whether torch's local cache dirs may be trusted, and a private one where they may not.

Torch loads and runs what its local dirs hold (``pickle.loads``, ``dlopen``), and creates its
default one, ``/tmp/torchinductor_<user>``, with no owner or mode check: another user who made
it first, owns it, can write it, or points it somewhere by symlink, runs code in our job. Every
``compile_regions`` checks, once per process (:func:`secure_local_dirs`), the Inductor dir, torch's
default dir (Inductor's precompiled headers stay there whatever ``TORCHINDUCTOR_CACHE_DIR``
says) and Triton's dir, with the store's own rule (:mod:`compile_cache.store.safety`); one that
fails gets a warning and is replaced by a private directory (0700) of ours, unless
``COMPILE_CACHE_TRUST_LOCAL_DIRS=1``. ``doctor`` shows the same verdicts (:func:`check_local_dirs`).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import Any

from .torch_compat import inductor_cache

__all__ = ["LocalDir", "UnsafeLocalDirWarning", "check_local_dirs", "secure_local_dirs"]


class UnsafeLocalDirWarning(UserWarning):
    """A local Inductor/Triton dir another user owns or can write: a private one is used instead."""


@dataclasses.dataclass(frozen=True)
class LocalDir:
    """One local dir torch loads compiled code from, and the verdict of the trust check."""

    label: str  # "inductor", "triton", "headers" (torch's default dir: precompiled headers)
    path: Path
    problem: str | None  # why it cannot be trusted (None: it can)
    replaced_by: Path | None = None  # the private dir used instead


def check_local_dirs() -> list[LocalDir]:
    """The trust verdict of every local dir torch would load compiled code from (no changes).

    The Inductor dir (``TORCHINDUCTOR_CACHE_DIR``, else torch's ``<tmp>/torchinductor_<user>``),
    torch's default dir when it differs (Inductor's precompiled headers live there whatever the
    variable says) and Triton's dir (``TRITON_CACHE_DIR``, else ``~/.triton``). Each must be
    this user's own and writable by nobody else, symlinks included (:mod:`compile_cache.store.safety`).
    """
    from .store.safety import check_private_dir

    dirs = inductor_cache.local_dirs()
    candidates = [("inductor", dirs.inductor)]
    default = dirs.headers
    if os.path.abspath(default) != os.path.abspath(dirs.inductor):
        candidates.append(("headers", default))
    candidates.append(("triton", dirs.triton_home))
    out = []
    for label, path in candidates:
        problem = check_private_dir(path) or _parent_problem(path)
        out.append(LocalDir(label, path, problem.message if problem else None))
    return out


def _parent_problem(path: Path) -> Any:
    """A dir whose parent another user owns or can write (unless sticky, like /tmp) can be
    renamed away and replaced by theirs between our check and torch's use."""
    from .store.safety import DirSafety, trust_problem

    parent = Path(os.path.realpath(path)).parent
    try:
        st = os.stat(parent)
    except OSError:
        return None
    if st.st_mode & stat.S_ISVTX:
        return None
    problem = trust_problem(st, parent, False, private=True)
    if problem is None:
        return None
    return DirSafety(
        f"its directory {parent} is {problem.short}",
        f"refusing to use {path}: whoever owns or can write its directory {parent} could rename it "
        f"and put their own in its place ({problem.short})",
    )


_local_dirs_checked: dict[str, list[LocalDir]] = {}


def secure_local_dirs() -> list[LocalDir]:
    """Check the local dirs (:func:`check_local_dirs`) once per process and setting; each one that
    cannot be trusted gets a warning and is replaced by a private directory of ours (0700):
    ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` point there, and Inductor's precompiled
    headers move there. ``COMPILE_CACHE_TRUST_LOCAL_DIRS=1`` turns this off (no check).
    Returns the verdicts (with ``replaced_by`` where a private dir is used).
    """
    from . import _warnings, config

    if config.TRUST_LOCAL_DIRS.value():
        return []
    state = "|".join(os.environ.get(v, "") for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HOME"))
    if state in _local_dirs_checked:
        return _local_dirs_checked[state]
    dirs = inductor_cache.local_dirs()
    _create_private_if_absent(dirs.inductor)
    _create_private_if_absent(dirs.headers)
    verdicts = []
    for found in check_local_dirs():
        if found.problem is None:
            verdicts.append(found)
            continue
        private = _private_dir(found.label)
        if found.label == "inductor":
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private)
        elif found.label == "triton":
            os.environ["TRITON_CACHE_DIR"] = str(private)
        elif not inductor_cache.redirect_header_dir(str(private)):
            private = None  # the capability is missing: it warned on its own
        verdicts.append(dataclasses.replace(found, replaced_by=private))
        instead = (f"using the private directory {private} instead" if private
                   else "torch will still use it")
        _warnings.warn(
            f"compile_cache: torch's local {found.label} dir is not safe: {found.problem}. "
            f"{instead.capitalize()}; point "
            f"{'TRITON_CACHE_DIR' if found.label == 'triton' else 'TORCHINDUCTOR_CACHE_DIR'} at a "
            "directory of your own to keep a warm local cache, or set "
            "COMPILE_CACHE_TRUST_LOCAL_DIRS=1 to use it anyway.",
            UnsafeLocalDirWarning,
        )
    default = os.path.abspath(dirs.headers)
    if any(v.replaced_by and v.label != "headers" and os.path.abspath(v.path) == default for v in verdicts):
        # torch's default dir was the Inductor dir: its precompiled headers move with it.
        inductor_cache.redirect_header_dir(str(_private_dir("precompiled_headers")))
    new_state = "|".join(os.environ.get(v, "") for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HOME"))
    _local_dirs_checked[state] = _local_dirs_checked[new_state] = verdicts
    return verdicts


def _create_private_if_absent(path: Path) -> None:
    """Create a missing local dir ourselves, 0700, so nobody can create it first between our check
    and torch's ``makedirs`` (the classic race on ``/tmp/torchinductor_<user>``)."""
    if os.path.lexists(path):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except OSError:
        pass


def _private_dir(label: str) -> Path:
    """A directory of ours (0700) for ``label``, stable across this user's processes on this host
    when the home directory can be trusted, else a fresh ``mkdtemp``."""
    import tempfile

    from ._paths import HOSTNAME
    from .store.safety import check_private_dir

    base = Path.home() / ".cache" / "compile_cache-local" / HOSTNAME
    try:
        for directory in (base.parent.parent, base.parent, base):
            if not directory.is_dir():
                os.mkdir(directory, 0o700)
        os.chmod(base, 0o700)
        if any(check_private_dir(d) for d in (Path.home(), base.parent.parent, base.parent, base)):
            raise OSError("home directory not private")
        target = base / label
        if not target.is_dir():
            os.mkdir(target, 0o700)
        if check_private_dir(target) is None and not target.is_symlink():
            return target
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix=f"compile_cache-{label}-"))


def _reset() -> None:
    """Forget the local dirs' check (tests)."""
    _local_dirs_checked.clear()
