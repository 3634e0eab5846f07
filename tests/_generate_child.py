"""Child process for tests/test_generate.py: ``generate()`` of a regionally compiled model with a
store, real Inductor, fp32, against eager generation of the same model.

    python _generate_child.py STORE

Runs a tiny Llama (DynamicCache, batch 2 with left padding) and a tiny GPT-2 (static cache) in
turn. Prints one line ``RESULT {json}``: per model, whether the token ids equal eager's, the FX-graph
cache hits and misses of its generate, what its store session restored and published, and the
region stats.
"""

import json
import sys

import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

import compile_cache

STORE = sys.argv[1]
CONFIGS = {
    "llama": dict(
        model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
    ),
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=2, n_positions=64),
}


def run(arch: str, static: bool) -> dict:
    options = dict(CONFIGS[arch])
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(options.pop("model_type"), vocab_size=128, bos_token_id=0,
                               eos_token_id=0, attn_implementation="eager", **options)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3] = 0  # left padding
    mask[1, :3] = 0
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
        hit, miss = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        compile_cache.compile_regions(model, cache_dir=STORE)
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert compile_cache.session.flush(120)  # what generate compiled is published off the step
    report = compile_cache.last_report()
    return {
        "equal": bool(torch.equal(out, ref)),
        "fx_hits": counters["inductor"]["fxgraph_cache_hit"] - hit,
        "fx_misses": counters["inductor"]["fxgraph_cache_miss"] - miss,
        "restored_packs": report.restored_packs,
        "published_packs": report.published_packs,
        "errors": report.errors,
        "precompile_hits": report.precompile_hits,
        "precompile_groups": report.precompile_groups,
        "frames_traced": counters["frames"]["ok"],
        "stats": compile_cache.region_stats(model),
    }


print("RESULT " + json.dumps({"llama": run("llama", False), "gpt2": run("gpt2", True)}))
