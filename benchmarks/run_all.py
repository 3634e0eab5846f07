"""Runs every benchmark, keeps its raw JSON, renders benchmarks/RESULTS.md and draws the charts.

Each benchmark runs as its own subprocess with ``--json`` (its progress goes to stderr); the JSON
it prints is saved as ``benchmarks/results/<name>.json`` with a ``run`` record added (command,
machine, torch, date, wall time). RESULTS.md is then rendered whole from the saved JSON
(``PAGE``: one section per scenario, each with its figures, command, machine and date, and one
line per definition change); nothing in it is written by hand, and its history stays in git.
``tests/test_benchmarks.py`` checks that the committed page is what the committed JSON renders.
Charts go to ``benchmarks/charts/``.

    python benchmarks/run_all.py                         # everything, ~20 min on 2 cores; quiet machine!
    python benchmarks/run_all.py --only cold_start,regions
    python benchmarks/run_all.py --render-only           # no rerun: RESULTS.md (and charts) from the JSON
    python benchmarks/run_all.py --from-json DIR         # the same from another results dir
    python benchmarks/run_all.py --smoke                 # tiny settings, output under /tmp (pipeline test)

``cold_start_gpu`` (Llama-3.2-1B shape on CUDA, bf16) runs only when named in ``--only``;
``benchmarks/gpu_check.sh`` runs it on a GPU machine and saves ``benchmarks/results/gpu/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

GPU_MODEL = "16x2048"
# Benchmark name -> script, full arguments, smoke arguments, result file (relative to the
# results dir), RESULTS.md heading. Every script also gets --json.
BENCHMARKS: dict[str, dict] = {
    "fingerprint": {
        "script": "bench_fingerprint.py",
        "args": ["--layers", "8", "20", "40", "80", "--repeats", "50"],
        "smoke": ["--layers", "2", "8", "--repeats", "3"],
        "file": "fingerprint.json",
        "heading": "## Fingerprint",
    },
    "regions": {
        "script": "bench_regions.py",
        "args": [],
        "smoke": ["--layers", "2", "--width", "64", "--heads", "2", "--seq", "16",
                  "--iters", "5", "--warmup", "1", "--variants", "eager,full,ours"],
        "file": "regions.json",
        "heading": "## Regional compilation",
    },
    "cold_start": {
        "script": "bench_cold_start.py",
        "args": ["--strategies", "eager,full,accelerate,regional", "--modes", "forward,train"],
        "smoke": ["--models", "2x64", "--seq", "16", "--strategies", "eager,regional",
                  "--no-plain", "--modes", "forward,train", "--repeats", "1"],
        "file": "cold_start.json",
        "heading": "## Cold start",
    },
    "ranks": {
        "script": "bench_ranks.py",
        "args": [],
        "smoke": ["--layers", "2", "--width", "64", "--heads", "2", "--seq", "16",
                  "--store-packs", "200", "--steps", "4"],
        "file": "ranks.json",
        "heading": "## Ranks",
    },
    "cold_start_gpu": {
        "script": "bench_cold_start.py",
        "args": ["--arch", "llama", "--models", GPU_MODEL, "--device", "cuda", "--dtype",
                 "bfloat16", "--strategies", "eager,full,accelerate,regional", "--timeout", "300"],
        "smoke": ["--arch", "llama", "--models", "2x64", "--device", "cuda", "--dtype",
                  "bfloat16", "--seq", "16", "--strategies", "regional", "--no-plain"],
        "file": os.path.join("gpu", "cold_start.json"),
        "heading": "## Cold start (GPU)",
    },
    "cli": {
        "script": "bench_cli.py",
        "args": ["--entries", "500", "--repeats", "5"],
        "smoke": ["--entries", "20", "--repeats", "1"],
        "file": "cli.json",
        "heading": "## Command line",
    },
    "generate": {  # the size, 4 layers x 2048 (Llama-3.2-1B's width): ~25 min on 2 cores
        "script": "bench_generate.py",
        "args": ["--rounds", "3"],
        "smoke": ["--width", "64", "--new", "8", "--warm-runs", "1", "--variants",
                  "eager,ours,ours_store"],
        "file": "generate.json",
        "heading": "## Generation",
    },
    "remote": {
        "script": "bench_remote.py",
        "args": ["--models", "4x256", "--repeats", "3"],
        "smoke": ["--models", "2x64", "--seq", "16", "--repeats", "1"],
        "file": "remote.json",
        "heading": "## Object storage",
    },
}
DEFAULT_RUN = ("fingerprint", "regions", "cold_start", "ranks", "cli", "generate", "remote")
# torch's own caches on an H200 with torch 2.11, Llama-3.2-1B shape, bf16, batch 1 x 128
# (docs: /work/shared/DESIGN.md section 1): the reference for the GPU section.
GPU_REFERENCE = (
    ("regional (per-block torch.compile)", "cold", 15.9),
    ("regional (per-block torch.compile)", "torch warm (same dir)", 4.7),
    ("regional (per-block torch.compile)", "Mega-Cache new node", 5.6),
    ("full torch.compile", "cold", 29.2),
    ("full torch.compile", "torch warm (same dir)", 7.7),
    ("full torch.compile", "Mega-Cache new node", 7.9),
    ("eager", "first call", 1.2),
)
GPU_GOAL = 0.5  # compile_cache new node <= 0.5x torch's same-dir warm (regional)


# --------------------------------------------------------------------------- running


def _run_meta() -> dict:
    import torch
    from _common import machine

    return {
        "machine": machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def run_benchmark(name: str, smoke: bool, results_dir: str, timeout: float) -> str | None:
    """Runs one benchmark; saves its JSON; returns an error message or None."""
    spec = BENCHMARKS[name]
    script = os.path.join(HERE, spec["script"])
    if not os.path.exists(script):
        return (f"{name}: benchmarks/{spec['script']} does not exist yet; skipped (its section "
                f"in RESULTS.md is left as it is). Rerun with --only {name} once it exists.")
    args = [*(spec["smoke"] if smoke else spec["args"]), "--json"]
    command = f"python benchmarks/{spec['script']} {' '.join(args)}"
    print(f"\n=== {name}: {command}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, script, *args], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"{name}: timed out after {timeout:.0f} s"
    wall = time.perf_counter() - start
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = done.stdout.strip()[-500:]
        return f"{name}: exit {done.returncode}, no JSON on stdout (tail: {tail!r})"
    if not isinstance(data, dict):
        return f"{name}: its JSON is not an object"
    data["run"] = {**_run_meta(), "command": command, "wall_s": round(wall, 1),
                   "returncode": done.returncode, "smoke": smoke}
    path = os.path.join(results_dir, spec["file"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"=== {name}: {wall:.0f} s, saved {os.path.relpath(path, ROOT)}", file=sys.stderr)
    if done.returncode != 0:
        return f"{name}: exit {done.returncode} (JSON saved; some variants may have failed)"
    return None


def load_results(results_dir: str) -> dict[str, dict]:
    """The saved JSON by benchmark name. A cold-start JSON measured on CUDA counts as
    ``cold_start_gpu`` wherever it lies (gpu_check.sh saves it as <OUT>/cold_start.json)."""
    found: dict[str, dict] = {}
    candidates = [(name, os.path.join(results_dir, spec["file"])) for name, spec in BENCHMARKS.items()]
    candidates.append(("cold_start", os.path.join(results_dir, "gpu", "cold_start.json")))
    for name, path in candidates:
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            data = json.load(f)
        if name.startswith("cold_start"):
            name = "cold_start_gpu" if str(data.get("device", "cpu")).startswith("cuda") else "cold_start"
        found.setdefault(name, data)
    return found


# --------------------------------------------------------------------------- RESULTS.md


def _meta(data: dict, default_command: str) -> dict:
    run = data.get("run", {})
    return {
        "command": run.get("command") or data.get("command") or default_command,
        "machine": run.get("machine") or data.get("machine") or "not recorded",
        "torch": run.get("torch") or data.get("torch") or "not recorded",
        "date": run.get("date") or data.get("date") or "not recorded",
        "wall_s": run.get("wall_s"),
        "smoke": run.get("smoke", False),
    }


def _provenance(data: dict, default_command: str) -> str:
    m = _meta(data, default_command)
    wall = f", {m['wall_s']:.0f} s" if m["wall_s"] is not None else ""
    lines = [f"Command: `{m['command']}`  ",
             f"Machine: {m['machine']}"
             + ("" if f"torch {m['torch']}" in m["machine"] else f"; torch {m['torch']}")
             + f"; run {m['date']}{wall}."]
    if m["smoke"]:
        lines.append("\n**Smoke run (tiny settings): tests the pipeline, not a measurement.**")
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def section_fingerprint(data: dict) -> str:
    rows = data.get("rows", [])
    table = _table(
        ["model", "modules", "tensors", "python ms", "native ms", "api ms", "python µs/tensor",
         "native µs/tensor", "speedup"],
        [[r["model"], r["modules"], r["tensors"], f"{r['python_ms']:.3f}", f"{r['native_ms']:.3f}",
          f"{r['api_ms']:.3f}", f"{r['python_us_per_tensor']:.2f}", f"{r['native_us_per_tensor']:.2f}",
          f"{r['speedup']:.1f}×"] for r in rows],
    )
    big = max(rows, key=lambda r: r["tensors"], default=None)
    goal = ""
    if big:
        ok = big["speedup"] >= 10 and big["api_ms"] < 2
        goal = (f"\n\nGoal (native ≥ 10× the reference, < 2 ms through the API on the largest "
                f"model): {big['model']}: {big['speedup']:.1f}×, {big['api_ms']:.3f} ms: "
                f"**{'met' if ok else 'not met'}**.")
    return f"""`benchmarks/bench_fingerprint.py`: `fingerprint_tree(attributes=True)` on models built on the meta
