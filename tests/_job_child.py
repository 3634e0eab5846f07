"""Child process: one start of a job on a model from a factory, with a store; compared to eager.

    python _job_child.py STORE path/to/file.py:factory

The factory returns ``(model, example_input)``. Prints one JSON line: the cache report, the
largest difference from eager, and the store's stats.
"""

import importlib
import json
import sys
from pathlib import Path

import torch

import compile_cache

store, target = sys.argv[1], sys.argv[2]
path, _, function = target.rpartition(":")
sys.path.insert(0, str(Path(path).parent))  # imported by its own name, as `warm` does: same key
module = importlib.import_module(Path(path).stem)
model, x = getattr(module, function)()
with torch.no_grad():
    expected = model(x)
    compile_cache.compile_regions(model, cache_dir=store)
    got = model(x)
print(json.dumps({
    "report": compile_cache.last_report().to_dict(),
    "max_diff": (got - expected).abs().max().item(),
}))
