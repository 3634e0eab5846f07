"""Ranks share one compile: total compile CPU, the slowest rank's time to first output, and the
time a training step spends in compile_cache's hooks while a publish runs on a large store.

Two ranks (gloo, CPU) run GPT-2 from transformers (random weights, eval, ``no_grad``, batch 1 x seq,
``use_cache=False``), each rank on a fresh node of its own (new TMPDIR, HOME, XDG_CACHE_HOME,
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR: nothing machine-wide, such as Inductor's
precompiled header under the temp dir, is left over from another run):

``uncached``  ``compile_regions(model, cache_dir=False)``, then the first forward: every rank compiles.
``cached``    ``compile_regions(model, cache_dir=<empty shared store>, example_inputs=...)``: one rank
              compiles and publishes, the other waits, restores and hits (shared-directory mode).

Per rank: CPU seconds from just before ``compile_regions`` to the first output, counted over the
rank's whole process tree with psutil: the rank itself, Inductor's compile workers and the g++
runs they (or the rank) waited for. Inductor keeps its default compile threads, so a rank that
compiles alone can use the core an idle rank leaves free. Both ranks start the clock after a
barrier. Goals: total CPU (cached) <= 0.55x uncached (0.5x ideal for 2 ranks), and the slowest
cached rank no slower than the slowest uncached one.

``hooks`` (one process, a fresh Inductor dir, a store already holding ``--store-packs`` packs of
other keys, 2,000 by default): the same GPT-2 in training mode, ``compile_regions`` without
example inputs, then ``--steps`` SGD steps whose sequence length changes once, so that several
steps end with a publish (forward graphs, backward graphs, a new shape). Per step: the time spent
in compile_cache's hook at the end of the forward (where a publish starts), and whether a publish
ran. Goal: the longest hook of a step with a publish under 5 ms. Side by side on the same store:
what a size-cap check costs by walking the store (what every publish did before the size counter)
against reading the counter.

    python benchmarks/bench_ranks.py [--json] [--layers 4 --width 256 --heads 4 --seq 128]
                                     [--measures ranks,hooks] [--store-packs 2000] [--steps 6]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Goal: total compile CPU of the cached ranks at most this fraction of the uncached ones.
GOAL_CPU = 0.55


def _cpu() -> float:
    """CPU seconds of this process, its live descendants (compile workers) and reaped children."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # exited between listing and reading
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _child(variant: str, rank: int, port: int, out: str, layers: int, width: int, heads: int,
           seq: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import compile_cache
    from compile_cache.torch_compat.dynamo import CompileCounters

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                          timeout=datetime.timedelta(seconds=1800))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=1800))
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gpt2", n_layer=layers, n_embd=width, n_head=heads)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "use_cache": False}
    dist.barrier()
    cpu0, t0 = _cpu(), time.perf_counter()
    if variant == "cached":
        compile_cache.compile_regions(model, cache_dir=os.environ["BENCH_STORE"],
                                      example_inputs=kwargs)
    else:
        compile_cache.compile_regions(model, cache_dir=False)
    with torch.no_grad():
        model(**kwargs)
    ttfo, cpu = time.perf_counter() - t0, _cpu() - cpu0
    from compile_cache import distributed as ccd

    warm = ccd.last_warm_up()
    result = {
        "rank": rank,
        "ttfo_s": ttfo,
        "cpu_s": cpu,
        "counters": CompileCounters.snapshot().as_dict(),
        "role": warm.role if warm is not None else "lazy",
        "waited_s": warm.waited_seconds if warm is not None else 0.0,
    }
    Path(out).write_text(json.dumps(result))
    os._exit(0)


def _fill_store(path: Path, packs: int) -> float:
    """A store holding ``packs`` small packs of other keys (10 per key), as a busy shared store
    would; returns the seconds it took (setup, not measured: without fsync)."""
    from unittest import mock

    from compile_cache.store import Store

    t0 = time.perf_counter()
    store = Store(path, max_size="20G")
    with mock.patch("os.fsync", lambda fd: None):
        for i in range(packs):
            store.publish(f"{i // 10:032x}", {f"inductor/fill/{i}": os.urandom(512)},
                          entry_info={"model_class": "fill"})
    return time.perf_counter() - t0


