"""compile_cache.torch_compat.kv.wrapped_forward: kernels' attention wrapper inside regions.

transformers 5.25 requires kernels 0.19, whose ``use_kernelized_func`` wraps ``LlamaAttention.
forward`` in a try/finally; Dynamo cannot resume the eager KV-cache update's graph break inside
it, so Llama's blocks called with a cache compiled once per block (6 graphs where 4 are right).
The lock's transformers (5.23) has no such wrapper: here a package laid out as kernels 0.19's
(``kernels._internals.layer.layer``, its wrapper's source as kernels has it) wraps the tiny
Llama's attention class, the newer shape on the lock's versions.
"""

from __future__ import annotations

import sys
import textwrap
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from compile_cache import compile_regions, fingerprint
from compile_cache.regions import RegionEagerWarning, RegionRecompileWarning, get_plan, region_stats
from compile_cache.torch_compat.kv import wrapped_forward

LAYER = '''\
import functools
from contextvars import ContextVar


class CompileableContextVar:
    def __init__(self, name):
        self.context_var = ContextVar(name, default=None)
        self.global_var = None
        self.uses_global_var = False

    def get(self):
        import torch

        if self.uses_global_var or torch.compiler.is_compiling():
            return self.global_var
        return self.context_var.get()

    def set(self, value):
        import torch

        if self.uses_global_var or torch.compiler.is_compiling():
            previous = self.global_var
            self.global_var = value
            self.uses_global_var = True
            return previous

        return self.context_var.set(value)

    def reset(self, token):
        if self.uses_global_var:
            self.global_var = token
            self.uses_global_var = token is not None
        else:
            self.context_var.reset(token)


_ACTIVE_KERNEL_FUNCS = CompileableContextVar("_ACTIVE_KERNEL_FUNCS")


class RotaryStub:
    """Stands for a kernel function (kernels makes each an nn.Module instance)."""

    kernel_layer_name = "rotary_pos_emb"

    def forward(self, *args):
        return args


rotary_pos_emb = RotaryStub()


def use_kernelized_func(*args):
    decorator_args = args

    def decorator(cls):
        orig_init = cls.__init__
        orig_forward = cls.forward

        def new_init(self, *args, **kwargs):
            orig_init(self, *args, **kwargs)
            hidden_kernels = self.__dict__.setdefault("_kernel_funcs", {})
            for fn in decorator_args:
                name = getattr(fn, "__name__", None) or getattr(fn, "kernel_layer_name", None)
                hidden_kernels[name] = type(fn)()

'''