device: GPT-2 small (transformers' default `gpt2` config) and the Llama-3-70B shape (hidden 8192,
64 heads, 8 KV heads, intermediate 28672, vocab 128256) at several depths. `python` =
`compile_cache._reference`, `native` = `compile_cache._C`, `api` = `compile_cache.fingerprint_tree`
(backend `{data.get('api_backend', '?')}` plus building the `Fingerprint` objects). Median of
{data.get('repeats', '?')} runs after 3 warm-up runs; minima are in the JSON.

{_provenance(data, "python benchmarks/bench_fingerprint.py --json")}

{table}{goal}

![fingerprint time against model size](charts/fingerprint.png)"""


def section_regions(data: dict) -> str:
    cfg = data.get("config", {})
    names = {"eager": "eager", "full": "full `torch.compile`",
             "accelerate": "accelerate `compile_regions`", "ours": "ours (compile_cache)",
             "ours-no-prefetch": "ours, `COMPILE_CACHE_PREFETCH=0`"}
    rows = []
    for r in data.get("results", []):
        if "error" in r:
            rows.append([names.get(r["variant"], r["variant"]), "error: " + " ".join(r["error"])[-120:],
                         None, None, None, None])
            continue
        rows.append([names.get(r["variant"], r["variant"]), f"{r['ttfo_s']:.2f}",
                     f"{r['steady_ms']:.2f}", _fmt(r.get("ttfo_vs_full")),
                     _fmt(r.get("steady_vs_full"), 3), r.get("unique_graphs")])
    table = _table(["variant", "TTFO s", "steady ms", "TTFO / full", "steady / full", "graphs"], rows)
    return f"""`benchmarks/bench_regions.py`: GPT-2 from transformers ({cfg.get('layers', '?')} layers, width
{cfg.get('width', '?')}, {cfg.get('heads', '?')} heads), batch 1 × {cfg.get('seq', '?')}, CPU,
`torch.no_grad()`; each variant in a fresh subprocess with an empty `TORCHINDUCTOR_CACHE_DIR`.
TTFO: compile call to the end of the first forward; steady: median of {cfg.get('iters', '?')}
forwards after {cfg.get('warmup', '?')} more. Goals: cold TTFO ≤ 0.5× full compile and ≤
accelerate's; steady state within 5 % of full compile.

Every cold Inductor CPU process first builds and loads a test library per candidate vector
instruction set (about 7 s here). `ours` builds them in the background while Dynamo traces
(`compile_cache/prefetch.py`; torch's probe still makes the choice); `ours, COMPILE_CACHE_PREFETCH=0`
shows regional compilation without that. Torch's machine-wide precompiled header (outside the
cache dir) is built once before the first variant, so no variant pays for it.

