"""``compile_cache.warm.warm``: the Python API behind ``compile-cache warm`` (eager backend: fast).

The real Inductor round trip (publish, then a hit in a new process) is in test_cli.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cli_targets import TinyMLP

from compile_cache.errors import ConfigError
from compile_cache.warm import WarmResult, _loss, describe_inputs, warm


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


def test_describe_inputs() -> None:
    assert describe_inputs(torch.zeros(2, 3)) == "2x3"
    assert describe_inputs(torch.tensor(1.0)) == "scalar"
    assert describe_inputs((torch.zeros(4), 7)) == "4, int"
    assert describe_inputs({"input_ids": torch.zeros(1, 8), "use_cache": False}) == "input_ids=1x8"


def test_loss_prefers_logits_mean_else_sum() -> None:
    class Out:
        logits = torch.ones(2, 2, requires_grad=True)

    assert _loss(Out()).item() == pytest.approx(1.0)
    assert _loss((torch.ones(3, requires_grad=True), 1)).item() == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="requires grad"):
        _loss(torch.ones(3))
