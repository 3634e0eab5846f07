"""Child process of tests/test_region_hooks.py: a hook registered after the first forward, on a
publishing node and on a fresh node that restores from the same store.

    python _hooks_child.py STORE PHASE PRECOMPILE     PHASE: publish | load, PRECOMPILE: 1 | 0

Builds a three-block model (width 32) and an eager copy, runs ``compile_regions(model,
cache_dir=STORE, precompile=...)`` (Inductor) and one forward, then registers a forward pre-hook
on block 1 of both and runs again. Prints one line ``RESULT {json}``: the largest difference from
eager before and after the hook, the region eager-run counts, the eager-run warnings, Dynamo
frames traced, FX-graph cache misses and the report's per-group precompile outcome.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings

import torch
from _region_models import Block
from torch import nn
from torch._dynamo.utils import counters

import compile_cache

STORE, PHASE, PRECOMPILE = sys.argv[1], sys.argv[2], sys.argv[3] == "1"


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(32) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def double_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0] * 2,)


def main() -> None:
    torch.manual_seed(0)
    model = Stack()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    rec: dict = {"phase": PHASE, "precompile": PRECOMPILE}
    compile_cache.compile_regions(model, cache_dir=STORE, precompile=PRECOMPILE)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        rec["before"] = float((model(x) - ref(x)).abs().max())
        for m in (model, ref):
            m.blocks[1].register_forward_pre_hook(double_input)
        rec["after"] = float((model(x) - ref(x)).abs().max())
        rec["again"] = float((model(x) - ref(x)).abs().max())
    compile_cache.session.flush(60)  # the publisher's packs are in the store after this
    report = compile_cache.last_report()
    rec["groups"] = report.precompile_groups if report is not None else {}
    rec["eager_calls"] = {k: v["eager_calls"] for k, v in compile_cache.region_stats(model).items()}
    rec["eager_warnings"] = [str(w.message) for w in caught
                             if issubclass(w.category, compile_cache.RegionEagerWarning)]
    rec["frames_traced"] = counters["frames"]["ok"]
    rec["fxgraph_misses"] = counters["inductor"]["fxgraph_cache_miss"]
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
