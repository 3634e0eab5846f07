"""``python -m compile_cache run --name NAME -- CMD ...``: start CMD with the process store on.

The child gets a ``sitecustomize`` first on its ``PYTHONPATH`` (coverage and ddtrace do it that
way) that calls :func:`compile_cache.process_store.enable_from_env` as soon as the program's
import of torch has run (before any compile: a compile needs torch), and then imports the
``sitecustomize`` that was there before (chained, so an existing one still runs). The program's
code is not changed. Only Python processes that start with this ``PYTHONPATH`` get the store, and
those that never import torch pay nothing for it: torch's own ISA-probe child (it gets the
program's ``sys.path``, this folder included, and only loads a test library: a torch
import and a restore would cost it some 4 s, six times in a cold start), a tool the program
starts. The exit code is the child's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import ConfigError

__all__ = ["SITECUSTOMIZE", "cmd_run", "child_env"]

#: The child's sitecustomize: enable the store once torch is imported, then chain the one it
#: shadows.
SITECUSTOMIZE = '''\
"""compile_cache run: the process store (once the program imports torch), then the
sitecustomize this one shadows."""
import os as _os
import sys as _sys


def _enable():
    try:
        from compile_cache.process_store import enable_from_env
        enable_from_env()
    except Exception as _exc:  # never stop the program over the store
        _sys.stderr.write(f"compile_cache run: store not enabled: {_exc}\\n")


class _EnableWithTorch:
    """Enables the store right after torch's own module has run, inside the program's first
    import of torch: a process that never imports torch imports nothing of ours."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "torch":
            return None
        _sys.meta_path.remove(cls)
        import importlib.util
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            if spec is not None:  # a loader we cannot follow: say so, and compile without it
                _sys.stderr.write("compile_cache run: store not enabled: torch's loader "
                                  f"{type(loader).__name__} has no exec_module\\n")
            return spec

        run_torch = loader.exec_module

        def exec_module(module):
            run_torch(module)
            _enable()

        loader.exec_module = exec_module
        return spec


if "torch" in _sys.modules:
    _enable()
else:
    _sys.meta_path.insert(0, _EnableWithTorch)


def _chain():
    import importlib.util
    here = _os.path.dirname(_os.path.abspath(__file__))
    for entry in _sys.path:
        if not entry or _os.path.abspath(entry) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_chain()
'''


def child_env(name: str, cache_dir: str | None, site_dir: str,
              base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: our sitecustomize's folder and compile_cache's first on
    ``PYTHONPATH``, the name (and store) for :func:`enable_from_env`."""
    env = dict(os.environ if base is None else base)
    package_root = str(Path(__file__).resolve().parents[2])
    parts = [site_dir, package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["COMPILE_CACHE_RUN_NAME"] = name
    if cache_dir:
        env["COMPILE_CACHE_RUN_DIR"] = cache_dir
    return env


def cmd_run(args: argparse.Namespace) -> int:
    """Runs ``args.cmd`` with the process store enabled under ``args.name``; its exit code.
    This process imports no torch (only the child, through its sitecustomize)."""
    from ..config import RUN_NAME_PATTERN as NAME_PATTERN

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("run: give the command after --, e.g. run --name gen -- python script.py")
    if not NAME_PATTERN.match(args.name):
        raise ConfigError(f"run: --name is 1-128 letters, digits, '.', '_' or '-', got {args.name!r}")
    with tempfile.TemporaryDirectory(prefix="compile_cache_run_") as site_dir:
        Path(site_dir, "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = child_env(args.name, args.cache_dir, site_dir)
        try:
            return subprocess.call(cmd, env=env)
        except FileNotFoundError as exc:
            print(f"compile-cache run: error: {exc}", file=sys.stderr)
            return 127
