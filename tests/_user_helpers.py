"""Throwaway users for the tests that are about users (a store or local dir of someone else).

CI runs as root, so :func:`make_users` creates two non-root users (``a`` and ``b``) and a group
both are in, and :func:`as_user` runs a function in a forked child that has dropped to one of
them (groups, gid, uid, umask 022, HOME/USER/TMPDIR of its own). The child is forked, not
exec'd: a non-root user cannot read this interpreter's files under /root, so everything the
child needs must be imported by the parent first (:func:`preload`). Not root: the fixture skips,
with that reason.
"""

from __future__ import annotations

import grp  # noqa: F401  (the children look names up: imported here, before they drop root)
import multiprocessing
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FORK = multiprocessing.get_context("fork")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: Path  # a private scratch home (0700, theirs)


@dataclass(frozen=True)
class Users:
    a: User
    b: User
    group: str  # both are in it
    gid: int
    scratch: Path  # 0755, root's: put each user's directories under it


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def make_users() -> Iterator[Users]:
    """Create users a and b and a shared group; remove them afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create throwaway users (CI runs as root)")
    if not shutil.which("useradd") or not shutil.which("groupadd"):
        pytest.skip("useradd/groupadd are not installed")
    tag = secrets.token_hex(3)
    group = f"ccg{tag}"
    names = (f"cca{tag}", f"ccb{tag}")
    scratch = Path(tempfile.mkdtemp(prefix="cc-users-", dir="/tmp"))
    scratch.chmod(0o755)
    created: list[str] = []
    try:
        _run("groupadd", group)
        for name in names:
            _run("useradd", "-M", "-U", "-G", group, "-s", "/usr/sbin/nologin", name)
            created.append(name)
        gid = grp.getgrnam(group).gr_gid
        users = []
        for name in names:
            pw = pwd.getpwnam(name)
            home = scratch / name
            home.mkdir(mode=0o700)
            os.chown(home, pw.pw_uid, pw.pw_gid)
            users.append(User(name, pw.pw_uid, pw.pw_gid, tuple(os.getgrouplist(name, pw.pw_gid)), home))
        yield Users(users[0], users[1], group, gid, scratch)
    finally:
        for name in created:
            subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["groupdel", group], capture_output=True, check=False)
        shutil.rmtree(scratch, ignore_errors=True)


def _child(user: User, env: dict[str, str], fn: Callable[..., Any], args: tuple, out: Any) -> None:
    try:
        os.setgroups(list(user.groups))
        os.setgid(user.gid)
        os.setuid(user.uid)
        os.umask(0o022)
        os.environ.update({"HOME": str(user.home), "USER": user.name, "LOGNAME": user.name,
                           "TMPDIR": str(user.home), **env})
        tempfile.tempdir = None  # gettempdir() follows the new TMPDIR
        from compile_cache._testing import reset_process_state

        reset_process_state()  # a fresh process: no warnings shown yet, no probe answers
        out.put(("ok", fn(*args)))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def as_user(user: User, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None,
            timeout: float = 120.0) -> Any:
    """``fn(*args)`` run as ``user`` in a forked child; its return value (picklable), or the
    child's traceback as an AssertionError."""
    out = FORK.Queue()
    proc = FORK.Process(target=_child, args=(user, dict(env or {}), fn, args, out))
    proc.start()
    try:
        status, value = out.get(timeout=timeout)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise AssertionError(f"as user {user.name}:\n{value}")
    return value


def owned_dir(path: Path, user: User, mode: int = 0o700, gid: int | None = None) -> Path:
    """Create ``path`` (as root) and give it to ``user`` (and group ``gid``) with ``mode``."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, user.uid, user.gid if gid is None else gid)
    path.chmod(mode)
    return path


def chown_tree(path: Path, user: User, gid: int | None = None) -> None:
    """Give everything under ``path`` to ``user`` (a store made by root in the test, handed over)."""
    for p in [path, *path.rglob("*")]:
        os.lchown(p, user.uid, user.gid if gid is None else gid)


def preload() -> None:
    """Import what the children use, while this process can still read its files."""
    import torch._inductor.codecache  # noqa: F401  (what the local-dir check may reach for)

    import compile_cache.cli.doctor  # noqa: F401
    import compile_cache.distributed.protocol  # noqa: F401
    import compile_cache.local_dirs  # noqa: F401
    import compile_cache.recovery  # noqa: F401


@dataclass
class Running:
    """A function running as a user in a forked child (:func:`start_as_user`)."""

    user: User
    proc: Any
    out: Any

    def result(self, timeout: float) -> Any:
        """Its return value; AssertionError with its traceback if it raised, or if it has not
        returned within ``timeout`` seconds (then it is killed)."""
        import queue

        try:
            status, value = self.out.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"as user {self.user.name}: no result within {timeout:g} s") from None
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        if status != "ok":
            raise AssertionError(f"as user {self.user.name}:\n{value}")
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def start_as_user(user: User, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> Running:
    """``fn(*args)`` started as ``user`` in a forked child, running beside the caller (an
    attacker's loop while the victim works): :meth:`Running.result` collects it."""
    out = FORK.Queue()
    proc = FORK.Process(target=_child, args=(user, dict(env or {}), fn, args, out))
    proc.start()
    return Running(user, proc, out)
