"""Regional compilation by fingerprint (compile_cache.regions)."""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from compile_cache import regions
from compile_cache.regions import (
    RegionEagerWarning,
    RegionRecompileWarning,
    compile_regions,
    get_plan,
    plan_regions,
    region_stats,
)

pytestmark = pytest.mark.usefixtures("dynamo_reset")


# ---------------------------------------------------------------- plain nn models


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


class OtherBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * 0.5 + x


class Head(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(x))


class SeqModel(nn.Module):
    """Repeats in a Sequential; an embedding leaf, a custom head outside the regions."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class MixedModel(nn.Module):
    """Alternating block types in a ModuleList, repeats in a ModuleDict and plain attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), OtherBlock(), Block(), OtherBlock()])
        self.branches = nn.ModuleDict({"a": Block(16), "b": Block(16)})
        self.up = nn.Linear(8, 16)
        self.enc1 = Head(16)
        self.enc2 = Head(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        y = self.up(x)
        y = self.branches["a"](y) + self.branches["b"](y)
        return self.enc1(y) - self.enc2(y)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            [nn.Sequential(Block(), Block(), Block()), nn.Sequential(Block(), Block(), Block())]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = s(x)
        return x


def _groups(plan: regions.RegionPlan) -> dict[str, tuple[str, ...]]:
    return {g.class_name.rsplit(".", 1)[-1]: g.names for g in plan.groups}


def test_plan_sequential_and_rest():
    plan = plan_regions(SeqModel())
    assert _groups(plan) == {"Block": ("blocks.0", "blocks.1", "blocks.2")}
    rest = {p.name: p.compiled for p in plan.rest}
    # the custom head is compiled on its own; the lone Linear stays eager; ancestors are glue
    assert rest == {"": False, "inp": False, "blocks": False, "head": True}
    assert plan.expected_graphs == 2
    text = str(plan)
    assert "inp" in text and "single torch.nn op" in text and "contains regions" in text
    json.dumps(plan.to_dict())
    d = plan.to_dict()
    assert d["groups"][0]["fingerprint"] == plan.groups[0].fingerprint
    assert len(d["groups"][0]["fingerprint"]) == 32
    assert d["groups"][0]["class_name"].endswith("Block")


def test_plan_mixed_moduledict_attributes():
    plan = plan_regions(MixedModel())
    groups = {g.names for g in plan.groups}
    assert groups == {
        ("layers.0", "layers.2"),
        ("layers.1", "layers.3"),
        ("branches.a", "branches.b"),
        ("enc1", "enc2"),
    }
    # Linears inside the blocks are never regions of their own
    assert not any(n.endswith("fc1") for g in plan.groups for n in g.names)
    assert {p.name for p in plan.rest} == {"", "layers", "branches", "up"}
    assert plan.expected_graphs == 4


def test_plan_nested_stacks_are_maximal():
    plan = plan_regions(Nested())
    assert [g.names for g in plan.groups] == [("stages.0", "stages.1")]


def test_plan_no_repeats_compiles_whole_and_leaves_not_regions():
    plan = plan_regions(Head())
    assert plan.groups == () and [(p.name, p.compiled) for p in plan.rest] == [("", True)]
    # identical Linears / Dropouts repeat but are single torch.nn ops: no region
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(), nn.Linear(4, 4), nn.Dropout())
    assert plan_regions(m).groups == ()


def test_plan_gpt2(tiny_gpt2):
    plan = plan_regions(tiny_gpt2(n_layer=3))
    assert [g.names for g in plan.groups] == [
        ("transformer.h.0", "transformer.h.1", "transformer.h.2")
    ]
    eager = {p.name for p in plan.eager_rest}
    assert {"transformer.wte", "transformer.wpe", "transformer.drop", "transformer.ln_f"} <= eager
    assert "lm_head" in eager and plan.compiled_rest == ()


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
    assert {p.name for p in plan.compiled_rest} == {"model.norm", "model.rotary_emb"}
    assert len(counting_backend.graphs) == plan.expected_graphs == 3
    assert counting_backend.symbolic == 0
    # with a KV cache the blocks read self.layer_idx: one entry per block, a warning, no eager
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(model(x).logits, ref)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RegionRecompileWarning)]
    assert len(msgs) == 1 and "layer_idx" in msgs[0]
    assert not [w for w in caught if issubclass(w.category, RegionEagerWarning)]
    assert counting_backend.symbolic == 0


def test_eager_fallback_is_reported(counting_backend):
    model = SeqModel()
    with contextlib.ExitStack() as stack:
        if regions._PER_CALL_RECOMPILE_LIMIT:
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


def test_disable_and_bad_input(monkeypatch):
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

    def fake_open_session(m, plan, kw, cache_dir, precompile):
        seen.update(model=m, plan=plan, kw=kw, cache_dir=cache_dir, precompile=precompile)
        return None

    from compile_cache import cache

    monkeypatch.setattr(cache, "open_session", fake_open_session)
    compile_regions(model, backend="eager", cache_dir="/tmp/x")
    assert seen["model"] is model and seen["kw"] == {"backend": "eager"}
    assert seen["cache_dir"] == "/tmp/x" and seen["plan"].groups
    assert seen["precompile"] is False


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
