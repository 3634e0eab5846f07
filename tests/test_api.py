"""compile_cache.api: the pipeline of compile_regions, and warm, the ahead-of-time grid behind
``compile-cache warm`` (eager backend: fast; the real Inductor round trip is in test_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cli_targets import TinyMLP
from _region_models import SeqModel

from compile_cache import api, compile_regions, get_plan, plan_regions
from compile_cache.api import WarmResult, warm
from compile_cache.errors import ConfigError
from compile_cache.keys import entry_key


# -- compile_regions ------------------------------------------------------------------------------
def test_disable_and_bad_input(monkeypatch, dynamo_reset):
    model = SeqModel()
    x = torch.randn(2, 4)
    ref = model(x)
    assert compile_regions(model, disable=True) is model
    assert all(m._compiled_call_impl is None for m in model.modules())
    assert get_plan(model).disabled and get_plan(model).expected_graphs == 0
    torch.testing.assert_close(model(x), ref)
    with pytest.raises(TypeError, match="list"):
        compile_regions([1, 2])
    with pytest.raises(TypeError, match="bakend"):
        compile_regions(model, bakend="eager")
    with pytest.raises(TypeError, match="42"):
        compile_regions(model, cache_dir=42)
    with pytest.raises(TypeError, match="_orig_mod"):
        compile_regions(torch.compile(model))
    with pytest.raises(TypeError, match="int"):
        plan_regions(3)
    seen = {}

    def fake_open_session(m, plan, key, cache_dir, precompile, record=None):
        seen.update(model=m, plan=plan, key=key, cache_dir=cache_dir, precompile=precompile)
        return None

    monkeypatch.setattr(api, "open_session", fake_open_session)
    compile_regions(model, backend="eager", cache_dir="/tmp/x")
    assert seen["model"] is model and seen["plan"].compile_kwargs == {"backend": "eager"}
    assert seen["cache_dir"] == "/tmp/x" and seen["plan"].groups
    assert seen["key"] == entry_key(model, seen["plan"], {"backend": "eager"}, False)
    assert seen["precompile"] is False


# -- warm -------------------------------------------------------------------------------------------
def test_one_result_per_shape_in_order(tmp_path: Path, dynamo_reset: None) -> None:
    model = TinyMLP()
    results = warm(model, [torch.randn(2, 16), torch.randn(3, 16)], cache_dir=tmp_path / "s", backend="eager")
    assert [r.shape for r in results] == ["2x16", "3x16"]
    assert all(isinstance(r, WarmResult) and r.seconds > 0 for r in results)
    assert all(r.status == "none" and r.published_bytes == 0 for r in results)  # eager: no Inductor
    assert results[0].key is not None and len(results[0].key) == 32
    assert not model.training
    assert results[0].to_dict()["shape"] == "2x16"


def test_train_runs_backward_and_leaves_model_in_train_mode(tmp_path: Path, dynamo_reset: None) -> None:
    model = TinyMLP()
    results = warm(model, [torch.randn(2, 16)], cache_dir=tmp_path / "s", train=True, backend="eager")
    assert len(results) == 1 and model.training
    assert all(p.grad is None for p in model.parameters())  # gradients are not left behind


def test_inputs_as_tuple_and_dict(tmp_path: Path, dynamo_reset: None) -> None:
    class TwoArgs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = TinyMLP(), TinyMLP()

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.b(self.a(x)) * scale

    results = warm(TwoArgs(), [(torch.randn(1, 16), 2.0), {"x": torch.randn(5, 16)}],
                   cache_dir=tmp_path / "s", backend="eager")
    assert [r.shape for r in results] == ["1x16, float", "x=5x16"]


def test_store_off_still_warms_without_a_key(dynamo_reset: None) -> None:
    results = warm(TinyMLP(), [torch.randn(1, 16)], cache_dir=False, backend="eager")  # type: ignore[arg-type]
    assert results[0].key is None and results[0].status == "none"


@pytest.mark.parametrize(
    ("model", "inputs", "match"),
    [
        ("not a module", [torch.randn(1, 16)], "torch.nn.Module"),
        (TinyMLP(), torch.randn(1, 16), "list of example inputs"),
        (TinyMLP(), [], "at least one"),
        (TinyMLP(), [[torch.randn(1, 16)]], "tensor, a tuple"),
    ],
)
def test_bad_arguments_raise_config_error(model: object, inputs: object, match: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=match):
        warm(model, inputs, cache_dir=tmp_path / "s", backend="eager")  # type: ignore[arg-type]


def test_train_without_anything_to_backpropagate_is_a_clear_error(tmp_path: Path, dynamo_reset: None) -> None:
    class NoGrad(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    with pytest.raises(ConfigError, match="requires grad"):
        warm(NoGrad(), [torch.randn(1, 4)], cache_dir=False, train=True, backend="eager")


class _Scaled(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_precompile_is_declined_and_blocks_differing_in_a_float_stay_eager_equal(
    tmp_path: Path, dynamo_reset: None
) -> None:
    """The issue-13 hazard: identical blocks but a float read by forward. With precompile asked
    for, the job warns, counts the decline, and every block keeps its own value."""
    from compile_cache.api import RegionPrecompileWarning
    from compile_cache.store import Store

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Scaled(s) for s in (1.0, 2.0, 3.0)]).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
        with pytest.warns(RegionPrecompileWarning, match="precompile=True"):
            compile_regions(model, backend="eager", precompile=True, cache_dir=tmp_path / "store")
        out = model(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert Store(tmp_path / "store").stats()["precompile_declined"] == 1
