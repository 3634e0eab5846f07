"""Child process shared by the artifact tests: compile a tiny MLP with Inductor, capture or restore.

    python _mlp_child.py capture PACK.pkl                 # compile, pickle what the compile added
    python _mlp_child.py restore PACK.pkl                 # restore the pickle, then compile
    python _mlp_child.py restore-store STORE KEY          # restore a store key's packs, then compile

Prints one line ``RESULT {json}``: compile counters, the member names the compile added, how many
files the restore wrote, and the output (a restored kernel must give exactly these values).
"""

import json
import pickle
import sys

import torch

from compile_cache import artifacts
from compile_cache.torch_compat.dynamo import CompileCounters

mode = sys.argv[1]
written = 0
if mode == "restore":
    with open(sys.argv[2], "rb") as f:
        written = len(artifacts.restore(pickle.load(f)).written)
elif mode == "restore-store":
    from compile_cache.store import Store

    for pack in Store(sys.argv[2]).load(sys.argv[3]):
        written += len(artifacts.restore(pack.members).written)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
x = torch.randn(4, 16)
with torch.no_grad():
    ref = model(x)
capture = artifacts.Capture()
before = CompileCounters.snapshot()
with torch.no_grad():
    out = torch.compile(model)(x)
counts = CompileCounters.snapshot().diff(before)
torch.testing.assert_close(out, ref)
added = capture.collect()
if mode == "capture":
    with open(sys.argv[2], "wb") as f:
        pickle.dump(added, f)
print("RESULT " + json.dumps({
    "counters": counts.as_dict(), "added": sorted(added), "written": written, "out": out.tolist(),
}))