{_provenance(data, "python benchmarks/bench_regions.py --json")}

{table}"""


def _fmt(value: object, digits: int = 2) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


SCENARIO_ORDER = ("first call", "cold", "torch warm", "megacache node", "cc publish", "cc node",
                  "cc warm publish", "cc node (warm)", "cc plain publish", "cc plain node")
STRATEGY_NAMES = {"eager": "eager", "full": "full torch.compile",
                  "accelerate": "accelerate compile_regions", "regional": "compile_cache regional"}
MODES = ("forward", "train")


def _mode(row: dict) -> str:
    return row.get("mode", "forward")  # JSON from before the training-step scenarios


def _cold_table(data: dict) -> str:
    rows = [r for r in data.get("rows", []) if "ttfo_s" in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    keys = list(dict.fromkeys((_mode(r), r["strategy"], r["scenario"]) for r in rows))
    keys.sort(key=lambda k: (MODES.index(k[0]) if k[0] in MODES else 9,
                             list(STRATEGY_NAMES).index(k[1]) if k[1] in STRATEGY_NAMES else 9,
                             SCENARIO_ORDER.index(k[2]) if k[2] in SCENARIO_ORDER else 99))
    header = ["mode", "strategy", "scenario"]
    for m in models:
        header += [f"{m} TTFO s", f"{m} process s", f"{m} fx miss/hit"]
    body = []
    for mode, strategy, scenario in keys:
        line: list[object] = [mode, STRATEGY_NAMES.get(strategy, strategy), scenario]
        for m in models:
            r = next((r for r in rows if (r["model"], _mode(r), r["strategy"], r["scenario"])
                      == (m, mode, strategy, scenario)), None)
            line += ([f"{r['ttfo_s']:.2f}", f"{r['process_s']:.2f}",
                      f"{r.get('fxgraph_miss', '')}/{r.get('fxgraph_hit', '')}"]
                     if r else [None, None, None])
        body.append(line)
    return _table(header, body)


def _ratio_table(data: dict) -> str:
    rows = [[s["model"], s.get("mode", "forward"), s["against"], _fmt(s.get("node_vs_warm")),
             _fmt(s.get("node_vs_cold")), _fmt(s.get("process_vs_eager")),
             _fmt(s.get("warm_publisher_node_vs_warm")), _fmt(s.get("node_vs_megacache")),
             _fmt(s.get("plain_vs_warm")), _fmt(s.get("plain_vs_cold")),
             _fmt(s.get("plain_process_vs_eager"))]
            for s in data.get("ratios", [])]
    return _table(["model", "mode", "torch strategy", "cc node / warm", "cc node / cold",
                   "cc node process / eager process", "cc node (warm publisher) / warm",
                   "cc node / Mega-Cache node", "cc plain node / warm", "cc plain node / cold",
                   "cc plain node process / eager process"], rows)


COLD_INTRO = """`benchmarks/bench_cold_start.py`: {what}, batch 1 × {seq}, `use_cache=False`; mode
`forward` = one forward under `torch.no_grad()`, `train` = one training step (train mode, forward
and `loss.backward()`); every scenario in its own process. TTFO = compile call to the end of the
first forward (and backward){sync}; "process" = the whole process, imports and model building
included. A *fresh node* has new, empty `TMPDIR`, `HOME`, `XDG_CACHE_HOME`,
`TORCHINDUCTOR_CACHE_DIR` and `TRITON_CACHE_DIR`, as a new container or CI runner has (torch
keeps its precompiled header under the temp dir), and nothing is built before measuring.
Scenarios: `cold` (a fresh node), `torch warm` (the cold run's node again: torch's own warm
start), `megacache node` (a fresh node + `torch.compiler.load_cache_artifacts` of the cold run's
bytes), `cc publish` / `cc node` (compile_cache with each region group precompiled, and an empty
store on a fresh node, then a fresh node with the filled store), `cc
warm publish` / `cc node (warm)` (a node whose local dirs are warm publishes into an empty store,
then a fresh node restores from it), `cc plain …` (the publish/node pair with
`precompile=False`: FX-graph entries only, Dynamo traces on every start), `eager` / `first call`
(no compile, a fresh node).
{repeats}"""


def _repeats_note(data: dict) -> str:
    """Which scenarios ran more than once, from the samples the rows hold."""
    rows = data.get("rows", [])
    counts = {len(r["ttfo_samples"]) for r in rows if r.get("ttfo_samples")}
    if not counts or max(counts) < 2:
        return "Every scenario ran once."
    repeated = list(dict.fromkeys(f"`{r['scenario']}`" for r in rows
                                  if len(r.get("ttfo_samples") or ()) >= 2))
    once = [s for s in dict.fromkeys(f"`{r['scenario']}`" for r in rows) if s not in repeated]
    note = (f"{', '.join(repeated)} ran {max(counts)} times each (every eager and `cc node` run "
            "on its own fresh node); their rows are the median run by TTFO, and the process "
            "ratios use the median whole process; all samples are in the JSON.")
    return note + (f" {', '.join(once)} ran once." if once else "")


def _cold_what(data: dict) -> tuple[str, str]:
    arch = {"gpt2": "GPT-2", "llama": "Llama (Llama-3.2-1B proportions)"}.get(
        data.get("arch", "gpt2"), data.get("arch", "gpt2"))
    device = data.get("device", "cpu")
    what = (f"{arch} from transformers (random weights), models {', '.join(data.get('models') or [])}"
            f" (layers × width), {device}, {data.get('dtype', 'float32')}")
    sync = ", after `torch.cuda.synchronize()`" if device.startswith("cuda") else ""
    return what, sync


def section_cold_start(data: dict) -> str:
    what, sync = _cold_what(data)
    return f"""{COLD_INTRO.format(what=what, seq=data.get('seq', '?'), sync=sync, repeats=_repeats_note(data))}

{_provenance(data, "python benchmarks/bench_cold_start.py --json")}

{_cold_table(data)}

Goals (issue 12): compile_cache on a fresh node ≤ 1.0× torch's warm start on a warm node and ≤
0.2× a cold start on a fresh node (TTFO), forward and train; its whole process ≤ 1.3× eager's
whole process. Issue 13: compile_cache with precompile on a fresh node ≤ 0.5× torch's warm start
on a warm node (the `cc node` columns, with precompile; `cc plain node` is `precompile=False`).

