"""Child process of tests/test_locks_heartbeat.py: one job warming a tiny model into a shared store.

    python _lock_child.py holder STORE OUT WAITER_READY   # compiles, holding the key's lock until
                                                         # the waiter is waiting (and 2 s more)
    python _lock_child.py waiter STORE OUT WAITER_READY   # warms the same key: waits, restores

Writes OUT (JSON): the warm-up report, the cache report and the largest difference from eager.
"""

import json
import sys
import time
from pathlib import Path

import torch

import compile_cache
from compile_cache import distributed, warmup
from compile_cache.demo import TinyTransformer

role, store, out, waiter_ready = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
torch.manual_seed(0)
model = TinyTransformer(layers=2, width=32, heads=2, vocab=64).eval()
x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    ref = model(x)
if role == "holder":
    real_run = warmup.run

    def run_late(*args, **kwargs):  # called with the key's lock held
        out.with_suffix(".locked").write_text("1")
        deadline = time.monotonic() + 120
        while not waiter_ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # past the waiter's lock timeout and the stale age: only heartbeats help
        return real_run(*args, **kwargs)

    warmup.run = run_late
else:
    waiter_ready.write_text("1")  # imports done: compile_regions (and the lock wait) comes now
compile_cache.compile_regions(model, cache_dir=store, example_inputs=(x,))
with torch.no_grad():
    diff = (model(x) - ref).abs().max().item()
out.write_text(json.dumps({
    "warm_up": distributed.last_warm_up().to_dict(),
    "report": compile_cache.last_report().to_dict(),
    "max_diff": diff,
}))
