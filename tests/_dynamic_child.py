"""Child process for tests/test_dynamic_shapes.py: one fresh node's ``generate()`` at one prompt
length, regionally compiled with real Inductor and a store, against eager.

    python _dynamic_child.py STORE LENGTH [static] [ARCH...]
    python _dynamic_child.py STORE warm 16,32,64     # compile_cache.warm() of the Llama's forward
    python _dynamic_child.py STORE forward 24,40,16  # forwards of that Llama, then FX-graph counts

``static`` compiles with ``dynamic=False``. Prints ``RESULT {json}``: per model, whether the token
ids equal eager's, the FX-graph hits and misses of its generate, the restored packs, the
automatic-dynamic decisions the session restored and the errors.
"""

import sys

import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

import compile_cache

STORE, MODE = sys.argv[1], sys.argv[2]
LENGTH = int(MODE) if MODE.isdigit() else 0
STATIC = "static" in sys.argv[3:]
CONFIGS = {
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=32, n_head=2, n_positions=64),
}


def build(arch: str) -> torch.nn.Module:
    options = dict(CONFIGS[arch])
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(options.pop("model_type"), vocab_size=128, bos_token_id=0,
                               eos_token_id=0, pad_token_id=0, attn_implementation="eager", **options)
    return AutoModelForCausalLM.from_config(cfg).eval()


def forwards(lengths: list[int], warm: bool) -> dict:
    """``warm``: compile_cache.warm() over ``lengths``; else forwards at them against eager."""
    model = build("llama")
    inputs = [dict(input_ids=torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)),
                   use_cache=False) for n in lengths]
    hit, miss = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    equal = []
    if warm:
        compile_cache.warm(model, inputs, cache_dir=STORE)
    else:
        with torch.no_grad():
            refs = [model(**x).logits for x in inputs]
            compile_cache.compile_regions(model, cache_dir=STORE)
            outs = [model(**x).logits for x in inputs]
        equal = [bool(torch.allclose(o, r, atol=1e-5, rtol=1e-4)) for o, r in zip(outs, refs, strict=True)]
    assert compile_cache.session.flush(120)
    report = compile_cache.last_report()
    return {"equal": equal, "fx_hits": counters["inductor"]["fxgraph_cache_hit"] - hit,
            "fx_misses": counters["inductor"]["fxgraph_cache_miss"] - miss,
            "restored_packs": report.restored_packs, "dynamic_inputs": report.dynamic_inputs,
            "precompile_hits": report.precompile_hits, "errors": report.errors}


def run(arch: str) -> dict:
    model = build(arch)
    ids = torch.randint(3, 128, (1, LENGTH), generator=torch.Generator().manual_seed(LENGTH))
    call = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(**call)
        hit, miss = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        kw = {"dynamic": False} if STATIC else {}
        compile_cache.compile_regions(model, cache_dir=STORE, **kw)
        out = model.generate(**call)
    assert compile_cache.session.flush(120)
    report = compile_cache.last_report()
    return {
        "equal": bool(torch.equal(out, ref)),
        "fx_hits": counters["inductor"]["fxgraph_cache_hit"] - hit,
        "fx_misses": counters["inductor"]["fxgraph_cache_miss"] - miss,
        "restored_packs": report.restored_packs,
        "published_packs": report.published_packs,
        "dynamic_inputs": report.dynamic_inputs,
        "precompile_groups": {k: v.get("status") for k, v in report.precompile_groups.items()},
        "errors": report.errors,
    }


if MODE in ("warm", "forward"):
    result = forwards([int(n) for n in sys.argv[3].split(",")], MODE == "warm")
else:
    ARCHS = [a for a in sys.argv[3:] if a != "static"] or ["llama", "gpt2"]
    result = {arch: run(arch) for arch in ARCHS}
print("RESULT " + __import__("json").dumps(result))