{_ratio_table(data)}

![time to first output per scenario](charts/cold_start.png)"""


def gpu_goal(data: dict) -> tuple[float | None, float | None, float | None]:
    """(cc node TTFO, regional torch warm TTFO, ratio) for the first model in a GPU run."""
    rows = [r for r in data.get("rows", []) if _mode(r) == "forward"]
    model = next((r["model"] for r in rows), None)
    pick = {(r["strategy"], r["scenario"]): r["ttfo_s"] for r in rows if r["model"] == model}
    node, warm = pick.get(("regional", "cc node")), pick.get(("regional", "torch warm"))
    return node, warm, (node / warm if node and warm else None)


def section_cold_start_gpu(data: dict) -> str:
    what, sync = _cold_what(data)
    node, warm, ratio = gpu_goal(data)
    if ratio is None:
        verdict = "not measured (the run lacks the regional `torch warm` or `cc node` scenario)"
    else:
        verdict = (f"{node:.2f} s / {warm:.2f} s = **{ratio:.2f}×: "
                   f"{'met' if ratio <= GPU_GOAL else 'not met'}**")
    reference = _table(["torch strategy", "scenario", "TTFO s"],
                       [[a, b, f"{c:.1f}"] for a, b, c in GPU_REFERENCE])
    return f"""{COLD_INTRO.format(what=what, seq=data.get('seq', '?'), sync=sync, repeats=_repeats_note(data))}
Run by `bash benchmarks/gpu_check.sh` on a GPU machine (JSON in `benchmarks/results/gpu/`).

{_provenance(data, "bash benchmarks/gpu_check.sh")}

{_cold_table(data)}

Goal: compile_cache new node ≤ {GPU_GOAL}× torch's same-dir warm start (regional): {verdict}.

{_ratio_table(data)}

Reference, our earlier measurement of torch's own caches (H200, torch 2.11, Llama-3.2-1B shape,
16 layers × 2048, bf16, batch 1 × 128; DESIGN.md section 1):

{reference}

![time to first output per scenario on GPU](charts/cold_start_gpu.png)"""


def section_ranks(data: dict) -> str:
    if "uncached" in data and "cached" in data:
        return _section_ranks_variants(data)
    rows = [r for r in data.get("rows", []) if isinstance(r, dict)]
    keys = list(dict.fromkeys(k for r in rows for k in r
                              if isinstance(r[k], (int, float, str, bool)) or r[k] is None))
    table = _table(keys, [[r.get(k) for k in keys] for r in rows]) if rows else "(no rows)"
    config = {k: v for k, v in data.items()
              if k not in ("rows", "run") and isinstance(v, (int, float, str, bool))}
    described = ", ".join(f"{k} {v}" for k, v in config.items())
    return f"""`benchmarks/bench_ranks.py`: several ranks starting the same model at once, with and without
compile_cache: the compile CPU seconds all ranks spend together and the slowest rank's time to
first output.{(' Settings: ' + described + '.') if described else ''}

{_provenance(data, "python benchmarks/bench_ranks.py --json")}

{table}

![ranks: compile CPU time and slowest TTFO](charts/ranks.png)"""


def _section_ranks_variants(data: dict) -> str:
    cfg = data.get("config", {})
    rows = []
    for variant in ("uncached", "cached"):
        for r in data[variant].get("ranks", []):
            c = r.get("counters", {})
            rows.append([variant, r.get("rank"), r.get("role"), f"{r['cpu_s']:.1f}",
                         f"{r['ttfo_s']:.1f}", f"{r.get('waited_s', 0):.1f}",
                         f"{c.get('fxgraph_miss', '')}/{c.get('fxgraph_hit', '')}"])
    table = _table(["variant", "rank", "role", "CPU s", "TTFO s", "waited s", "fx miss/hit"], rows)
    u, c = data["uncached"], data["cached"]
    n = len(u.get("ranks", []))

    def verdict(ok: object) -> str:
        return "met" if ok else "not met"

    return f"""`benchmarks/bench_ranks.py`: {n} ranks (gloo, CPU) start GPT-2 from transformers
({cfg.get('layers', '?')} layers × {cfg.get('width', '?')}, {cfg.get('heads', '?')} heads, batch 1 ×
{cfg.get('seq', '?')}, {cfg.get('threads', '?')} thread(s) per rank) at once, each with its own empty
`TORCHINDUCTOR_CACHE_DIR`: `uncached` (`compile_regions(cache_dir=False)`: every rank compiles)
against `cached` (an empty shared store: one rank compiles and publishes, the others wait and
restore). CPU = the rank's process tree (itself, compile workers, reaped g++ children, via psutil)
from just before `compile_regions` to the first output.

{_provenance(data, "python benchmarks/bench_ranks.py --json")}

{table}

Total compile CPU: uncached {u['total_cpu_s']:.1f} s, cached {c['total_cpu_s']:.1f} s →
{_fmt(data.get('cpu_ratio'))}× (goal ≤ {data.get('goal_cpu_max', 0.6)}×: **{verdict(data.get('goal_cpu'))}**). Slowest rank TTFO:
uncached {u['slowest_ttfo_s']:.1f} s, cached {c['slowest_ttfo_s']:.1f} s → {_fmt(data.get('ttfo_ratio'))}×
(goal ≤ 1.0×: **{verdict(data.get('goal_ttfo'))}**).
{_section_hooks(data['hooks'], cfg, verdict) if isinstance(data.get('hooks'), dict) else ''}
![ranks: compile CPU time and slowest TTFO](charts/ranks.png)"""


def _section_hooks(h: dict, cfg: dict, verdict: Callable[[object], str]) -> str:
    """bench_ranks.py's hooks measure: time in compile_cache's hooks per training step."""
    rows = [[r.get("step"), r.get("seq"), f"{r.get('step_s', 0):.2f}", f"{r.get('hook_ms', 0):.2f}",
             r.get("published"), "yes" if r.get("publishing", r.get("published")) else "no"]
            for r in h.get("steps", [])]
    worst = h.get("max_hook_ms_publishing")
    return f"""
