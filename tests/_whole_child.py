"""Child process of tests/test_whole.py: ``compile_cache.compile`` on one node.

    python _whole_child.py STORE PHASE [on|off]     PHASE: publish | load; precompile on/off
                                                     (default: COMPILE_CACHE_PRECOMPILE's)

Compiles (Inductor) a tiny GPT-2 whole with ``compile_cache.compile(model)`` and runs a forward
(eval, no_grad) and a training step (forward, backward, SGD step) beside an eager copy; then
``compile_cache.compile(fn)`` on a function closing over a tensor; then a second function, warmed
with ``compile_cache.warm`` on the publisher and compiled with ``compile_cache.compile`` on the
fresh node. Prints ``RESULT {json}``:
the largest differences from eager, the FX-graph hits and misses of each part, the frames the
forward traced and the precompile entries it loaded, the reports.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch._dynamo.utils import counters

import compile_cache

STORE, PHASE = sys.argv[1], sys.argv[2]
PRECOMPILE = {"on": True, "off": False}.get(sys.argv[3]) if len(sys.argv) > 3 else None


def gpt2() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                               n_positions=64, bos_token_id=0, eos_token_id=0,
                               attn_implementation="eager", resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(cfg)


def fx() -> tuple[int, int]:
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def main() -> None:
    out: dict = {"phase": PHASE}
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model = gpt2()
    ref = copy.deepcopy(model)
    same = compile_cache.compile(model, cache_dir=STORE, precompile=PRECOMPILE)
    out["in_place"] = same is model and type(model).__name__ == "GPT2LMHeadModel"
    report = compile_cache.last_report()
    out["model_key"] = report.key
    out["model_restored_packs"] = report.restored_packs

    h0, m0 = fx()
    frames = counters["frames"]["ok"]
    model.eval()
    ref.eval()
    with torch.no_grad():
        out["forward_diff"] = float((model(ids).logits - ref(ids).logits).abs().max())
    # what the forward traced, and the precompile entries loaded (compile_cache.compile loads
    # the part's entry before the first call)
    out["forward_frames"] = counters["frames"]["ok"] - frames
    out["entry_loads"] = counters["dynamo_cache"]["dynamo_cache_hit"]
    model.train()
    ref.train()
    model.config.use_cache = ref.config.use_cache = False
    losses = []
    grads = []
    for m in (model, ref):
        m.zero_grad()
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
        grads.append(m.transformer.wte.weight.grad)
    out["loss_diff"] = float((losses[0] - losses[1]).abs())
    out["grad_diff"] = float((grads[0] - grads[1]).abs().max())
    h1, m1 = fx()
    out["model_fx_hits"], out["model_fx_misses"] = h1 - h0, m1 - m0

    scale = torch.linspace(0.5, 1.5, 32)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((torch.tanh(x) * scale - y) ** 2).mean() + x.sin().sum() * 1e-3

    fn = compile_cache.compile(loss_fn, cache_dir=STORE)
    out["fn_key"] = fn.key
    out["fn_restored_packs"] = compile_cache.last_report().restored_packs
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    y = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
    h2, m2 = fx()
    out["fn_diff"] = float((fn(x, y) - loss_fn(x, y)).abs())
    h3, m3 = fx()
    out["fn_fx_hits"], out["fn_fx_misses"] = h3 - h2, m3 - m2
    fn_report = compile_cache.last_report()

    # a function warmed on the publisher (compile_cache.warm: compile_cache.compile(fn)'s key),
    # compiled and called on the fresh node
    def warmed_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (torch.cos(x) * scale + y).abs().amax(dim=0)

    h4, m4 = fx()
    if PHASE == "publish":
        result = compile_cache.warm(warmed_fn, [(x, y)], cache_dir=STORE)[0]
        out["warmed"] = {"key": result.key, "status": result.status,
                         "published_packs": result.published_packs}
        diff = 0.0
    else:
        wfn = compile_cache.compile(warmed_fn, cache_dir=STORE)
        diff = float((wfn(x, y) - warmed_fn(x, y)).abs().max())
        out["warmed"] = {"key": wfn.key, "restored_packs": compile_cache.last_report().restored_packs}
    h5, m5 = fx()
    out["warmed"].update(diff=diff, fx_hits=h5 - h4, fx_misses=m5 - m4)
    out["flushed"] = compile_cache.session.flush(120)
    reports = [report, fn_report]
    out["published_packs"] = [r.published_packs for r in reports]
    out["errors"] = [e for r in reports for e in r.errors]
    out["precompile"] = [report.precompile, report.precompile_declined,
                         {g.get("status"): g.get("reason", "")
                          for g in report.precompile_groups.values()}]
    out["capture"] = [r.capture for r in reports]
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
