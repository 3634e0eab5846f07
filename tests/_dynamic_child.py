"""Child process for tests/test_dynamic_shapes.py: one fresh node's ``generate()`` at one prompt
length, regionally compiled with real Inductor and a store, against eager.

    python _dynamic_child.py STORE LENGTH [static] [ARCH...] [warm=16,32,64] [prefill=48] [forward=24,40,20]

``static`` compiles with ``dynamic=False``. After the generates, on a tiny Qwen2 (``qwen2_kv``:
another key and other code objects than the generates' models): ``warm=...``
runs compile_cache.warm() of its forward with a KV cache (``use_cache=True``, what
``warm --use-cache --seq-len ...`` runs) at those lengths; ``prefill=N`` runs its generate()
prefill alone (one new token) at N tokens against eager; ``forward=...`` runs its forwards with
a KV cache at those lengths against eager. Prints ``RESULT {json}``: per model, whether the token
ids equal eager's, the FX-graph hits and misses of its generate, the restored packs, the
automatic-dynamic decisions the session restored, the errors and timings; under
``warm``/``prefill``/``forward`` the same for those calls.
"""

import os
import sys
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

import compile_cache
from compile_cache.torch_compat import dynamic_shapes

STORE, LENGTH = sys.argv[1], int(sys.argv[2])
OPTIONS = sys.argv[3:]
STATIC = "static" in OPTIONS
THEN = {k: [int(n) for n in v.split(",")] for k, _, v in (o.partition("=") for o in OPTIONS if "=" in o)}
CONFIGS = {
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=32, n_head=2, n_positions=64),
    # another family (its own modeling file): Dynamo's resume functions after a graph break are
    # code objects of the modeling file, shared in a process by every model of that family, and
    # so is their automatic-dynamic record; a Llama of another width here would make the Llama's
    # record dynamic in the width (what this process saw), a graph later nodes do not have
    "qwen2_kv": dict(model_type="qwen2", num_hidden_layers=2, hidden_size=48, intermediate_size=64,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64),
}


def build(arch: str) -> torch.nn.Module:
    options = dict(CONFIGS[arch])
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(options.pop("model_type"), vocab_size=128, bos_token_id=0,
                               eos_token_id=0, pad_token_id=0, attn_implementation="eager", **options)
    return AutoModelForCausalLM.from_config(cfg).eval()


def forwards(lengths: list[int], mode: str) -> dict:
    """``qwen2_kv`` at ``lengths`` with a KV cache: ``warm``, compile_cache.warm() over them;
    ``prefill``, generate() of one new token (its prefill alone) against eager; ``forward``,
    forwards against eager."""
    model = build("qwen2_kv")
    inputs = [dict(input_ids=torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)),
                   use_cache=True) for n in lengths]
    hit, miss = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    equal = []
    if mode == "warm":
        compile_cache.warm(model, inputs, cache_dir=STORE)
    elif mode == "prefill":
        calls = [dict(input_ids=x["input_ids"], attention_mask=torch.ones_like(x["input_ids"]),
                      max_new_tokens=1, do_sample=False, pad_token_id=0) for x in inputs]
        with torch.no_grad():
            refs = [model.generate(**call) for call in calls]
            compile_cache.compile_regions(model, cache_dir=STORE)
            outs = [model.generate(**call) for call in calls]
        equal = [bool(torch.equal(o, r)) for o, r in zip(outs, refs, strict=True)]
    else:
        with torch.no_grad():
            refs = [model(**x).logits for x in inputs]
            compile_cache.compile_regions(model, cache_dir=STORE)
            outs = [model(**x).logits for x in inputs]
        equal = [bool(torch.allclose(o, r, atol=1e-5, rtol=1e-4)) for o, r in zip(outs, refs, strict=True)]
    assert compile_cache.session.flush(120)
    report = compile_cache.last_report()
    group = compile_cache.get_plan(model).groups[0].code_name  # the record's member is named so
    restored = dynamic_shapes.read_restored(group) or {}
    return {"equal": equal, "record_codes": sorted(c["name"] for c in restored.get("codes", {}).values()), "fx_hits": counters["inductor"]["fxgraph_cache_hit"] - hit,
            "fx_misses": counters["inductor"]["fxgraph_cache_miss"] - miss,
            "restored_packs": report.restored_packs, "dynamic_inputs": report.dynamic_inputs,
            "precompile_hits": report.precompile_hits, "errors": report.errors}


def run(arch: str) -> dict:
    model = build(arch)
    ids = torch.randint(3, 128, (1, LENGTH), generator=torch.Generator().manual_seed(LENGTH))
    call = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        ref = model.generate(**call)
        eager_s = time.perf_counter() - t
        hit, miss = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        kw = {"dynamic": False} if STATIC else {}
        compile_cache.compile_regions(model, cache_dir=STORE, **kw)
        t = time.perf_counter()
        out = model.generate(**call)
        first_s = time.perf_counter() - t
    assert compile_cache.session.flush(120)
    report = compile_cache.last_report()
    return {
        "equal": bool(torch.equal(out, ref)),
        "fx_hits": counters["inductor"]["fxgraph_cache_hit"] - hit,
        "fx_misses": counters["inductor"]["fxgraph_cache_miss"] - miss,
        "restored_packs": report.restored_packs,
        "published_packs": report.published_packs,
        "dynamic_inputs": report.dynamic_inputs,
        "key": report.key, "partial_causes": report.partial_causes, "pid": os.getpid(),
        "precompile_groups": {k: v.get("status") for k, v in report.precompile_groups.items()},
        "errors": report.errors,
        "eager_s": round(eager_s, 3), "first_generate_s": round(first_s, 3),
    }


ARCHS = [a for a in OPTIONS if a != "static" and "=" not in a] or ["llama", "gpt2"]
result = {arch: run(arch) for arch in ARCHS}
for mode, lengths in THEN.items():  # in the order given
    result[mode] = forwards(lengths, mode)
print("RESULT " + __import__("json").dumps(result))
