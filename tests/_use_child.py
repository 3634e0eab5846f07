"""Child process of tests/test_capture.py: capture by use inside one process (fresh node set up
by the caller).

    python _use_child.py two STORES     # two models, an identical third, a .so being linked
    python _use_child.py edits STORE N  # a helper of the model edited N times, one job each
    python _use_child.py last STORE N   # a job with the last edit (run on a fresh node)

Prints ``RESULT {json}``.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch._dynamo.utils import counters

import compile_cache
from compile_cache import artifacts, capture
from compile_cache.demo import TinyTransformer
from compile_cache.store import Store


def members(store: Path) -> dict[str, list[str]]:
    return {p.name: list(p.member_names) for e in Store(store).entries() for p in e.packs}


def run(model: nn.Module, store: Path, x: torch.Tensor) -> torch.Tensor:
    compile_cache.compile_regions(model, cache_dir=store)
    with torch.no_grad():
        out = model(x)
    assert compile_cache.session.flush(120)
    return out


def transformer(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(layers=layers, width=width, heads=2, vocab=64).eval()


def two(stores: Path) -> dict:
    tokens = torch.randint(0, 64, (1, 8))
    run(transformer(2, 32), stores / "a", tokens)
    run(transformer(1, 16), stores / "b", tokens)  # another block: another region group
    misses = counters["inductor"]["fxgraph_cache_miss"]
    run(transformer(2, 32), stores / "a2", tokens)  # identical to the first: compiles nothing
    result = {"a": members(stores / "a"), "b": members(stores / "b"), "a2": members(stores / "a2"),
              "misses": misses, "a2_misses": counters["inductor"]["fxgraph_cache_miss"] - misses}

    # A library of the first model's group that a linker writes in place while a capture runs
    # (torch's CppBuilder.build writes the target directly, holding torch's lock for its key). It
    # is a copy of one of the group's kernels, recorded as loaded: rewriting a library this
    # process has mapped would crash it, and on a real node the one being linked is not mapped.
    from torch._inductor.codecache import get_lock_dir
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch.utils._filelock import FileLock

    from compile_cache.torch_compat import cache_use

    group = compile_cache.plan_regions(transformer(2, 32)).groups[0].code_name
    real = next(n for p in result["a"].values() for n in p if n.endswith(".main.so"))
    whole = (Path(cache_dir()) / real.split("/", 1)[1]).read_bytes()
    key = "cbeinglinked0123456789"
    path = Path(cache_dir()) / "zz" / f"{key}.main.so"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(whole)
    kernel = "inductor/zz/" + path.name
    stack = cache_use.owner_stack()
    stack.append(group)
    try:
        cache_use._record_kernel(str(path), key)  # as torch's _load_library hook does
    finally:
        stack.pop()
    lock = FileLock(os.path.join(get_lock_dir(), key + ".lock"))
    writing = threading.Event()

    def linker() -> None:
        with lock:
            with open(path, "wb") as f:  # in place, as ld does
                f.write(whole[: len(whole) // 2])
                f.flush()
                writing.set()
                time.sleep(2.0)
                f.write(whole[len(whole) // 2:])

    thread = threading.Thread(target=linker)
    thread.start()
    writing.wait()
    partial_seen = len(path.read_bytes()) < len(whole)
    run(transformer(2, 32), stores / "a3", tokens)  # publishes into an empty store meanwhile
    thread.join()
    got = {n: d for p in Store(stores / "a3").load(Store(stores / "a3").entries()[0].key)
           for n, d in p.members.items()}
    result["linked"] = {"partial_seen": partial_seen, "in_pack": kernel in got,
                        "whole": got.get(kernel) == whole,
                        "complete": artifacts.is_complete_library(got.get(kernel, b""))}

    # The same library cut short with no one holding the lock (a crashed or foreign writer).
    path.write_bytes(whole[: len(whole) // 3])
    skipped = capture.counts()["incomplete_skipped"]
    run(transformer(2, 32), stores / "a4", tokens)
    result["truncated"] = {"in_pack": any(kernel in n for n in members(stores / "a4").values()),
                           "skipped": capture.counts()["incomplete_skipped"] - skipped}
    return result


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation(self.lin(x))  # noqa: F821 - defined by edit()


class Edited(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def edit(i: int) -> None:
    """Version ``i`` of the helper the blocks call: an edit the cache key does not see (the
    fingerprint hashes ``forward``'s own code, not the code of what it calls)."""
    exec(f"def activation(x):\n    return torch.relu(x) * {1.0 + i / 8}\n", globals())


def edits(store: Path, n: int) -> dict:
    x = torch.randn(4, 16)
    jobs = []
    for i in range(n):
        torch._dynamo.reset()  # a new job: Dynamo as a fresh process has it
        edit(i)
        torch.manual_seed(0)
        model = Edited().eval()
        with torch.no_grad():
            expected = model(x)
        misses = counters["inductor"]["fxgraph_cache_miss"]
        out = run(model, store, x)
        report = compile_cache.last_report()
        jobs.append({"key": report.key, "restored_packs": report.restored_packs,
                     "misses": counters["inductor"]["fxgraph_cache_miss"] - misses,
                     "diff": (out - expected).abs().max().item()})
    return {"jobs": jobs}


def last(store: Path, n: int) -> dict:
    edit(n - 1)
    torch.manual_seed(0)
    model = Edited().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
    out = run(model, store, x)
    local = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return {"misses": counters["inductor"]["fxgraph_cache_miss"],
            "hits": counters["inductor"]["fxgraph_cache_hit"],
            "diff": (out - expected).abs().max().item(),
            "report": compile_cache.last_report().to_dict(),
            "fx_files": len([p for p in (local / "fxgraph").rglob("*") if p.is_file()]),
            "aot_files": len([p for p in (local / "aotautograd").rglob("*") if p.is_file()])}


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "two":
        out = two(Path(sys.argv[2]))
    elif mode == "edits":
        out = edits(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        out = last(Path(sys.argv[2]), int(sys.argv[3]))
    print("RESULT " + json.dumps(out), flush=True)