Time a training step spends in compile_cache's hooks while a publish runs (`hooks`: one process,
GPT-2 {cfg.get('layers', '?')} × {cfg.get('width', '?')} in training mode, SGD steps, the sequence
length doubled half way; the store already holds {h.get('store_packs', '?')} packs of other keys):

{_table(["step", "seq", "step s", "hook ms", "packs published", "publish queued or running"], rows)}

Publishing runs on a background thread (`compile_cache/publisher.py`): a step's hook only queues
it. Longest hook of a step while a publish was queued or running: {_fmt(worst)} ms (goal < 5 ms: **{verdict(h.get('goal_hooks'))}**).
The size-cap check a publish makes, on this store: walking it {_fmt(h.get('size_walk_ms'))} ms
against the size counter {_fmt(h.get('size_counter_ms'))} ms ({_fmt(h.get('walk_vs_counter'))}×);
reading every pack header (the old eviction pass) {_fmt(h.get('read_all_headers_ms'))} ms.
"""


def section_cli(data: dict) -> str:
    rows = [[r["command"], f"{r['median_s']:.3f}", f"{r['cpu_median_s']:.3f}",
             _fmt(r.get("vs_import_torch"))] if "median_s" in r else [r["command"], r.get("error"), None, None]
            for r in data.get("rows", [])]
    table = _table(["command", "wall s (median)", "CPU s (median)", "wall / import torch"], rows)
    verdict = "met" if data.get("goal_met") else "not met"
    return f"""`benchmarks/bench_cli.py`: each command as a fresh `python -m compile_cache ...` process on a
synthetic store of {data.get('entries', '?')} entries (1-2 packs each, full `entry.json` records,
stats shards, recorded misses), median of {data.get('repeats', '?')} runs; `python -c pass` and
`python -c "import torch"` (what every command cost while `import compile_cache` imported torch)
measured in the same run. Load average {data.get('load_average', 0):.1f} on {data.get('cores', '?')} cores
during the run (CPU time is the cost that does not depend on sharing the cores).

{_provenance(data, "python benchmarks/bench_cli.py --json")}

{table}

Goal: `ls` and `stats` under {data.get('goal_s', 0.3)} s wall each: **{verdict}**."""


def section_generate(data: dict) -> str:
    import bench_generate

    cfg = data.get("config", {})
    rows = [[r["variant"], r.get("error")] + [None] * 7 if "error" in r else
            [r["variant"], _fmt(r.get("cold_ttft_s")), _fmt(r.get("cold_generate_s")),
             _fmt(r.get("warm_generate_s"), 3), _fmt(r.get("decode_tok_s"), 1),
             r.get("unique_graphs"), f"{r.get('fxgraph_hit')}/{r.get('fxgraph_miss')}",
             "yes" if r.get("same_tokens_as_eager") else "no", r.get("runs")]
            for r in data.get("results", [])]
    table = _table(["variant", "cold TTFT s", "cold generate s", "warm generate s",
                    "decode tok/s", "graphs", "fx hit/miss", "same ids as eager", "runs"], rows)
    ratios = data.get("ratios", {})
    goals = []
    for key, what, sense, goal in bench_generate.GOALS:
        value = ratios.get(key)
        if value is not None:
            met = value <= goal if sense == "<=" else value >= goal
            goals.append(f"- {what}: **{value:.2f}** (goal {sense} {goal}: {'met' if met else 'not met'})")
    paired = data.get("paired") or {}
    if paired.get("ours_vs_full_per_pair"):
        pairs = ", ".join(f"{v:.2f}" for v in paired["ours_vs_full_per_pair"])
        rates = paired.get("decode_tok_s", {})
        medians = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in rates.items() if v)
        goals.append(f"- decode A/B in one process ({paired.get('pairs')} pairs of full and ours "
                     f"alternating; ours / full per pair): {pairs}; median tok/s {medians}")
    if ratios.get("decode_vs_full_per_process") is not None:
        goals.append(f"- ours / full decode of the per-process medians above: "
                     f"{ratios['decode_vs_full_per_process']:.2f}")
    for n, r in enumerate(ratios.get("per_round", []), 1):
        values = ", ".join(f"{k.split('_vs_')[0].replace('_', ' ')} {v:.2f}" for k, v in r.items()
                           if v is not None)
        goals.append(f"- round {n} alone: {values}")
    if ratios.get("ours_break_decode_vs_ours") is not None:
        goals.append(f"- decode tok/s with the cache update between two graphs everywhere / with "
                     f"layer views: {ratios['ours_break_decode_vs_ours']:.2f}")
    return f"""`benchmarks/bench_generate.py`: `model.generate()` on a Llama with Llama-3.2-1B's proportions,
{cfg.get('layers', '?')} layers × {cfg.get('width', '?')}, {cfg.get('dtype', '?')}, greedy, prompt
{cfg.get('prompt', '?')} tokens, {cfg.get('new', '?')} new tokens; every variant in its own process on a fresh
node; cold figures from the compile call, warm figures the median of {cfg.get('warm_runs', '?')} more
generates; medians of {cfg.get('rounds', '?')} round(s). The decode goal is taken from an A/B run: full
compile and ours in one more process, alternating generates, so each pair shares the
machine's speed of that moment. In bf16 a compiled variant's token ids may differ
from eager's (near-tied logits of random weights); the tests check equality in fp32.

{_provenance(data, "python benchmarks/bench_generate.py --json")}

{table}

""" + "\n".join(goals)


def section_remote(data: dict) -> str:
    rows = []
    for r in data.get("rows", []):
        for label, name in (("dir", "directory store"), ("s3", "S3 (moto, 127.0.0.1)"),
                            ("s3_raw", "S3, packs uncompressed"),
                            ("gcs", "GCS (gcp-storage-emulator, 127.0.0.1)"),
                            ("azure", "Azure Blob (Azurite, 127.0.0.1)")):
            if label not in r:
                continue
            d = r[label]
            paired = (f"{d['ratio']:.3f} / {d['paired_ratio']:.3f}"
                      if d.get("ratio") is not None and d.get("paired_ratio") is not None else "-")
            rows.append([r["model"], name, _fmt(d["ttfo_s"]), _fmt(d["process_s"]), d["fxgraph_miss"],
                         f"{int(d['bytes_moved']):,}", paired])
    ratios = "; ".join(f"{r['model']}: **{r['ratio']:.2f}x** ({'met' if r['goal_met'] else 'not met'})"
                       for r in data.get("rows", []) if r.get("ratio") is not None)
    table = _table(["model", "store", "TTFO s (median)", "process s", "FX-graph misses",
                    "bytes moved per start", "/ dir (medians / paired)"], rows)
    return f"""`benchmarks/bench_remote.py`: GPT-2 (random weights, CPU, batch 1 x {data.get('seq', '?')}),
