"""Programs tests/test_process_store.py starts under ``python -m compile_cache run``; none of
them knows compile_cache (except to report what the store did).

    python _run_scripts.py generate|plain|plain_b8

``generate``: transformers' ``generate(cache_implementation="static")`` on a tiny GPT-2, with
transformers' own compile of the forward (``compile_config`` on every device, since this is a
CPU); ``plain``: ``torch.compile(model)`` on a small MLP (``plain_b8``: its input batch 8, not 4). Each compares with eager and prints ``RESULT {json}``:
the difference, FX-graph hits and misses, and what the process store did.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch._dynamo.utils import counters


def fx() -> tuple[int, int]:
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def generate() -> float:
    from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                               n_positions=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                               attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only otherwise
    got = model.generate(ids, compile_config=compile_config, **kw)
    want = ref.generate(ids, disable_compile=True, **kw)
    return float((got != want).sum())


def plain(width: int, batch: int = 4) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                torch.nn.Linear(2 * width, width))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((compiled(x) - ref(x)).abs().max())


def main() -> None:
    which = sys.argv[1]
    h0, m0 = fx()
    diff = {"generate": generate, "plain": lambda: plain(32),
            "plain_b8": lambda: plain(32, batch=8)}[which]()
    h1, m1 = fx()
    out = {"script": which, "diff": diff, "fx_hits": h1 - h0, "fx_misses": m1 - m0}
    store = sys.modules.get("compile_cache.process_store")
    if store is not None and store.enabled():
        import compile_cache.session as session

        report = session.last_report()
        out["store"] = report is not None
    if store is not None and store.enabled() and report is not None:
        out.update(name=store.enabled(), key=report.key, restored_packs=report.restored_packs,
                   flushed=store.flush(120), published_packs=report.published_packs,
                   errors=report.errors)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
