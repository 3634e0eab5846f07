"""Issue 35 in process (no Inductor): objects a block stores are recorded by identity (pins on
the block), a decline in the region's own frame ends the call before anything runs, warnings
name the guard that failed, flags split groups, embeddings stay eager, and a block is a KV-cache
block only once a call passes a cache. The two-process cases are in test_precompile_values.py
and test_architectures.py."""

from __future__ import annotations

import functools
import types
import uuid
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from compile_cache.plan import plan_regions
from compile_cache.regions import RegionRecompileWarning, _GroupState, recompile_cause
from compile_cache.torch_compat import precompile as pc
from compile_cache.torch_compat.precompile.guards import DECLINE, DROP, PINNED, classify_guard
from compile_cache.torch_compat.precompile.pins import Pins, describe, verify

D = 8


class _Entry:
    """A stand-in for torch's GuardFilterEntry (names as torch hands them: ``L[...]`` stripped)."""

    def __init__(self, guard_type: str, name: str, value: Any, *, is_global: bool = False,
                 derived: tuple[str, ...] = ("ID_MATCH",)) -> None:
        self.guard_type, self.name, self.value = guard_type, name, value
        self.has_value, self.is_global = True, is_global
        self.derived_guard_types, self.orig_guard = derived, None


def _local_function(x: torch.Tensor) -> torch.Tensor:
    return x


def _wrapped() -> None:
    """Not exported under its qualname (as an lru_cache helper's __wrapped__ is not)."""


_wrapped_alias = _wrapped
del _wrapped


@pytest.mark.parametrize(("entry", "region_frame", "action", "says"), [
    # transformers' GELUActivation.act = nn.functional.gelu, in the region's own frame: a pin
    (_Entry("BUILTIN_MATCH", "self._modules['mlp']._modules['act'].act",
            torch.nn.functional.gelu), True, DROP, PINNED),
    (_Entry("CLOSURE_MATCH", "self.act", _local_function, derived=()), True, DROP, PINNED),
    (_Entry("ID_MATCH", "self.ops", torch.nn.functional), True, DROP, PINNED),
    # the same source in another frame (after a graph break): self is not the block
    (_Entry("BUILTIN_MATCH", "self.act", torch.nn.functional.gelu), False, DECLINE,
     "traced apart from the region's call"),
    # a function passed as an argument: not on the block, not checkable per call
    (_Entry("CLOSURE_MATCH", "args[1]", _local_function, derived=()), True, DECLINE,
     "reached from the call's arguments"),
    # transformers' DynamicCache.update, reached through the class of a KV-cache argument: a
    # pin on the call (issue 53: checked at each call, against the publisher's at the first
    # call after a load)
    (_Entry("CLOSURE_MATCH", "dict(type(kwargs['past_key_values']).__mro__[1].__dict__)"
            "['update'].__closure__[1].cell_contents", _local_function, derived=()), True, DROP,
     PINNED),
    # Mamba: the torch module and torch's pytree registry, reached by __import__
    (_Entry("ID_MATCH", "__import__('torch')", torch), False, DROP, PINNED),
    (_Entry("BUILTIN_MATCH", "list(dict.keys(__import__('torch').utils._pytree.SUPPORTED_NODES))[0]",
            tuple), False, DROP, PINNED),
    # Mamba: an lru_cache helper's __wrapped__ (a global function not found by its qualname)
    (_Entry("CLOSURE_MATCH", "G['helper'].__wrapped__", _wrapped_alias, is_global=True, derived=()),
     False, DROP, PINNED),
    # CLIP: a global Dynamo installed under a name of this process; a loaded graph that used it
    # failed with NameError (___module_collections_<id>_c65) before this declined
    (_Entry("ID_MATCH", "G['_139751808275920_c65'].Tensor", torch.Tensor, is_global=True), False,
     DECLINE, "a global Dynamo installed in this process only"),
    # something with no portable description still declines
    (_Entry("ID_MATCH", "self.table", object()), True, DECLINE, "builtins.object"),
    # a property's getter, a method, reached through the block's class (issue 53): swapped after
    # compiling, the running process must see it: a pin on the block, checked at every call
    (_Entry("CLOSURE_MATCH", "dict(type(self).__dict__)['scale'].fget", _local_function,
            derived=()), True, DROP, PINNED),
    (_Entry("CLOSURE_MATCH", "dict(type(self).__dict__)['scale'].fget", _local_function,
            derived=()), False, DECLINE, "cannot be checked at each call"),
    # a module of the user's (not torch's): pinned, with the names it holds
    (_Entry("MODULE_MATCH", "G['settings']", pytest, is_global=True), False, DROP, PINNED),
    # a guard type precompile does not know declines
    (_Entry("SOME_NEW_MATCH", "self.x", 1, derived=()), True, DECLINE, "does not know"),
    (_Entry("EQUALS_MATCH", "self.x", 1, derived=("SOME_NEW_MATCH",)), True, DECLINE,
     "does not know"),
    # a value rebuilt from the loading process that has no portable description
    (_Entry("EQUALS_MATCH", "G['CONFIG']", object(), is_global=True, derived=()), False, DECLINE,
     "no portable description"),
])
def test_objects_a_block_stores_are_pinned_by_identity(entry: _Entry, region_frame: bool,
                                                      action: str, says: str) -> None:
    decision = classify_guard(entry, region_frame=region_frame)
    assert decision.action == action and says in decision.reason, decision