fresh-node time to first output restoring from a directory store and from object storage on
emulators on 127.0.0.1 (moto's S3 server{', gcp-storage-emulator, Azurite' if any('gcs' in r for r in data.get('rows', [])) else ''}; the same packs: exported from the directory store, imported),
alternately, median of {data.get('repeats', '?')} fresh nodes each (new TMPDIR, HOME,
XDG_CACHE_HOME, Inductor/Triton dirs and an empty local tier). Bytes moved: S3, downloaded plus
uploaded (the local tier's counters); directory, the member bytes restored.

{_provenance(data, "python benchmarks/bench_remote.py --json")}

{table}

Goal: S3 at most {data.get('goal', 1.1)}x the directory store: {ratios or '-'}.{_remote_extra(data)}"""


def _remote_extra(data: dict) -> str:
    """The bytes goal (compressed against uncompressed packs) and the client's import time."""
    lines = []
    for r in data.get("rows", []):
        if r.get("bytes_fewer") is not None:
            lines.append(f"Bytes moved per fresh node, uncompressed / compressed packs: {r['model']}: "
                         f"**{r['bytes_fewer']:.2f}x** (goal >= {data.get('bytes_goal', 3.0)}: "
                         f"{'met' if r.get('bytes_goal_met') else 'not met'}); uncompressed S3 / "
                         f"directory TTFO {r['raw_ratio']:.2f}x.")
    for r in data.get("rows", []):
        for label, name in (("gcs", "GCS emulator"), ("azure", "Azurite")):
            d = r.get(label)
            if d and d.get("ratio") is not None:
                lines.append(f"{name} / directory TTFO, {r['model']}: **{d['ratio']:.2f}x** "
                             f"({'met' if d.get('goal_met') else 'not met'}); median of the paired "
                             f"ratios {d['paired_ratio']:.2f} ({', '.join(map(str, d['paired_ratios']))}).")
    probe = data.get("client_import")
    if probe:
        lines.append(f"S3 client on a fresh node ({probe['client']}): import {probe['import_s']:.3f} s, "
                     f"make {probe['make_s']:.3f} s, first request {probe['first_request_s']:.3f} s "
                     f"(s3fs imported: {'yes' if probe['s3fs_imported'] else 'no'}).")
    for label, p in (data.get("client_imports") or {}).items():
        if label != "s3":
            lines.append(f"{label} client on a fresh node ({p['client']}): import {p['import_s']:.3f} s, "
                         f"make {p['make_s']:.3f} s, first request {p['first_request_s']:.3f} s.")
    return ("\n\n" + "\n\n".join(lines)) if lines else ""


SECTIONS: dict[str, Callable[[dict], str]] = {
    "fingerprint": section_fingerprint,
    "regions": section_regions,
    "cold_start": section_cold_start,
    "cold_start_gpu": section_cold_start_gpu,
    "ranks": section_ranks,
    "cli": section_cli,
    "generate": section_generate,
    "remote": section_remote,
}


def section_restored(runs: list[dict]) -> str:
    """Fresh nodes restoring a filled store against eager and torch's warm start, several runs."""
    rows = []
    for data in runs:
        by = {(r["model"], _mode(r), r["scenario"]): r for r in data.get("rows", [])}
        for ratio in data.get("ratios", []):
            model, mode = ratio["model"], ratio.get("mode", "forward")
            eager, node = by.get((model, mode, "first call")), by.get((model, mode, "cc node"))
            warm = by.get((model, mode, "torch warm"))
            if not (eager and node and warm):
                continue
            runs_each = len(node.get("ttfo_samples") or ()) or 1
            rows.append([f"{model}, {runs_each} each", mode,
                         f"{eager.get('process_median_s', eager['process_s']):.2f}",
                         f"{node.get('process_median_s', node['process_s']):.2f}",
                         f"**{ratio['process_vs_eager']:.2f}**", f"{node['ttfo_s']:.2f}",
                         f"{warm['ttfo_s']:.2f}", f"**{ratio['node_vs_warm']:.2f}**"])
    table = _table(["run", "mode", "eager process s", "cc node process s",
                    "process / eager (goal ≤ 1.1)", "cc node TTFO s", "torch warm TTFO s",
                    "TTFO / torch warm (goal ≤ 0.3)"], rows)
    provenance = "\n\n".join(_provenance(d, "python benchmarks/bench_cold_start.py --json")
                              for d in runs)
    return f"""`benchmarks/bench_cold_start.py --strategies eager,regional --no-plain`: GPT-2 (random
weights, CPU, float32, batch 1 × 128, `use_cache=False`); `forward` = one forward under
`torch.no_grad()`, `train` = one training step. Every run is its own fresh node (new `TMPDIR`,
`HOME`, `XDG_CACHE_HOME`, `TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`): eager as often as
`cc node` (compile_cache restoring a store one publisher filled, each region group
precompiled). "process" is the median whole process, imports and model building included;
TTFO (compile call to first output) is the median run's, against torch's own warm start of the
same regions on a warm node. All samples are in the JSON. The machine was idle.

{provenance}

{table}"""


def section_whole(runs: list[dict]) -> str:
    """compile_cache.compile(model) and `run` against full torch.compile (bench_cold_start)."""
    parts = []
    for data in runs:
        parts.append(f"{_provenance(data, 'python benchmarks/bench_cold_start.py --json')}\n\n"
                     f"{_cold_table(data)}\n\n{_ratio_table(data)}")
    body = "\n\n".join(parts)
    return f"""`benchmarks/bench_cold_start.py --strategies full`: GPT-2 (random weights, CPU, float32,
batch 1 × 128), forward and one training step, every scenario in its own process on a fresh
node, one sample per row. `cc whole` is `compile_cache.compile(model)` (the whole model as one
part, precompiled), `cc run` the unchanged `torch.compile(model)` started by
`python -m compile_cache run --name bench` (its TTFO includes the process store's restore at
interpreter start): each a publisher on a fresh node, then a fresh node that restores. Goals:
the fresh node ≤ 0.5× full `torch.compile`'s warm start on a warm node and ≤ 0.15× its cold
start (the `cc whole node` and `cc run node` ratio rows).

{body}"""


def section_prompts(data: dict) -> str:
    """New prompt lengths on successive fresh nodes (bench_generate --prompts)."""
    cfg = data.get("config", {})
    rows = []
    for r in data.get("results", []):
        eager, ours = r.get("eager") or {}, r.get("ours") or {}
        budget = r.get("budget_s")
        ratio = ours.get("cold_generate_s") / budget if budget and ours.get("cold_generate_s") else None
        rows.append([r.get("node"), r.get("prompt"), _fmt(eager.get("cold_generate_s")),
                     _fmt(ours.get("cold_generate_s")), _fmt(budget), _fmt(ratio),
                     f"{ours.get('fxgraph_miss')} / {ours.get('fxgraph_hit')}",
                     f"{ours.get('restored_packs')} / {ours.get('published_packs')}",
                     "yes" if ours.get("tokens") == eager.get("tokens") else "no"])
    table = _table(["node", "prompt", "eager first generate s", "ours first generate s",
                    "1.2 × eager + 2 s", "ours / that", "FX misses / hits",
                    "packs restored / published", "ids equal eager's"], rows)
    return f"""`benchmarks/bench_generate.py --prompts`: `generate()` ({cfg.get('new', '?')} new tokens,
greedy, batch 1) of a Llama ({cfg.get('layers', '?')} layers × {cfg.get('width', '?')},
{cfg.get('dtype', '?')}, CPU) with `compile_regions(model, cache_dir=STORE)`, one fresh node per
prompt length, one shared store: the store learns which dimensions vary, so from the third node
on a new length compiles nothing. Goal: at most 1.2 × eager's first generate + 2 s from the
third node on.

{_provenance(data, "python benchmarks/bench_generate.py --prompts 16,10,12,24 --json")}

{table}"""


def section_architectures(data: dict) -> str:
    """First generate() per architecture on a fresh node (bench_architectures --batched)."""
    rows = []
    for r in data.get("rows", []):
        goal = r.get("generate_goal_s")
        node = r.get("cc node")
        verdict = (f"≤ {goal:.2f} s: **{'met' if node <= goal else 'not met'}** ({node / goal:.2f}×)"
                   if goal and node is not None else None)
        rows.append([r.get("arch"), _fmt(r.get("eager")), f"**{node:.2f}**" if node else None,
                     _fmt(r.get("cc plain")), _fmt(r.get("torch warm")),
                     _fmt(r.get("node_vs_plain")),
                     f"{r.get('cc node frames')} / {r.get('cc plain frames')}",
                     r.get("cc node fx_misses"), verdict])
    table = _table(["model", "eager s", "cc node s", "cc plain s", "torch warm s",
                    "node / plain", "frames traced (node / plain)", "FX misses (node)",
                    "goal (1.2 × eager + 2 s)"], rows)
    return f"""`benchmarks/bench_architectures.py --batched --calls generate`: the first `generate()` of the
tiny transformers models of `tests/_architectures_child.py` (random weights, CPU), each scenario
in its own process on its own fresh node: eager, compile_cache with `precompile=True` restoring
a filled store (`cc node`), the same with `precompile=False` (`cc plain`, its own publisher and
store), and torch's warm start (`compile_regions(cache_dir=False)` on a node that ran it once).

{_provenance(data, "python benchmarks/bench_architectures.py --batched --json")}

{table}"""


def section_table(data: dict) -> str:
    """A table kept as rows and columns in its JSON (``columns``, ``rows``, ``description``)."""
    source = (data.get("run") or {}).get("source")
    return (f"{data.get('description', '')}\n\n"
            f"{_provenance(data, 'not recorded')}{(chr(10) + 'Source: ' + source + '.') if source else ''}"
            f"\n\n{_table(data.get('columns', []), data.get('rows', []))}")


@dataclass(frozen=True)
class Scenario:
    """One section of RESULTS.md: its heading, the JSON it is rendered from (relative to the
    results dir; a missing file leaves the section out), how, and why a definition changed
    (one line each, shown under the table)."""

    heading: str
    files: tuple[str, ...]
    render: Callable[[list[dict]], str]
    changes: tuple[str, ...] = ()


def _one(section: Callable[[dict], str]) -> Callable[[list[dict]], str]:
    return lambda runs: section(runs[0])


PRECOMPILE_CHANGE = (
    "`cc node` is compile_cache with precompile: the default until 2026-12-07 (commit 15b8b30 "
    "turned it off while it is under review), so these rows were measured with it on; rerun now, "
    "the same command measures the new default.")
PAGE: tuple[Scenario, ...] = (
    Scenario("Restored start on a fresh node (CPU)",
             ("restored_start_12x768.json", "restored_start_4x256.json",
              "restored_start_4x256_forward.json"), section_restored,
             (PRECOMPILE_CHANGE,
              "The process ratio compares median whole processes of eager and `cc node` (since "
              "2026-12-04); earlier figures took the whole process of the median run by TTFO.")),
    Scenario("Cold start (CPU)", ("cold_start.json",), _one(section_cold_start),
             (PRECOMPILE_CHANGE,)),
    Scenario("Cold start (GPU)", ("gpu/cold_start.json",), _one(section_cold_start_gpu),
             ("On torch 2.11 precompile is off altogether (its config overrides are "
              "process-wide), so `cc node` here restores compiled graphs and Dynamo traces.",)),
    Scenario("Regional compilation", ("regions.json",), _one(section_regions)),
    Scenario("Ranks", ("ranks.json",), _one(section_ranks)),
    Scenario("Object storage", ("remote.json",), _one(section_remote),
             ("The ratio to the directory store is the median of paired ratios (each node's TTFO "
              "over the directory node's run beside it) since 2026-12-04; before, a ratio of "
              "medians.",)),
    Scenario("Generation", ("generate.json",), _one(section_generate)),
    Scenario("New prompt lengths on successive fresh nodes", ("generate_prompts.json",),
             _one(section_prompts)),
    Scenario("Architectures: first generate() on a fresh node", ("architectures_generate.json",),
             _one(section_architectures)),
    Scenario("Whole model and process store", ("whole_model_4x256.json", "whole_model_12x768.json"),
             section_whole,
             ("`cc node` and `cc whole` ran with precompile: the default until 2026-12-07 (commit "
              "15b8b30 turned it off while it is under review); rerun now, the same command "
              "measures the new default.",)),
    Scenario("Fingerprint", ("fingerprint.json",), _one(section_fingerprint)),
    Scenario("Command line", ("cli.json",), _one(section_cli)),
    Scenario("A store's part of a start against one big entry", ("store_start.json",),
             _one(section_table)),
    Scenario("Memory bounds against hostile packs and archives", ("memory_bounds.json",),
             _one(section_table)),
    Scenario("Supported torch releases: the demo's cached start", ("torch_versions.json",),
             _one(section_table)),
)

PAGE_INTRO = """# Benchmark results

Generated by `python benchmarks/run_all.py --render-only` from the JSON under
`benchmarks/results/`: one section per scenario with its current figures, the command that made
them, the machine and the date. Do not edit this file; rerun a benchmark (`python
benchmarks/run_all.py --only NAME`, or the command shown) and render again. Earlier figures and
the notes of how they were reached are in the git history of this file and of
`benchmarks/results/`. TTFO is the time from the compile call to the end of the first output. A
*fresh node* has new, empty `TMPDIR`, `HOME`, `XDG_CACHE_HOME`, `TORCHINDUCTOR_CACHE_DIR` and
`TRITON_CACHE_DIR`, as a new container or CI runner has.
"""


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading (the docs site uses the same rule)."""
    text = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def render_page(results_dir: str) -> str:
    """The whole of RESULTS.md from the JSON in ``results_dir``; the same JSON, the same text."""
    sections = []
    for scenario in PAGE:
        runs = []
        for name in scenario.files:
            path = os.path.join(results_dir, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    runs.append(json.load(f))
        if not runs:
            continue
        changes = "".join(f"\n\nDefinition change: {line}" for line in scenario.changes)
        files = ", ".join(f"`benchmarks/results/{n}`" for n in scenario.files
                          if os.path.isfile(os.path.join(results_dir, n)))
        sections.append((scenario.heading,
                         f"## {scenario.heading}\n\n{scenario.render(runs).strip()}{changes}"
                         f"\n\nJSON: {files}."))
    contents = "\n".join(f"- [{h}](#{_anchor(h)})" for h, _ in sections)
    body = "\n\n".join(text for _, text in sections)
    return f"{PAGE_INTRO}\n{contents}\n\n{body}\n"


def write_results(results_md: str, results_dir: str) -> None:
    """Writes the page rendered from ``results_dir`` to ``results_md``."""
    os.makedirs(os.path.dirname(os.path.abspath(results_md)), exist_ok=True)
    with open(results_md, "w", encoding="utf-8") as f:
        f.write(render_page(results_dir))


def draw_charts(charts_dir: str, data: dict[str, dict], names: list[str] | None = None) -> list[str]:
    """Draws the charts for the benchmarks with data; returns the paths written."""
    import plots

    jobs = {
        "cold_start": lambda d: plots.cold_start_chart(d, os.path.join(charts_dir, "cold_start.png")),
        "cold_start_gpu": lambda d: plots.cold_start_chart(
            d, os.path.join(charts_dir, "cold_start_gpu.png"),
            title=f"Time to first output on GPU (batch 1 × {d.get('seq')}, no_grad)"),
        "fingerprint": lambda d: plots.fingerprint_chart(d, os.path.join(charts_dir, "fingerprint.png")),
        "ranks": lambda d: plots.ranks_chart(d, os.path.join(charts_dir, "ranks.png")),
    }
    written = []
    for name in names or list(data):
        if name in data and name in jobs:
            try:
                written.append(jobs[name](data[name]))
            except (ValueError, KeyError) as exc:
                print(f"chart for {name} skipped: {exc}", file=sys.stderr)
    return written


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=lambda s: [v for v in s.split(",") if v],
                        help=f"comma-separated subset of {','.join(BENCHMARKS)} to run "
                             f"(default {','.join(DEFAULT_RUN)}); the page is always rendered whole")
    parser.add_argument("--render-only", "--results-page", action="store_true",
                        help="run nothing: render RESULTS.md (and the charts) from the results dir")
    parser.add_argument("--from-json", metavar="DIR",
                        help="run nothing: render RESULTS.md and the charts from DIR")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny settings to test the pipeline; output under a temp dir unless "
                             "--results-dir/--results-md/--charts-dir say otherwise")
    parser.add_argument("--results-dir", help="where the JSON goes (default benchmarks/results)")
    parser.add_argument("--results-md", help="the page to write (default benchmarks/RESULTS.md)")
    parser.add_argument("--charts-dir", help="where the PNGs go (default benchmarks/charts)")
    parser.add_argument("--no-charts", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    args = parser.parse_args(argv)

    names = args.only
    unknown = sorted(set(names or []) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    render_only = args.render_only or bool(args.from_json)
    if render_only and args.smoke:
        parser.error("--render-only/--from-json run nothing; --smoke does not apply")

    base = os.path.join(tempfile.gettempdir(), "compile_cache_bench_smoke") if args.smoke else None
    results_dir = args.results_dir or args.from_json or (
        os.path.join(base, "results") if base else os.path.join(HERE, "results"))
    results_md = args.results_md or (os.path.join(base, "RESULTS.md") if base
                                     else os.path.join(HERE, "RESULTS.md"))
    charts_dir = args.charts_dir or (os.path.join(base, "charts") if base
                                     else os.path.join(HERE, "charts"))

    problems: list[str] = []
    if not render_only:
        for name in names or DEFAULT_RUN:
            error = run_benchmark(name, args.smoke, results_dir, args.timeout)
            if error:
                problems.append(error)
                print(f"!!! {error}", file=sys.stderr)

    if not os.path.isdir(results_dir):
        print(f"no results in {results_dir}", file=sys.stderr)
        return 1
    write_results(results_md, results_dir)
    print(f"\nwrote {results_md}", file=sys.stderr)
    data = load_results(results_dir)
    if not args.no_charts:
        for path in draw_charts(charts_dir, data, names):
            print(f"chart {path}", file=sys.stderr)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
