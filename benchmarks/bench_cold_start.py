"""Time to first output of a fresh process: cold, torch's caches, and compile_cache on a new node.

GPT-2 from transformers (random weights), CPU, batch 1 x 128, ``torch.no_grad()``,
``use_cache=False`` by default; ``--arch llama`` builds a Llama with Llama-3.2-1B's proportions
(``16x2048`` is Llama-3.2-1B's shape: 32 heads, 8 KV heads, intermediate 8192, vocab 128256),
``--device cuda --dtype bfloat16`` runs it on a GPU (timers stop after ``torch.cuda.synchronize()``). Every scenario runs in its own fresh process; "new node" means a new, empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR.

  cold              empty local dirs, nothing else
  torch warm        the same local dirs a cold run left (torch's own cache, same machine)
  megacache node    new empty dirs + torch.compiler.load_cache_artifacts() of the cold run's bytes
  cc publish        compile_cache, empty store, empty dirs (a cold start that also publishes)
  cc node           compile_cache, new empty dirs, the store the publish run filled
  cc precompile     the same two steps with precompile=True (Dynamo tracing skipped too)

Compile strategies: ``full`` (torch.compile(model)), ``accelerate`` (accelerate's
compile_regions) and ``regional`` (compile_cache.compile_regions, store off for the torch
scenarios); ``eager`` (opt-in) times the first uncompiled call, one process. The compile_cache
scenarios run whatever ``--strategies`` says (``--no-precompile`` drops the precompile pair).
The short scenarios (torch warm, cc node, cc precompile) run ``--repeats`` times (default 3, each
cc node run with new empty dirs) and report the median run; the JSON keeps every sample. TTFO is from the compile call to the end of the first forward; ``process`` is the
whole process, imports included.

    python benchmarks/bench_cold_start.py                       # 4x256 and 12x768, ~12 min
    python benchmarks/bench_cold_start.py --models 2x64 --seq 16 # smoke test
    python benchmarks/bench_cold_start.py --arch llama --models 16x2048 --device cuda \
        --dtype bfloat16 --strategies eager,regional,full --json       # Llama-3.2-1B shape, GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    build_model,
    machine,
    parse_model_spec,
    prime_precompiled_header,
    run_child,
    synchronize,
)

TORCH_SCENARIOS = ("cold", "torch warm", "megacache node")
STRATEGIES = ("eager", "full", "accelerate", "regional")


def _child(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    model, tokens = build_model(args.arch, args.layers, args.width, args.seq, heads=args.heads,
                                device=args.device, dtype=args.dtype)
    if args.load_megacache:
        with open(args.load_megacache, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    synchronize(args.device)
    setup_s = time.perf_counter() - started
    with torch.no_grad():
        t0 = time.perf_counter()
        if args.strategy == "eager":
            pass
        elif args.strategy == "full":
            model = torch.compile(model)
        elif args.strategy == "accelerate":
            from accelerate.utils import compile_regions as accelerate_compile_regions

            model = accelerate_compile_regions(model)
        else:
            import compile_cache

            store = args.store or False
            compile_cache.compile_regions(model, cache_dir=store, precompile=args.precompile)
        model(tokens, use_cache=False)
        synchronize(args.device)
        ttfo = time.perf_counter() - t0
    if args.save_megacache:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(args.save_megacache, "wb") as f:
                f.write(saved[0])
    from torch._dynamo.utils import counters

    precompile = {}
    if args.strategy == "regional" and args.store:
        import compile_cache

        report = compile_cache.last_report()
        # per group: loaded (tracing skipped), new, declined or failed, and why
        precompile = {g["label"].split(" ", 1)[0].rsplit(".", 1)[-1]: g["status"]
                      + (f" ({g['reason']})" if g["reason"] else "")
                      for g in (report.precompile_groups.values() if report else ())}
    return {
        "ttfo_s": ttfo,
        "setup_s": setup_s,
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "frames_traced": counters["frames"]["ok"],  # 0 on a precompile hit
        **({"precompile": precompile} if precompile else {}),
    }


def _scenario(args: argparse.Namespace, model: str, strategy: str, local: str, **extra: str) -> dict:
    layers, width = parse_model_spec(model)
    heads = max(1, width // 64)
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(local, "inductor"),
        TRITON_CACHE_DIR=os.path.join(local, "triton"),
    )
    argv = [
        os.path.abspath(__file__), "--child", "--strategy", strategy, "--layers", str(layers),
        "--width", str(width), "--heads", str(heads), "--seq", str(args.seq),
        "--arch", args.arch, "--device", args.device, "--dtype", args.dtype,
    ]
    for flag, value in extra.items():
        argv += [f"--{flag.replace('_', '-')}"] + ([] if value == "" else [value])
    return run_child(argv, env, timeout=args.timeout)


def _median_of(runs: list[dict]) -> dict:
    """The run with the median TTFO, plus every run's TTFO as ``ttfo_samples``."""
    ordered = sorted(runs, key=lambda r: r["ttfo_s"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["ttfo_samples"] = [round(r["ttfo_s"], 3) for r in runs]
    middle["process_samples"] = [round(r["process_s"], 3) for r in runs]
    return middle


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    repeats = max(1, args.repeats)  # short warm scenarios: a median, less at the mercy of noise

    def record(model: str, strategy: str, scenario: str, result: dict) -> None:
        row = {"model": model, "strategy": strategy, "scenario": scenario, **result}
        rows.append(row)
        if args.json_out:  # partial results survive a run cut short by a time limit
            _write_json(args.json_out, {**_header(args), "rows": rows, "ratios": ratios(rows),
                                        "partial": True})
        print(
            f"  {model:>7} {strategy:<10} {scenario:<16} ttfo {row['ttfo_s']:6.2f} s  "
            f"process {row['process_s']:6.2f} s  fx miss/hit {row['fxgraph_miss']}/{row['fxgraph_hit']}  "
            f"traced {row.get('frames_traced', '-')}"
            + (f"  precompile {row['precompile']}" if row.get("precompile") else ""),
            file=sys.stderr,
        )

    if args.device == "cpu" and any(s != "eager" for s in args.strategies):
        prime_precompiled_header()  # no scenario pays the machine-wide header for the others
    with tempfile.TemporaryDirectory(prefix="bench_cold_start_") as tmp:
        for model in args.models:
            if "eager" in args.strategies:
                record(model, "eager", "first call",
                       _scenario(args, model, "eager", os.path.join(tmp, f"{model}-eager")))
            for strategy in (s for s in args.strategies if s != "eager"):
                node_a = os.path.join(tmp, f"{model}-{strategy}-a")
                blob = os.path.join(tmp, f"{model}-{strategy}.megacache")
                record(model, strategy, "cold", _scenario(args, model, strategy, node_a, save_megacache=blob))
                warm = [_scenario(args, model, strategy, node_a) for _ in range(repeats)]
                record(model, strategy, "torch warm", _median_of(warm))
                node_b = os.path.join(tmp, f"{model}-{strategy}-b")
                record(model, strategy, "megacache node",
                       _scenario(args, model, strategy, node_b, load_megacache=blob))
            for precompile in (False,) if args.no_precompile else (False, True):
                label = "cc precompile" if precompile else "cc node"
                store = os.path.join(tmp, f"{model}-store-{int(precompile)}")
                extra = {"store": store, **({"precompile": ""} if precompile else {})}
                node_c = os.path.join(tmp, f"{model}-cc{int(precompile)}-c")
                publish = _scenario(args, model, "regional", node_c, **extra)
                record(model, "regional", label.replace("node", "publish") if not precompile
                       else "cc precompile publish", publish)
                nodes = [  # each with new, empty local dirs
                    _scenario(args, model, "regional",
                              os.path.join(tmp, f"{model}-cc{int(precompile)}-d{i}"), **extra)
                    for i in range(repeats)
                ]
                record(model, "regional", label, _median_of(nodes))
    return rows


def _header(args: argparse.Namespace) -> dict:
    import torch

    return {
        "benchmark": "cold_start", "machine": args.machine, "seq": args.seq, "arch": args.arch,
        "device": args.device, "dtype": args.dtype, "models": args.models,
        "strategies": args.strategies, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "command": args.command,
    }


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def ratios(rows: list[dict]) -> list[dict]:
    """The goal ratios per model: compile_cache's new node against torch's warm and cold."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        pick = {(r["strategy"], r["scenario"]): r["ttfo_s"] for r in rows if r["model"] == model}
        node = pick.get(("regional", "cc node"))
        pre = pick.get(("regional", "cc precompile"))
        for strategy in ("regional", "full"):
            warm, cold = pick.get((strategy, "torch warm")), pick.get((strategy, "cold"))
            mega = pick.get((strategy, "megacache node"))
            if not (node and warm and cold):
                continue
            out.append({
                "model": model, "against": strategy,
                "node_vs_warm": node / warm, "node_vs_cold": node / cold,
                "precompile_vs_warm": (pre / warm) if pre else None,
                "node_vs_megacache": (node / mega) if mega else None,
            })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda s: s.split(","), default=["4x256", "12x768"],
                        help="comma-separated LAYERSxWIDTH list (default 4x256,12x768)")
    parser.add_argument("--strategies", type=lambda s: [v for v in s.split(",") if v],
                        default=["full", "accelerate", "regional"],
                        help="comma-separated, from eager,full,accelerate,regional "
                             "(default full,accelerate,regional; the compile_cache scenarios "
                             "always run)")
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                        help="gpt2 (heads = width/64) or llama (Llama-3.2-1B proportions: "
                             "heads = width/64, KV heads = heads/4, intermediate = 4*width)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--no-precompile", action="store_true",
                        help="skip the compile_cache precompile scenarios (saves two processes)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each short scenario (torch warm, cc node, cc precompile); "
                             "the row is the median run (default 3)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds allowed per scenario process (default 1800)")
    parser.add_argument("--json-out", metavar="PATH",
                        help="also write the JSON to PATH, rewritten after every scenario "
                             "(with \"partial\": true until the run completes)")
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
    unknown = sorted(set(args.strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: choose cpu or cuda")
    for spec in args.models:
        try:
            parse_model_spec(spec)
        except ValueError as exc:
            parser.error(str(exc))

    args.machine = machine()
    args.command = "python benchmarks/bench_cold_start.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    print(f"bench_cold_start: {args.machine}, {args.arch} on {args.device} in {args.dtype}, "
          f"batch 1 x {args.seq}", file=sys.stderr)
    rows = run(args)
    summary = ratios(rows)
    result = {**_header(args), "rows": rows, "ratios": summary}
    if args.json_out:
        _write_json(args.json_out, result)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"\n{'model':>7} {'strategy':<10} {'scenario':<22} {'TTFO s':>7} {'process s':>9}")
    for r in rows:
        print(f"{r['model']:>7} {r['strategy']:<10} {r['scenario']:<22} {r['ttfo_s']:7.2f} {r['process_s']:9.2f}")
    print("\ngoal ratios (TTFO): cc node <= 1.2x torch warm and <= 0.25x cold; precompile <= 0.5x warm")
    for s in summary:
        pre = f"{s['precompile_vs_warm']:.2f}" if s["precompile_vs_warm"] else "n/a"
        print(f"  {s['model']:>7} vs {s['against']:<8}: node/warm {s['node_vs_warm']:.2f}  "
              f"node/cold {s['node_vs_cold']:.2f}  precompile/warm {pre}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
