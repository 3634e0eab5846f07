"""setup.py: the native extension is optional, and torch chooses its C++ standard.

torch >= 2.14's headers need C++20; setup.py forced ``-std=c++17``, so the build failed with 17
compile errors, pip exited 1 and nothing was installed: the pure-Python fingerprint never got a
chance. Here the extension's build fails on purpose (a compiler that fails every compile) and the
package must still install and fingerprint, with one warning.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import fresh_node_env

ROOT = Path(__file__).resolve().parents[1]

#: A C++ compiler that answers torch's version check as the real one does and fails every build.
FAILING_CXX = """#!/bin/sh
case "$1" in --version|-v|--help) exec c++ "$@";; esac
echo "failing-cxx: this compiler fails every build" >&2
exit 1
"""

#: Imports the installed copy only: this venv's editable install of the tree maps
#: ``compile_cache._C`` to the tree's own extension through a finder of its own, dropped here.
USE = """
import json, sys, warnings
sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
                 and "__editable__" not in getattr(type(f), "__module__", "")]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import compile_cache
    import torch
    from compile_cache.fingerprint import fingerprint
    digest = str(fingerprint(torch.nn.Sequential(torch.nn.Linear(2, 3))))
print(json.dumps({"file": compile_cache.__file__, "backend": compile_cache.backend, "digest": digest,
                  "warnings": [str(w.message) for w in caught]}))
"""


def _copy_sources(to: Path) -> None:
    """What a source install reads (the tree's build outputs, its in-place _C included, left out)."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, to / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o")
    shutil.copytree(ROOT / "csrc", to / "csrc", ignore=ignore)
    shutil.copytree(ROOT / "compile_cache", to / "compile_cache", ignore=ignore)


def test_a_failed_native_build_installs_a_package_that_fingerprints_in_python(tmp_path: Path) -> None:
    src, target = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    _copy_sources(src)
    cxx = tmp_path / "failing-cxx"
    cxx.write_text(FAILING_CXX)
    cxx.chmod(0o755)
    env = fresh_node_env(tmp_path / "node", CXX=str(cxx))
    env.pop("PYTHONPATH", None)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(src)],
        env=env, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]
    log = built.stdout + built.stderr
    assert "failing-cxx: this compiler fails every build" in log
    assert "could not be built" in log and "pure-Python fingerprint backend" in log
    # the C++ standard is torch's choice (C++20 from torch 2.13 on; torch >= 2.14's headers need
    # it), not one of ours after it
    commands = [line for line in log.splitlines() if "fingerprint.cpp" in line and " -c " in line]
    assert commands and all([flag for flag in command.split() if flag.startswith("-std=")]
                            == ["-std=c++20"] for command in commands), commands
    assert (target / "compile_cache" / "fingerprint.py").is_file()
    assert not list((target / "compile_cache").glob("_C*")), "no extension was built"

    env = fresh_node_env(tmp_path / "node", PYTHONPATH=str(target), PYTHONSAFEPATH="1")
    used = subprocess.run([sys.executable, "-c", USE], env=env, capture_output=True, text=True,
                          timeout=300, check=False, cwd=tmp_path)
    assert used.returncode == 0, used.stderr[-3000:]
    result = json.loads(used.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve().is_relative_to(target.resolve())
    assert result["backend"] == "python"
    (warning,) = [w for w in result["warnings"] if "compile_cache" in w]
    assert "native fingerprint backend unavailable" in warning and "pure-Python backend" in warning
    # the same digest as the native backend gives in this process (the reference encoding)
    import torch

    from compile_cache.fingerprint import fingerprint

    assert str(fingerprint(torch.nn.Sequential(torch.nn.Linear(2, 3)))) == result["digest"]

