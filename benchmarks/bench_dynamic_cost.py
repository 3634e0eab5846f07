"""What a dynamic graph costs at run time against a static one (issue 36).

A tiny Llama (2 layers, width 64), forward of 1 x 64 tokens without a KV cache, regionally
compiled with Inductor on CPU, once with ``dynamic=False`` and once with ``dynamic=True``; one
thread; best of 7 rounds of 50 forwards each, the two models interleaved.

    python benchmarks/bench_dynamic_cost.py
"""

import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import compile_cache


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "llama", vocab_size=128, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        attn_implementation="eager")
    return AutoModelForCausalLM.from_config(cfg).eval()


def main() -> None:
    torch.set_num_threads(1)
    ids = torch.randint(3, 128, (1, 64))
    models = {}
    for name, dynamic in (("static", False), ("dynamic", True)):
        model = build()
        compile_cache.compile_regions(model, cache_dir=False, dynamic=dynamic)
        with torch.no_grad():
            for _ in range(3):
                model(input_ids=ids, use_cache=False)
        models[name] = model
    best = dict.fromkeys(models, float("inf"))
    with torch.no_grad():
        for _ in range(7):
            for name, model in models.items():
                start, n = time.perf_counter(), 50
                for _ in range(n):
                    model(input_ids=ids, use_cache=False)
                best[name] = min(best[name], (time.perf_counter() - start) / n * 1e6)
    print({k: round(v) for k, v in best.items()}, "us/forward (best of 7x50), dynamic/static",
          round(best["dynamic"] / best["static"], 3))


if __name__ == "__main__":
    main()
