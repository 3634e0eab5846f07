"""Compiled call paths installed in place, and eager runs / recompiles reported (compile_cache.regions)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from _region_models import Block, MixedModel, SeqModel
from torch._dynamo.utils import counters

from compile_cache import compile_regions, regions
from compile_cache.plan import REASONS
from compile_cache.regions import (
    RegionEagerWarning,
    RegionRecompileWarning,
    get_plan,
    region_stats,
)

pytestmark = pytest.mark.usefixtures("dynamo_reset")


# ---------------------------------------------------------------- compile in place


def test_in_place_identity_hooks_state_dict(counting_backend):
    model = SeqModel()
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    model.blocks[1].register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    model.blocks[1].register_forward_hook(lambda m, a, o: o + 1)
    model.tag = "mine"
    x = torch.randn(2, 4)
    ref = model(x)
    out_model = compile_regions(model, backend=counting_backend)
    assert out_model is model and type(model) is SeqModel
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.tag == "mine"
    assert len(model.blocks[1]._forward_hooks) == 1 and len(model.blocks[1]._forward_pre_hooks) == 1
    torch.testing.assert_close(model(x), ref)
    assert counting_backend.calls == 4  # three blocks + head, all compiled
    # blocks 0 and 2 share a graph; the hooked block 1 has its own code object; the head
    assert len(counting_backend.graphs) == get_plan(model).expected_graphs == 3
    # calling twice is harmless: same plan, nothing recompiles
    before = len(counting_backend.graphs)
    assert compile_regions(model, backend=counting_backend) is model
    torch.testing.assert_close(model(x), ref)
    assert len(counting_backend.graphs) == before
    assert get_plan(model) is not None


def test_mixed_model_graph_count_and_grads(counting_backend):
    torch.manual_seed(0)
    model = MixedModel()
    x = torch.randn(3, 8, requires_grad=True)
    ref = model(x)
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_xgrad = x.grad.clone()
    model.zero_grad()
    x.grad = None
    compile_regions(model, backend=counting_backend)
    out = model(x)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, ref_xgrad)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], msg=n)
    plan = get_plan(model)
    assert len(counting_backend.graphs) == plan.expected_graphs == 4
    assert counting_backend.calls == 8  # every region call ran compiled code
    assert all(s["eager_calls"] == 0 for s in region_stats(model).values())


def test_gpt2_forward_one_graph_static(counting_backend, tiny_gpt2):
    model = tiny_gpt2(n_layer=3).eval()
    x = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        compile_regions(model, backend=counting_backend)
        out = model(x, use_cache=False).logits
        out2 = model(x, use_cache=False).logits
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out2, ref)
    assert len(counting_backend.graphs) == get_plan(model).expected_graphs == 1
    assert counters["stats"]["unique_graphs"] == 1
    assert counting_backend.calls == 6  # 3 blocks x 2 forwards, all compiled
    assert counting_backend.symbolic == 0  # no automatic dynamic shapes
    stats = region_stats(model)
    assert [s["block_recompiles"] for s in stats.values()] == [0]


def test_gpt2_train_step_gradients(tiny_gpt2):
    torch.manual_seed(0)
    model = tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    x = torch.randint(0, 128, (2, 16))
    loss = model(x, labels=x, use_cache=False).loss
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compile_regions(model, backend="aot_eager")
    loss2 = model(x, labels=x, use_cache=False).loss
    loss2.backward()
    torch.testing.assert_close(loss2, loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert all(s["eager_calls"] == 0 for s in region_stats(model).values())


def test_llama_groups_rest_and_layer_idx_warning(counting_backend, tiny_llama):
    model = tiny_llama(layers=3).eval()
    x = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        compile_regions(model, backend=counting_backend)
        out = model(x, use_cache=False).logits
    torch.testing.assert_close(out, ref)
    plan = get_plan(model)
    assert {p.name for p in plan.compiled_rest} == {"model.norm"}
    assert "model.rotary_emb" in {p.name for p in plan.rest if p.reason == REASONS["no_parameters"]}
    assert len(counting_backend.graphs) == plan.expected_graphs == 2
    assert counting_backend.symbolic == 0
    # with a KV cache (model(x) makes one) the blocks still share entries: the cache update
    # runs between two graphs (tests/test_generate.py), no per-block recompile, no eager run
    graphs = len(counting_backend.graphs)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(model(x).logits, ref)
    assert not [w for w in caught if issubclass(w.category, (RegionRecompileWarning, RegionEagerWarning))]
    assert len(counting_backend.graphs) == graphs + 2  # the block before and after the update
    group = plan.groups[0].code_name
    assert region_stats(model)[group]["block_recompiles"] == 0
    assert region_stats(model)[group]["eager_calls"] == 0
    assert counting_backend.symbolic == 0


def test_eager_fallback_is_reported(counting_backend):
    model = SeqModel()
    with contextlib.ExitStack() as stack:
        if regions.PER_CALL_RECOMPILE_LIMIT:
            compile_regions(model, backend=counting_backend, recompile_limit=1, dynamic=False)
        else:  # torch 2.11: no per-call limit; a global one, which compile_regions raises to 3
            stack.enter_context(torch._dynamo.config.patch(recompile_limit=1))
            compile_regions(model, backend=counting_backend, dynamic=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in (2, 3, 4, 5):  # new shapes; limit 3 entries (group of 3 blocks)
                model(torch.randn(n, 4))
    eager = [str(w.message) for w in caught if issubclass(w.category, RegionEagerWarning)]
    assert eager and all("recompile limit" in m for m in eager)
    assert any("blocks.0" in m for m in eager)  # once per group, naming it
    group = get_plan(model).groups[0].code_name
    assert region_stats(model)[group]["eager_calls"] > 0


def test_force_eager_stance_is_reported(counting_backend):
    model = SeqModel()
    compile_regions(model, backend=counting_backend)
    with torch.compiler.set_stance("force_eager"), pytest.warns(RegionEagerWarning, match="blocks"):
        model(torch.randn(2, 4))


def test_instance_forward_and_accelerate_hooks_run_compiled(counting_backend):
    from accelerate.hooks import ModelHook, add_hook_to_module
    from accelerate.utils.operations import convert_outputs_to_fp32

    class Scale(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return (args[0] * 3,), kwargs

    model = SeqModel()
    model.blocks.append(Block())
    x = torch.randn(2, 4)
    add_hook_to_module(model.blocks[0], Scale())
    add_hook_to_module(model.blocks[1], Scale())
    for block in model.blocks[2:]:
        block.forward = convert_outputs_to_fp32(block.forward)
    ref = model(x)
    compile_regions(model, backend=counting_backend)
    plan = get_plan(model)
    assert sorted(g.names for g in plan.groups) == [
        ("blocks.0", "blocks.1"),
        ("blocks.2", "blocks.3"),
    ]
    torch.testing.assert_close(model(x), ref)
    assert counting_backend.calls == 5  # four hooked blocks + head, all compiled
    assert len(counting_backend.graphs) == plan.expected_graphs == 3
    assert all(s["eager_calls"] == 0 for s in region_stats(model).values())
    assert hasattr(model.blocks[0], "_hf_hook")


@pytest.mark.inductor
def test_inductor_gpt2_matches_eager(tiny_gpt2):
    model = tiny_gpt2().eval()
    x = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        compile_regions(model)
        out = model(x, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert all(s["eager_calls"] == 0 for s in region_stats(model).values())


# ------------------------------------------------ each model's blocks, their own module's globals

TWIN_SOURCE = """
import torch
from torch import nn

