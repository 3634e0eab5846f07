"""Child process of tests/test_capture.py: one job start on a node (the caller sets up the node's
environment: new TMPDIR, HOME, XDG_CACHE_HOME and local torch cache dirs for a fresh node).

    python _node_child.py STORE MODE [--flush] [--plain]

MODE: ``fwd`` (one forward under no_grad), ``train`` (one training step: forward and backward),
``both`` (the forward, then the training step). ``--plain`` compiles with ``precompile=False``
(FX-graph and AOTAutograd entries only, Dynamo traces on every start); without it each region
group is precompiled (``precompile=True``: off by default while it is under review). The model is compile_cache.demo's
TinyTransformer (2 blocks, width 32) in eval mode (no dropout: outputs comparable with eager).

Prints ``RESULT {json}``: torch's cache counters, the largest differences from eager (output and
gradients), what the header deferral did, the precompiled headers under this node's temp dir,
and the cache report. Without ``--flush`` it exits at once, as a one-step job does: whatever is
not published yet is published by the exit hook.
"""

import glob
import json
import sys
import tempfile

import torch
from torch._dynamo.utils import counters

import compile_cache
from compile_cache.demo import TinyTransformer
from compile_cache.torch_compat import cache_use, cpp_header

store, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = TinyTransformer(layers=2, width=32, heads=2, vocab=128).eval()
tokens = torch.randint(0, 128, (1, 16))
with torch.no_grad():
    expected = model(tokens)
model(tokens).float().sum().backward()
expected_grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad(set_to_none=True)

compile_cache.compile_regions(model, cache_dir=store,
                               precompile="--plain" not in sys.argv)
out_diff = grad_diff = 0.0
if mode in ("fwd", "both"):
    with torch.no_grad():
        out_diff = (model(tokens) - expected).abs().max().item()
if mode in ("train", "both"):
    out = model(tokens)
    out.float().sum().backward()
    out_diff = max(out_diff, (out - expected).abs().max().item())
    grad_diff = max((p.grad - g).abs().max().item()
                    for p, g in zip(model.parameters(), expected_grads, strict=True))
if "--flush" in sys.argv:
    assert compile_cache.session.flush(120)
report = compile_cache.last_report()
print("RESULT " + json.dumps({
    "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
    "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
    "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
    "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
    "frames_traced": counters["frames"]["ok"],
    "out_diff": out_diff,
    "grad_diff": grad_diff,
    "header": cpp_header.counts(),
    "use": cache_use.counts(),
    "gch": glob.glob(f"{tempfile.gettempdir()}/**/*.gch", recursive=True),
    "eager_calls": sum(s["eager_calls"] for s in compile_cache.region_stats(model).values()),
    "report": report.to_dict(),
}), flush=True)
