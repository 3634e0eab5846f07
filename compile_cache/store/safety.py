"""Where the store lives, and whether a directory is safe to load code from.

A pack holds pickles and shared libraries that torch loads and runs, so whoever owns or can write
a directory we load from can run code in this process. One rule, :func:`trust_problem`, decides
for every directory and file we follow, from the store root down (symlinks resolved), and for
torch's local Inductor and Triton dirs:

* it belongs to this user (or root, who can act as this user anyway), or, in group mode
  (``COMPILE_CACHE_SHARED=group``), to a group this user is in, with the mode a group-shared
  store has (directories setgid and group-writable: 2775);
* nobody else can write it: not world-writable, and group-writable only in group mode by one of
  this user's groups (for torch's local dirs: by the owner's own user-private group);
* a symlink on the way is this user's (or root's) own, so nobody else can swap it.

Everything else is refused with a message that names the owner and says how to fix it: the store
raises :class:`~compile_cache.errors.UnsafeStoreError` (:func:`check_safe_dir`, :func:`check_tree`),
``doctor`` reports the same verdict (:func:`describe_dir`), and a local dir that fails gets a
warning and a private directory instead (:mod:`compile_cache.artifacts`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .. import config
from ..errors import UnsafeStoreError

__all__ = [
    "DirSafety",
    "check_dir",
    "check_private_dir",
    "check_safe_dir",
    "check_tree",
    "describe_dir",
    "describe_owner",
    "resolve_location",
    "trust_problem",
]


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
    """Why a path is unsafe: ``short`` for a listing, ``message`` with the fix."""

    short: str
    message: str


def _user_name(uid: int) -> str | None:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return None


def _group_name(gid: int) -> str | None:
    try:
        import grp

        return grp.getgrgid(gid).gr_name
    except (ImportError, KeyError):
        return None


def describe_owner(uid: int) -> str:
    """``alice (uid 1001)``, or ``54321`` for a uid without a name."""
    name = _user_name(uid)
    return f"{name} (uid {uid})" if name else str(uid)


def _describe_group(gid: int) -> str:
    name = _group_name(gid)
    return f"{name} (gid {gid})" if name else str(gid)


def _our_groups() -> set[int]:
    return set(os.getgroups()) | {os.getegid()}


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _user_private_group(uid: int, gid: int) -> bool:
    """Whether ``gid`` is the user-private group of ``uid`` (named after it, nobody else in it):
    the ``umask 002`` convention of Debian/Ubuntu, where g+w gives nobody else access."""
    try:
        import grp
        import pwd

        user = pwd.getpwuid(uid)
        group = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def trust_problem(
    st: os.stat_result, path: Path | str, group_mode: bool, *, private: bool = False,
) -> DirSafety | None:
    """Why the directory or file with stat ``st`` at ``path`` cannot be trusted, or None.

    ``group_mode``: a group-shared store (``COMPILE_CACHE_SHARED=group``). ``private``: torch's
    local dirs, which are never group-shared (group-writable only by the owner's own group).
    """
    mode = stat.S_IMODE(st.st_mode)
    is_dir = stat.S_ISDIR(st.st_mode)
    ours = _trusted_owner(st.st_uid)
    if ours and not mode & stat.S_IWOTH and not (mode & stat.S_IWGRP and (is_dir or private)):
        return None  # the common case, decided without a user-database lookup
    kind = "directory" if is_dir else "file"
    refuse = f"refusing to use compile cache {kind} {path}"
    owner = describe_owner(st.st_uid)
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
    if private:
        return _private_problem(st, path, refuse, owner, ours=ours)
    groups = _our_groups()
    # A group-writable file in a tree only this user (or group) can enter reaches nobody else:
    # write access to files is the directories' question.
    if mode & stat.S_IWGRP and is_dir:
        if not group_mode:
            return DirSafety(
                "group-writable without COMPILE_CACHE_SHARED=group",
                f"{refuse}: it is group-writable (mode {mode:04o}) but COMPILE_CACHE_SHARED=group "
                f"is not set. {fix}",
            )
        if st.st_gid not in groups:
            return DirSafety(
                f"writable by group {st.st_gid}, not one of this process's groups",
                f"{refuse}: it is writable by group {_describe_group(st.st_gid)}, which is not one "
                f"of this process's groups. Fix it with `chgrp <your-group> {path}` or "
                f"`chmod g-w {path}`.",
            )
    if ours:
        return None
    return _others_problem(st, path, refuse, owner, group_mode, groups)


def _private_problem(st: os.stat_result, path: Path | str, refuse: str, owner: str, *,
                     ours: bool) -> DirSafety | None:
    """:func:`trust_problem` of torch's local dirs (never group-shared)."""
    mode = stat.S_IMODE(st.st_mode)
    if not ours:
        return DirSafety(
            f"owned by user {owner}",
            f"{refuse}: it belongs to user {owner}, whose files this process would load and "
            f"run. Use a directory of your own.",
        )
    if mode & stat.S_IWGRP and not _user_private_group(st.st_uid, st.st_gid):
        return DirSafety(
            f"writable by group {_describe_group(st.st_gid)}",
            f"{refuse}: it is writable by group {_describe_group(st.st_gid)} (mode "
            f"{mode:04o}), whose members could plant code this process would run. Fix it with "
            f"`chmod g-w {path}`.",
        )
    return None


def _others_problem(st: os.stat_result, path: Path | str, refuse: str, owner: str, group_mode: bool,
                    groups: set[int]) -> DirSafety | None:
    """:func:`trust_problem` of what another user owns: trusted only in a group-shared store."""
    mode = stat.S_IMODE(st.st_mode)
    is_dir = stat.S_ISDIR(st.st_mode)
    if not group_mode:
        return DirSafety(
            f"owned by user {owner}",
            f"{refuse}: it belongs to user {owner}, whose artifacts this process would load and "
            f"run. Use a directory of your own (COMPILE_CACHE_DIR or --cache-dir), or, to share "
            f"one store on purpose, have its owner make it group-shared (`chgrp <group> {path} && "
            f"chmod 2775 {path}`) and set COMPILE_CACHE_SHARED=group.",
        )
    if st.st_gid not in groups:
        return DirSafety(
            f"owned by user {owner} and group {st.st_gid}, not one of this process's groups",
            f"{refuse}: it belongs to user {owner} and group {_describe_group(st.st_gid)}, which "
            f"is not one of this process's groups. Use a store of your own group, or ask to be "
            f"added to that group.",
        )
    if is_dir and not (mode & stat.S_ISGID and mode & stat.S_IWGRP):
        return DirSafety(
            f"owned by user {owner}, not setgid and group-writable (2775)",
            f"{refuse}: it belongs to user {owner} and has mode {mode:04o}, not the setgid, "
            f"group-writable mode of a group-shared store (2775). Its owner can fix it with "
            f"`chmod 2775 {path}`.",
        )
    return None


def _link_problem(path: Path, group_mode: bool) -> DirSafety | None:
    """A symlink at ``path`` must be our own (or root's): anybody who owns it could swap it."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISLNK(st.st_mode) or _trusted_owner(st.st_uid):
        return None
    if group_mode and st.st_gid in _our_groups():
        return None
    owner = describe_owner(st.st_uid)
    return DirSafety(
        f"a symlink owned by user {owner}",
        f"refusing to use compile cache directory {path}: it is a symlink that belongs to user "
        f"{owner}, who could point it anywhere at any time. Use the directory it points to "
        f"({os.path.realpath(path)}) directly, or a directory of your own.",
    )


def check_dir(path: Path, group_mode: bool, *, private: bool = False) -> DirSafety | None:
    """None if ``path`` may be trusted (see :func:`trust_problem`); symlinks are followed, and a
    symlink at ``path`` itself must be ours.

    An absent directory, or one this user cannot even search, is safe: nothing in it can be
    loaded here either.
    """
    problem = _link_problem(Path(path), group_mode)
    if problem is not None:
        return problem
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    return trust_problem(st, path, group_mode, private=private)


def check_private_dir(path: Path) -> DirSafety | None:
    """:func:`check_dir` for torch's local Inductor/Triton dirs (never group-shared)."""
    return check_dir(path, False, private=True)


def check_safe_dir(path: Path, group_mode: bool) -> None:
    """Raise :class:`UnsafeStoreError` if ``path`` cannot be trusted."""
    problem = check_dir(path, group_mode)
    if problem is not None:
        raise UnsafeStoreError(problem.message)


def check_tree(root: Path, below: tuple[Path, ...], group_mode: bool) -> None:
    """Raise :class:`UnsafeStoreError` unless ``root`` (symlinks resolved, and each symlink ours)
    and the directories ``below`` it can be trusted."""
    check_safe_dir(root, group_mode)
    real = Path(os.path.realpath(root))
    if real != Path(os.path.abspath(root)):
        check_safe_dir(real, group_mode)
    for directory in below:
        check_safe_dir(directory, group_mode)


def describe_dir(path: Path, group_mode: bool) -> tuple[str, bool]:
    """``(description, safe)`` of a store directory's mode and owner, for ``doctor``."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot stat: {exc.strerror or exc}", False
    mode = stat.S_IMODE(st.st_mode)
    owner = "you" if st.st_uid == os.geteuid() else describe_owner(st.st_uid)
    text = f"{mode:04o}, owner {owner}, group {_describe_group(st.st_gid)}"
    problem = check_dir(path, group_mode)
    if problem is None and os.path.realpath(path) != os.path.abspath(path):
        problem = check_dir(Path(os.path.realpath(path)), group_mode)
    if problem is not None:
        return f"{text}: UNSAFE, {problem.short}", False
    if group_mode:
        setgid = "setgid" if mode & stat.S_ISGID else "no setgid bit (new files may get other groups)"
        return f"{text}: group-shared, {setgid}", True
    return f"{text}: private, safe", True
