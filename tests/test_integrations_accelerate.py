"""compile_regions with accelerate: prepare() after compile_regions, and install()."""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import TorchDynamoPlugin  # noqa: E402

from compile_cache import compile_regions, get_plan, region_stats  # noqa: E402
from compile_cache.integrations import accelerate as integration  # noqa: E402

pytestmark = pytest.mark.usefixtures("dynamo_reset")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    integration.uninstall()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _train_step(accelerator, model, x):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = model.lm_head.weight.detach().clone()
    loss = model(x, labels=x, use_cache=False).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    assert torch.isfinite(loss)
    assert not torch.equal(before, model.lm_head.weight)
    return model


def test_compile_regions_then_prepare_trains(tiny_gpt2, counting_backend):
    model = tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    keys = list(model.state_dict())
    assert compile_regions(model, backend=counting_backend) is model
    prepared = _train_step(Accelerator(cpu=True), model, torch.randint(0, 128, (2, 16)))
    assert prepared is model and list(model.state_dict()) == keys
    assert counting_backend.calls == 2  # both blocks ran compiled code
    assert len(counting_backend.graphs) == 1


def test_install_routes_plugin_to_compile_regions(tiny_gpt2):
    import accelerate.accelerator as acc

    original = acc.compile_regions
    integration.install()
    integration.install()  # idempotent
    assert integration.installed() and acc.compile_regions is not original
    model = tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    keys = list(model.state_dict())
    plugin = TorchDynamoPlugin(use_regional_compilation=True, backend="eager")
    accelerator = Accelerator(cpu=True, dynamo_plugin=plugin, mixed_precision="bf16")
    prepared = _train_step(accelerator, model, torch.randint(0, 128, (2, 16)))
    # ours: the same object, compiled in place; no OptimizedModule, no "_orig_mod" keys
    assert prepared is model and list(model.state_dict()) == keys
    assert get_plan(model) is not None and get_plan(model).compile_kwargs == {"backend": "eager"}
    blocks = {f"transformer.h.{i}" for i in range(len(model.transformer.h))}
    assert [set(g.names) for g in get_plan(model).groups] == [blocks]  # one group of every block
    assert all(b._compiled_call_impl is not None for b in model.transformer.h)  # compiled in place
    # the mixed-precision wrapper sits on the root's forward; the blocks still run compiled code
    assert "forward" in model.__dict__
    stats = region_stats(model)
    assert stats and all(s["eager_calls"] == 0 and s["cache_entries"] >= 1 for s in stats.values())
    integration.uninstall()
    assert acc.compile_regions is original and not integration.installed()


def test_install_warns_once_when_the_plugin_compiles_nothing(tiny_gpt2, monkeypatch, fresh_state):
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    integration.install()
    model = tiny_gpt2()
    plugin = TorchDynamoPlugin(use_regional_compilation=True)  # backend: accelerate's default, "no"
    accelerator = Accelerator(cpu=True, dynamo_plugin=plugin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = accelerator.prepare(model)
        accelerator.prepare_model(model)  # once per process, not once per call
    found = [w for w in caught if "backend 'no'" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "backend='inductor'" in str(found[0].message) and "compiles nothing" in str(found[0].message)
    assert found[0].filename == __file__  # it points at the user's prepare() call
    assert prepared is model and get_plan(model) is None  # indeed nothing was compiled
    assert all(m._compiled_call_impl is None for m in model.modules())


def test_install_is_silent_when_a_backend_is_given(tiny_gpt2, fresh_state):
    integration.install()
    model = tiny_gpt2()
    plugin = TorchDynamoPlugin(use_regional_compilation=True, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Accelerator(cpu=True, dynamo_plugin=plugin).prepare(model)
    assert not [w for w in caught if "backend 'no'" in str(w.message)]
    assert get_plan(model) is not None
    integration.uninstall()
    import accelerate.accelerator as acc

    assert not getattr(acc.Accelerator.prepare, "_compile_cache_checked", False)
    assert not getattr(acc.Accelerator.prepare_model, "_compile_cache_checked", False)
