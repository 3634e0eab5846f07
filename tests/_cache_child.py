"""Child process for tests/test_cache.py: one start of a job that uses compile_regions + a store.

Usage: python _cache_child.py STORE LAYERS WIDTH DTYPE [precompile]. Prints one JSON line: the
cache report, Inductor counters and the largest difference from eager.
"""

import json
import sys

import torch
from torch._dynamo.utils import counters

import compile_cache
from compile_cache.demo import TinyTransformer
from compile_cache.torch_compat import isa

store, layers, width, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
precompile = len(sys.argv) > 5 and sys.argv[5] == "precompile"
torch.manual_seed(0)
model = TinyTransformer(layers=layers, width=width, heads=2, vocab=128).eval()
model.to(getattr(torch, dtype))
tokens = torch.randint(0, 128, (1, 16))
with torch.no_grad():
    expected = model(tokens)
    compile_cache.compile_regions(model, cache_dir=store, precompile=precompile)
    got = model(tokens)
assert compile_cache.session.flush(120)  # what the forward compiled is published off the step
report = compile_cache.last_report()
print(
    json.dumps(
        {
            "report": report.to_dict(),
            "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
            "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
            "max_diff": (got - expected).abs().max().item(),
            "eager_calls": sum(s["eager_calls"] for s in compile_cache.region_stats(model).values()),
            "isa_probe": isa.counts(),
            "traced_graphs": counters["stats"]["unique_graphs"],  # Dynamo tracing this process
        }
    )
)
