"""Time to first output of a fresh process: cold, torch's caches, and compile_cache on a new node.

GPT-2 from transformers (random weights), CPU, batch 1 x 128, ``torch.no_grad()``,
``use_cache=False``. Every scenario runs in its own fresh process; "new node" means a new, empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR.

  cold              empty local dirs, nothing else
  torch warm        the same local dirs a cold run left (torch's own cache, same machine)
  megacache node    new empty dirs + torch.compiler.load_cache_artifacts() of the cold run's bytes
  cc publish        compile_cache, empty store, empty dirs (a cold start that also publishes)
  cc node           compile_cache, new empty dirs, the store the publish run filled
  cc precompile     the same two steps with precompile=True (Dynamo tracing skipped too)

Compile strategies: ``full`` (torch.compile(model)), ``accelerate`` (accelerate's
compile_regions) and ``regional`` (compile_cache.compile_regions, store off for the torch
scenarios). TTFO is from the compile call to the end of the first forward; ``process`` is the
whole process, imports included.

    python benchmarks/bench_cold_start.py                       # 4x256 and 12x768, ~12 min
    python benchmarks/bench_cold_start.py --models 2x64 --seq 16 # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import build_gpt2, machine, run_child  # noqa: E402

TORCH_SCENARIOS = ("cold", "torch warm", "megacache node")


def _child(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    import torch

    model, tokens = build_gpt2(args.layers, args.width, args.heads, args.seq)
    if args.load_megacache:
        with open(args.load_megacache, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    setup_s = time.perf_counter() - started
    with torch.no_grad():
        t0 = time.perf_counter()
        if args.strategy == "full":
            model = torch.compile(model)
        elif args.strategy == "accelerate":
            from accelerate.utils import compile_regions as accelerate_compile_regions

            model = accelerate_compile_regions(model)
        else:
            import compile_cache

            store = args.store or False
            compile_cache.compile_regions(model, cache_dir=store, precompile=args.precompile)
        model(tokens, use_cache=False)
        ttfo = time.perf_counter() - t0
    if args.save_megacache:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(args.save_megacache, "wb") as f:
                f.write(saved[0])
    from torch._dynamo.utils import counters

    return {
        "ttfo_s": ttfo,
        "setup_s": setup_s,
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
    }


def _scenario(args: argparse.Namespace, model: str, strategy: str, local: str, **extra: str) -> dict:
    layers, width = (int(v) for v in model.split("x"))
    heads = max(1, width // 64)
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(local, "inductor"),
        TRITON_CACHE_DIR=os.path.join(local, "triton"),
    )
    argv = [
        os.path.abspath(__file__), "--child", "--strategy", strategy, "--layers", str(layers),
        "--width", str(width), "--heads", str(heads), "--seq", str(args.seq),
    ]
    for flag, value in extra.items():
        argv += [f"--{flag.replace('_', '-')}"] + ([] if value == "" else [value])
    return run_child(argv, env)


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []

    def record(model: str, strategy: str, scenario: str, result: dict) -> None:
        row = {"model": model, "strategy": strategy, "scenario": scenario, **result}
        rows.append(row)
        print(
            f"  {model:>7} {strategy:<10} {scenario:<16} ttfo {row['ttfo_s']:6.2f} s  "
            f"process {row['process_s']:6.2f} s  fx miss/hit {row['fxgraph_miss']}/{row['fxgraph_hit']}",
            file=sys.stderr,
        )

    with tempfile.TemporaryDirectory(prefix="bench_cold_start_") as tmp:
        for model in args.models:
            for strategy in args.strategies:
                node_a = os.path.join(tmp, f"{model}-{strategy}-a")
                blob = os.path.join(tmp, f"{model}-{strategy}.megacache")
                record(model, strategy, "cold", _scenario(args, model, strategy, node_a, save_megacache=blob))
                record(model, strategy, "torch warm", _scenario(args, model, strategy, node_a))
                node_b = os.path.join(tmp, f"{model}-{strategy}-b")
                record(model, strategy, "megacache node",
                       _scenario(args, model, strategy, node_b, load_megacache=blob))
            for precompile in (False, True):
                label = "cc precompile" if precompile else "cc node"
                store = os.path.join(tmp, f"{model}-store-{int(precompile)}")
                extra = {"store": store, **({"precompile": ""} if precompile else {})}
                node_c = os.path.join(tmp, f"{model}-cc{int(precompile)}-c")
                node_d = os.path.join(tmp, f"{model}-cc{int(precompile)}-d")
                publish = _scenario(args, model, "regional", node_c, **extra)
                record(model, "regional", label.replace("node", "publish") if not precompile
                       else "cc precompile publish", publish)
                record(model, "regional", label, _scenario(args, model, "regional", node_d, **extra))
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """The goal ratios per model: compile_cache's new node against torch's warm and cold."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        pick = {(r["strategy"], r["scenario"]): r["ttfo_s"] for r in rows if r["model"] == model}
        node = pick.get(("regional", "cc node"))
        pre = pick.get(("regional", "cc precompile"))
        for strategy in ("regional", "full"):
            warm, cold = pick.get((strategy, "torch warm")), pick.get((strategy, "cold"))
            if not (node and warm and cold):
                continue
            out.append({
                "model": model, "against": strategy,
                "node_vs_warm": node / warm, "node_vs_cold": node / cold,
                "precompile_vs_warm": (pre / warm) if pre else None,
            })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda s: s.split(","), default=["4x256", "12x768"],
                        help="comma-separated LAYERSxWIDTH list (default 4x256,12x768)")
    parser.add_argument("--strategies", type=lambda s: s.split(","),
                        default=["full", "accelerate", "regional"])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="regional", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--precompile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save-megacache", help=argparse.SUPPRESS)
    parser.add_argument("--load-megacache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return 0

    print(f"bench_cold_start: {machine()}, batch 1 x {args.seq}", file=sys.stderr)
    rows = run(args)
    summary = ratios(rows)
    if args.json:
        print(json.dumps({"machine": machine(), "seq": args.seq, "rows": rows, "ratios": summary}, indent=1))
        return 0
    print(f"\n{'model':>7} {'strategy':<10} {'scenario':<22} {'TTFO s':>7} {'process s':>9}")
    for r in rows:
        print(f"{r['model']:>7} {r['strategy']:<10} {r['scenario']:<22} {r['ttfo_s']:7.2f} {r['process_s']:9.2f}")
    print("\ngoal ratios (TTFO): cc node <= 1.2x torch warm and <= 0.25x cold; precompile <= 0.6x warm")
    for s in summary:
        pre = f"{s['precompile_vs_warm']:.2f}" if s["precompile_vs_warm"] else "n/a"
        print(f"  {s['model']:>7} vs {s['against']:<8}: node/warm {s['node_vs_warm']:.2f}  "
              f"node/cold {s['node_vs_cold']:.2f}  precompile/warm {pre}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
