"""Time to first output of a fresh process: cold, torch's caches, and compile_cache on a fresh node.

GPT-2 from transformers (random weights), CPU, batch 1 x 128, ``use_cache=False`` by default;
``--arch llama`` builds a Llama with Llama-3.2-1B's proportions (``16x2048`` is Llama-3.2-1B's
shape: 32 heads, 8 KV heads, intermediate 8192, vocab 128256), ``--device cuda --dtype bfloat16``
runs it on a GPU (timers stop after ``torch.cuda.synchronize()``). ``--modes`` picks what is timed:
``forward`` (one forward under ``torch.no_grad()``) and/or ``train`` (one training step: the
model in train mode, a forward and ``loss.backward()``); ``--train`` is ``--modes train``.

Every scenario runs in its own process. A *fresh node* is a new machine as a new container, VM or
CI runner has it: new, empty TMPDIR, HOME, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR (torch keeps its precompiled header under the temp dir, Triton its cache under
~/.triton). Nothing is built before measuring: every cold and fresh-node run starts from nothing.

  eager             first call without compiling, on a fresh node
  cold              a fresh node, no store
  torch warm        the cold run's node again (all five dirs): torch's own warm start
  megacache node    a fresh node + torch.compiler.load_cache_artifacts() of the cold run's bytes
  cc publish        compile_cache on a fresh node with an empty store (a cold start that publishes)
  cc node           compile_cache on a fresh node with the store cc publish filled
  cc warm publish   compile_cache on a node whose local dirs are warm (the regional cold run's),
                    with an EMPTY store: it hits locally and must still publish
  cc node (warm)    compile_cache on a fresh node with the store cc warm publish filled
  cc plain …        the publish/node pair with precompile=False (FX-graph entries only: Dynamo
                    traces on every start)
  cc whole …        (with ``full``) compile_cache.compile(model): publish on a fresh node, then a
                    fresh node that restores (the whole model as one part; precompile default)
  cc run …          (with ``full``) torch.compile(model) unchanged, started by
                    ``python -m compile_cache run --name bench``: publish, then a fresh node
                    (its TTFO includes the restore at interpreter start)

The cc scenarios other than "cc plain" use compile_cache's defaults; precompile is off by default
(issue 53), so ``--cc-precompile on`` makes the cc publish / cc node pair ask for it (each region
group's traced code restored too, so a node that restores it traces nothing), the header's
``cc_precompile`` says which a run measured.

Compile strategies: ``full`` (torch.compile(model)), ``accelerate`` (accelerate's
compile_regions) and ``regional`` (compile_cache.compile_regions, store off for the torch
scenarios); ``eager`` times the uncompiled call. The compile_cache scenarios always run. The
short scenarios (eager, torch warm, the cc nodes) run ``--repeats`` times (default 3, each cc
node and each eager run on its own fresh node) and report the median run by TTFO, with the
median whole process as ``process_median_s``, which the process ratios use; the JSON keeps every
sample. TTFO is from the compile call to the end of the first forward (and backward); ``process``
is the whole process, imports and model building included.

    python benchmarks/bench_cold_start.py --modes forward,train   # 4x256 and 12x768
    python benchmarks/bench_cold_start.py --models 2x64 --seq 16 --strategies eager,regional \
        --modes forward,train --repeats 1                          # smoke test
    python benchmarks/bench_cold_start.py --arch llama --models 16x2048 --device cuda \
        --dtype bfloat16 --strategies eager,regional,full --json   # Llama-3.2-1B shape, GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    KernelCounters,
    build_model,
    compile_bytecode,
    fresh_node_env,
    machine,
    parse_model_spec,
    run_child,
    synchronize,
)

TORCH_SCENARIOS = ("cold", "torch warm", "megacache node")
STRATEGIES = ("eager", "full", "accelerate", "regional")
#: The issue-37 goals: compile_cache.compile(model) and `run`'s fresh node against full
#: torch.compile's warm start (warm node) and cold start (fresh node).
GOAL_WHOLE_VS_WARM, GOAL_WHOLE_VS_COLD = 0.5, 0.15


def _child(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    model, tokens = build_model(args.arch, args.layers, args.width, args.seq, heads=args.heads,
                                device=args.device, dtype=args.dtype)
    train = args.mode == "train"
    model.train(train)
    kernels = KernelCounters()  # Triton kernels compiled from source, autotune benchmarks
    if args.load_megacache:
        with open(args.load_megacache, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    synchronize(args.device)
    setup_s = time.perf_counter() - started
    with torch.set_grad_enabled(train):
        t0 = time.perf_counter()
        if args.strategy == "eager":
            pass
        elif args.strategy == "full":
            model = torch.compile(model)
        elif args.strategy == "whole":  # compile_cache.compile(model): whole, with the store
            import compile_cache

            precompile = {"default": None, "on": True, "off": False}[args.precompile]
            model = compile_cache.compile(model, cache_dir=args.store or False, precompile=precompile)
        elif args.strategy == "accelerate":
            from accelerate.utils import compile_regions as accelerate_compile_regions

            model = accelerate_compile_regions(model)
        else:
            import compile_cache

            store = args.store or False
            precompile = {"default": None, "on": True, "off": False}[args.precompile]
            compile_cache.compile_regions(model, cache_dir=store, precompile=precompile)
        out = model(tokens, use_cache=False)
        if train:
            out.logits.float().sum().backward()
        synchronize(args.device)
        ttfo = time.perf_counter() - t0
    if args.save_megacache:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(args.save_megacache, "wb") as f:
                f.write(saved[0])
    from torch._dynamo.utils import counters

    restore = {}
    process_store = sys.modules.get("compile_cache.process_store")
    if process_store is not None and process_store.enabled():  # under `compile_cache run`
        import compile_cache

        report = compile_cache.last_report()
        # the restore ran at interpreter start (sitecustomize), before t0: count it in TTFO
        restore = {"run_restore_s": report.restore_seconds if report else 0.0,
                   "run_restored_packs": report.restored_packs if report else 0}
        ttfo += restore["run_restore_s"]
        process_store.flush(600)  # a publisher's packs are in the store before the next node
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
        **kernels.read(),
        **({"precompile": precompile} if precompile else {}),
        **restore,
    }


def _scenario(args: argparse.Namespace, model: str, mode: str, strategy: str, node: str,
              run_store: str | None = None, **extra: str) -> dict:
    """One process on ``node`` (a directory: a fresh node when new, the same machine again when
    reused; see fresh_node_env); with ``run_store``, started by ``python -m compile_cache run
    --name bench`` with that store (the process store: torch.compile's own compile unchanged)."""
    layers, width = parse_model_spec(model)
    heads = max(1, width // 64)
    prefix = [] if run_store is None else [
        "-m", "compile_cache", "run", "--cache-dir", run_store, "--name", "bench", "--",
        sys.executable]
    argv = [
        *prefix, os.path.abspath(__file__), "--child", "--strategy", strategy, "--layers", str(layers),
        "--width", str(width), "--heads", str(heads), "--seq", str(args.seq), "--mode", mode,
        "--arch", args.arch, "--device", args.device, "--dtype", args.dtype,
    ]
    for flag, value in extra.items():
        argv += [f"--{flag.replace('_', '-')}"] + ([] if value == "" else [value])
    return run_child(argv, fresh_node_env(node), timeout=args.timeout)


def _median_of(runs: list[dict]) -> dict:
    """The run with the median TTFO, plus every run's TTFO and whole process as samples, and the
    median whole process (``process_median_s``: TTFO and process need not be the same run's)."""
    ordered = sorted(runs, key=lambda r: r["ttfo_s"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["ttfo_samples"] = [round(r["ttfo_s"], 3) for r in runs]
    middle["process_samples"] = [round(r["process_s"], 3) for r in runs]
    middle["process_median_s"] = statistics.median(r["process_s"] for r in runs)
    return middle


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    compile_bytecode()  # as installed: the processes do not compile compile_cache's source
    repeats = max(1, args.repeats)  # short warm scenarios: a median, less at the mercy of noise

    def record(model: str, mode: str, strategy: str, scenario: str, result: dict) -> None:
        row = {"model": model, "mode": mode, "strategy": strategy, "scenario": scenario, **result}
        rows.append(row)
        if args.json_out:  # partial results survive a run cut short by a time limit
            _write_json(args.json_out, {**_header(args), "rows": rows, "ratios": ratios(rows),
                                        "partial": True})
        print(
            f"  {model:>7} {mode:<7} {strategy:<10} {scenario:<16} ttfo {row['ttfo_s']:6.2f} s  "
            f"process {row['process_s']:6.2f} s  fx miss/hit {row['fxgraph_miss']}/{row['fxgraph_hit']}  "
            f"traced {row.get('frames_traced', '-')}  triton compiled {row.get('triton_compiled', '-')}  "
            f"autotune benchmarks {row.get('autotune_benchmarks', '-')}"
            + (f"  precompile {row['precompile']}" if row.get("precompile") else ""),
            file=sys.stderr,
        )

    with tempfile.TemporaryDirectory(prefix="bench_cold_start_") as tmp:
        count = iter(range(1_000_000))

        def fresh(label: str) -> str:
            return os.path.join(tmp, f"node-{next(count)}-{label}")

        def once(strategy: str, node: str, job: object, **extra: str) -> dict:
            """A run on a node nobody reuses; the node (and its 149 MB header) goes after it."""
            try:
                return job(strategy, node, **extra)  # type: ignore[operator]
            finally:
                shutil.rmtree(node, ignore_errors=True)

        for model in args.models:
            for mode in args.modes:
                def job(strategy: str, node: str, **extra: str) -> dict:
                    return _scenario(args, model, mode, strategy, node, **extra)  # noqa: B023

                if "eager" in args.strategies:  # the process ratios' baseline: a median too
                    eager = [once("eager", fresh("eager"), job) for _ in range(repeats)]
                    record(model, mode, "eager", "first call", _median_of(eager))
                warm_node = None
                for strategy in (s for s in args.strategies if s != "eager"):
                    node = fresh(strategy)
                    blob = os.path.join(tmp, f"{model}-{mode}-{strategy}.megacache")
                    record(model, mode, strategy, "cold", job(strategy, node, save_megacache=blob))
                    warm = [job(strategy, node) for _ in range(repeats)]  # the same machine
                    record(model, mode, strategy, "torch warm", _median_of(warm))
                    if strategy == "regional" and warm_node is None:
                        warm_node = node
                    else:
                        shutil.rmtree(node, ignore_errors=True)
                    if not args.goal_only:
                        record(model, mode, strategy, "megacache node",
                               once(strategy, fresh("mega"), job, load_megacache=blob))
                pairs = [(args.cc_precompile, "cc publish", "cc node")]
                if not args.no_plain:
                    pairs.append(("off", "cc plain publish", "cc plain node"))
                for precompile, publish_label, node_label in pairs:
                    store = os.path.join(tmp, f"{model}-{mode}-store-{precompile}")
                    extra = {"store": store, "precompile": precompile}
                    publisher = fresh("cc")
                    record(model, mode, "regional", publish_label, job("regional", publisher, **extra))
                    if warm_node is None and precompile == args.cc_precompile:
                        warm_node = publisher
                    else:
                        shutil.rmtree(publisher, ignore_errors=True)
                    nodes = [once("regional", fresh("cc"), job, **extra) for _ in range(repeats)]
                    record(model, mode, "regional", node_label, _median_of(nodes))
                if "full" in args.strategies:  # compile_cache for torch.compile(model) users
                    for strategy, label, via_run in (("whole", "cc whole", False),
                                                     ("full", "cc run", True)):
                        store = os.path.join(tmp, f"{model}-{mode}-store-{strategy}")
                        kw = {"run_store": store} if via_run else {"store": store}
                        record(model, mode, strategy, f"{label} publish",
                               once(strategy, fresh("cc"), job, **kw))
                        nodes = [once(strategy, fresh("cc"), job, **kw) for _ in range(repeats)]
                        record(model, mode, strategy, f"{label} node", _median_of(nodes))
                if args.goal_only:
                    continue
                # A node whose local dirs are warm publishes into an empty store...
                store = os.path.join(tmp, f"{model}-{mode}-store-from-warm")
                record(model, mode, "regional", "cc warm publish",
                       once("regional", warm_node, job, store=store))
                # ...which a fresh node then restores from.
                nodes = [once("regional", fresh("cc"), job, store=store) for _ in range(repeats)]
                record(model, mode, "regional", "cc node (warm)", _median_of(nodes))
    return rows


def _header(args: argparse.Namespace) -> dict:
    import torch

    return {
        "benchmark": "cold_start", "machine": args.machine, "seq": args.seq, "arch": args.arch,
        "device": args.device, "dtype": args.dtype, "models": args.models, "modes": args.modes,
        "fresh_node": "new TMPDIR, HOME, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR",
        "strategies": args.strategies, "torch": torch.__version__, "cc_precompile": args.cc_precompile,
        "date": time.strftime("%Y-%m-%d"), "command": args.command,
    }


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


#: The goals (issue 12): a fresh node at most this times torch's warm start on a warm node and
#: a cold start on a fresh node; the whole process at most this times eager's whole process.
GOAL_VS_WARM, GOAL_VS_COLD, GOAL_VS_EAGER_PROCESS = 1.0, 0.2, 1.3
#: Issue 53: with precompile (--cc-precompile on), a fresh node's first output at most this times
#: torch's warm start, and its whole process at most this times eager's.
GOAL_PRECOMPILE_VS_WARM, GOAL_PRECOMPILE_PROCESS = 0.3, 1.1


def ratios(rows: list[dict]) -> list[dict]:
    """The goal ratios per model and mode: compile_cache's fresh node against torch's warm start
    and cold start (per torch strategy), and its whole process against eager's."""
    out = []
    keys = dict.fromkeys((r["model"], r.get("mode", "forward")) for r in rows)
    for model, mode in keys:
        mine = [r for r in rows if r["model"] == model and r.get("mode", "forward") == mode]
        pick = {(r["strategy"], r["scenario"]): r for r in mine}

        def ttfo(strategy: str, scenario: str, pick: dict = pick) -> float | None:
            row = pick.get((strategy, scenario))
            return row["ttfo_s"] if row else None

        node, plain = ttfo("regional", "cc node"), ttfo("regional", "cc plain node")
        from_warm = ttfo("regional", "cc node (warm)")
        eager = pick.get(("eager", "first call"))

        def process_vs_eager(scenario: str, pick: dict = pick, eager: dict | None = eager) -> float | None:
            row = pick.get(("regional", scenario))
            if not (row and eager):
                return None
            return _process(row) / _process(eager)

        for strategy in ("regional", "full"):
            warm, cold = ttfo(strategy, "torch warm"), ttfo(strategy, "cold")
            mega = ttfo(strategy, "megacache node")
            if not (node and warm and cold):
                continue
            out.append({
                "model": model, "mode": mode, "against": strategy,
                "node_vs_warm": node / warm, "node_vs_cold": node / cold,
                "warm_publisher_node_vs_warm": (from_warm / warm) if from_warm else None,
                "process_vs_eager": process_vs_eager("cc node"),
                "plain_vs_warm": (plain / warm) if plain else None,
                "plain_vs_cold": (plain / cold) if plain else None,
                "plain_process_vs_eager": process_vs_eager("cc plain node"),
                "node_vs_megacache": (node / mega) if mega else None,
            })
        full_warm, full_cold = ttfo("full", "torch warm"), ttfo("full", "cold")
        for strategy, label in (("whole", "cc whole"), ("full", "cc run")):
            whole_node = ttfo(strategy, f"{label} node")
            if whole_node and full_warm and full_cold:
                out.append({"model": model, "mode": mode, "against": f"full ({label} node)", "what": label,
                            "node_vs_warm": whole_node / full_warm,
                            "node_vs_cold": whole_node / full_cold})
    return out


def _process(row: dict) -> float:
    """A row's whole process: the median of its runs where it has several."""
    return row.get("process_median_s", row["process_s"])


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


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
    parser.add_argument("--no-plain", action="store_true",
                        help="skip the cc plain scenarios (precompile=False; saves two processes)")
    parser.add_argument("--goal-only", action="store_true",
                        help="only the goal's rows: eager, cold, torch warm, cc publish, cc node "
                             "(no megacache node, no warm-publish pair; gpu_check.sh)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each short scenario (torch warm, the cc nodes); "
                             "the row is the median run (default 3)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds allowed per scenario process (default 1800)")
    parser.add_argument("--json-out", metavar="PATH",
                        help="also write the JSON to PATH, rewritten after every scenario "
                             "(with \"partial\": true until the run completes)")
    parser.add_argument("--modes", type=lambda s: [v for v in s.split(",") if v],
                        default=["forward"],
                        help="comma-separated, from forward,train (default forward)")
    parser.add_argument("--train", action="store_true", help="the same as --modes train")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="regional", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--precompile", choices=("default", "on", "off"), default="default",
                        help=argparse.SUPPRESS)
    parser.add_argument("--cc-precompile", choices=("default", "on", "off"), default="default",
                        help="precompile in the cc publish / cc node pair (default: the package's "
                             "default, off since issue 53; 'on' measures precompile=True)")
    parser.add_argument("--mode", default="forward", help=argparse.SUPPRESS)
    parser.add_argument("--save-megacache", help=argparse.SUPPRESS)
    parser.add_argument("--load-megacache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    if args.train:
        args.modes = ["train"]
    bad_modes = sorted(set(args.modes) - {"forward", "train"})
    if bad_modes or not args.modes:
        parser.error(f"unknown modes {bad_modes}; choose from forward, train")
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
    print(f"\n{'model':>7} {'mode':<7} {'strategy':<10} {'scenario':<22} {'TTFO s':>7} "
          f"{'process s':>9}")
    for r in rows:
        print(f"{r['model']:>7} {r['mode']:<7} {r['strategy']:<10} {r['scenario']:<22} "
              f"{r['ttfo_s']:7.2f} {r['process_s']:9.2f}")
    print(f"\ngoals: cc node <= {GOAL_VS_WARM}x torch warm (warm node) and <= {GOAL_VS_COLD}x "
          f"cold (fresh node); cc node process <= {GOAL_VS_EAGER_PROCESS}x eager process; "
          f"with --cc-precompile on: cc node <= {GOAL_PRECOMPILE_VS_WARM}x torch warm, process <= "
          f"{GOAL_PRECOMPILE_PROCESS}x eager (issue 53); this run: cc_precompile={args.cc_precompile}")
    print(f"issue 37 goals: cc whole / cc run node <= {GOAL_WHOLE_VS_WARM}x full torch warm "
          f"(warm node) and <= {GOAL_WHOLE_VS_COLD}x full cold (fresh node)")
    for s in summary:
        if "what" in s:
            print(f"  {s['model']:>7} {s['mode']:<7} {s['what']:<8} vs full: node/warm "
                  f"{_fmt(s['node_vs_warm'])}  node/cold {_fmt(s['node_vs_cold'])}")
            continue
        print(f"  {s['model']:>7} {s['mode']:<7} vs {s['against']:<8}: node/warm "
              f"{_fmt(s['node_vs_warm'])}  node/cold {_fmt(s['node_vs_cold'])}  "
              f"process/eager {_fmt(s['process_vs_eager'])}  from-warm-publisher/warm "
              f"{_fmt(s['warm_publisher_node_vs_warm'])}  plain/warm "
              f"{_fmt(s['plain_vs_warm'])}  plain process/eager "
              f"{_fmt(s['plain_process_vs_eager'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