def _hooks_child(out: str, layers: int, width: int, heads: int, seq: int, steps: int) -> None:
    """Training steps on a store full of packs: the time each step spends in compile_cache's hook."""
    import torch
    from _common import build_gpt2

    import compile_cache
    from compile_cache import publisher, regions
    from compile_cache.session import session_for
    from compile_cache.store import maintenance

    model, _ = build_gpt2(layers, width, heads, seq)
    model.train()
    store_dir = os.environ["BENCH_STORE"]
    compile_cache.compile_regions(model, cache_dir=store_dir)
    session = session_for(model)
    assert session is not None
    hooks: list[float] = []
    busy: list[bool] = []  # per hook call: a publish queued or running on the background thread

    def timed(seconds: float) -> None:
        t0 = time.perf_counter()
        session.after_forward(seconds)
        hooks.append(time.perf_counter() - t0)
        busy.append(publisher.get().pending() > 0)

    regions.observe_calls(model, timed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(steps):
        length = seq if step < steps // 2 else seq * 2  # a new shape half way: more to publish
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen)
        published = session.report.published_packs
        before = len(hooks)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        done = session.report.published_packs - published
        rows.append({"step": step, "seq": length, "step_s": time.perf_counter() - t0,
                     "hook_ms": 1e3 * sum(hooks[before:]), "published": done,
                     "publishing": bool(done) or any(busy[before:])})
    flushed = session.flush(120.0)  # what the steps queued, written off the step
    store = session.store
    t0 = time.perf_counter()
    walked = maintenance.total_size(store.parts)
    walk_ms = 1e3 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    counted, _ = store.counters.tracked_size()
    counter_ms = 1e3 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    n_packs = sum(len(e.packs) for e in store.entries())
    headers_ms = 1e3 * (time.perf_counter() - t0)
    Path(out).write_text(json.dumps({
        "steps": rows, "flushed": flushed, "published_total": session.report.published_packs,
        "store_packs": n_packs, "size_walked": walked, "size_counted": counted,
        "size_walk_ms": walk_ms, "size_counter_ms": counter_ms, "read_all_headers_ms": headers_ms,
    }))
    os._exit(0)


