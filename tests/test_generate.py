"""``model.generate()`` of transformers models under compile_regions (the KV cache in regions:
compile_cache/torch_compat/kv/cache.py, compile_cache/regions.py).

Every case compares token ids with eager generation of the same model. Graph counting uses a
recording backend (tests/conftest.py); real Inductor runs only in the fresh-node test, in child
processes (tests/_generate_child.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import child_pythonpath
from torch import nn

from compile_cache import compile_regions, get_plan, last_report, region_stats, torch_compat
from compile_cache.regions import (
    RegionEagerWarning,
    RegionPrecompileWarning,
    RegionRecompileWarning,
)
from compile_cache.store import Store
from compile_cache.torch_compat import TorchCompatWarning
from compile_cache.torch_compat.kv import cache as kv_cache
from compile_cache.torch_compat.kv import calls as kv_calls

pytestmark = pytest.mark.usefixtures("dynamo_reset")
REGION_WARNINGS = (RegionEagerWarning, RegionRecompileWarning)


def _prompts(batch: int, length: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding on row 1
        ids[1, :3] = 0
        mask[1, :3] = 0
    return ids, mask


def _generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, *, static: bool = False,
              sample: bool = False, new: int = 5, **kw) -> torch.Tensor:
    kw.update(max_new_tokens=new, min_new_tokens=new, do_sample=sample, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    if sample:
        torch.manual_seed(7)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **kw)


def _region(model: nn.Module) -> dict[str, int]:
    return region_stats(model)[get_plan(model).groups[0].code_name]


def _region_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, REGION_WARNINGS)]


@pytest.mark.parametrize(
    ("arch", "layers", "static", "batch"),
    [
        ("llama", 2, False, 1), ("llama", 4, False, 2), ("llama", 2, True, 2), ("llama", 4, True, 1),
        ("gpt2", 2, False, 2), ("gpt2", 4, False, 1), ("gpt2", 2, True, 1), ("gpt2", 4, True, 2),
    ],
    ids=["llama-2-dynamic-b1", "llama-4-dynamic-b2", "llama-2-static-b2", "llama-4-static-b1",
         "gpt2-2-dynamic-b2", "gpt2-4-dynamic-b1", "gpt2-2-static-b1", "gpt2-4-static-b2"],
)
def test_generate_matches_eager_with_one_entry_per_phase(
    counting_backend, tiny_llama, tiny_gpt2, arch, layers, static, batch
):
    model = (tiny_llama(layers=layers) if arch == "llama" else tiny_gpt2(n_layer=layers)).eval()
    ids, mask = _prompts(batch)
    ref = _generate(model, ids, mask, static=static)
    compile_regions(model, backend=counting_backend, cache_dir=False)
    assert model.generation_config.disable_compile is True  # transformers' own compile stays off
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _generate(model, ids, mask, static=static)
        graphs = len(counting_backend.graphs)
        again = _generate(model, ids, mask, static=static)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    assert _region_warnings(caught) == []
    # prefill and decode: one entry each, whatever the number of layers, none per token
    region = _region(model)
    assert region["cache_entries"] == 2, region
    assert region["eager_calls"] == 0 and region["block_recompiles"] == 0
    # the prefill is two graphs around the eager cache update, a decode step is one graph; the
    # compiled parts outside the regions (Llama's final norm; its rotary embedding, which
    # holds no parameters, stays eager) one per phase
    assert graphs == 3 + 2 * len(get_plan(model).compiled_rest)
    assert len(counting_backend.graphs) == graphs  # the second generate compiled nothing


@pytest.mark.parametrize("static", [False, True], ids=["dynamic_cache", "static_cache"])
def test_sampled_generate_with_a_seed_matches_eager(counting_backend, tiny_llama, static):
    model = tiny_llama(layers=3).eval()
    ids, mask = _prompts(2)
    ref = _generate(model, ids, mask, static=static, sample=True)
    compile_regions(model, backend=counting_backend, cache_dir=False)
    assert torch.equal(_generate(model, ids, mask, static=static, sample=True), ref)
    assert _region(model)["cache_entries"] == 2


def test_transformers_decode_compile_does_not_trace_through_the_regions(counting_backend, tiny_llama):
    """generate() would wrap the whole forward in torch.compile for a static cache on a GPU (here
    forced with _compile_all_devices); compile_regions turns that off for its model."""
    from transformers import CompileConfig

    model = tiny_llama(layers=2).eval()
    ids, mask = _prompts(1)
    ref = _generate(model, ids, mask, static=True)
    compile_regions(model, backend=counting_backend, cache_dir=False)
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _generate(model, ids, mask, static=True, compile_config=config)
    assert torch.equal(out, ref) and _region_warnings(caught) == []
    assert _region(model)["cache_entries"] == 2


def test_a_full_compile_elsewhere_still_traces_the_cache_update(counting_backend, tiny_llama):
    """The eager cache update is scoped to compile_cache's regions: a user's own fullgraph compile
    of another model's forward still has the update in its one graph."""
    from transformers import StaticCache

    regional = tiny_llama(layers=2).eval()
    compile_regions(regional, backend=counting_backend, cache_dir=False)
    ids, mask = _prompts(1)
    _generate(regional, ids, mask)
    other = tiny_llama(layers=2).eval()
    full = torch.compile(other.forward, backend="eager", fullgraph=True)  # raises on a break
    with torch.no_grad():
        cache, ref_cache = (StaticCache(config=other.config, max_cache_len=32) for _ in range(2))
        out = full(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        ref = other(input_ids=ids, attention_mask=mask, cache=ref_cache, use_cache=True)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(cache.layers[1].keys, ref_cache.layers[1].keys)


def test_fullgraph_compiles_per_block_names_the_cache_and_stays_compiled(counting_backend, tiny_llama):
    model = tiny_llama(layers=3).eval()
    ids, mask = _prompts(1)
    ref = _generate(model, ids, mask)
    compile_regions(model, backend=counting_backend, fullgraph=True, cache_dir=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _generate(model, ids, mask)
    assert torch.equal(out, ref)
    recompiles = [str(w.message) for w in caught if issubclass(w.category, RegionRecompileWarning)]
    assert len(recompiles) == 1, recompiles
    assert "reads the KV cache at each block's own layer index" in recompiles[0]
    assert "kwargs['cache'].layers[0]" in recompiles[0]  # the failing guard
    assert "use_cache=False" in recompiles[0] and "model.generate()" in recompiles[0]
    assert not [w for w in caught if issubclass(w.category, RegionEagerWarning)]
    # per block: prefill, first decode step, dynamic decode; the limit allows size x phases
    region = _region(model)
    assert region["eager_calls"] == 0 and region["cache_entries"] == 9
    runner = model.model.layers[0]._compiled_call_impl
    assert runner.state.limit == max(torch._dynamo.config.recompile_limit, 3 * kv_cache.PHASES)


def test_recompile_limit_allows_group_size_times_phases(tiny_llama):
    model = tiny_llama(layers=6).eval()
    compile_regions(model, backend="eager", cache_dir=False)
    runner = model.model.layers[0]._compiled_call_impl
    assert runner.state.limit == max(torch._dynamo.config.recompile_limit, 6 * kv_cache.PHASES)
    compile_regions(model, backend="eager", cache_dir=False, recompile_limit=40)
    assert model.model.layers[0]._compiled_call_impl.state.limit == 40


@pytest.mark.parametrize("views", [True, False], ids=["layer_view", "eager_update"])
def test_decode_past_the_recompile_limit_is_reported(counting_backend, tiny_llama, monkeypatch, views):
    """dynamic=False with a DynamicCache recompiles at every decode step: past the limit the block
    (with the view) or the part after the eager update (a resume function) runs uncompiled, and
    that is warned and counted, with the cache's advice."""
    monkeypatch.setattr(kv_calls.CacheCalls, "use_views", views)
    model = tiny_llama(layers=2).eval()
    model.set_attn_implementation("sdpa")  # decode without a mask: only the KV length changes
    ids, mask = _prompts(1)
    ref = _generate(model, ids, mask, new=10)
    compile_regions(model, backend=counting_backend, dynamic=False, recompile_limit=4, cache_dir=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _generate(model, ids, mask, new=10)
    assert torch.equal(out, ref)
    eager = [str(w.message) for w in caught if issubclass(w.category, RegionEagerWarning)]
    assert eager and all("recompile limit" in m and "dynamic=False" in m for m in eager)
    if not views:
        assert any("the part after a graph break" in m for m in eager)
    assert _region(model)["eager_calls"] > 0


def test_precompile_is_declined_for_blocks_that_take_a_cache(tiny_llama, tmp_path):
    model = tiny_llama(layers=2).eval()
    ids, mask = _prompts(1)
    ref = _generate(model, ids, mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_regions(model, backend="eager", precompile=True, cache_dir=tmp_path / "store")
        out = _generate(model, ids, mask)
    assert not torch._dynamo.config.caching_precompile  # never turned on for the process
    # the cache reason is warned once (the backend's, which every part declines for, too)
    declined = [str(w.message) for w in caught if issubclass(w.category, RegionPrecompileWarning)
                and "KV cache" in str(w.message)]
    assert len(declined) == 1 and "LlamaDecoderLayer" in declined[0]
    group = get_plan(model).groups[0].code_name
    reported = last_report().precompile_groups[group]
    assert reported["status"] == "declined" and "backend 'eager'" in reported["reason"]
    assert "KV cache" in reported["cache_calls"]  # and its cache calls would compile plain anyway
    assert last_report().precompile_declined >= 1
    assert Store(tmp_path / "store").stats()["precompile_declined"] >= 1
    assert torch.equal(out, ref)
    assert _region(model)["cache_entries"] == 2


# ------------------------------------------------------------- blocks that are not what they seem


class _Attention(nn.Module):
    """A toy attention block that keeps its keys and values in a transformers Cache."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, layer_idx: int, cache=None) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # (batch, 1 head, tokens, width)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        att = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        return x + self.out((att @ v).squeeze(1))


class _SharedDepths(nn.Module):
    """Two identical blocks run at three depths: block 0 at depths 0 and 2 (cache layers 0 and 2),
    block 1 at depth 1 with cache layer 3. Binding a block's view to "its" layer by position or by
    its first call would read the wrong layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Attention(), _Attention()])
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        for block, layer in ((self.blocks[0], 0), (self.blocks[1], 3), (self.blocks[0], 2)):
            x = block(x, layer, cache=cache)
        return self.head(x)


def _decode(model: nn.Module, steps: int = 4) -> list[torch.Tensor]:
    from transformers import DynamicCache

    cache = DynamicCache()
    torch.manual_seed(1)
    x = torch.randn(2, 6, 16)
    outs = []
    with torch.no_grad():
        for _ in range(steps):
            y = model(x, cache=cache)
            outs.append(y)
            x = y[:, -1:]  # one new token per step, as a decode does
    return outs


def test_blocks_updating_other_layers_than_expected_stay_correct(counting_backend):
    model = _SharedDepths().eval()
    ref = _decode(model)
    compile_regions(model, backend=counting_backend, cache_dir=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _decode(model)
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want)
    assert not [w for w in caught if issubclass(w.category, RegionEagerWarning)]
    calls = model.blocks[0]._compiled_call_impl.state.cache_calls
    assert calls.bindings[model.blocks[0]._compiled_call_impl] is None  # two layers: never viewed
    assert calls.bindings[model.blocks[1]._compiled_call_impl][1] == 3  # the layer it updated
    assert calls.view_calls > 0  # block 1's decode steps went through its view of layer 3


class _Rerouted(nn.Module):
    """Two identical blocks; after the first decode step the model sends block 1 to a new cache
    layer, by argument (``by="argument"``) or by changing its attribute (``by="attribute"``). A
    view still bound to the layer block 1 first updated would write the wrong one."""

    def __init__(self, by: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Attention(), _Attention()])
        for index, block in enumerate(self.blocks):
            block.layer_idx = index
        self.by, self.step = by, 0

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        self.step += 1
        if self.step == 3:  # the second decode step
            self.blocks[1].layer_idx = 2
        for block in self.blocks:
            layer = block.layer_idx if self.by == "argument" else None
            x = block(x, layer, cache=cache) if layer is not None else block(x, cache=cache)
        return x


class _AttentionByAttribute(_Attention):
    def forward(self, x: torch.Tensor, layer_idx: int | None = None, cache=None) -> torch.Tensor:
        return super().forward(x, self.layer_idx if layer_idx is None else layer_idx, cache)


def _rerouted_matches_eager(by: str, backend) -> _Rerouted:
    """A model whose block 1 moves to another layer mid-generation (by argument or attribute),
    compiled in regions: its five decode steps equal eager's; the compiled model."""

    def build() -> _Rerouted:
        model = _Rerouted(by).eval()
        for block in model.blocks:
            block.__class__ = _AttentionByAttribute
        return model

    ref = _decode(build(), steps=5)
    model = build()
    compile_regions(model, backend=backend, cache_dir=False)
    out = _decode(model, steps=5)
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want)
    return model


