"""Child process of tests/test_precompile_values.py: a precompiled entry must prove the values and
classes it was traced under, on one node.

    python _precompile_values_child.py STORE PHASE [CASE,...]    PHASE: publish | load

Each case writes its model's module (``cc_values_<case>``) into this node's TMPDIR, from a source
that may differ between the publishing node and the loading node (an edited setting, another base
class, an added override), imports it, may change a value at run time before compiling (as a
config file, a command-line flag or ``os.environ`` would), and compares every call of
``compile_regions(model, cache_dir=STORE, precompile=True)`` (Inductor) with eager. Prints one line
``CASE {json}`` per case: the largest difference from eager per call, Dynamo frames traced,
precompile entries loaded, the report's per-group outcome and the precompile warnings.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import textwrap
import traceback
import warnings

import torch
from torch._dynamo.utils import counters

import compile_cache

STORE, PHASE = sys.argv[1], sys.argv[2]
LOAD = PHASE == "load"
D = 16
X = torch.randn(4, D, generator=torch.Generator().manual_seed(0))
MODULES = os.path.join(os.environ["TMPDIR"], "cc_modules")
os.makedirs(MODULES, exist_ok=True)
sys.path.insert(0, MODULES)

HEADER = """
import enum
import torch
from torch import nn

D = 16
"""


def module(case: str, source: str):
    """Write and import this node's version of the case's model module."""
    name = f"cc_values_{case}"
    with open(os.path.join(MODULES, name + ".py"), "w") as f:
        f.write(HEADER + textwrap.dedent(source))
    importlib.invalidate_caches()
    return importlib.import_module(name)


def maxdiff(a, b) -> float:
    return float((a - b).abs().max())


class Stack(torch.nn.Module):
    def __init__(self, blocks) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Case:
    def __init__(self, name: str) -> None:
        self.rec = {"case": name, "phase": PHASE, "diffs": {}, "reports": []}
        self.frames0 = counters["frames"]["ok"]
        self.hits0 = counters["dynamo_cache"]["dynamo_cache_hit"]
        self._warnings = warnings.catch_warnings(record=True)
        self._reports = []

    def __enter__(self) -> Case:
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        return self

    def model(self, block_cls, n: int = 2):
        torch.manual_seed(0)
        model = Stack([block_cls() for _ in range(n)])
        return model, copy.deepcopy(model)

    def compile(self, model, **kwargs):
        compile_cache.compile_regions(model, cache_dir=STORE, precompile=True, **kwargs)
        self._reports.append(compile_cache.last_report())
        return model

    def check(self, label: str, got, want) -> None:
        self.rec["diffs"][label] = maxdiff(got, want)

    def __exit__(self, kind, exc, tb) -> bool:
        self._warnings.__exit__(None, None, None)
        if exc is not None:
            self.rec["error"] = f"{kind.__name__}: {exc}"
            self.rec["traceback"] = "".join(traceback.format_exception(kind, exc, tb))[-3000:]
        compile_cache.session.flush(60)
        self.rec["frames_traced"] = counters["frames"]["ok"] - self.frames0
        self.rec["dynamo_cache_hits"] = counters["dynamo_cache"]["dynamo_cache_hit"] - self.hits0
        self.rec["reports"] = [{"groups": r.precompile_groups, "published_packs": r.published_packs,
                                "restored_packs": r.restored_packs,
                                "unproven": r.precompile_unproven, "outcome": r.outcome}
                               for r in self._reports]
        # (not the one-time notice that an explicit precompile=True is under review)
        self.rec["warnings"] = [str(w.message) for w in self.caught
                                if issubclass(w.category, compile_cache.RegionPrecompileWarning)
                                and "precompile is under review" not in str(w.message)]
        print("CASE " + json.dumps(self.rec), flush=True)
        return True


def run(name: str, source: str, before=None, calls=("fwd",), **compile_kwargs) -> None:
    """The common case: build, maybe change a value at run time, compile, compare each call."""
    with Case(name) as c:
        mod = module(name, source)
        if before is not None:
            before(mod)
        model, ref = c.model(mod.Block)
        c.compile(model, **compile_kwargs)
        with torch.no_grad():
            for label in calls:
                c.check(label, model(X), ref(X))


# ------------------------------------------------------------ values read through a module


ACTIVATION = """
MODE = "{mode}"

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x)
        return torch.tanh(y) if MODE == "tanh" else torch.sigmoid(y) * 3
