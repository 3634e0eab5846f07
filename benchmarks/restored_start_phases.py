"""Phase timer of one start: GPT-2 as bench_cold_start's child builds it, wall time per phase.

Run it on a fresh node (new TMPDIR, HOME, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR; see _common.fresh_node_env) with a store that bench_cold_start's ``cc publish``
(or any compile_regions run of the same model) filled:

    python benchmarks/restored_start_phases.py forward regional /path/to/store
    python benchmarks/restored_start_phases.py train eager
    PHASES_MODEL=12x768 python benchmarks/restored_start_phases.py forward regional /path/to/store

It prints one line ``PHASES {...}`` on stderr at the last ``atexit`` handler: seconds spent
importing torch, in transformers and building the model, importing compile_cache, in
``compile_regions``, to the first output (forward, or forward and backward), and in the other
``atexit`` handlers (thread joins come before them). The interpreter's exit after it (module
teardown, the final garbage collections) is the process's wall time minus the phases' sum:
time the process from outside (``PHASES_T0``: the launcher's ``time.time()``, to count the
interpreter's start too). A second line ``PHASES_CPU {...}`` gives the main thread's CPU time
per phase (``time.thread_time``: under load, less at the mercy of other processes than wall
time). ``PHASES_MODULES=path`` also writes the imported module names.
Write compile_cache's bytecode first (``_common.compile_bytecode()``, as bench_cold_start does):
in a tree without it, every process compiles compile_cache's source again under
``PYTHONDONTWRITEBYTECODE``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

T0 = float(os.environ.get("PHASES_T0", time.time()))
MARKS: list[tuple[str, float, float]] = [("start", time.time(), time.thread_time())]


def mark(name: str) -> None:
    MARKS.append((name, time.time(), time.thread_time()))


def report() -> None:
    mark("atexit_others")
    out = {"python_start": round(MARKS[0][1] - T0, 4)}
    cpu = {"python_start": round(MARKS[0][2], 4)}
    for (_, before, cpu_before), (name, at, cpu_at) in zip(MARKS, MARKS[1:], strict=False):
        out[name] = round(at - before, 4)
        cpu[name] = round(cpu_at - cpu_before, 4)
    sys.stderr.write("PHASES " + json.dumps(out) + "\n")
    sys.stderr.write("PHASES_CPU " + json.dumps(cpu) + "\n")  # the main thread's CPU per phase


atexit.register(report)  # registered first: runs last


def main() -> None:
    mode, strategy = sys.argv[1], sys.argv[2]
    store = sys.argv[3] if len(sys.argv) > 3 else None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    mark("import_torch")
    from _common import build_model

    layers, width = (int(n) for n in os.environ.get("PHASES_MODEL", "4x256").split("x"))
    model, tokens = build_model("gpt2", layers, width, 128, heads=width // 64, device="cpu", dtype="float32")
    train = mode == "train"
    model.train(train)
    mark("transformers_build")
    if strategy == "regional":
        import compile_cache

        mark("import_compile_cache")
    with torch.set_grad_enabled(train):
        if strategy == "regional":
            compile_cache.compile_regions(model, cache_dir=store or False)
            mark("compile_regions")
        out = model(tokens, use_cache=False)
        if train:
            out.logits.float().sum().backward()
        mark("first_output")
    if os.environ.get("PHASES_MODULES"):
        with open(os.environ["PHASES_MODULES"], "w") as f:
            f.write("\n".join(sorted(sys.modules)) + "\n")
    mark("main_done")


if __name__ == "__main__":
    main()
