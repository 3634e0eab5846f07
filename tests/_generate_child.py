"""Child process for tests/test_generate.py: ``generate()`` of a regionally compiled model with a
store, real Inductor, fp32, against eager generation of the same model.

    python _generate_child.py STORE          # the generates that fill the store (or hit it)
    python _generate_child.py STORE vary     # other generates of the same models on that store

Runs a tiny Llama (DynamicCache, batch 2 with left padding) and a tiny GPT-2 (static cache) in
turn. Prints one line ``RESULT {json}``: per model, whether the token ids equal eager's, the FX-graph
cache hits and misses of its generate, what its store session restored and published, and the
region stats. ``vary`` runs, per model, generates that the store's entries were not made with
(another prompt length, padding and number of new tokens; the other cache class), each against
eager: ``equal`` is then one flag per generate.
"""

import copy
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


#: ``vary``: per model, (batch, prompt length, padded rows' pad length, new tokens, static cache).
#: Llama's first generate can hit the loaded decode entry with other KV lengths and pads; the
#: others use the other cache class than the store's entries were made with.
VARIED = {
    "llama": [(2, 6, 2, 7, False), (2, 10, 3, 5, True)],
    "gpt2": [(2, 10, 3, 5, False)],
}


def _inputs(batch: int, length: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    ids[batch - 1, :pad] = 0  # left padding on the last row
    mask[batch - 1, :pad] = 0
    return ids, mask


def run(arch: str, static: bool, varied: bool = False) -> dict:
    options = dict(CONFIGS[arch])
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(options.pop("model_type"), vocab_size=128, bos_token_id=0,
                               eos_token_id=0, attn_implementation="eager", **options)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    cases = VARIED[arch] if varied else [(2, 10, 3, 5, static)]
    calls = []
    for batch, length, pad, new, cache_static in cases:
        ids, mask = _inputs(batch, length, pad)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        if cache_static:
            kw["cache_implementation"] = "static"
        calls.append(dict(input_ids=ids, attention_mask=mask, **kw))
    reference = copy.deepcopy(model)  # a static-cache generate leaves an attribute on the model
    with torch.no_grad():             # (part of its fingerprint): keep the compiled one untouched
        refs = [reference.generate(**call) for call in calls]
        hit, miss = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        compile_cache.compile_regions(model, cache_dir=STORE)
        outs = [model.generate(**call) for call in calls]
    assert compile_cache.session.flush(120)  # what generate compiled is published off the step
    report = compile_cache.last_report()
    equal = [bool(torch.equal(out, ref)) for out, ref in zip(outs, refs, strict=True)]
    return {
        "equal": equal if varied else equal[0],
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


VARY = sys.argv[2:] == ["vary"]
print("RESULT " + json.dumps({"llama": run("llama", False, VARY), "gpt2": run("gpt2", True, VARY)}))
