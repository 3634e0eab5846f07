"""Where a fresh node's job thread spends its start, restoring from a directory or object storage.

GPT-2 2x64 (as ``bench_remote --models 2x64 --seq 16``), one cold start publishing into a
directory store, its entries copied to moto's S3, gcp-storage-emulator and Azurite (all three on
127.0.0.1, as ``bench_remote`` starts them); then fresh nodes (new TMPDIR, HOME, XDG_CACHE_HOME,
Inductor, Triton and local-tier dirs) in turn, each stamping the job thread's phases:

  open      opening the store and restoring its packs (``session.open_session``), the two
            phases below included
  preload   importing torch's code cache while the prefetch thread works (object storage)
  fetch     waiting for the prefetch thread, then putting its packs in place (object storage)
  rest      the rest of the start: ``compile_regions`` but open, and the first forward
  ttfo      the ``compile_regions`` call to the end of the first forward

``--base PATH``: every object-storage node runs twice, with this checkout's package and with the
one under PATH (another checkout, its extension built; ``git worktree add PATH <commit>``), in
turn: an A/B of a change, side by side in one run. The phases are found by wrapping
compile_cache's own functions in the child (a phase whose function is gone is left out).

    python benchmarks/remote_phases.py --repeats 8
    python benchmarks/remote_phases.py --repeats 8 --base /tmp/main-before
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "tests"))

#: (phase, module, owner, function): a phase is the time spent inside that function.
WRAPPED = [
    ("open", "compile_cache.session", None, "open_session"),
    ("preload", "compile_cache.torch_compat.inductor_cache", None, "preload"),
    ("fetch", "compile_cache.store.remote", "RemoteTier", "fetch"),
]


def _child() -> None:
    import importlib

    import torch
    from _common import build_gpt2

    import compile_cache

    model, tokens = build_gpt2(2, 64, 1, 16)
    spent: dict[str, float] = {}
    for phase, module_name, owner, name in WRAPPED:
        module = importlib.import_module(module_name)
        target = getattr(module, owner, None) if owner else module
        real = getattr(target, name, None) if target is not None else None
        if real is None:
            continue

        def timed(*args, _real=real, _phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                spent[_phase] = spent.get(_phase, 0.0) + time.perf_counter() - start

        setattr(target, name, timed)
        if module_name == "compile_cache.session":  # the api module imported it by name
            setattr(importlib.import_module("compile_cache.api"), name, timed)
    with torch.no_grad():
        start = time.perf_counter()
        compile_cache.compile_regions(model, cache_dir=os.environ["COMPILE_CACHE_DIR"])
        model(tokens, use_cache=False)
        ttfo = time.perf_counter() - start
    spent["ttfo"] = ttfo
    spent["rest"] = ttfo - spent.get("open", 0.0)
    print("PHASES " + json.dumps({k: round(v * 1000, 2) for k, v in spent.items()}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=8, help="fresh nodes per store (and variant)")
    parser.add_argument("--base", help="another checkout whose package the B nodes run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child()
        return 0
    import bench_remote as bench
    from _common import prime_precompiled_header

    prime_precompiled_header()
    bench.byte_compile()
    if args.base:
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(args.base, "compile_cache")],
                       check=True, capture_output=True, timeout=600)
    variants = [("this", None)] + ([("base", os.path.abspath(args.base))] if args.base else [])
    work = tempfile.mkdtemp(prefix="remote_phases_")
    server = bench.MotoServer(os.path.join(work, "moto.log"))
    emulators = bench.start_emulators(work)
    phases: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        directory = os.path.join(work, "dir-store")
        bench.start_node(argparse.Namespace(seq=16, timeout=1800), "2x64", os.path.join(work, "cold"), server, directory)
        for url in (bench.URL, bench.GCS_URL, bench.AZ_URL):
            bench.copy_store(directory, server, work, url)
        stores = [("dir", directory), ("s3", bench.URL), ("gcs", bench.GCS_URL), ("azure", bench.AZ_URL)]
        for i in range(args.repeats):
            for store, where in stores:
                for variant, path in variants if store != "dir" else variants[:1]:
                    base = os.path.join(work, f"{store}-{variant}-{i}")
                    env = bench.node_env(base, server, where)
                    if path:
                        env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
                    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                                          capture_output=True, text=True, timeout=1800, check=False)
                    line = next((x for x in done.stdout.splitlines() if x.startswith("PHASES ")), None)
                    shutil.rmtree(base, ignore_errors=True)
                    if line is None:
                        raise RuntimeError(f"{store} node failed: {done.stderr[-3000:]}")
                    phases.setdefault((store, variant), []).append(json.loads(line[len("PHASES "):]))
                    print(f"{store} {variant} #{i}: {line}", file=sys.stderr, flush=True)
    finally:
        server.stop()
        for emulator in emulators:
            emulator.stop()
        shutil.rmtree(work, ignore_errors=True)
    names = ["open", "preload", "fetch", "rest", "ttfo"]
    print(f"{'store':6} {'code':5} " + " ".join(f"{n + ' ms':>10}" for n in names) + "  (medians)")
    for (store, variant), runs in phases.items():
        cells = [statistics.median(r[n] for r in runs) if all(n in r for r in runs) else None for n in names]
        print(f"{store:6} {variant:5} " + " ".join(f"{c:10.1f}" if c is not None else f"{'':>10}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
