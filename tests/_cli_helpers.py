"""Shared helpers of the CLI tests (tests/test_cli_*.py): run the CLI in a subprocess or in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compile_cache import cli

HERE = Path(__file__).resolve().parent
TARGET = f"{HERE / '_cli_targets.py'}:mlp"
SUBCOMMANDS = ("warm", "ls", "stats", "verify", "prune", "clear", "export", "import", "explain", "doctor")


def cli_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The CLI subprocess's environment: no COMPILE_CACHE_* setting, its own local torch dirs,
    and this checkout's package first on the path (not whichever copy is installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")
    env["TRITON_CACHE_DIR"] = str(tmp / "triton")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run_cli(tmp: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``python -m compile_cache ARGS`` in a subprocess, stdin not a terminal."""
    return subprocess.run(
        [sys.executable, "-m", "compile_cache", *args],
        env=cli_env(tmp, **extra_env), cwd=tmp, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300, check=False,
    )


def call(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``cli.main(ARGS)`` in this process: (exit code, stdout, stderr)."""
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
