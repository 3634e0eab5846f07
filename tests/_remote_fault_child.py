"""Child process for tests/test_store_remote.py: job starts on stores on object storage that
cannot be used (issue 57), one after the other in this process.

Usage: python _remote_fault_child.py CASES_JSON, a list of ``{"url": ..., "env": {...}}``: each
start gets the store ``url`` and the cloud variables ``env`` (no others), a new model
and Dynamo reset. Prints one JSON line: per start, the seconds from ``compile_regions`` to its
first output, whether that output equals eager's, the warnings shown, the report and the
counters of the start's local tier. The model is two repeated blocks (compile_regions' regions),
so that Dynamo's eager backend gives eager's bits exactly.
"""

import json
import os
import sys
import time
import warnings

import torch

import compile_cache
from compile_cache.store import Store
from compile_cache.store import _reset as reset_store_warnings
from compile_cache.store.remote import local_tier_dir

CLOUD = ("AWS_", "GOOGLE_", "GCE_", "CLOUDSDK_", "AZURE_", "STORAGE_EMULATOR_HOST", "FSSPEC_", "GCSFS_",
         "NO_GCE_CHECK")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


results = []
for case in json.loads(sys.argv[1]):
    for name in [n for n in os.environ if n.startswith(CLOUD)]:
        del os.environ[name]
    os.environ.update(case["env"])
    torch._dynamo.reset()
    reset_store_warnings()
    torch.manual_seed(0)
    model = Model().eval()
    tokens = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(tokens)
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            start = time.monotonic()
            compile_cache.compile_regions(model, cache_dir=case["url"], backend="eager")
            got = model(tokens)
            seconds = time.monotonic() - start
    flushed = compile_cache.session.flush(60)  # the outcome is recorded with the publish, off the step
    report = compile_cache.last_report()
    local = Store(local_tier_dir(case["url"])).stats()
    results.append({
        "url": case["url"], "seconds": seconds, "flushed": flushed, "equal": bool(torch.equal(got, expected)),
        "warnings": [str(w.message) for w in shown], "restored_packs": report.restored_packs,
        "miss_reason": report.miss_reason, "store": report.store,
        "local_tier": {k: local[k] for k in ("misses", "remote_errors")},
    })
print(json.dumps(results))