"""


def case_global_edited() -> None:
    """A module-level string edited between the two runs."""
    run("global_edited", ACTIVATION.format(mode="sigmoid" if LOAD else "tanh"))


def case_global_runtime() -> None:
    """The same setting, set at run time before compile_regions (a flag, os.environ)."""
    run("global_runtime", ACTIVATION.format(mode="tanh"),
        before=(lambda mod: setattr(mod, "MODE", "sigmoid")) if LOAD else None)


def case_global_numbers() -> None:
    """A module-level float and int, set at run time on the fresh node."""
    source = """
    SCALE = 2.0
    SHIFT = 1

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return torch.roll(torch.tanh(self.lin(x)), SHIFT, dims=-1) * SCALE
    """

    def before(mod) -> None:
        mod.SCALE, mod.SHIFT = 5.0, 3

    run("global_numbers", source, before=before if LOAD else None)


def case_global_enum() -> None:
    """A global enum member, compared by ``.value`` and by identity."""
    source = """
    class Mode(enum.Enum):
        A = 1
        B = 2

    CURRENT = Mode.A

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            y = self.lin(x) * (2.0 if CURRENT.value == 1 else -3.0)
            return torch.tanh(y) if CURRENT is Mode.A else torch.sigmoid(y)
    """
    run("global_enum", source, before=(lambda mod: setattr(mod, "CURRENT", mod.Mode.B)) if LOAD else None)


def case_shared_module() -> None:
    """An attribute of a global module instance (a shared LayerNorm's eps)."""
    source = """
    SHARED = nn.LayerNorm(D)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return SHARED(self.lin(x))
    """
    run("shared_module", source, before=(lambda mod: setattr(mod.SHARED, "eps", 10.0)) if LOAD else None)


def case_config_default() -> None:
    """A config class's class-level default: read through the global class, and through an
    instance of it that the block holds (its class is pickled by reference)."""
    source = """
    class Config:
        act = "tanh"
        scale = 1.0

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.cfg = Config()

        def forward(self, x):
            y = self.lin(x) * self.cfg.scale
            return torch.tanh(y) if Config.act == "tanh" else torch.sigmoid(y)
    """

    def before(mod) -> None:
        mod.Config.act, mod.Config.scale = "sigmoid", 4.0

    run("config_default", source, before=before if LOAD else None)


# ------------------------------------------------------------------ values and code of classes


CLASS_VALUE = """
class Block(nn.Module):
    kind = "{kind}"

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x)
        return torch.tanh(y) if self.kind == "tanh" else torch.sigmoid(y) * 3
"""


def case_class_attr_edited() -> None:
    run("class_attr_edited", CLASS_VALUE.format(kind="sigmoid" if LOAD else "tanh"))


def case_class_attr_runtime() -> None:
    run("class_attr_runtime", CLASS_VALUE.format(kind="tanh"),
        before=(lambda mod: setattr(mod.Block, "kind", "sigmoid")) if LOAD else None)


def case_base_class() -> None:
    """Another base class on the fresh node: same class name, same forward."""
    source = """
    class Tanh:
        def act(self, y):
            return torch.tanh(y)

    class Sigmoid:
        def act(self, y):
            return torch.sigmoid(y) * 3

    class Block({base}, nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.act(self.lin(x))
    """
    run("base_class", source.format(base="Sigmoid" if LOAD else "Tanh"))


def case_override_added() -> None:
    """An override added below forward on the fresh node."""
    source = """
    class Base(nn.Module):
        def act(self, y):
            return torch.tanh(y)

    class Block(Base):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.act(self.lin(x))
    {override}
    """
    override = ("\n        def act(self, y):\n            return torch.sigmoid(y) * 3\n"
                if LOAD else "")
    run("override_added", source.format(override=override))


def case_rebound_class_function() -> None:
    """A class-level staticmethod rebound at run time on the fresh node."""
    source = """
    def tanh(y):
        return torch.tanh(y)

    def sigmoid(y):
        return torch.sigmoid(y) * 3

    class Block(nn.Module):
        helper = staticmethod(tanh)

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.helper(self.lin(x))
    """
    run("rebound_class_function", source,
        before=(lambda mod: setattr(mod.Block, "helper", staticmethod(mod.sigmoid))) if LOAD else None)


# -------------------------------------------------------------------------- entries and calls


def case_two_graphs() -> None:
    """The publisher runs with two values of a global (two graphs in one entry); the fresh node
    starts with the second: only its graph may be installed, and nothing is traced."""
    with Case("two_graphs") as c:
        mod = module("two_graphs", ACTIVATION.format(mode="tanh"))
        if LOAD:
            mod.MODE = "sigmoid"
        model, ref = c.model(mod.Block)
        c.compile(model)
        with torch.no_grad():
            c.check("first", model(X), ref(X))
            if not LOAD:
                mod.MODE = "sigmoid"
                c.check("second", model(X), ref(X))


def case_direct_call_after_patch() -> None:
    """A module-level function monkeypatched after the first forward, then a block called
    directly (not through the model): the pin is checked at every region call."""
    source = """
    def act(y):
        return torch.tanh(y)

    def other(y):
        return torch.sigmoid(y) * 3

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return act(self.lin(x))
    """
    with Case("direct_call_after_patch") as c:
        mod = module("direct_call_after_patch", source)
        model, ref = c.model(mod.Block)
        c.compile(model)
        with torch.no_grad():
            c.check("model", model(X), ref(X))
            mod.act = mod.other
            c.check("block_direct", model.blocks[0](X), ref.blocks[0](X))
            c.check("model_after", model(X), ref(X))


PLAIN = """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x
"""


def case_mode_default() -> None:
    run("mode_default", PLAIN, mode="default")


def case_mode_max_autotune() -> None:
    run("mode_max_autotune", PLAIN, mode="max-autotune-no-cudagraphs")


# ------------------------------------------ objects stored on the block (issue 35): by identity


STORED = """
import torch.nn.functional as F

{extra}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.act = {act}

    def forward(self, x):
        return self.act(self.lin(x))
"""


def case_stored_builtin() -> None:
    """transformers' GELUActivation stores ``nn.functional.gelu`` on the instance; here the
    fresh node's block stores ``torch.relu``: same structure, same fingerprint."""
    # (set from a global, so that __init__'s code, in the class lineage, is the same)
    run("stored_builtin", STORED.format(extra=f"ACT = {'torch.relu' if LOAD else 'F.gelu'}",
                                        act="ACT"))


def case_stored_function() -> None:
    """A Python function stored on the instance, of the same qualified name whose code was
    edited between the two nodes."""
    body = "return torch.sigmoid(x) * 3" if LOAD else "return torch.tanh(x)"
    run("stored_function", STORED.format(extra=f"def act(x):\n    {body}", act="act"))


def case_stored_same() -> None:
    """The same builtin stored on the block on both nodes: the entry loads, nothing traced."""
    run("stored_same", STORED.format(extra="", act="F.gelu"))


# ------------------------------- KV-cache calls traced into the graph (issue 35): values proven


KV_CACHE = """
from transformers import DynamicCache, PretrainedConfig

def new_cache():  # as generate() makes one: a layer per block, from the model's config
    return DynamicCache(config=PretrainedConfig(num_hidden_layers={blocks}))

MODE = "{mode}"

class Block(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.layer_idx = layer_idx

    def forward(self, x, past_key_values=None):
        k = self.lin(x)
        if past_key_values is not None:
            k, _ = past_key_values.update(k, k, self.layer_idx)
        y = x + k.mean(-2, keepdim=True)
        return torch.tanh(y) if MODE == "tanh" else torch.sigmoid(y) * 3

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(i) for i in range({blocks})])

    def forward(self, x, cache):
        for block in self.blocks:
            x = block(x, past_key_values=cache)
        return x
"""


def case_kv_cache_global() -> None:
    """A part called with a KV cache (one block: no eager update between two graphs, Dynamo traces
    the update into the graph, as for T5's decoder self-attention) that reads a module-level
    setting set at run time on the fresh node: its cache calls precompile (entry ``__cache``),
    and the fresh node must not install the publisher's graphs. A prefill of 3 tokens, then a
    decode step of 1."""
    kv_cache_case("kv_cache_global", 1)


def kv_cache_case(name: str, blocks: int, more: tuple[int, ...] = ()) -> None:
    """KV_CACHE with ``blocks`` blocks: a prefill of 3 tokens (then, each on a new cache, one of
    each length in ``more``: ``prefill<N>``), then a decode step of 1; the record says how the
    group's cache calls went (``cache_calls``: traced update, layer view, eager update)."""
    with Case(name) as c:
        mod = module(name, KV_CACHE.format(mode="tanh", blocks=blocks))
        if LOAD:
            mod.MODE = "sigmoid"
        torch.manual_seed(0)
        model = mod.Model()
        ref = copy.deepcopy(model)
        c.compile(model)
        # (new tensors, not slices of one: their strides are those of a block's output, so the
        # second block does not recompile for a stride)
        g = torch.Generator().manual_seed(3)
        prompt, step = torch.randn(1, 1, 3, D, generator=g), torch.randn(1, 1, 1, D, generator=g)
        with torch.no_grad():
            for n in more:
                x = torch.randn(1, 1, n, D, generator=g)
                c.check(f"prefill{n}", model(x, mod.new_cache()), ref(x, mod.new_cache()))
            got_cache, want_cache = mod.new_cache(), mod.new_cache()
            c.check("prefill", model(prompt, got_cache), ref(prompt, want_cache))
            c.check("decode", model(step, got_cache), ref(step, want_cache))
            c.check("cache", torch.cat([layer.keys for layer in got_cache.layers]),
                    torch.cat([layer.keys for layer in want_cache.layers]))
        runner = model.blocks[0]._compiled_call_impl  # None: one block, compiled as a part
        calls = None if runner is None else runner.state.cache_calls
        if calls is not None:
            c.rec["cache_calls"] = [calls.traced_update_calls, calls.view_calls,
                                    calls.eager_update_calls]


def case_kv_cache_group() -> None:
    """Two identical blocks (a group: the cache update is traced into the graph, one entry per
    block, issue 35) read the module-level setting of KV_CACHE, set at run time on the fresh
    node: none of the publisher's graphs (the prefill entries, the decode step's through the
    layer view) may run there. The prefill entries are dynamic in the length (issue 36): the
    publisher prefills at 5 and 7 tokens (the second recompiles dynamic), then 3 (served by the
    dynamic entries); the fresh node prefills at 4, then 3, lengths those entries would serve,
    were their values not proven."""
    kv_cache_case("kv_cache_group", 2, (4,) if LOAD else (5, 7))


# ----------------------------------------- four more ways to be wrong (issue 53), and a crash


def case_absent_value() -> None:
    """``getattr(settings, "EXTRA", 0.0)`` on a settings module that lacks EXTRA when traced;
    the fresh node sets it at run time before compiling."""
    module("absent_settings", "")
    source = """
    import cc_values_absent_settings as settings

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return torch.tanh(self.lin(x)) + getattr(settings, "EXTRA", 0.0)
    """

    def before(mod) -> None:
        mod.settings.EXTRA = 3.0

    run("absent_value", source, before=before if LOAD else None)


def case_absent_env() -> None:
    """``os.environ.get("CC_I53_ACT", "tanh")`` in forward, the variable set only on the fresh
    node."""
    source = """
    import os

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            y = self.lin(x)
            return torch.tanh(y) if os.environ.get("CC_I53_ACT", "tanh") == "tanh" else torch.sigmoid(y) * 3
    """
    if LOAD:
        os.environ["CC_I53_ACT"] = "sigmoid"
    try:
        run("absent_env", source)
    finally:
        os.environ.pop("CC_I53_ACT", None)


def case_shadowed_builtin() -> None:
    """``max(...)`` in forward; the fresh node binds a module global ``max = min``."""
    source = """
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.lin(x) * max(1.0, 2.5)
    """
    run("shadowed_builtin", source, before=(lambda mod: setattr(mod, "max", min)) if LOAD else None)


PROPERTY = """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    @property
    def scale(self):
        return 2.0

    def forward(self, x):
        return self.lin(x) * self.scale
"""


def case_property_swap() -> None:
    """A block class's property replaced after the first call, in the same process."""
    with Case("property_swap") as c:
        mod = module("property_swap", PROPERTY)
        model, ref = c.model(mod.Block)
        c.compile(model)
        with torch.no_grad():
            c.check("before", model(X), ref(X))
            mod.Block.scale = property(lambda s: 5.0)
            c.check("after", model(X), ref(X))


TWIN = HEADER + """
SCALE = {scale}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * SCALE
"""


def case_twin_modules() -> None:
    """Two files with the same Block and another SCALE, loaded in turn under one name
    (``spec_from_file_location``, registered), one model from each, compiled in turn."""
    import importlib.util

    with Case("twin_modules") as c:
        for label, scale in (("first", 1.0), ("second", 10.0)):
            path = os.path.join(MODULES, f"twin_{label}", "cc_values_twin.py")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(TWIN.format(scale=scale))
            spec = importlib.util.spec_from_file_location("cc_values_twin", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules["cc_values_twin"] = mod
            spec.loader.exec_module(mod)
            model, ref = c.model(mod.Block)
            c.compile(model)
            with torch.no_grad():
                c.check(label, model(X), ref(X))


def case_numpy_scale() -> None:
    """A class attribute that is a numpy scalar (``scale = np.float32(2.0)``)."""
    source = """
    import numpy as np

    class Block(nn.Module):
        scale = np.float32(2.0)

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return torch.tanh(self.lin(x)) * self.scale
    """
    run("numpy_scale", source, calls=("fwd", "again"))


CASES = ["global_edited", "global_runtime", "global_numbers", "global_enum", "shared_module",
         "config_default", "class_attr_edited", "class_attr_runtime", "base_class",
         "override_added", "rebound_class_function", "two_graphs", "direct_call_after_patch",
         "mode_default", "mode_max_autotune", "stored_builtin", "stored_function", "stored_same",
         "kv_cache_global", "kv_cache_group"]

if __name__ == "__main__":
    for name in (sys.argv[3].split(",") if len(sys.argv) > 3 else CASES):
        globals()[f"case_{name}"]()