class Act(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.act = fn


class StoredBlock(nn.Module):
    def __init__(self, fn: Any = torch.nn.functional.gelu) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.mlp = Act(fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.act(self.lin(x))


SOURCE = "self._modules['mlp'].act"


def test_a_pin_on_the_block_is_checked_on_the_block_called() -> None:
    a, b = StoredBlock(), StoredBlock()
    pins = Pins({})
    pins.add({SOURCE: a.mlp.act})
    assert pins.changed(a) is None and pins.changed(b) is None
    b.mlp.act = torch.relu  # set after compiling, or another block of the group
    moved = pins.changed(b)
    assert moved is not None and SOURCE in moved and "relu" in moved and "gelu" in moved
    assert pins.changed(a) is None  # per block: a still holds gelu


def test_a_function_made_per_block_with_the_same_code_is_accepted() -> None:
    def make() -> Any:
        return lambda x: x * 2

    a, b = StoredBlock(make()), StoredBlock(make())
    assert a.mlp.act is not b.mlp.act
    pins = Pins({})
    pins.add({SOURCE: a.mlp.act})
    assert pins.changed(b) is None  # same qualified name and code: the same function
    b.mlp.act = lambda x: x * 3  # other code
    assert pins.changed(b) is not None


def test_a_publishers_pin_on_the_block_is_verified_on_the_loaders_block() -> None:
    described = {SOURCE: describe(torch.nn.functional.gelu),
                 "self.ops": describe(torch.nn.functional)}
    block = StoredBlock()
    block.ops = torch.nn.functional
    assert verify(described, {}, block) is None
    block.ops = torch.special  # a module object: compared by name
    reason = verify(described, {}, block)
    assert reason is not None and "module torch.special" in reason
    block.ops, block.mlp.act = torch.nn.functional, torch.relu
    reason = verify(described, {}, block)
    assert reason is not None and "relu" in reason and "the block holds another object" in reason
    assert "no block" in (verify(described, {}) or "")  # never loaded without a block to check


def _tramp(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not torch.compiler.is_compiling():
        EAGER.append(type(self).__name__)
    return self._call_impl(*args, **kwargs)


EAGER: list[str] = []


class ArgFnBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.calls = 0

    def forward(self, x: torch.Tensor, fn: Any) -> torch.Tensor:
        return fn(self.lin(x))


def test_a_decline_in_the_regions_frame_ends_the_call_before_it_runs() -> None:
    """A function passed as an argument cannot be pinned: the guard filter declines in the
    region's own frame. That call is not run eagerly by Dynamo (no eager region run, no frame of
    the block traced on its own, which would compile its graphs twice): it runs once, compiled
    without precompile."""
    fn = pc.region_function(_tramp, f"test_decline_{uuid.uuid4().hex[:12]}")
    pf = pc.PrecompiledFunction(fn, {"backend": "eager"})
    block, x = ArgFnBlock(), torch.randn(2, D)
    EAGER.clear()
    ok, total = counters["frames"]["ok"], counters["frames"]["total"]
    with torch.no_grad():
        out = pf(block, x, _local_function)
        want = block.lin(x)
    assert torch.equal(out, want)
    assert pf.status == "declined" and "args[1]" in (pf.declined or ""), pf.declined
    assert EAGER == []  # the region never ran uncompiled
    # the precompile attempt (declined) and the plain compile: two traces of the region's frame,
    # none of the block's own frame
    assert counters["frames"]["ok"] - ok == 1 and counters["frames"]["total"] - total == 2


def test_a_block_that_stores_gelu_precompiles_and_notices_a_swap() -> None:
    fn = pc.region_function(_tramp, f"test_stored_{uuid.uuid4().hex[:12]}")
    pf = pc.PrecompiledFunction(fn, {"backend": "eager"})
    a, b, x = StoredBlock(), StoredBlock(), torch.randn(2, D)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        assert torch.allclose(pf(a, x), a(x)) and torch.allclose(pf(b, x), b(x))
        assert pf.status == "new" and pf.declined is None and SOURCE in pf.pins.described()
        b.mlp.act = torch.relu
        assert torch.allclose(pf(b, x), torch.relu(b.lin(x)))
    assert pf.status == "declined" and "relu" in (pf.declined or "")


def test_a_part_compiled_whole_declines_what_a_region_would_pin_before_it_runs() -> None:
    """A part outside the regions (a whole model: compile_cache.compile) is not pinned: a guard
    that a region's block would pin declines in the part's first frame, before anything of the
    call ran, so a later frame's decline (after a graph break) never comes after frames compiled
    under precompile; the call runs once, compiled without precompile."""
    fn = pc.region_function(_tramp, f"test_part_{uuid.uuid4().hex[:12]}")
    pf = pc.PrecompiledFunction(fn, {"backend": "eager"}, pin_block=False)
    block, x = StoredBlock(), torch.randn(2, D)
    EAGER.clear()
    ok, total = counters["frames"]["ok"], counters["frames"]["total"]
    with torch.no_grad():
        assert torch.allclose(pf(block, x), block(x))
    assert pf.status == "declined" and "not pinned" in (pf.declined or ""), pf.declined
    assert not pf.pins.described()
    assert EAGER == []  # the part never ran uncompiled
    assert counters["frames"]["ok"] - ok == 1 and counters["frames"]["total"] - total == 2



def _deprecated(fn: Any) -> Any:
    """A decorator as transformers' ``deprecate_kwarg``: the module-level name is the wrapper,
    the function it wraps lives only in the wrapper's closure (GPT-2's ``create_causal_mask``)."""

    @functools.wraps(fn)
    def wrapped_func(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapped_func


@_deprecated
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _halved(x: torch.Tensor) -> torch.Tensor:
    return x / 2


class WrappedCallBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(self.lin(x))


def test_a_part_compiled_whole_pins_a_global_closure_and_notices_a_change() -> None:
    """Whole GPT-2's ``create_causal_mask``: the function a module-level decorator wraps is
    reached through the wrapper's closure; in the part's own frame it is pinned (module,
    qualified name, code digest), not declined, and a change of the cell is noticed at the next
    call (the part compiles again with every guard)."""
    fn = pc.region_function(_tramp, f"test_part_{uuid.uuid4().hex[:12]}")
    pf = pc.PrecompiledFunction(fn, {"backend": "eager"}, pin_block=False)
    block, x = WrappedCallBlock(), torch.randn(2, D)
    with torch.no_grad():
        assert torch.equal(pf(block, x), block(x))
        assert pf.status == "new" and pf.declined is None, pf.declined
        pins = pf.pins.described()
        (source,) = [s for s in pins if "__closure__" in s]
        assert "_scaled" in source and pins[source].startswith(f"{__name__}._scaled:")
        cell = next(c for c in _scaled.__closure__ if c.cell_contents is _scaled.__wrapped__)
        original = cell.cell_contents
        cell.cell_contents = _halved
        try:
            assert torch.equal(pf(block, x), block.lin(x) / 2)
        finally:
            cell.cell_contents = original
    assert pf.status == "declined" and "rebound after compiling" in (pf.declined or "")


class NestedBreakBlock(nn.Module):
    """Counts its calls in a buffer; the graph breaks inside a function it calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return _breaks(self.lin(x))


def _breaks(y: torch.Tensor) -> torch.Tensor:
    y = y + 1
    torch._dynamo.graph_break()
    return y * 2


def test_a_part_compiled_whole_that_graph_breaks_declines_before_it_runs() -> None:
    """A whole GPT-2 training step breaks its graph (transformers' ``logger.warning_once``):
    the frames Dynamo traces apart afterwards close over functions no saved guard identifies,
    so the part's own frame declines before anything of the call ran (the buffer counts one
    call, the part never runs uncompiled), and the decline is not remembered for the entry
    (its paths without a break, saved before, still load on the next node)."""
    fn = pc.region_function(_tramp, f"test_part_{uuid.uuid4().hex[:12]}")
    pf = pc.PrecompiledFunction(fn, {"backend": "eager"}, pin_block=False)
    block, x = NestedBreakBlock(), torch.randn(2, D)
    EAGER.clear()
    with torch.no_grad():
        out = pf(block, x)
        assert torch.equal(out, (block.lin(x) + 1) * 2)
    assert pf.status == "declined" and "graph-breaks in its own frame" in (pf.declined or "")
    assert pf.decline_persists is False
    assert float(block.calls) == 1.0 and EAGER == []


def test_module_globals_of_a_saved_frame_are_recorded_as_import_sources() -> None:
    """Dynamo's bytecode loads ``collections`` (to rebuild transformers' ``ModelOutput``) from
    a global named after this process (``___module_collections_<id>_c<n>``) that torch does
    not save with the package: a loaded whole GPT-2 failed with NameError. The name is recorded
    as the package's import source; a name that is no module declines."""
    import collections

    from compile_cache.torch_compat.precompile import GuardReport, _record_module_globals

    name = f"___module_collections_{id(collections)}_c0"
    scope = types.ModuleType(f"_cc_test_scope_{uuid.uuid4().hex[:8]}")
    scope.__dict__[name] = collections
    scope.__dict__["___module_fake_1_c0"] = object()
    code = compile(f"def inner():\n    return {name}.OrderedDict\n", "<test>", "exec")

    class _Package:
        def __init__(self) -> None:
            self._current_entry = types.SimpleNamespace(python_module=scope.__name__)
            self.sources: dict[str, str] = {}

        def add_import_source(self, alias: str, module_name: str) -> None:
            self.sources[alias] = module_name

    import sys

    sys.modules[scope.__name__] = scope
    try:
        package, report = _Package(), GuardReport()
        _record_module_globals(package, code, report)  # found in a nested code object
        assert package.sources == {name: "collections"} and report.safe
        _record_module_globals(package, compile("___module_fake_1_c0", "<t>", "eval"), report)
        assert not report.safe and "___module_fake_1_c0" in report.declined[0]
    finally:
        del sys.modules[scope.__name__]


# ----------------------------------------------------------------------------- recompile warnings


@pytest.mark.parametrize(("guard", "varying", "says", "never"), [
    ("kwargs['position_bias'] is None", ("layer_idx",), "called with different arguments",
     "layer_idx"),
    ("len(args) == 1", ("layer_idx",), "called with different arguments", "per-block values"),
    ("self._modules['attn'].mode == 'a'", ("attn.mode", "layer_idx"),
     "per-block values (attribute(s) read by forward: attn.mode)", "layer_idx"),
    # an argument's value (Llama's generate: a number the blocks are called with)
    ("args[1] == 0", ("layer_idx",), "different values of an argument", "per-block values"),
    ("L['args'][1] == 0", ("layer_idx",), "different values of an argument", "layer_idx"),
    ("kwargs['is_causal'] == True", ("is_causal",), "different values of an argument",
     "per-block values"),
    # a tensor's size or stride: an input change
    ("args[0].stride()[0] == 8", ("layer_idx",), "other sizes, strides", "per-block values"),
    ("tensor 'args[0]' stride mismatch at index 0. expected 8, actual 1", ("layer_idx",),
     "other sizes, strides", "layer_idx"),
    ("kwargs['hidden_states'].size()[1] == 8", ("layer_idx",), "other sizes, strides",
     "per-block values"),
    # grad mode is grad mode (T5 from eval to training was blamed on is_causal)
    ("GLOBAL_STATE changed: grad_mode", ("SelfAttention.is_causal",), "grad mode", "is_causal"),
])
def test_the_recompile_cause_names_the_failing_guard(guard: str, varying: tuple[str, ...],
                                                     says: str, never: str) -> None:
    cause, _fix = recompile_cause(guard, varying)
    assert says in cause and guard in cause and never not in cause, cause


def test_a_kv_cache_group_is_told_the_guard_that_failed_first() -> None:
    """The newest entry failed on an argument's value; an older one on the cache of its layer.
    The warning names the first (it is what differs between the two blocks' calls)."""
    reasons = "0/1: args[1] == 0\n0/0: kwargs['past_key_values'].layers[0].is_initialized == False"
    cause, _fix = recompile_cause("args[1] == 0", ("layer_idx",), reasons, takes_cache=True)
    assert "args[1] == 0" in cause and "different values of an argument" in cause, cause
    assert "KV cache" not in cause and "layer_idx" not in cause, cause
    guard = "kwargs['past_key_values'].layers[0].is_initialized == False"
    cause, _fix = recompile_cause(guard, ("layer_idx",), guard, takes_cache=True)
    assert "KV cache at each block's own layer index" in cause and guard in cause, cause


class _Runner:  # what on_recompile needs of a _RegionRunner: only its identity
    pass


def _recompile_warnings(reasons: list[str], varying: tuple[str, ...]) -> list[str]:
    state = _GroupState("Block x2 [a, b]", types.FunctionType(_tramp.__code__, {}).__code__, 2,
                        varying)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.on_recompile(["0/0: self.x == 1"], _Runner())  # the group's first compile
        state.on_recompile(reasons, _Runner())
    return [str(w.message) for w in caught if w.category is RegionRecompileWarning]


def test_grad_mode_is_not_blamed_on_a_per_block_attribute() -> None:
    """T5 going from eval to training: the newest entry (the previous block's) fails on grad
    mode; an older one on is_causal. Torch's business (the inputs changed), not per-block."""
    reasons = ["0/2: GLOBAL_STATE changed: grad_mode ", "0/0: self._modules['SelfAttention'].is_causal == False"]
    assert _recompile_warnings(reasons, ("SelfAttention.is_causal",)) == []


def test_an_argument_guard_is_not_per_block_values() -> None:
    (msg,) = _recompile_warnings(["1/1: kwargs['position_bias'] is None   # x = y"], ("layer_idx",))
    assert "kwargs['position_bias'] is None" in msg and "different arguments" in msg
    assert "layer_idx" not in msg and "per-block values" not in msg
    (msg,) = _recompile_warnings(["2/0: len(args) == 1"], ())
    assert "len(args) == 1" in msg and "different arguments" in msg


class ArgBlock(nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.layer_idx = idx

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        return y if bias is None else y + bias


class ArgStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ArgBlock(i) for i in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None
        for block in self.blocks:  # T5: only the first block computes the position bias
            x = block(x, bias=bias)
            bias = x * 0.1
        return x


def test_blocks_called_with_none_and_a_tensor_are_told_so() -> None:
    import compile_cache

    model = ArgStack()
    compile_cache.compile_regions(model, cache_dir=False, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(torch.randn(2, D))
    (msg,) = [str(w.message) for w in caught if w.category is RegionRecompileWarning]
    assert "different arguments" in msg and "bias" in msg and "layer_idx" not in msg, msg


class ValueBlock(nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.layer_idx = idx

    def forward(self, x: torch.Tensor, first: int = 0) -> torch.Tensor:
        return self.lin(x) * 2 if first == 0 else self.lin(x)


class LayoutBlock(ValueBlock):
    def forward(self, x: torch.Tensor, first: int = 0) -> torch.Tensor:
        return self.lin(x.contiguous()) if x.stride()[0] == 1 else self.lin(x)


class CallStack(nn.Module):
    """Calls block i with ``first=i`` (value) or every other block with a transposed input."""

    def __init__(self, block: type[ValueBlock], how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(i) for i in range(3)])
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if self.how == "value":
                x = block(x, i)
            else:
                x = block(x.t().contiguous().t() if i % 2 else x.contiguous())
        return x


@pytest.mark.parametrize(("block", "how"), [(ValueBlock, "value"), (LayoutBlock, "layout")])
def test_an_argument_value_or_layout_is_not_blamed_on_a_block_attribute(
    block: type[ValueBlock], how: str
) -> None:
    """Real Dynamo guards (eager backend): ``args[1] == 0`` is an argument's value, told so; a
    stride guard is an input change, torch's business as with plain torch.compile (no warning).
    Neither is "per-block values" of ``layer_idx``."""
    import compile_cache

    model, x = CallStack(block, how), torch.randn(D, D)
    with torch.no_grad():
        want = model(x)
    compile_cache.compile_regions(model, cache_dir=False, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            assert torch.allclose(model(x), want)
    got = [str(w.message) for w in caught if w.category is RegionRecompileWarning]
    if how == "value":
        (msg,) = got
        assert "failing guard: args[1] == 0" in msg and "different values of an argument" in msg
        assert "layer_idx" not in msg and "per-block values" not in msg, msg
    else:
        assert got == [], got
        (stats,) = compile_cache.region_stats(model).values()
        assert stats["cache_entries"] == 2 and stats["block_recompiles"] == 0, stats


# ------------------------------------------------------------------------------- plan, reports


class Attn(nn.Module):
    def __init__(self, causal: bool, idx: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.is_causal, self.layer_idx = causal, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).cumsum(-1) if self.is_causal else self.lin(x)


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.ModuleList([Attn(False, i) for i in range(2)])
        self.dec = nn.ModuleList([Attn(True, i) for i in range(2)])
        self.emb_a = ScaledEmbedding(16, D)
        self.emb_b = ScaledEmbedding(16, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb_a(ids) + self.emb_b(ids)
        for block in [*self.enc, *self.dec]:
            x = block(x)
        return x


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 2.0


def test_blocks_that_differ_in_a_flag_do_not_share_a_group_and_embeddings_stay_eager() -> None:
    plan = plan_regions(EncDec())
    groups = {g.names: g for g in plan.groups}
    assert set(groups) == {("enc.0", "enc.1"), ("dec.0", "dec.1")}, plan.describe()
    assert len({g.code_name for g in plan.groups}) == 2
    # layer_idx differs inside each group and does not split it
    parts = {p.name: p for p in plan.compiled_rest}
    assert "emb_a" not in parts and "emb_b" not in parts, plan.describe()
    # a group whose blocks agree keeps its code name (no flag variant)
    same = plan_regions(nn.Sequential(Attn(True, 0), Attn(True, 1)))
    assert [g.variant for g in same.groups] == [""]


def test_a_block_is_a_kv_cache_block_only_once_a_call_passes_a_cache() -> None:
    from transformers.cache_utils import DynamicCache

    from compile_cache.precompiled import CacheRoutedCall
    from compile_cache.torch_compat.kv.calls import CacheCalls

    class Block(nn.Module):
        def forward(self, x: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
            return x

    block, events = Block(), []

    def precompiled(*args: Any, **kwargs: Any) -> str:
        return "p"

    precompiled.module = block
    route = CacheRoutedCall(precompiled, lambda *a, **k: "q", CacheCalls.for_block(block.forward),
                            None, lambda: events.append("cache"))
    x = torch.ones(1)
    assert [route(x), route(x, None)] == ["p", "p"] and events == []  # an encoder's calls
    assert route(x, DynamicCache()) == "q" and events == ["cache"]
    assert route(x, DynamicCache()) == "q" and events == ["cache"]  # reported once


def test_a_saved_tensor_whose_grad_no_guard_reads_unpickles() -> None:
    """A graph traced after a backward (T5's generate() after a training step) saved its guarded
    parameters with a ``.grad`` outside the guard tree, as a placeholder that torch's unpickling
    assigned to ``.grad`` (TypeError): the entry could not be checked or loaded on a fresh node.
    Loaded, that grad is None."""
    import pickle

    import torch._dynamo.guards as dynamo_guards

    from compile_cache.torch_compat.precompile import _load_unsaved_grads

    weight = nn.Parameter(torch.randn(2, 3))
    weight.grad = torch.ones(2, 3)
    args = (torch.empty_like(weight, device="meta", requires_grad=True), weight.device,
            torch.Tensor, torch._C._dispatch_keys(weight).raw_repr(), dynamo_guards._Missing("x"))
    saved = pickle.dumps((dynamo_guards.GuardsStatePickler._unpickle_tensor, args))
    _load_unsaved_grads()
    fn, loaded_args = pickle.loads(saved)  # noqa: S301 - our own bytes
    fake = fn(*loaded_args)
    assert fake.grad is None and tuple(fake.shape) == (2, 3) and fake.requires_grad


class TrainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_precompile_in_training_gives_no_torch_warning_plain_compile_does_not() -> None:
    """Torch pickles a traced frame's guards for the entry, reading each guarded tensor's
    ``.grad``: a non-leaf input (an activation) warned "The .grad attribute of a Tensor that is
    not a leaf Tensor is being accessed" from torch/_dynamo/guards.py, once per training frame
    (Mixtral, T5); plain torch.compile saves nothing and gives none."""
    fn = pc.region_function(_tramp, f"test_train_{uuid.uuid4().hex[:12]}")
    pf = pc.PrecompiledFunction(fn, {"backend": "eager"})
    block, leaf = TrainBlock().train(), torch.randn(2, D, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = leaf * 2  # a non-leaf tensor that requires grad, as every block's input in training
        pf(block, x).sum().backward()
    assert pf.status == "new" and leaf.grad is not None
    torch_warnings = [f"{w.filename}: {w.message}" for w in caught if "torch" in w.filename]
    assert not [w for w in torch_warnings if "guards.py" in w or "leaf Tensor" in w], torch_warnings


# ------------------------------------------------------ the allow-list of guard treatments


def test_every_guard_type_of_the_installed_torch_has_exactly_one_treatment() -> None:
    """A torch that adds a guard type makes this fail until the type is given a treatment (until
    then it declines: an unknown type is never kept or dropped)."""
    from compile_cache.torch_compat.precompile.guards import (
        DECLINED,
        GUARD_TREATMENTS,
        PINNED_TYPE,
        RECORDED,
        guard_builder_types,
        treatment,
    )

    missing = guard_builder_types() - set(GUARD_TREATMENTS)
    assert not missing, f"guard types without a treatment: {sorted(missing)}"
    assert {t for t, _ in GUARD_TREATMENTS.values()} == {RECORDED, PINNED_TYPE, DECLINED}
    assert treatment("A_TYPE_TORCH_ADDS_LATER") == DECLINED
    # what torch cannot save is never kept
    from compile_cache.torch_compat.precompile.guards import unsupported_guard_types

    assert not {t for t in unsupported_guard_types() if treatment(t) == RECORDED}


def test_a_builtin_shadowed_after_compiling_and_a_module_name_added_are_seen_by_the_pins() -> None:
    """The pins of issue 53: the block's module binding a builtin's name (``max = min``), and a
    user module gaining a name that code read with a default (``getattr(settings, "EXTRA", 0.0)``)."""
    import types as pytypes

    from compile_cache.torch_compat.precompile.pins import builtin_shadow_source

    module = pytypes.ModuleType("cc_i53_settings")
    before = describe(module)
    module.EXTRA = 3.0
    assert describe(module) != before and describe(torch) == "module torch"
    block = StoredBlock()
    source = builtin_shadow_source("max")
    pins = Pins({})
    pins.add({source: None})
    assert pins.changed(block) is None
    scope = type(block).forward.__globals__
    scope["max"] = min
    try:
        moved = pins.changed(block)
    finally:
        del scope["max"]
    assert moved is not None and "max" in moved


def test_a_name_bound_on_a_pinned_module_after_compiling_is_noticed() -> None:
    """``hasattr(settings, "FLAG")`` traced with FLAG absent: Dynamo guards the module's identity
    only; the pin also holds its number of names, so binding FLAG after compiling is seen."""
    import types as pytypes

    module = pytypes.ModuleType("cc_i53_flags")
    pins = Pins({"settings": module})
    pins.add({"G['settings']": module})
    assert pins.changed() is None
    module.FLAG = 1
    moved = pins.changed()
    assert moved is not None and "gained or lost a name" in moved


def test_environment_variables_read_in_traced_code_are_recorded_and_compared(monkeypatch) -> None:
    """``os.environ.get("X", default)`` in traced code: Dynamo guards none of the variables, so
    those its module names are recorded with the entry and compared before it loads."""
    import sys
    import types as pytypes

    from compile_cache.torch_compat.precompile.guards import environ_differs, environ_reads

    module = pytypes.ModuleType("cc_i53_env_reader")
    exec("import os\nENV = 'CC_I53_SETTING'\ndef f():\n    return os.environ.get('CC_I53_OTHER', 'a')\n",
         module.__dict__)
    monkeypatch.setitem(sys.modules, "cc_i53_env_reader", module)
    monkeypatch.delenv("CC_I53_SETTING", raising=False)
    monkeypatch.delenv("CC_I53_OTHER", raising=False)
    recorded = environ_reads("G['__import_cc_i53_env_reader'].os.environ")
    assert recorded == {"CC_I53_OTHER": None, "CC_I53_SETTING": None}
    assert environ_differs(recorded) is None
    monkeypatch.setenv("CC_I53_OTHER", "b")
    assert "CC_I53_OTHER is 'b' here but was unset" in environ_differs(recorded)
    assert environ_reads("G['os'].environ") is None  # the reading module is not known


def test_a_pin_on_the_calls_arguments_is_checked_at_each_call_and_after_a_load() -> None:
    """A pin reached from the call's arguments (a KV cache's class method): compared by identity
    at each call; restored with an entry, against the publisher's description at the first call
    (no call exists before the load); not checked on a call that does not pass the argument."""
    source = "type(kwargs['cache']).update"

    class Cache:
        def update(self) -> None:
            """The method the traced code reached."""

    pins = Pins({})
    pins.add({source: Cache.update})
    assert pins.changed(None, (), {"cache": Cache()}) is None
    assert pins.changed(None, (), {}) is None  # not passed: the entry's own guards rule it out
    original = Cache.update
    Cache.update = lambda self: None  # swapped after compiling
    assert "update" in (pins.changed(None, (), {"cache": Cache()}) or "")
    Cache.update = original
    loaded = Pins({})
    loaded.add_current({source: describe(Cache.update)})
    assert loaded.watching and verify({source: describe(Cache.update)}, {}) is None
    assert loaded.changed(None, (), {"cache": Cache()}) is None
    other = Pins({})
    other.add_current({source: "somewhere.else:0"})
    assert "at this call but was somewhere.else:0" in (other.changed(None, (), {"cache": Cache()}) or "")


def test_a_failed_load_leaves_no_global_behind_and_moves_the_counter_past_it() -> None:
    """A load that raised half-way (issue 53: a numpy class attribute's entry) had installed the
    package's globals into the function's namespace; the trace that followed picked the same
    counter-named global and raised ``Name '__builtins_dict___0' already exists in scope``."""
    import torch._dynamo.bytecode_transformation as bt

    from compile_cache.torch_compat.precompile import _undo_load

    scope: dict[str, Any] = {"torch": torch}
    fn = types.FunctionType(compile("def f():\n    return 1\n", "<i53>", "exec").co_consts[0], scope)
    before = frozenset(scope)
    top = next(bt._unique_id_counter) + 500
    scope[f"__builtins_dict___{top}"] = {}  # what the publisher's counter named
    scope["__import_cc_i53"] = torch
    _undo_load(fn, before)
    assert set(scope) == {"torch"}
    assert next(bt._unique_id_counter) > top
