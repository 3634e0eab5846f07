"""Child process of tests/test_precompile.py: the adversarial precompile cases on one node.

    python _precompile_child.py STORE PHASE [CASE,...]    PHASE: publish | load

Every case builds its model(s), keeps an eager copy, runs ``compile_regions(model,
cache_dir=STORE, precompile=True)`` (Inductor) and compares every call with eager. The publishing
node starts with an empty store; the loading node is a fresh node (the parent gives it new
TMPDIR, HOME, XDG_CACHE_HOME and local cache dirs) that restores from the store. Prints one line
``CASE {json}`` per case: the largest difference from eager per call, Dynamo frames traced,
precompile entries loaded, the report's per-group precompile outcome, the precompile warnings.
"""

from __future__ import annotations

import copy
import itertools
import json
import sys
import traceback
import warnings

import _precompile_models as m
import torch
import torch._dynamo.bytecode_transformation as bytecode_transformation
from torch._dynamo.utils import counters

import compile_cache
from compile_cache.keys import environment_digest
from compile_cache.torch_compat import isa
from compile_cache.torch_compat import precompile as pc

STORE, PHASE = sys.argv[1], sys.argv[2]
LOAD = PHASE == "load"
ENV_BEFORE = environment_digest()
#: Modules only a real compile needs: a start that restores every group imports none of them
#: (compile_cache.torch_compat.inductor_backend: compile_fx and its passes;
#: compile_cache.torch_compat.restored_code: the code generator, lowering and the kernel
#: modules, and torch._inductor.debug with the scheduler and IR it imports; inductor_backend:
#: torch.compile's minifier wrapper, after_dynamo, with AOTAutograd's partitioners and networkx;
#: restored_code: cpp_extension and setuptools for the CPU kernels' command lines;
#: precompile.lazy_globals: the decomposition table (with torch.ao.quantization.fx) that every
#: saved graph names; compile_cache.session: compile_cache.explain, which says why a start
#: missed or compiled; tests/test_precompile.py).
COMPILE_ONLY = ("torch._inductor.compile_fx", "torch._inductor.pattern_matcher",
                "torch._inductor.fx_passes.post_grad", "torch._inductor.fx_passes.pre_grad",
                "torch._inductor.fx_passes.joint_graph", "torch._inductor.constant_folding",
                "torch._inductor.graph", "torch._inductor.lowering",
                "torch._inductor.select_algorithm", "torch._inductor.codegen.memory_planning",
                "torch._inductor.codegen.wrapper", "torch._inductor.kernel.mm",
                "torch._inductor.debug", "torch._inductor.scheduler", "torch._inductor.ir",
                "torch._inductor.dependencies", "torch._inductor.comms", "torch._inductor.memory",
                "torch._inductor.loop_body", "torch._dynamo.repro.after_aot",
                "torch._dynamo.repro.after_dynamo", "torch._dynamo.testing",
                "torch._functorch.aot_autograd", "torch._functorch.partitioners", "networkx",
                "torch.utils.cpp_extension", "setuptools", "torch._inductor.decomposition",
                "torch.ao.quantization.fx", "compile_cache.explain")
X = torch.randn(4, m.D, generator=torch.Generator().manual_seed(0))

#: How often this process planned the ISA probe's test-library builds (compile_cache.prefetch:
#: a start that restored its packs plans none; its restore answers torch's probe).
ISA_PLANS = [0]
_plan_probe_builds = isa.plan_probe_builds


def _counted_plan_probe_builds():
    ISA_PLANS[0] += 1
    return _plan_probe_builds()


isa.plan_probe_builds = _counted_plan_probe_builds


def seeded(build):
    torch.manual_seed(0)
    return build()