def _run_hooks(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    root = work / "hooks"
    root.mkdir()
    fill_s = _fill_store(root / "store", args.store_packs)
    from _common import fresh_node_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env = fresh_node_env(str(root / "node"), env)
    env.update(BENCH_STORE=str(root / "store"),
               OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]))
    cmd = [sys.executable, __file__, "--hooks-child", str(root / "r.json"), str(args.layers),
           str(args.width), str(args.heads), str(args.seq), str(args.steps)]
    with open(root / "log.txt", "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.timeout, check=False).returncode
    if code != 0:
        raise SystemExit(f"hooks run failed ({code}):\n" + (root / "log.txt").read_text()[-3000:])
    data = json.loads((root / "r.json").read_text())
    with_publish = [r["hook_ms"] for r in data["steps"] if r.get("publishing", r["published"])]
    without = [r["hook_ms"] for r in data["steps"] if not r.get("publishing", r["published"])]
    data.update(
        fill_store_s=fill_s,
        max_hook_ms_publishing=max(with_publish) if with_publish else None,
        max_hook_ms_other=max(without) if without else None,
        walk_vs_counter=(data["size_walk_ms"] / data["size_counter_ms"]) if data["size_counter_ms"] else None,
    )
    data["goal_hooks"] = data["max_hook_ms_publishing"] is not None and data["max_hook_ms_publishing"] < 5.0
    return data


def _run_variant(variant: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    import torch.distributed as dist

    root = work / variant
    root.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=1800))
    procs = []
    for rank in range(2):
        from _common import fresh_node_env

        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
        env = fresh_node_env(str(root / f"node{rank}"), env)
        env.update(
            BENCH_STORE=str(root / "store"),
            OMP_NUM_THREADS=str(args.threads),
            PYTHONPATH=str(ROOT),
        )
        cmd = [sys.executable, __file__, "--child", variant, str(rank), str(store.port),
               str(root / f"r{rank}.json"), str(args.layers), str(args.width), str(args.heads),
               str(args.seq)]
        log = open(root / f"log{rank}.txt", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    results = []
    for rank, (proc, log) in enumerate(procs):
        code = proc.wait(timeout=args.timeout)
        log.close()
        if code != 0:
            raise SystemExit(f"{variant} rank {rank} failed ({code}):\n"
                             + (root / f"log{rank}.txt").read_text()[-3000:])
        results.append(json.loads((root / f"r{rank}.json").read_text()))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (pinned)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--measures", default="ranks,hooks",
                        help="what to measure: ranks (2 ranks, CPU and TTFO), hooks (time in hooks)")
    parser.add_argument("--store-packs", type=int, default=2000,
                        help="packs of other keys in the store of the hooks measure")
    parser.add_argument("--steps", type=int, default=6, help="training steps of the hooks measure")
    parser.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    parser.add_argument("--hooks-child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        v, rank, port, out, layers, width, heads, seq = args.child
        _child(v, int(rank), int(port), out, int(layers), int(width), int(heads), int(seq))
        return 0
    if args.hooks_child:
        out, *nums = args.hooks_child
        _hooks_child(out, *(int(n) for n in nums))
        return 0
    measures = {m.strip() for m in args.measures.split(",") if m.strip()}
    unknown = measures - {"ranks", "hooks"}
    if unknown or not measures:
        parser.error(f"--measures: {sorted(unknown) or 'nothing'} is not ranks or hooks")

    summary: dict[str, Any] = {
        "config": {k: getattr(args, k) for k in ("layers", "width", "heads", "seq", "threads")},
        "goal_cpu_max": GOAL_CPU,
    }
    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as tmp:
        if "ranks" in measures:
            for variant in ("uncached", "cached"):
                ranks = _run_variant(variant, args, Path(tmp))
                summary[variant] = {
                    "ranks": ranks,
                    "total_cpu_s": sum(r["cpu_s"] for r in ranks),
                    "slowest_ttfo_s": max(r["ttfo_s"] for r in ranks),
                }
        if "hooks" in measures:
            summary["hooks"] = _run_hooks(args, Path(tmp))
            summary["hooks"]["config"] = {"store_packs": args.store_packs, "steps": args.steps}
    if "ranks" in measures:
        u, c = summary["uncached"], summary["cached"]
        summary["cpu_ratio"] = c["total_cpu_s"] / u["total_cpu_s"] if u["total_cpu_s"] else None
        summary["ttfo_ratio"] = c["slowest_ttfo_s"] / u["slowest_ttfo_s"] if u["slowest_ttfo_s"] else None
        summary["goal_cpu"] = summary["cpu_ratio"] is not None and summary["cpu_ratio"] <= GOAL_CPU
        summary["goal_ttfo"] = summary["ttfo_ratio"] is not None and summary["ttfo_ratio"] <= 1.0
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    cfg = summary["config"]
    if "hooks" in summary:
        _print_hooks(summary["hooks"], cfg)
    if "ranks" not in measures:
        return 0
    print(f"GPT-2 {cfg['layers']} layers x {cfg['width']}, batch 1 x {cfg['seq']}, 2 ranks (gloo, CPU), "
          f"{cfg['threads']} thread(s) per rank")
    print(f"{'variant':10} {'rank':>4} {'role':>9} {'CPU s':>8} {'TTFO s':>8} {'waited s':>9} "
          f"{'FX miss':>8} {'FX hit':>7}")
    for variant in ("uncached", "cached"):
        for r in summary[variant]["ranks"]:
            print(f"{variant:10} {r['rank']:>4} {r['role']:>9} {r['cpu_s']:8.1f} {r['ttfo_s']:8.1f} "
                  f"{r['waited_s']:9.1f} {r['counters']['fxgraph_miss']:8d} "
                  f"{r['counters']['fxgraph_hit']:7d}")
    print(f"total compile CPU: uncached {u['total_cpu_s']:.1f} s, cached {c['total_cpu_s']:.1f} s "
          f"-> {summary['cpu_ratio']:.2f}x (goal <= {GOAL_CPU}x): {'ok' if summary['goal_cpu'] else 'MISSED'}")
    print(f"slowest rank TTFO: uncached {u['slowest_ttfo_s']:.1f} s, cached {c['slowest_ttfo_s']:.1f} s "
          f"-> {summary['ttfo_ratio']:.2f}x (goal <= 1.0x): {'ok' if summary['goal_ttfo'] else 'MISSED'}")
    return 0


def _print_hooks(h: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"training steps, GPT-2 {cfg['layers']} layers x {cfg['width']}, store of {h['store_packs']} "
          f"packs (filled in {h['fill_store_s']:.1f} s)")
    print(f"{'step':>4} {'seq':>5} {'step s':>8} {'hook ms':>9} {'published':>9} {'publishing':>10}")
    for r in h["steps"]:
        print(f"{r['step']:>4} {r['seq']:>5} {r['step_s']:8.2f} {r['hook_ms']:9.2f} {r['published']:>9} "
              f"{'yes' if r.get('publishing') else 'no':>10}")
    worst = h["max_hook_ms_publishing"]
    print("longest hook of a step while a publish was queued or ran: "
          + (f"{worst:.1f} ms (goal < 5 ms): {'ok' if h['goal_hooks'] else 'MISSED'}" if worst is not None
             else "no step published (nothing compiled?)"))
    print(f"size-cap check on this store: walk {h['size_walk_ms']:.1f} ms vs counter "
          f"{h['size_counter_ms']:.2f} ms -> {h['walk_vs_counter']:.0f}x (sizes {h['size_walked']} "
          f"walked, {h['size_counted']} counted); reading every pack header (the old eviction "
          f"pass) {h['read_all_headers_ms']:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