@pytest.mark.parametrize("by", ["argument", "attribute"])
def test_a_block_sent_to_another_layer_mid_generation_stays_correct(counting_backend, by):
    model = _rerouted_matches_eager(by, counting_backend)
    calls = model.blocks[0]._compiled_call_impl.state.cache_calls
    assert calls.view_calls > 0  # the views were used before and after the change
    assert calls.bindings[model.blocks[1]._compiled_call_impl] is None  # two layers: no more view


def test_a_view_returned_by_a_block_acts_as_the_cache():
    from transformers import DynamicCache

    cache = DynamicCache()
    k = torch.randn(1, 1, 2, 4)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    view = kv_calls._make_view(cache, cache.layers[1])
    assert isinstance(view, DynamicCache) and view.get_seq_length() == 2 and len(view) == 2
    view.update(k, k, 1)  # bound: layer 1 only
    assert [layer.keys.shape[-2] for layer in cache.layers] == [2, 4]
    view.__dict__["_cc_layer"] = None  # the region call ended
    view.update(k, k, 0)  # the cache's own update, by index
    assert [layer.keys.shape[-2] for layer in cache.layers] == [4, 4]
    view.custom = 1
    assert cache.custom == 1


class _Routed:
    """A member's compiled call as CacheCalls sees it (precompiled.CacheRoutedCall), run as is:
    ``traced_call`` (the group's precompiled cache-calls function; None once it declined) and the
    call itself (the view, or the eager update); ``paths`` says which each call took."""

    def __init__(self, block: nn.Module, traced: bool = True) -> None:
        self.__self__ = block
        self.paths: list[str] = []
        self.traced_call = self._traced if traced else None

    def _traced(self, *args, **kwargs):
        self.paths.append("traced" if not kv_cache.SCOPE.active else "traced in scope")
        return self.__self__(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.paths.append("view" if kv_calls.is_view(kwargs.get("cache")) else "eager")
        return self.__self__(*args, **kwargs)


class _TwoLayers(_Attention):
    """Updates two cache layers in one call (a block holding two attention layers)."""

    def forward(self, x: torch.Tensor, layer_idx: int, cache=None) -> torch.Tensor:
        return super().forward(super().forward(x, layer_idx, cache), layer_idx + 1, cache)


def _new_cache(kind: str, layers: int):
    from transformers import DynamicCache, PretrainedConfig, StaticCache

    config = PretrainedConfig(num_hidden_layers=layers)
    return DynamicCache(config=config) if kind == "dynamic" else StaticCache(config=config, max_cache_len=32)


def _group_calls(plan: list[tuple[nn.Module, int]], kind: str, cache_layers: int,
                 traced: bool = True, steps: int = 3) -> tuple[kv_calls.CacheCalls, list[_Routed], list]:
    """A prefill of 6 tokens and ``steps`` decode steps through one group's CacheCalls
    (``plan``: block and layer index per depth), each output compared with the same blocks
    called eagerly on a cache of their own; returns the CacheCalls, the members' routed calls
    and their runners (what the bindings are keyed by)."""
    calls = kv_calls.CacheCalls.for_block(plan[0][0].forward)
    calls.traced_updates = True
    members: dict[int, tuple[_Routed, Any]] = {}
    for block, _ in plan:
        members.setdefault(id(block), (_Routed(block, traced), type("Runner", (), {})()))
    cache, ref_cache = _new_cache(kind, cache_layers), _new_cache(kind, cache_layers)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for _ in range(steps + 1):
            y, want = x, x
            for block, layer in plan:
                routed, runner = members[id(block)]
                y = calls.call(runner, routed, (y, layer), {"cache": cache})
                want = block(want, layer, cache=ref_cache)
            torch.testing.assert_close(y, want)
            x = y[:, -1:]
    return calls, [m[0] for m in members.values()], [m[1] for m in members.values()]


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_traced_update_proves_the_view_of_the_one_layer_it_changed(kind):
    """A group that precompiles runs its prefill with the cache update traced into the graph (no
    eager update records which layer it wrote): what changed in the cache proves the view."""
    torch.manual_seed(0)
    blocks = [_Attention(), _Attention()]
    calls, routed, runners = _group_calls([(blocks[0], 0), (blocks[1], 1)], kind, 2)
    assert [r.paths for r in routed] == [["traced", "view", "view", "view"]] * 2
    assert [calls.bindings[r][1] for r in runners] == [0, 1]
    assert (calls.traced_update_calls, calls.view_calls, calls.eager_update_calls) == (2, 6, 0)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_traced_update_of_two_layers_proves_no_view(kind):
    """Block 1 writes layers 0 and 1 in one call, layer 0 after block 0 initialised it: a
    StaticLayer is written in place (same tensors, and no version bump under no_grad in a compiled
    graph), so only its cumulative_length shows the second write. Bound to layer 1 alone, its
    view would send both writes there."""
    torch.manual_seed(0)
    first, both = _Attention(), _TwoLayers()
    cache = _new_cache(kind, 3)
    with torch.no_grad():
        first(torch.randn(1, 4, 16), 0, cache=cache)
        before = kv_calls._layer_states(cache)
        both(torch.randn(1, 4, 16), 0, cache=cache)
    assert [index for _, _, index in kv_calls._updated_layers(cache, before)] == [0, 1]
    calls, routed, runners = _group_calls([(first, 0), (both, 0)], kind, 3)
    assert calls.bindings[runners[0]][1] == 0 and calls.bindings[runners[1]] is None
    assert routed[1].paths == ["traced"] * 4  # never viewed: every call traced again


def test_without_a_traced_function_the_eager_update_proves_the_view():
    """The group's cache-calls function declined (``traced_call`` None): the eager update, as before."""
    kv_cache.install()
    torch.manual_seed(0)
    blocks = [_Attention(), _Attention()]
    calls, routed, _ = _group_calls([(blocks[0], 0), (blocks[1], 1)], "dynamic", 2, traced=False)
    assert [r.paths for r in routed] == [["eager", "view", "view", "view"]] * 2
    assert (calls.traced_update_calls, calls.eager_update_calls) == (0, 2)


def test_a_cache_the_view_cannot_serve_ends_the_binding():
    from transformers import DynamicCache, EncoderDecoderCache

    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    assert kv_calls._layer_states(cache) is None
    assert kv_calls._updated_layers(cache, None) == [(cache, "update", None)]


def test_groups_up_to_the_traced_limit_take_the_traced_update():
    forward = _Attention().forward
    for size, traced in ((2, True), (kv_calls.TRACED_MAX_BLOCKS, True),
                         (kv_calls.TRACED_MAX_BLOCKS + 1, False)):
        takes, calls = kv_calls.CacheCalls.for_group(forward, size, {}, ())
        assert takes and calls is not None and calls.traced_updates is traced
    assert kv_calls.CacheCalls.for_group(forward, 2, {"fullgraph": True}, ()) == (True, None)


def test_a_view_class_pickles_by_reference_in_a_fresh_process():
    """A precompiled decode entry guards on the view's class, which pickle saves by name: a
    fresh process that has made no view yet finds the same class under that name."""
    import pickle

    from transformers.cache_utils import DynamicCache, StaticCache

    for cls in (DynamicCache, StaticCache):
        view_cls = type(kv_calls._make_view(object.__new__(cls), None))
        assert pickle.loads(pickle.dumps(view_cls)) is view_cls
        code = ("import pickle, sys, transformers.cache_utils as cu; "
                "from compile_cache.torch_compat.kv import calls as kv_calls; "
                "c = pickle.loads(sys.stdin.buffer.read()); "
                f"assert c.__mro__[2] is cu.{cls.__name__} and kv_calls.is_view(object.__new__(c))")
        done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(view_cls),
                              capture_output=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    with pytest.raises(AttributeError, match="LayerView_NoSuchCache"):
        kv_calls.LayerView_NoSuchCache  # noqa: B018 - only the cache classes a view serves


def test_cache_guard_finds_per_layer_cache_guards_only():
    reasons = (
        "0/0: tensor 'args[0]' size mismatch at index 1. expected 12, actual 1\n"
        "0/1: kwargs['cache'].layers[0].is_initialized == False  # if not self.is_initialized:"
    )
    assert kv_cache.cache_guard(reasons) == "kwargs['cache'].layers[0].is_initialized == False"
    assert kv_cache.cache_guard("0/0: args[1].layers[2].keys size mismatch") == ""  # no cache name
    assert kv_cache.cache_guard("0/0: self._modules['attn'].layer_idx == 1") == ""


def test_without_nested_graph_breaks_the_blocks_compile_per_block_and_say_so(
    counting_backend, tiny_llama, monkeypatch, fresh_state
):
    original = torch._dynamo.disable

    def disable(fn=None, recursive=True, **kwargs):  # a torch whose disable() takes no reason=
        return original(fn, recursive, **kwargs)

    monkeypatch.setattr(torch._dynamo, "disable", disable)
    torch_compat._reset()
    model = tiny_llama(layers=2).eval()
    ids, mask = _prompts(1)
    ref = _generate(model, ids, mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_regions(model, backend=counting_backend, cache_dir=False)
        out = _generate(model, ids, mask)
    assert torch.equal(out, ref)
    compat = [str(w.message) for w in caught if issubclass(w.category, TorchCompatWarning)]
    assert len(compat) == 1 and "dynamo.nested_graph_breaks" in compat[0]
    assert "dynamo.nested_graph_breaks" in torch_compat.degraded()
    recompiles = [str(w.message) for w in caught if issubclass(w.category, RegionRecompileWarning)]
    assert len(recompiles) == 1 and "use_cache=False" in recompiles[0]
    assert _region(model)["eager_calls"] == 0  # the limit (size x phases) keeps it compiled


# ------------------------------------------------------------- a fresh node, real Inductor

CHILD = Path(__file__).with_name("_generate_child.py")


def _fresh_node_run(root: Path, store: Path, *args: str, machine: Path | None = None) -> dict:
    """One process on a fresh node: new TMPDIR, HOME, XDG_CACHE_HOME and local cache dirs; with
    ``machine`` (conftest.build_machine), a publisher on that build machine: its temp dir, home
    and torch's precompiled header there, local cache dirs of its own (it compiles cold)."""
    dirs = {name: root / name for name in ("tmp", "home", "xdg", "inductor", "triton")}
    if machine is not None:
        dirs.update({name: machine / name for name in ("tmp", "home", "xdg")})
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=machine is not None and path.parent == machine)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COMPILE_CACHE_", "TORCHINDUCTOR_", "TRITON_"))}
    env.update(TMPDIR=str(dirs["tmp"]), HOME=str(dirs["home"]), XDG_CACHE_HOME=str(dirs["xdg"]),
               TORCHINDUCTOR_CACHE_DIR=str(dirs["inductor"]), TRITON_CACHE_DIR=str(dirs["triton"]),
               PYTHONPATH=child_pythonpath(env=env),
               COMPILE_CACHE_PRECOMPILE="1")  # what the store holds: precompiled entries
    done = subprocess.run([sys.executable, str(CHILD), str(store), *args], env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.inductor
def test_fresh_node_restores_every_generate_graph(tmp_path, build_machine):
    store = tmp_path / "store"
    cold = _fresh_node_run(tmp_path / "node-a", store, machine=build_machine)
    warm = _fresh_node_run(tmp_path / "node-b", store)
    for arch in ("llama", "gpt2"):
        first, second = cold[arch], warm[arch]
        assert first["equal"] and second["equal"], (arch, first, second)  # Inductor, fp32
        assert first["fx_misses"] > 0 and first["published_packs"] > 0 and not first["errors"]
        assert second["restored_packs"] == first["published_packs"], (arch, second)
        # nothing compiled, and nothing looked up either: every call's code was precompiled
        # (once the prefill's FX graphs were FX-cache hits: it traced, issue 35)
        assert second["fx_misses"] == 0 and second["fx_hits"] == 0, (arch, second)
        # Every group's code came from the store as precompiled entries: the blocks' prefill
        # calls (the cache update traced into the graph, one entry per block; issue 35), their
        # decode steps (the layer view, which the traced prefill proved) and the other groups.
        groups = second["precompile_groups"]
        # (the blocks' own function, for calls without a cache, is unused: generate() passes one)
        assert all(g["status"] in ("loaded", "unused") and "cache_calls" not in g
                   for g in groups.values()), groups
        for suffix in ("__views", "__cache"):
            entry = [g for name, g in groups.items() if name.endswith(suffix)]
            assert [g["status"] for g in entry] == ["loaded"], (arch, suffix, groups)
        assert second["precompile_hits"] == sum(g["status"] == "loaded" for g in groups.values())
        if not second["precompile_hits"]:  # every graph an FX-graph hit
            assert second["fx_hits"] == first["fx_misses"], (arch, second)
        assert second["published_packs"] == 0 and not second["errors"]
        for stats in (first["stats"], second["stats"]):
            assert all(s["eager_calls"] == 0 for s in stats.values()), stats
    # Llama runs first in its process: on the fresh node Dynamo traced nothing (once, only the
    # prefill's two frames before and after the eager cache update).
    assert warm["llama"]["frames_traced"] == 0 < cold["llama"]["frames_traced"], warm["llama"]

    # A third fresh node generates what the store's entries were not made with, on the same
    # models (one key): Llama with another prompt length, padding and number of new tokens (its
    # decode steps run the loaded decode entry at KV lengths it never saw), then with a static
    # cache (another view class); GPT-2 with a DynamicCache where the store's came from a static
    # cache. Every generate must give eager's token ids, whatever the store holds.
    varied = _fresh_node_run(tmp_path / "node-c", store, "vary")
    for arch in ("llama", "gpt2"):
        assert varied[arch]["equal"] and all(varied[arch]["equal"]), (arch, varied[arch])
        assert varied[arch]["restored_packs"] >= 1 and not varied[arch]["errors"], varied[arch]
        assert all(s["eager_calls"] == 0 for s in varied[arch]["stats"].values()), varied[arch]
    llama_decode = [g for name, g in varied["llama"]["precompile_groups"].items() if name.endswith("__views")]
    assert [g["status"] for g in llama_decode] == ["loaded"], varied["llama"]["precompile_groups"]


def test_a_block_sent_to_another_layer_stays_correct_on_a_torch_without_isolate_recompiles(
        counting_backend, monkeypatch):
    """torch 2.11's shape: no ``isolate_recompiles``, so each group is a plain ``torch.compile``.
    The compiled call must still be bound to its block (``__self__``): CacheCalls reads the
    block's ``layer_idx`` through it. Up to c50a859 it was not, and a block moved to another
    layer by attribute wrote and read its old layer (off by 0.42 on torch 2.11)."""
    from compile_cache.torch_compat import dynamo

    monkeypatch.setattr(dynamo, "compile_group", lambda fn, key, **kw: None)
    model = _rerouted_matches_eager("attribute", counting_backend)
    assert model.blocks[1]._compiled_call_impl.compiled.__self__ is model.blocks[1]