def maxdiff(a, b) -> float:
    if isinstance(a, (tuple, list)):
        return max(maxdiff(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "logits"):
        return maxdiff(a.logits, b.logits)
    return float((a - b).abs().max())


class Case:
    def __init__(self, name: str) -> None:
        self.rec = {"case": name, "phase": PHASE, "diffs": {}, "reports": []}
        self.frames0 = counters["frames"]["ok"]
        self.hits0 = counters["dynamo_cache"]["dynamo_cache_hit"]
        self.fx0 = counters["inductor"]["fxgraph_cache_miss"]
        self.saves0 = dict(pc.SAVES)
        self._warnings = warnings.catch_warnings(record=True)

    def __enter__(self) -> Case:
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        return self

    def compile(self, model, **kwargs):
        compile_cache.compile_regions(model, cache_dir=STORE, precompile=True, **kwargs)
        self._reports = getattr(self, "_reports", []) + [compile_cache.last_report()]
        return model

    def check(self, label: str, got, want) -> None:
        self.rec["diffs"][label] = maxdiff(got, want)
        self.rec.setdefault("compile_only_modules", sorted(m for m in COMPILE_ONLY if m in sys.modules))
        self.rec.setdefault("isa_probe_plans", ISA_PLANS[0])

    def __exit__(self, kind, exc, tb) -> bool:
        self._warnings.__exit__(None, None, None)
        if exc is not None:
            self.rec["error"] = f"{kind.__name__}: {exc}"
            self.rec["traceback"] = "".join(traceback.format_exception(kind, exc, tb))[-3000:]
        compile_cache.session.flush(60)  # publishing runs in the background: the report is final after it
        self.rec["frames_traced"] = counters["frames"]["ok"] - self.frames0
        self.rec["dynamo_cache_hits"] = counters["dynamo_cache"]["dynamo_cache_hit"] - self.hits0
        self.rec["fxgraph_misses"] = counters["inductor"]["fxgraph_cache_miss"] - self.fx0
        self.rec["entry_saves"] = {at: pc.SAVES.get(at, 0) - self.saves0.get(at, 0)
                                   for at in ("compile", "forward")}
        self.rec["reports"] = [
            {"key": r.key, "groups": r.precompile_groups, "published_packs": r.published_packs,
             "restored_packs": r.restored_packs, "errors": r.errors}
            for r in getattr(self, "_reports", [])
        ]
        self.rec["warnings"] = [str(w.message) for w in self.caught
                                if issubclass(w.category, compile_cache.RegionPrecompileWarning)]
        print("CASE " + json.dumps(self.rec), flush=True)
        return True  # a crash is a result too


def fresh_unique_ids() -> None:
    """Torch's unique-id counter as a fresh process has it (the cases that need a collision)."""
    bytecode_transformation._unique_id_counter = itertools.count()


# ---------------------------------------------------------------------------------- the cases


def case_unique_ids_unfixed() -> None:
    """Without compile_cache's fix: a trace after a restored entry crashes (torch 2.13 bug)."""
    with Case("unique_ids_unfixed") as c:
        fresh_unique_ids()
        model = seeded(lambda: m.Stack([m.ShapeBlock(2.0) for _ in range(2)]))
        ref = copy.deepcopy(model)
        fix = pc._advance_unique_ids
        pc._advance_unique_ids = lambda scope: None
        try:
            c.compile(model)
            with torch.no_grad():
                c.check("x4", model(X), ref(X))
                if LOAD:  # a new rank: not in the restored entry, traced here
                    x3d = X.reshape(2, 2, m.D)
                    c.check("x3d", model(x3d), ref(x3d))
        finally:
            pc._advance_unique_ids = fix


def case_unique_ids() -> None:
    with Case("unique_ids") as c:
        fresh_unique_ids()
        model = seeded(lambda: m.Stack([m.ShapeBlockFixed(2.0) for _ in range(2)]))
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            c.check("x4", model(X), ref(X))
            if LOAD:
                x3d = X.reshape(2, 2, m.D)
                c.check("x3d", model(x3d), ref(x3d))


def case_plain() -> None:
    with Case("plain") as c:
        model = seeded(lambda: m.Stack([m.PlainBlock() for _ in range(3)]))
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            c.check("fwd", model(X), ref(X))
            c.check("fwd2", model(X), ref(X))


def case_late_restore() -> None:
    """A distributed follower: its groups compiled before the leader published; the restore
    that follows must load the leader's entries (not trace and publish its own)."""
    import os

    from compile_cache.session import session_for
    from compile_cache.store import Store

    with Case("late_restore") as c:
        model = seeded(lambda: m.Stack([m.LateBlock(2.0) for _ in range(2)]))
        ref = copy.deepcopy(model)
        if not LOAD:
            c.compile(model)
        else:
            own = os.path.join(os.path.dirname(STORE), "late-store")
            compile_cache.compile_regions(model, cache_dir=own, precompile=True)
            report = compile_cache.last_report()
            for pack in Store(STORE).load(report.key):  # the leader's publish arrives
                Store(own).publish(report.key, pack.members,
                                   metadata=pack.header.get("metadata"))
            session_for(model).restore(count=False)
            c._reports = [report]
        with torch.no_grad():
            c.check("fwd", model(X), ref(X))


def case_values() -> None:
    """Block by block, one attribute kind differs: float, then int, then bool."""
    with Case("values") as c:
        values = [(1.0, 1, True), (2.0, 1, True), (2.0, 2, True), (2.0, 2, False)]
        model = seeded(lambda: m.Stack([m.ValueBlock(*v) for v in values]))
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            c.check("fwd", model(X), ref(X))
            for i in range(len(values)):
                c.check(f"block{i}", model.blocks[i](X), ref.blocks[i](X))


def case_optional() -> None:
    with Case("optional") as c:
        model = seeded(lambda: m.Stack([m.MaskBlock() for _ in range(2)]))
        ref = copy.deepcopy(model)
        c.compile(model)
        mask = (torch.arange(m.D) % 2).float()
        with torch.no_grad():
            c.check("no_mask", model(X), ref(X))
            c.check("mask_positional", model(X, mask), ref(X, mask))
            c.check("mask_keyword", model(X, mask=mask), ref(X, mask=mask))
            c.check("no_mask_again", model(X), ref(X))


def case_train_eval() -> None:
    with Case("train_eval") as c:
        model = seeded(lambda: m.Stack([m.DropBlock() for _ in range(2)]))
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            model.train()
            ref.eval()
            y = model(X)
            c.rec["train_differs_from_eval"] = maxdiff(y, ref(X)) > 1e-3
            model.eval()
            c.check("eval", model(X), ref(X))


def case_requires_grad() -> None:
    with Case("requires_grad") as c:
        model = seeded(lambda: m.Stack([m.GradBlock(2.0) for _ in range(2)]))
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            c.check("no_grad", model(X), ref(X))
        x1, x2 = X.clone().requires_grad_(True), X.clone().requires_grad_(True)
        y1, y2 = model(x1), ref(x2)
        c.check("grad_forward", y1, y2)
        y1.sum().backward()
        y2.sum().backward()
        c.check("input_grad", x1.grad, x2.grad)
        c.check("weight_grad", model.blocks[0].lin.weight.grad, ref.blocks[0].lin.weight.grad)


def case_eps() -> None:
    """Two models of the same shapes, another LayerNorm eps, one process."""
    with Case("eps") as c:
        m1 = seeded(lambda: m.Stack([m.NormBlock(1e-5) for _ in range(2)]))
        m2 = seeded(lambda: m.Stack([m.NormBlock(10.0) for _ in range(2)]))
        r1, r2 = copy.deepcopy(m1), copy.deepcopy(m2)
        c.compile(m1)
        with torch.no_grad():
            c.check("model1", m1(X), r1(X))
        c.compile(m2)
        with torch.no_grad():
            c.check("model2", m2(X), r2(X))
            c.check("model1_again", m1(X), r1(X))


def case_mutate() -> None:
    with Case("mutate") as c:
        model = seeded(lambda: m.Stack([m.MutateBlock(1.0) for _ in range(3)]))
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            c.check("before", model(X), ref(X))
            for net in (model, ref):
                net.blocks[1].scale = 3.0
            c.check("after_scale_3", model(X), ref(X))


def _swapped(c: Case, block_cls, act, swapped_act) -> None:
    model = seeded(lambda: m.Stack([block_cls(act) for _ in range(2)]))
    ref = copy.deepcopy(model)
    c.compile(model)
    with torch.no_grad():
        c.check("before", model(X), ref(X))
        for net in (model, ref):
            net.blocks[1].act = swapped_act
        c.check("after_swap", model(X), ref(X))


def case_fnattr() -> None:
    """A Python function stored on the instance: recorded by identity (a pin on the block), so
    the swap on one block after compiling is noticed and declines."""
    with Case("fnattr") as c:
        _swapped(c, m.FnAttrBlock, m.act_a, m.act_b)


def case_argfn() -> None:
    """A function passed to the blocks as an argument: declined while tracing the region's own
    frame (before any of the call runs), remembered by the store."""
    with Case("argfn") as c:
        model = seeded(lambda: m.Stack([m.ArgFnBlock() for _ in range(2)]))
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            c.check("before", model(X, m.act_a), ref(X, m.act_a))
            c.check("after_swap", model(X, m.act_b), ref(X, m.act_b))


def case_break_count() -> None:
    """A decline found in the frame after a graph break: the call must not run again (the first
    frame's in-place update would count twice)."""
    with Case("break_count") as c:
        model = seeded(lambda: m.Stack([m.BreakCountBlock() for _ in range(2)]))
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            c.check("out", model(X), ref(X))
            c.check("calls", torch.stack([b.calls for b in model.blocks]),
                    torch.stack([b.calls for b in ref.blocks]))
            c.check("out_again", model(X), ref(X))
            c.check("calls_again", torch.stack([b.calls for b in model.blocks]),
                    torch.stack([b.calls for b in ref.blocks]))


def case_builtinattr() -> None:
    with Case("builtinattr") as c:
        _swapped(c, m.BuiltinAttrBlock, torch.tanh, torch.sigmoid)


def case_global_flag() -> None:
    """The user turned caching_precompile on process-wide (TORCH_CACHING_PRECOMPILE=1)."""
    import torch._dynamo.config as dynamo_config

    with Case("global_flag") as c:
        dynamo_config.caching_precompile = True
        try:
            _swapped(c, m.FlagFnBlock, m.act_a, m.act_b)
        finally:
            dynamo_config.caching_precompile = False


def case_rebind() -> None:
    """A module-level function the blocks call, rebound after compiling (monkeypatching)."""
    with Case("rebind") as c:
        model = seeded(lambda: m.Stack([m.HelperBlock() for _ in range(2)]))
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            c.check("before", model(X), ref(X))
            m.helper = m.act_b
            try:
                c.check("after_rebind", model(X), ref(X))
            finally:
                m.helper = m.HELPER


def case_bound_differently() -> None:
    """A module-level function bound otherwise on the loading node than where it published."""
    with Case("bound_differently") as c:
        if LOAD:
            m.helper2 = m.act_b
        try:
            model = seeded(lambda: m.Stack([m.Helper2Block() for _ in range(2)]))
            ref = copy.deepcopy(model)
            c.compile(model)
            with torch.no_grad():
                c.check("fwd", model(X), ref(X))
        finally:
            m.helper2 = m.HELPER2


def _hf(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if kind == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                   n_positions=64, attn_implementation="eager")
    else:
        cfg = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=256,
                                   max_position_embeddings=64, attn_implementation="sdpa")
    return seeded(lambda: AutoModelForCausalLM.from_config(cfg).eval())


