"""``python -m compile_cache warm`` (compile_cache.cli.warm): one real cold Inductor warm into a
store, shared by the CLI tests (the ``warmed`` fixture); cheaper variations in-process with the
eager backend: the mode it mirrors (eval/train, grad, use_cache, dtype, device, shapes), the key
it prints, and exit 1 when it leaves no entry for that key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _cli_targets
import pytest
from _cli_helpers import HERE, TARGET, call, one_line_error, run_cli

import compile_cache

pytestmark = pytest.mark.usefixtures("no_env_store")


@pytest.mark.inductor
def test_cold_warm_compiles_and_publishes(warmed: tuple[Path, dict[str, Any]]) -> None:
    _store, data = warmed
    assert data["ok"] is True and data["hit"] is False
    assert data["compiled"] == 1 and data["fxgraph_misses"] >= 1
    assert data["published_packs"] >= 1 and data["published_bytes"] > 0
    assert [r["shape"] for r in data["results"]] == ["4x16"]
    assert data["results"][0]["status"] == "compiled"
    assert data["mode"] == {"train": False, "grad": False, "use_cache": None, "dtype": "float32",
                            "device": "cpu", "shapes": ["4x16"]}
    assert data["outcome"] == "miss" and "not in the store" in data["miss_reason"]


@pytest.mark.inductor
def test_second_process_on_new_node_hits_with_zero_misses(store_copy: Path, tmp_path: Path) -> None:
    node = tmp_path / "node2"
    node.mkdir()
    proc = run_cli(node, "warm", TARGET, "--cache-dir", str(store_copy), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["hit"] is True
    assert data["compiled"] == 0 and data["fxgraph_misses"] == 0
    # Precompile is off by default: Dynamo traced, and every graph it made was a hit in the
    # restored FX-graph cache, so the shape counts as a hit.
    assert data["restored_packs"] >= 1 and data["fxgraph_hits"] >= 1
    assert data["precompile_hits"] == 0
    assert data["results"][0]["status"] == "hit"
    assert data["published_packs"] == 0


def test_warm_eager_grid_prints_a_row_per_shape_and_exits_1_without_an_entry(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = call(capsys, "warm", f"{HERE / '_cli_targets.py'}:tiny_two_shapes",
                          "--backend", "eager", "--cache-dir", str(tmp_path / "s"))
    lines = out.splitlines()
    assert lines[0] == "mode: eval, no_grad, float32, cpu; shapes 1x16 | 2x8"
    header = lines.index(next(line for line in lines if line.startswith("SHAPE")))
    assert lines[header].split() == ["SHAPE", "RESULT", "SECONDS", "PUBLISHED"]
    assert lines[header + 1].startswith("1x16") and lines[header + 2].startswith("2x8")
    assert "0 of 2 shape(s) compiled" in out
    # The eager backend compiles nothing a job could restore: warm says so and fails.
    key = compile_cache.last_report().key
    assert f"key {key}:" in out
    assert code == 1
    one_line_error(err, f"no entry for key {key}", "backend 'eager'")


def test_help_shows_the_mode_it_runs_and_the_flags_that_change_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        call(capsys, "warm", "--help")
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("model.eval()", "torch.no_grad()", "use_cache=False", "model's own dtype",
                   "1 x 128", "--train", "--eval", "--grad, --no-grad", "--use-cache, --no-use-cache",
                   "--dtype", "--device", "--batch-size", "--seq-len", "last_report().key"):
        assert needle in text, needle


@pytest.mark.parametrize(
    ("flags", "seen", "line"),
    [
        ([], (False, False, False, (1, 16), "float32"),
         "eval, no_grad, use_cache=False, float32, cpu; shapes input_ids=1x16"),
        (["--train", "--seq-len", "8"], (True, True, False, (1, 8), "float32"),
         "train (forward and backward), grad, use_cache=False, float32, cpu; shapes input_ids=1x8"),
        (["--train", "--no-grad", "--use-cache", "--batch-size", "2", "--seq-len", "4", "--dtype", "float64"],
         (True, False, True, (2, 4), "float64"),
         "train, no_grad, use_cache=True, float64, cpu; shapes input_ids=2x4"),
        (["--eval", "--grad", "--device", "cpu"], (False, True, False, (1, 16), "float32"),
         "eval, grad, use_cache=False, float32, cpu; shapes input_ids=1x16"),
    ],
)
def test_flags_change_how_the_model_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], seen: tuple[Any, ...], line: str
) -> None:
    _cli_targets.SEEN.clear()
    code, out, _ = call(capsys, "warm", f"{HERE / '_cli_targets.py'}:recorder", *flags,
                        "--backend", "eager", "--cache-dir", str(tmp_path / "s"), "--json")
    assert code == 1  # eager: nothing stored
    assert _cli_targets.SEEN == [seen]  # how the model really ran
    data = json.loads(out)
    assert data["mode"]["train"] is seen[0] and data["mode"]["grad"] is seen[1]
    assert data["mode"]["use_cache"] is seen[2] and data["mode"]["dtype"] == seen[4]
    _cli_targets.SEEN.clear()
    code, out, _ = call(capsys, "warm", f"{HERE / '_cli_targets.py'}:recorder", *flags,
                        "--backend", "eager", "--cache-dir", str(tmp_path / "s"))
    assert out.splitlines()[0] == f"mode: {line}"


def test_warm_hf_builds_from_config_with_a_shape_grid(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = call(
        capsys, "warm", "--hf", "gpt2", "--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2",
        "--set", "vocab_size=64", "--set", "n_positions=32", "--set", "attn_implementation=eager",
        "--batch-size", "1,2", "--seq-len", "8", "--backend", "eager", "--train",
        "--cache-dir", str(tmp_path / "s"), "--json",
    )
    assert code == 1  # eager: no entry
    data = json.loads(out)
    assert [r["shape"] for r in data["results"]] == ["input_ids=1x8", "input_ids=2x8"]
    assert data["mode"]["train"] is True and data["mode"]["use_cache"] is False


def test_warm_kwargs_inputs_and_dtype(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = call(capsys, "warm", f"{HERE / '_cli_targets.py'}:tiny_kwargs", "--backend", "eager",
                        "--dtype", "float32", "--device", "cpu", "--dynamic", "false",
                        "--cache-dir", str(tmp_path / "s"), "--json")
    assert code == 1  # eager: no entry
    data = json.loads(out)
    assert data["results"][0]["shape"] == "tokens=1x8" and data["compile"] == {"backend": "eager", "dynamic": False}


@pytest.mark.parametrize(("name", "sets", "model", "inputs"), [
    ("t5", ["num_layers=1", "d_model=16", "d_kv=8", "d_ff=32", "num_heads=2", "vocab_size=64"],
     "T5ForConditionalGeneration", ["input_ids", "decoder_input_ids", "use_cache"]),
    ("bert", ["num_hidden_layers=1", "hidden_size=16", "num_attention_heads=2",
              "intermediate_size=32", "vocab_size=64"], "BertModel", ["input_ids", "use_cache"]),
    ("vit", ["num_hidden_layers=1", "hidden_size=16", "num_attention_heads=2",
             "intermediate_size=32", "image_size=16", "patch_size=8"], "ViTModel", ["pixel_values"]),
    ("whisper", ["encoder_layers=1", "decoder_layers=1", "d_model=16", "encoder_attention_heads=2",
                 "decoder_attention_heads=2", "encoder_ffn_dim=32", "decoder_ffn_dim=32",
                 "num_mel_bins=8", "max_source_positions=8", "max_target_positions=16",
                 "vocab_size=64", "pad_token_id=0", "bos_token_id=1", "eos_token_id=2",
                 "decoder_start_token_id=1"], "WhisperForConditionalGeneration",
     ["input_features", "decoder_input_ids", "use_cache"]),
])
def test_warm_hf_builds_encoders_and_encoder_decoders(name: str, sets: list[str], model: str,
                                                      inputs: list[str]) -> None:
    """--hf builds what the model type has: an encoder-decoder LM, a causal LM, else the base
    model (an encoder, whose causal-LM head is for decoders only), with the inputs it takes;
    the model runs on them."""
    import argparse

    import torch

    from compile_cache.cli.job import add_job_arguments, build_job

    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    flags = [x for s in sets for x in ("--set", s)]
    job = build_job(parser.parse_args(["--hf", name, *flags, "--seq-len", "8"]))
    assert type(job.model).__name__ == model
    assert list(job.inputs[0]) == inputs
    with torch.no_grad():
        job.model(**job.inputs[0])


def test_warm_help_says_which_models_hf_builds(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        call(capsys, "warm", "--help")
    except SystemExit:
        pass
    out = " ".join(capsys.readouterr().out.split())
    for words in ("causal LM", "sequence-to-sequence LM (t5, bart)", "base model (bert, vit, whisper, clip)"):
        assert words in out, out
