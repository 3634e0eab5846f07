"""The ``python -m compile_cache`` program (compile_cache.cli.main): every subcommand's --help, bad
input (flags, TARGETs, environment variables) as one line and exit 2, tracebacks kept for
unexpected errors, and the program named as the user typed it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cli_helpers import HERE, SUBCOMMANDS, TARGET, call, one_line_error, run_cli

from compile_cache import cli
from compile_cache.cli.output import PROG, _prog

pytestmark = pytest.mark.usefixtures("no_env_store")


def test_target_that_does_not_import_subprocess(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "warm", "no_such_package.models:build", "--cache-dir", str(tmp_path / "s"))
    assert proc.returncode == 2
    one_line_error(proc.stderr, "no_such_package.models:build", "does not import")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["warm", f"{HERE / '_cli_targets.py'}:not_a_model"], ["returned str", "expected a torch.nn.Module"]),
        (["warm", f"{HERE / '_cli_targets.py'}:no_such_factory"], ["no attribute 'no_such_factory'"]),
        (["warm", f"{HERE / '_cli_targets.py'}:model_only"], ["needs example inputs"]),
        (["warm", "missing_file.py:f"], ["no such file"]),
        (["warm", "compile_cache.demo"], ["expected package.module:factory"]),
        (["warm", "--hf", "not-a-model-type"], ["--hf 'not-a-model-type'", "unknown model type"]),
        (["warm", "--hf", "gpt2", "--set", "oops"], ["--set 'oops'", "key=value"]),
        (["warm", "--hf", "gpt2", "--batch-size", "1,x"], ["--batch-size"]),
        (["warm", "--hf", "gpt2", "--dtype", "float33"], ["--dtype 'float33'"]),
        (["warm", "--hf", "gpt2", "--set", "n_layer=two"], ["--set n_layer='two'", "whole number", "12"]),
        (["warm", "--hf", "gpt2", "--set", "n_layer=2", "--set", "n_head=5"],
         ["--hf 'gpt2'", "n_head=5", "cannot build the model"]),
        (["warm", TARGET, "--use-cache"], ["--use-cache"]),
        (["explain", "--hf", "gpt2", "--set", "n_layer=two"], ["--set n_layer='two'"]),
        (["explain", "--limit", "0"], ["--limit 0"]),
        (["warm"], ["give a TARGET"]),
        (["prune", "--max-size", "20X"], ["--max-size", "'20X'"]),
        (["prune", "--older-than", "3 fortnights"], ["--older-than"]),
        (["prune", "--key", "ffff"], ["--key 'ffff'", "no cache entry"]),
        (["import", "no-such-archive.tar"], ["no such archive"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], needles: list[str]
) -> None:
    code, _out, err = call(capsys, *args, "--cache-dir", str(tmp_path / "s"))
    assert code == 2
    one_line_error(err, *needles)


@pytest.mark.parametrize("command", ["ls", "stats", "verify", "export", "warm"])
def test_store_path_that_is_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str) -> None:
    path = tmp_path / "a-file"
    path.write_text("x")
    extra = {"export": ["out.tar"], "warm": [f"{HERE / '_cli_targets.py'}:mlp"]}.get(command, [])
    code, _out, err = call(capsys, command, *extra, "--cache-dir", str(path))
    assert code == 2
    one_line_error(err, str(path), "not a directory")


def test_bad_environment_size_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMPILE_CACHE_MAX_SIZE", "20X")
    code, _out, err = call(capsys, "stats", "--cache-dir", str(tmp_path / "s"))
    assert code == 2
    one_line_error(err, "COMPILE_CACHE_MAX_SIZE", "'20X'")


def test_unexpected_errors_keep_their_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "boom_target.py"
    target.write_text("def build():\n    raise RuntimeError('bug in the factory')\n")
    with pytest.raises(RuntimeError, match="bug in the factory"):
        cli.main(["warm", f"{target}:build", "--cache-dir", str(tmp_path / "s")])


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help_and_cache_dir(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: {PROG} {command}" in out and "--cache-dir" in out and "--json" in out


def test_the_program_is_named_as_the_user_typed_it(tmp_path: Path) -> None:
    assert PROG == "python -m compile_cache"  # pytest, like `python -m`, is not the console script
    assert _prog("/usr/local/bin/compile-cache") == "compile-cache"
    assert _prog("/site-packages/compile_cache/__main__.py") == "python -m compile_cache"
    proc = run_cli(tmp_path, "prune", "--max-size", "20X", "--cache-dir", str(tmp_path / "s"))
    assert proc.returncode == 2
    one_line_error(proc.stderr, "python -m compile_cache prune: error:")


def _unusable_device() -> str:
    """``cuda`` on a CPU-only torch (this project's CI); a GPU index past the last one elsewhere."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def test_a_device_this_torch_cannot_use_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    device = _unusable_device()
    code, _out, err = call(capsys, "warm", TARGET, "--device", device, "--cache-dir", str(tmp_path / "s"))
    assert code == 2
    one_line_error(err, f"--device {device!r}", "not usable")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("COMPILE_CACHE_MAX_SIZE", "abc"),
        ("COMPILE_CACHE_WAIT_TIMEOUT", "-5"),
        ("COMPILE_CACHE_DISTRIBUTED", "bogus"),
        ("COMPILE_CACHE_PREFETCH", "banana"),
        ("COMPILE_CACHE_BACKEND", "rust"),
    ],
)
def test_a_bad_environment_value_stops_warm_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    name: str, value: str,
) -> None:
    monkeypatch.setenv(name, value)
    code, _out, err = call(capsys, "warm", TARGET, "--backend", "eager", "--cache-dir", str(tmp_path / "s"))
    assert code == 2
    one_line_error(err, f"{name}={value!r}", "expected")
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").rglob("*.pack"))


def test_bad_dynamic_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["warm", "x:y", "--dynamic", "maybe"])
    assert exit_info.value.code == 2
    assert "true or false" in capsys.readouterr().err