SCALE = {scale}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * SCALE
"""


def _load_as(name: str, path, scale: float):
    """A module loaded from ``path`` under ``name`` (registered in sys.modules, as a plugin
    loader does), whatever module held that name before."""
    import importlib.util
    import sys

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TWIN_SOURCE.format(scale=scale))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _stack_of(module) -> tuple[torch.nn.Module, torch.nn.Module]:
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(module.Block(), module.Block())
    return model, copy.deepcopy(model)


def test_two_modules_under_one_name_run_against_their_own_globals(counting_backend, tmp_path,
                                                                  monkeypatch):
    """Two files with the same Block and other module-level values, loaded in turn under one
    name, one model from each (issue 53): the second model's blocks must not use the first
    module's globals (before: 9.9 away from eager, with cache_dir=False)."""
    import sys
    import uuid

    name = f"twinmod_{uuid.uuid4().hex[:8]}"  # Dynamo resolves module names once per process
    monkeypatch.delitem(sys.modules, name, raising=False)
    x = torch.randn(2, 4)
    first = _load_as(name, tmp_path / "a" / "twin.py", 1.0)
    model_a, ref_a = _stack_of(first)
    compile_regions(model_a, cache_dir=False, backend=counting_backend)
    torch.testing.assert_close(model_a(x), ref_a(x))
    second = _load_as(name, tmp_path / "b" / "twin.py", 10.0)
    model_b, ref_b = _stack_of(second)
    compile_regions(model_b, cache_dir=False, backend=counting_backend)
    with pytest.warns(RegionEagerWarning, match=f"loaded under the name '{name}'"):
        torch.testing.assert_close(model_b(x), ref_b(x))
    torch.testing.assert_close(model_a(x), ref_a(x))  # the first model is still compiled, right
    first.SCALE = 3.0  # and its guards read its own module
    torch.testing.assert_close(model_a(x), ref_a(x))
    (stats_b,) = region_stats(model_b).values()
    assert stats_b["eager_calls"] == 2  # both blocks, once each
    (stats_a,) = region_stats(model_a).values()
    assert stats_a["eager_calls"] == 0


def test_a_reloaded_module_runs_against_its_new_values(counting_backend, tmp_path, monkeypatch):
    """importlib.reload keeps the module's namespace: a model built before and one after, both
    compiled, each computes what eager does with the reloaded values."""
    import importlib
    import sys
    import uuid

    name = f"reloaded_{uuid.uuid4().hex[:8]}"
    monkeypatch.delitem(sys.modules, name, raising=False)
    x = torch.randn(2, 4)
    module = _load_as(name, tmp_path / "m" / f"{name}.py", 1.0)
    monkeypatch.syspath_prepend(str(tmp_path / "m"))
    old, old_ref = _stack_of(module)
    compile_regions(old, cache_dir=False, backend=counting_backend)
    torch.testing.assert_close(old(x), old_ref(x))
    (tmp_path / "m" / f"{name}.py").write_text(TWIN_SOURCE.format(scale=10.0))
    module = importlib.reload(module)
    new, new_ref = _stack_of(module)
    compile_regions(new, cache_dir=False, backend=counting_backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RegionEagerWarning)
        torch.testing.assert_close(new(x), new_ref(x))
        torch.testing.assert_close(old(x), old_ref(x))
