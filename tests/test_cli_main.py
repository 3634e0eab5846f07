"""The ``compile-cache`` program (compile_cache.cli.main): every subcommand's --help, bad input as
one line and exit 2, tracebacks kept for unexpected errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli_helpers import HERE, SUBCOMMANDS, call, one_line_error, run_cli

from compile_cache import cli

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
    assert f"usage: compile-cache {command}" in out and "--cache-dir" in out and "--json" in out


def test_bad_dynamic_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["warm", "x:y", "--dynamic", "maybe"])
    assert exit_info.value.code == 2
    assert "true or false" in capsys.readouterr().err
