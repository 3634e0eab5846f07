"""The ``compile-cache`` command line: every subcommand run as a real subprocess at least once.

One session fixture runs a real Inductor ``warm`` (tests/_cli_targets.py:mlp, one shape) into a
store; the other tests share it, copying it (``shutil.copytree``) when they change it. Cheaper
variations of the same commands run in-process through ``cli.main`` to keep the file fast.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compile_cache import cli

HERE = Path(__file__).resolve().parent
TARGET = f"{HERE / '_cli_targets.py'}:mlp"
SUBCOMMANDS = ("warm", "ls", "stats", "verify", "prune", "clear", "export", "import", "doctor")


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")
    env["TRITON_CACHE_DIR"] = str(tmp / "triton")
    env.update(extra)
    return env


def run_cli(tmp: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``python -m compile_cache ARGS`` in a subprocess, stdin not a terminal."""
    return subprocess.run(
        [sys.executable, "-m", "compile_cache", *args],
        env=_env(tmp, **extra_env), cwd=tmp, stdin=subprocess.DEVNULL,
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


@pytest.fixture(autouse=True)
def _no_env_store(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("COMPILE_CACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # not a terminal


@pytest.fixture(scope="session")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A store populated by one real cold ``warm`` (Inductor) in a subprocess, and its --json."""
    tmp = tmp_path_factory.mktemp("warmed")
    store = tmp / "store"
    proc = run_cli(tmp, "warm", TARGET, "--cache-dir", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    return store, json.loads(proc.stdout)


@pytest.fixture
def store_copy(warmed: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    """A private copy of the warmed store, for tests that change it."""
    copy = tmp_path / "store"
    shutil.copytree(warmed[0], copy)
    return copy


# ---------------------------------------------------------------------------------------------
# warm
# ---------------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_cold_warm_compiles_and_publishes(warmed: tuple[Path, dict[str, Any]]) -> None:
    _store, data = warmed
    assert data["ok"] is True and data["hit"] is False
    assert data["compiled"] == 1 and data["fxgraph_misses"] >= 1
    assert data["published_packs"] >= 1 and data["published_bytes"] > 0
    assert [r["shape"] for r in data["results"]] == ["4x16"]
    assert data["results"][0]["status"] == "compiled"


@pytest.mark.inductor
def test_second_process_on_new_node_hits_with_zero_misses(store_copy: Path, tmp_path: Path) -> None:
    node = tmp_path / "node2"
    node.mkdir()
    proc = run_cli(node, "warm", TARGET, "--cache-dir", str(store_copy), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["hit"] is True
    assert data["compiled"] == 0 and data["fxgraph_misses"] == 0
    assert data["restored_packs"] >= 1 and data["fxgraph_hits"] >= 1
    assert data["results"][0]["status"] == "hit"
    assert data["published_packs"] == 0


def test_warm_eager_grid_prints_a_row_per_shape(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = call(capsys, "warm", f"{HERE / '_cli_targets.py'}:tiny_two_shapes",
                        "--backend", "eager", "--cache-dir", str(tmp_path / "s"))
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["SHAPE", "RESULT", "SECONDS", "PUBLISHED"]
    assert rows[0].startswith("1x16") and rows[1].startswith("2x8")
    assert "0 of 2 shape(s) compiled" in out


def test_warm_hf_builds_from_config_with_a_shape_grid(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = call(
        capsys, "warm", "--hf", "gpt2", "--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2",
        "--set", "vocab_size=64", "--set", "n_positions=32", "--set", "attn_implementation=eager",
        "--batch-size", "1,2", "--seq-len", "8", "--backend", "eager", "--train",
        "--cache-dir", str(tmp_path / "s"), "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert [r["shape"] for r in data["results"]] == ["input_ids=1x8", "input_ids=2x8"]


def test_warm_kwargs_inputs_and_dtype(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = call(capsys, "warm", f"{HERE / '_cli_targets.py'}:tiny_kwargs", "--backend", "eager",
                        "--dtype", "float32", "--device", "cpu", "--dynamic", "false",
                        "--cache-dir", str(tmp_path / "s"), "--json")
    assert code == 0
    assert json.loads(out)["results"][0]["shape"] == "tokens=1x8"


# ---------------------------------------------------------------------------------------------
# bad input: one line on stderr, exit 2
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# ls / stats
# ---------------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_ls_shows_one_row_per_entry(warmed: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    store, data = warmed
    proc = run_cli(tmp_path, "ls", "--cache-dir", str(store))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["KEY", "MODEL", "REGIONS"]
    row = lines[1]
    assert row.startswith(data["key"][:12])
    assert "TinyMLP" in row and "_Block x2" in row and "KiB" in row and "ago" in row and "cpu" in row
    assert "1 entry, 1 pack(s)" in proc.stdout


@pytest.mark.inductor
def test_ls_json_quiet_sort_limit(capsys: pytest.CaptureFixture[str], warmed: tuple[Path, dict[str, Any]]) -> None:
    store, data = warmed
    code, out, _ = call(capsys, "ls", "--cache-dir", str(store), "--json")
    assert code == 0
    entry = json.loads(out)["entries"][0]
    assert entry["key"] == data["key"] and entry["regions"] == "_Block x2" and entry["size"] > 0
    code, out, _ = call(capsys, "ls", "--cache-dir", str(store), "-q", "--sort", "size")
    assert out.split() == [data["key"]]
    code, out, _ = call(capsys, "ls", "--cache-dir", str(store), "-q", "--limit", "0")
    assert code == 0 and out == ""


def test_ls_empty_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = call(capsys, "ls", "--cache-dir", str(tmp_path / "empty"))
    assert code == 0 and out.startswith("No cache entries in")


@pytest.mark.inductor
def test_stats_counts_the_cold_warm(warmed: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    store, _data = warmed
    proc = run_cli(tmp_path, "stats", "--cache-dir", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["publishes"] >= 1 and stats["misses"] >= 1 and stats["size"] > 0
    assert stats["entries"] == 1 and stats["compile_seconds"] > 0


@pytest.mark.inductor
def test_stats_human_and_zero(capsys: pytest.CaptureFixture[str], store_copy: Path) -> None:
    code, out, _ = call(capsys, "stats", "--cache-dir", str(store_copy))
    assert code == 0
    for label in ("Hits", "Misses", "Hit rate", "Errors", "Corrupt packs", "Compile time saved", "Cache size"):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert "of 20.0 GiB" in out
    code, out, _ = call(capsys, "stats", "--zero", "--cache-dir", str(store_copy))
    assert code == 0 and "zeroed" in out
    code, out, _ = call(capsys, "stats", "--json", "--cache-dir", str(store_copy))
    stats = json.loads(out)
    assert stats["misses"] == 0 and stats["publishes"] == 0 and stats["entries"] == 1


# ---------------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_verify_clean_store(warmed: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "verify", "--cache-dir", str(warmed[0]))
    assert proc.returncode == 0, proc.stderr
    assert "Checked 1 entries, 1 packs" in proc.stdout and "OK: no problems found" in proc.stdout


@pytest.mark.inductor
def test_verify_finds_and_fixes_a_corrupt_pack(capsys: pytest.CaptureFixture[str], store_copy: Path) -> None:
    (pack,) = store_copy.glob("v1/entries/*/*/packs/*.pack")
    data = bytearray(pack.read_bytes())
    data[-1] ^= 0xFF
    pack.write_bytes(bytes(data))
    code, out, _ = call(capsys, "verify", "--cache-dir", str(store_copy))
    assert code == 1
    assert "corrupt pack" in out and "checksum" in out and "verify --fix" in out
    code, out, _ = call(capsys, "verify", "--fix", "--cache-dir", str(store_copy), "--json")
    assert code == 0
    data_json = json.loads(out)
    assert len(data_json["corrupt_packs"]) == 1 and data_json["remaining"]["ok"] is True
    code, out, _ = call(capsys, "verify", "--cache-dir", str(store_copy))
    assert code == 0 and "OK" in out


# ---------------------------------------------------------------------------------------------
# prune / clear
# ---------------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_prune_by_size_subprocess(store_copy: Path, tmp_path: Path, warmed: tuple[Path, dict[str, Any]]) -> None:
    proc = run_cli(tmp_path, "prune", "--max-size", "1K", "-y", "--cache-dir", str(store_copy))
    assert proc.returncode == 0, proc.stderr
    assert warmed[1]["key"][:12] in proc.stdout and "Removed 1 entry" in proc.stdout
    assert not list(store_copy.glob("v1/entries/*/*/packs/*.pack"))


@pytest.mark.inductor
def test_prune_dry_run_refusal_and_key(
    capsys: pytest.CaptureFixture[str], store_copy: Path, warmed: tuple[Path, dict[str, Any]]
) -> None:
    key = warmed[1]["key"]
    code, out, _ = call(capsys, "prune", "--older-than", "0s", "--dry-run", "--cache-dir", str(store_copy))
    assert code == 0 and "Would remove 1 entry" in out and key[:12] in out
    code, out, _ = call(capsys, "prune", "--max-size", "20G", "--cache-dir", str(store_copy))
    assert code == 0 and out.startswith("Nothing to prune")
    code, _out, err = call(capsys, "prune", "--key", key[:8], "--cache-dir", str(store_copy))
    assert code == 2
    one_line_error(err, "pass -y")
    code, out, _ = call(capsys, "prune", "--key", key[:8], "-y", "--json", "--cache-dir", str(store_copy))
    assert code == 0 and json.loads(out)["removed"] == [key]
    code, out, _ = call(capsys, "ls", "-q", "--cache-dir", str(store_copy))
    assert out == ""


@pytest.mark.inductor
def test_clear_refuses_without_yes_when_not_a_tty(store_copy: Path, tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "clear", "--cache-dir", str(store_copy))
    assert proc.returncode == 2
    one_line_error(proc.stderr, "pass -y")
    assert list(store_copy.glob("v1/entries/*/*/packs/*.pack"))


@pytest.mark.inductor
def test_clear_dry_run_then_yes(capsys: pytest.CaptureFixture[str], store_copy: Path) -> None:
    code, out, _ = call(capsys, "clear", "--dry-run", "--cache-dir", str(store_copy))
    assert code == 0 and "Would remove 1 entry" in out
    code, out, _ = call(capsys, "clear", "-y", "--cache-dir", str(store_copy))
    assert code == 0 and "Removed 1 entry" in out
    assert not list(store_copy.glob("v1/entries/*/*/packs/*.pack"))


# ---------------------------------------------------------------------------------------------
# export / import
# ---------------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_export_then_import_into_another_store(
    warmed: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, data = warmed
    archive = tmp_path / "cache.tar.gz"
    proc = run_cli(tmp_path, "export", str(archive), "--key", data["key"][:12], "--cache-dir", str(store))
    assert proc.returncode == 0, proc.stderr
    assert "Exported 1 pack(s) of 1 entry" in proc.stdout and archive.is_file()
    other = tmp_path / "other"
    proc = run_cli(tmp_path, "import", str(archive), "--cache-dir", str(other), "--json")
    assert proc.returncode == 0, proc.stderr
    first = json.loads(proc.stdout)
    assert first["keys"] == [data["key"]] and first["packs_added"] == 1
    code, out, _ = call(capsys, "import", str(archive), "--cache-dir", str(other))
    assert code == 0 and "0 pack(s) added, 1 already present" in out
    code, out, _ = call(capsys, "ls", "-q", "--cache-dir", str(other))
    assert out.split() == [data["key"]]


def test_import_rejects_a_bad_archive_before_writing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import tarfile

    archive = tmp_path / "evil.tar"
    payload = tmp_path / "payload"
    payload.write_text("x")
    with tarfile.open(archive, "w") as tar:
        tar.add(payload, arcname="../../escape.txt")
    code, _out, err = call(capsys, "import", str(archive), "--cache-dir", str(tmp_path / "s"))
    assert code == 2
    one_line_error(err, "import")
    assert not list((tmp_path / "s").glob("v1/entries/*/*"))


# ---------------------------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------------------------
def test_doctor_json_subprocess(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("compile-cache")  # the console script, when installed
    args = [str(script)] if script.exists() else [sys.executable, "-m", "compile_cache"]
    proc = subprocess.run(
        [*args, "doctor", "--cache-dir", str(tmp_path / "s"), "--json"],
        env=_env(tmp_path, COMPILE_CACHE_SIGNING_KEY="hunter2-secret"), cwd=tmp_path,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "hunter2-secret" not in proc.stdout
    data = json.loads(proc.stdout)
    assert data["store"]["source"] == "argument" and data["store"]["lock_mode"] in ("fcntl", "mkdir", "none")
    assert data["store"]["filesystem"] and data["fingerprint"]["backend"] in ("native", "python")
    variables = {v["name"]: v["value"] for v in data["variables"]}
    assert variables["COMPILE_CACHE_SIGNING_KEY"] == "set"
    assert set(variables) >= {"COMPILE_CACHE_DIR", "COMPILE_CACHE_MAX_SIZE", "TORCHINDUCTOR_CACHE_DIR"}
    assert len(data["environment"]["key"]) == 32


def test_doctor_human_output_and_env_source(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "from-env"
    store.mkdir(mode=0o700)
    monkeypatch.setenv("COMPILE_CACHE_DIR", str(store))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code, out, _ = call(capsys, "doctor")
    assert code == 0
    assert "COMPILE_CACHE_DIR environment variable" in out and str(store) in out
    assert "lock mode" in out and "private, safe" in out
    assert "thread count" in out  # the cross-node hazard, with its fix
    assert re.search(r"COMPILE_CACHE_SIGNING_KEY +unset +default", out)  # a secret shows set/unset
    assert re.search(r"COMPILE_CACHE_DIR +\S+ +environment", out)  # each value with its source


def test_doctor_flags_a_world_writable_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = tmp_path / "open"
    store.mkdir()
    store.chmod(0o777)
    code, out, _ = call(capsys, "doctor", "--cache-dir", str(store))
    assert code == 1
    assert "UNSAFE, world-writable" in out and "Problems" in out
