"""``compile-cache warm`` (compile_cache.cli.warm): one real cold Inductor warm into a store, shared
by the CLI tests (the ``warmed`` fixture); cheaper variations in-process with the eager backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _cli_helpers import HERE, TARGET, call, run_cli

pytestmark = pytest.mark.usefixtures("no_env_store")


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
