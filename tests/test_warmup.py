"""compile_cache.warmup: the one runner of example inputs (call, loss rule, preserved state)."""

from __future__ import annotations

import pytest
import torch
from _cli_targets import TinyMLP

from compile_cache import warmup
from compile_cache.warmup import describe_inputs, loss_of


def test_describe_inputs() -> None:
    assert describe_inputs(torch.zeros(2, 3)) == "2x3"
    assert describe_inputs(torch.tensor(1.0)) == "scalar"
    assert describe_inputs((torch.zeros(4), 7)) == "4, int"
    assert describe_inputs({"input_ids": torch.zeros(1, 8), "use_cache": False}) == "input_ids=1x8"


def test_one_loss_rule_logits_else_every_tensor_that_requires_grad() -> None:
    class Out:
        logits = torch.ones(2, 2, requires_grad=True)
        hidden = torch.ones(5, requires_grad=True)  # not part of the loss when logits exist

    assert loss_of(Out()).item() == pytest.approx(4.0)
    assert loss_of((torch.ones(3, requires_grad=True), 1)).item() == pytest.approx(3.0)
    both = (torch.ones(3, requires_grad=True), {"aux": torch.ones(2, requires_grad=True)})
    assert loss_of(both).item() == pytest.approx(5.0)  # every tensor that requires grad
    assert loss_of(torch.ones(3)) is None  # nothing to backpropagate
    assert loss_of(torch.ones(3, dtype=torch.int64)) is None


def test_inputs_are_called_as_positional_keyword_or_single() -> None:
    seen = []

    def model(*args, **kwargs):
        seen.append((args, kwargs))

    warmup.call(model, (1, 2))
    warmup.call(model, [3])
    warmup.call(model, {"x": 4})
    warmup.call(model, 5)
    assert seen == [((1, 2), {}), ((3,), {}), ((), {"x": 4}), ((5,), {})]


def test_run_leaves_modes_grads_buffers_and_rng_as_they_were(dynamo_reset: None) -> None:
    model = torch.nn.Sequential(TinyMLP(), torch.nn.BatchNorm1d(16)).eval()
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    grad_object = first.grad
    stats = model[1].running_mean.clone()
    x = torch.randn(4, 16)
    rng = torch.get_rng_state()
    result = warmup.run(model, x, train=True)
    assert result.backward and result.seconds > 0
    assert not model.training and not any(m.training for m in model.modules())
    assert first.grad is grad_object and torch.equal(first.grad, torch.ones_like(first))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    assert torch.equal(model[1].running_mean, stats)
    assert torch.equal(torch.get_rng_state(), rng)


def test_signature_follows_shapes_dtypes_and_train() -> None:
    x = torch.zeros(2, 3)
    assert warmup.signature((x,), False) == warmup.signature((torch.ones(2, 3),), False)
    assert warmup.signature((x,), False) != warmup.signature((torch.zeros(2, 4),), False)
    assert warmup.signature((x,), False) != warmup.signature((x,), True)
    assert warmup.signature((x,), False) != warmup.signature((x.double(),), False)