IDS = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
NEXT = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(2))


def case_gpt2() -> None:
    with Case("gpt2") as c:
        model = _hf("gpt2")
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            c.check("fwd", model(IDS, use_cache=False), ref(IDS, use_cache=False))
            c.check("fwd2", model(IDS, use_cache=False), ref(IDS, use_cache=False))


def case_llama() -> None:
    """Per-layer layer_idx read with use_cache=True: prefill, two decode steps, no cache."""
    with Case("llama") as c:
        model = _hf("llama")
        ref = copy.deepcopy(model)
        c.compile(model)
        with torch.no_grad():
            a, b = model(IDS, use_cache=True), ref(IDS, use_cache=True)
            c.check("prefill", a, b)
            c.rec["has_cache"] = a.past_key_values is not None
            for step in (1, 2):
                a = model(NEXT, past_key_values=a.past_key_values, use_cache=True)
                b = ref(NEXT, past_key_values=b.past_key_values, use_cache=True)
                c.check(f"decode{step}", a, b)
            c.check("no_cache", model(IDS, use_cache=False), ref(IDS, use_cache=False))


def case_scope() -> None:
    """After all the precompile compiles and calls: the flag is off, the environment key is
    unchanged, and the user's own torch.compile keeps its identity guards."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    with Case("scope") as c:
        c.rec["caching_precompile"] = bool(dynamo_config.caching_precompile)
        c.rec["suppress_errors"] = bool(dynamo_config.suppress_errors)
        c.rec["force_non_lazy_backward_lowering"] = bool(
            functorch_config.force_non_lazy_backward_lowering)
        c.rec["environment_unchanged"] = environment_digest() == ENV_BEFORE

        def user_f(x, act):
            return act(x) + 1

        compiled = torch.compile(user_f, backend="eager")
        c.check("user_tanh", compiled(X, torch.tanh), user_f(X, torch.tanh))
        c.check("user_sigmoid", compiled(X, torch.sigmoid), user_f(X, torch.sigmoid))


CASES = ["unique_ids_unfixed", "unique_ids", "plain", "late_restore", "values", "optional", "train_eval",
         "requires_grad", "eps", "mutate", "fnattr", "argfn", "break_count", "builtinattr", "global_flag", "rebind",
         "bound_differently", "gpt2", "llama", "scope"]

if __name__ == "__main__":
    for name in (sys.argv[3].split(",") if len(sys.argv) > 3 else CASES):
        globals()[f"case_{name}"]()