def _real_kernels() -> Any:
    """kernels' layer module when transformers' LlamaAttention is wrapped by it (transformers
    >= 5.25 with kernels installed: make test-latest), else None."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    # kernels' decorator replaces __init__ too, and compile_cache's stand-in (installed by an
    # earlier test of the process) only the forward: the class is kernels' whatever ran before
    if "use_kernelized_func" not in getattr(LlamaAttention.__init__, "__qualname__", ""):
        return None
    return sys.modules["kernels._internals.layer.layer"]


@pytest.fixture
def kernels_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """kernels 0.19's layer module, as far as the wrapper goes (the real one where transformers
    already uses it)."""
    real = _real_kernels()
    if real is not None:
        yield real
        wrapped_forward.uninstall()
        return
    package = tmp_path / "kernels" / "_internals" / "layer"
    package.mkdir(parents=True)
    for folder in (tmp_path / "kernels", tmp_path / "kernels" / "_internals", package):
        (folder / "__init__.py").write_text("")
    tail = "        cls.__init__ = new_init\n        cls.forward = new_forward\n        return cls\n\n    return decorator\n"
    (package / "layer.py").write_text(
        LAYER + textwrap.indent(wrapped_forward.KNOWN_SOURCE, " " * 8) + "\n" + tail)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    import kernels._internals.layer.layer as layer

    yield layer
    wrapped_forward.uninstall()
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        del sys.modules[name]


def _kernelized_llama(tiny_llama: Any, layer: Any) -> torch.nn.Module:
    if _real_kernels() is layer:  # transformers' own LlamaAttention is kernels-wrapped
        return tiny_llama(layers=3).eval()
    from transformers.models.llama.modeling_llama import LlamaAttention

    class KernelizedAttention(LlamaAttention):
        """LlamaAttention as transformers 5.25 defines it with kernels installed."""

    layer.use_kernelized_func(layer.rotary_pos_emb)(KernelizedAttention)
    model = tiny_llama(layers=3).eval()
    for block in model.model.layers:
        block.self_attn.__class__ = KernelizedAttention
        block.self_attn._kernel_funcs = {"rotary_pos_emb": layer.RotaryStub()}
    return model


def test_llama_blocks_with_kernels_wrapper_share_one_graph_per_group_with_a_kv_cache(
        counting_backend: Any, tiny_llama: Any, kernels_layer: Any) -> None:
    model = _kernelized_llama(tiny_llama, kernels_layer)
    assert wrapped_forward._probe() is None
    x = torch.randint(0, 128, (1, 12))
    key_before = fingerprint(model)
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        compile_regions(model, backend=counting_backend, cache_dir=False)
        torch.testing.assert_close(model(x, use_cache=False).logits, ref)
        graphs = len(counting_backend.graphs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.testing.assert_close(model(x).logits, ref)
    assert not [w for w in caught if issubclass(w.category, (RegionRecompileWarning, RegionEagerWarning))]
    # the block before and after the eager cache update, for the whole group (before: 4 more,
    # the attention traced on its own for each block)
    assert len(counting_backend.graphs) == graphs + 2
    group = get_plan(model).groups[0].code_name
    assert region_stats(model)[group]["block_recompiles"] == 0
    assert region_stats(model)[group]["eager_calls"] == 0
    # the context variable was reset as kernels' finally resets it
    var = kernels_layer._ACTIVE_KERNEL_FUNCS
    assert var.global_var is None and var.uses_global_var is False
    # the key is the same whether the stand-in is installed or not
    assert fingerprint(model) == key_before


def _kernelize(attention: torch.nn.Module) -> None:
    """What kernels' ``kernelize`` does to an instance's private kernel functions: each gets a
    forward of its own (here the same code, bound: the outputs stay eager's)."""
    for function in attention._kernel_funcs.values():
        function.forward = types.MethodType(type(function).forward, function)


@pytest.mark.parametrize("kernelized", [False, True])
def test_an_exception_in_a_region_call_puts_kernels_context_back(
        counting_backend: Any, tiny_llama: Any, kernels_layer: Any, kernelized: bool) -> None:
    """Without the wrapper's finally, a cache update that raises (between two graphs, after the
    traced code set the dispatch map: kernelized private kernel functions) would leave the map
    set for every later call outside a layer: the region runner puts it back."""
    from transformers import DynamicCache

    class BrokenCache(DynamicCache):
        def update(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a cache that fails")

    model = _kernelized_llama(tiny_llama, kernels_layer)
    if kernelized:
        for block in model.model.layers:
            _kernelize(block.self_attn)
    compile_regions(model, backend=counting_backend, cache_dir=False)
    x = torch.randint(0, 128, (1, 12))
    var = kernels_layer._ACTIVE_KERNEL_FUNCS
    with torch.no_grad():
        model(x)
        assert var.global_var is None and var.uses_global_var is False
        with pytest.raises(RuntimeError, match="a cache that fails"):
            model(x, past_key_values=BrokenCache())
    assert var.global_var is None and var.uses_global_var is False


def test_a_wrapper_of_unknown_source_is_left_alone(tiny_llama: Any, kernels_layer: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = _kernelized_llama(tiny_llama, kernels_layer)
    cls = type(model.model.layers[0].self_attn)
    wrapper = cls.__dict__["forward"]
    assert wrapped_forward.install(model.modules()) == 1
    wrapped_forward.uninstall()
    assert cls.__dict__["forward"] is wrapper
    monkeypatch.setattr(wrapped_forward, "KNOWN_SOURCE",
                        wrapped_forward.KNOWN_SOURCE.replace("finally:", "finally:  # another"))
    assert wrapped_forward.install(model.modules()) == 0
    assert cls.__dict__["forward"] is wrapper


@pytest.mark.parametrize("kernelized", [False, True])
def test_traced_stand_in_reads_the_dispatch_map_only_for_kernelized_functions(
        tiny_llama: Any, kernels_layer: Any, monkeypatch: pytest.MonkeyPatch,
        kernelized: bool) -> None:
    """While traced, an attention whose private kernel functions are not kernelized runs its
    class's own forward: the dispatch map (keyed by ids, holding kernels' locally defined
    function classes, which no saved entry can carry) would change nothing, and is never set;
    kernelized ones set it as kernels' wrapper does. Same outputs either way."""
    from compile_cache.torch_compat.kv import cache as kv_cache

    model = _kernelized_llama(tiny_llama, kernels_layer).eval()
    attention = model.model.layers[0].self_attn
    assert wrapped_forward.install(model.modules()) == 1
    if kernelized:
        _kernelize(attention)
    hidden = torch.randn(1, 5, 64)
    rotary = model.model.rotary_emb(hidden, torch.arange(5)[None])
    with torch.no_grad():
        ref = attention(hidden, position_embeddings=rotary, attention_mask=None)[0]
    var = kernels_layer._ACTIVE_KERNEL_FUNCS
    maps: list[Any] = []
    monkeypatch.setattr(var, "set", lambda value: maps.append(value) or type(var).set(var, value))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as Dynamo traces it
    monkeypatch.setattr(kv_cache.SCOPE, "active", True)  # a region's call
    with torch.no_grad():
        out = attention(hidden, position_embeddings=rotary, attention_mask=None)[0]
    torch.testing.assert_close(out, ref)
    if kernelized:
        assert len(maps) == 1
        assert [entry[0] for entry in maps[0].values()] == list(attention._kernel_funcs.values())
    else:
        assert maps == []
    assert var.global_var is None and var.uses_global_var is False
