"""Where the store lives, and whether its directory is safe to load code from.

A pack holds pickles and shared libraries that torch loads and runs, so a store directory other
users can write into would let them run code in this process. :func:`check_dir` is the one
implementation of that rule: the store refuses such a directory (:func:`check_safe_dir` raises
:class:`~compile_cache.errors.UnsafeStoreError`), and ``doctor`` reports it
(:func:`describe_dir`), with the same verdict and the same fix.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .. import config
from ..errors import UnsafeStoreError

__all__ = ["DirSafety", "check_dir", "check_safe_dir", "describe_dir", "resolve_location"]


def resolve_location(path: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """Where the store lives and why: ``(directory, source)``.

    Precedence: the ``path`` argument, ``COMPILE_CACHE_DIR``, ``$XDG_CACHE_HOME/compile_cache``
    (only if absolute, per the XDG spec), ``~/.cache/compile_cache``. ``source`` is one of
    ``"argument"``, ``"COMPILE_CACHE_DIR"``, ``"XDG_CACHE_HOME"``, ``"default"``.
    """
    if path is not None:
        return Path(path).expanduser().absolute(), "argument"
    env = (config.DIR.value() or "").strip()
    if env:
        return Path(env).expanduser().absolute(), "COMPILE_CACHE_DIR"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "compile_cache", "XDG_CACHE_HOME"
    return Path.home() / ".cache" / "compile_cache", "default"


@dataclass(frozen=True)
class DirSafety:
    """Why a directory is unsafe: ``short`` for a listing, ``message`` with the fix."""

    short: str
    message: str


def check_dir(path: Path, group_mode: bool) -> DirSafety | None:
    """None if only this user (or, in group mode, this user's group) can write ``path``.

    An absent directory, or one this user cannot even search, is safe: nothing in it can be
    loaded here either.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, PermissionError):
        return None
    mode = stat.S_IMODE(st.st_mode)
    refuse = f"refusing to use compile cache directory {path}"
    fix = (
        f"Fix it with `chmod go-w {path}`, or, to share the cache with your group on purpose, "
        f"set COMPILE_CACHE_SHARED=group and `chmod o-w {path}`."
    )
    if mode & stat.S_IWOTH:
        return DirSafety(
            "world-writable",
            f"{refuse}: it is world-writable (mode {mode:04o}), so any user could plant "
            f"artifacts this process would load and run. {fix}",
        )
    our_groups = set(os.getgroups()) | {os.getegid()}
    if mode & stat.S_IWGRP:
        if not group_mode:
            return DirSafety(
                "group-writable without COMPILE_CACHE_SHARED=group",
                f"{refuse}: it is group-writable (mode {mode:04o}) but COMPILE_CACHE_SHARED=group "
                f"is not set. {fix}",
            )
        if st.st_gid not in our_groups:
            return DirSafety(
                f"writable by group {st.st_gid}, not one of this process's groups",
                f"{refuse}: it is writable by group {st.st_gid}, which is not one of this "
                f"process's groups. Fix it with `chgrp <your-group> {path}` or `chmod g-w {path}`.",
            )
    if st.st_uid not in (os.geteuid(), 0):
        shared_ok = group_mode and st.st_gid in our_groups
        if not shared_ok and os.access(path, os.W_OK):
            return DirSafety(
                f"owned by user {st.st_uid} and writable here",
                f"{refuse}: it belongs to user {st.st_uid} and is writable here. Use your own "
                f"directory (COMPILE_CACHE_DIR), or set COMPILE_CACHE_SHARED=group to share one "
                f"with your group on purpose.",
            )
    return None


def check_safe_dir(path: Path, group_mode: bool) -> None:
    """Raise :class:`UnsafeStoreError` if other users could write into ``path``."""
    problem = check_dir(path, group_mode)
    if problem is not None:
        raise UnsafeStoreError(problem.message)


def describe_dir(path: Path, group_mode: bool) -> tuple[str, bool]:
    """``(description, safe)`` of a store directory's mode and owner, for ``doctor``."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot stat: {exc.strerror or exc}", False
    mode = stat.S_IMODE(st.st_mode)
    owner = "you" if st.st_uid == os.geteuid() else f"uid {st.st_uid}"
    text = f"{mode:04o}, owner {owner}, group {st.st_gid}"
    problem = check_dir(path, group_mode)
    if problem is not None:
        return f"{text}: UNSAFE, {problem.short}", False
    if group_mode:
        setgid = "setgid" if mode & stat.S_ISGID else "no setgid bit (new files may get other groups)"
        return f"{text}: group-shared, {setgid}", True
    return f"{text}: private, safe", True
