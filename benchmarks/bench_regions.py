"""Cold-start and steady-state cost of regional compilation on GPT-2 (CPU, no_grad).

Variants, each in a fresh subprocess with an empty TORCHINDUCTOR_CACHE_DIR:
  eager               no compile
  full                torch.compile(model)
  accelerate          accelerate.utils.compile_regions(model)
  ours                compile_cache.compile_regions(model)
  ours-no-prefetch    the same with COMPILE_CACHE_PREFETCH=0: Inductor's ISA probe libraries are
                      not built ahead in the background (compile_cache/prefetch.py)

Torch keeps its precompiled kernel header outside the cache dir, once per machine
(<tmp>/torchinductor_<user>/precompiled_headers). So that no variant pays for it and the others
not, a throwaway compile builds it before the first variant runs.

"ttfo_s" is the time from the compile call to the end of the first forward; "steady_ms" the
median of --iters forwards after --warmup more. Ratios are to the full compile.

    python benchmarks/bench_regions.py                          # 6 layers x 384, seq 128
    python benchmarks/bench_regions.py --layers 2 --width 64 --seq 16 --iters 5   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import prime_precompiled_header  # noqa: E402

VARIANTS = ("eager", "full", "accelerate", "ours", "ours-no-prefetch")


def _child(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "gpt2",
        n_layer=args.layers,
        n_embd=args.width,
        n_head=args.heads,
        n_positions=max(1024, args.seq),
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (1, args.seq))
    with torch.no_grad():
        t0 = time.perf_counter()
        if args.variant == "full":
            model = torch.compile(model)
        elif args.variant == "accelerate":
            from accelerate.utils import compile_regions as acc_compile_regions

            model = acc_compile_regions(model)
        elif args.variant in ("ours", "ours-no-prefetch"):
            from compile_cache import compile_regions

            model = compile_regions(model, cache_dir=False)
        model(x, use_cache=False)
        ttfo = time.perf_counter() - t0
        for _ in range(args.warmup):
            model(x, use_cache=False)
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            model(x, use_cache=False)
            times.append((time.perf_counter() - t) * 1e3)
    from torch._dynamo.utils import counters

    result = {
        "variant": args.variant,
        "ttfo_s": ttfo,
        "steady_ms": statistics.median(times),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "threads": torch.get_num_threads(),
    }
    prefetch = sys.modules.get("compile_cache.prefetch")
    if prefetch is not None and prefetch.current() is not None:
        run = prefetch.current()
        result["isa_prefetch"] = {
            "built": run.built,
            "loads_answered": run.loads_answered,
            "seconds": round(run.seconds, 2),
        }
    return result


def _run_variant(variant: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_regions_") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))
        env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
        env["COMPILE_CACHE_PREFETCH"] = "0" if variant == "ours-no-prefetch" else "1"
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            variant,
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
            "--heads",
            str(args.heads),
            "--seq",
            str(args.seq),
            "--iters",
            str(args.iters),
            "--warmup",
            str(args.warmup),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            return {"variant": variant, "error": proc.stderr.strip().splitlines()[-5:]}
        return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.width % args.heads:
        p.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if args.child:
        args.variant = args.child
        print(json.dumps(_child(args)))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if any(v != "eager" for v in variants):
        prime_precompiled_header(args.timeout)
    results = [_run_variant(v, args) for v in variants]
    full = next((r for r in results if r.get("variant") == "full" and "error" not in r), None)
    for r in results:
        if full and "error" not in r:
            r["ttfo_vs_full"] = r["ttfo_s"] / full["ttfo_s"]
            r["steady_vs_full"] = r["steady_ms"] / full["steady_ms"]
    config = {k: getattr(args, k) for k in ("layers", "width", "heads", "seq", "iters", "warmup")}
    if args.json:
        print(json.dumps({"config": config, "results": results}, indent=2))
        return 0 if all("error" not in r for r in results) else 1
    print(f"GPT-2 {args.layers} layers x {args.width}, batch 1 x {args.seq}, CPU, no_grad")
    print(
        f"{'variant':<18}{'TTFO s':>9}{'steady ms':>11}{'TTFO/full':>11}{'steady/full':>13}{'graphs':>8}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<18} ERROR: {' | '.join(r['error'])}")
            continue
        print(
            f"{r['variant']:<18}{r['ttfo_s']:>9.2f}{r['steady_ms']:>11.2f}"
            f"{r.get('ttfo_vs_full', float('nan')):>11.2f}"
            f"{r.get('steady_vs_full', float('nan')):>13.3f}{r['unique_graphs']:>8}"
        )
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
