"""How fast the store's command line starts: ``ls``, ``stats``, ``explain`` on a store of N entries.

A synthetic store (``--entries``, default 500) is filled with packs shaped like real ones (a
few FX-graph-sized members each, an ``entry.json`` with a full key record, stats shards, a few
recorded misses), then each command runs as a fresh ``python -m compile_cache ...`` process,
``--repeats`` times (median reported). Side by side in the same run: ``python -c pass`` (the
interpreter's own start, the floor) and ``python -c "import torch"`` (what every command paid
when ``import compile_cache`` pulled in torch). Goal: ``ls`` and ``stats`` under 0.3 s wall each.

The commands run as an installed package runs: with Python's bytecode cache (``pip install``
byte-compiles; ``PYTHONDONTWRITEBYTECODE`` is dropped from the children's environment) and after
one untimed run of each command that writes it.

    python benchmarks/bench_cli.py                 # 500 entries, median of 5
    python benchmarks/bench_cli.py --entries 50 --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GOAL_S = 0.3
GOAL_COMMANDS = ("ls", "stats")


def _record(i: int) -> dict[str, Any]:
    """An entry.json record like ``compile_cache.keys.key_fields`` writes (10 models, 50 setups)."""
    env = {"torch": "2.13.0+cpu", "python": "3.11.7", "cpu_threads": str(1 + i % 4),
           "cpu_capability": "AVX2+avx2+fma", "inductor_config": f"{i % 3:032x}",
           "functorch_config": "0" * 32, "dynamo_config": "1" * 32, "cuda_available": "0"}
    return {
        "model_class": f"models.Net{i % 10}", "torch": "2.13.0+cpu", "device": "cpu",
        "regions": "Block x12",
        "model": {"class": f"models.Net{i % 10}", "fingerprint": f"{i:032x}",
                  "structure": f"{i % 10:032x}", "dtypes": ["float32"], "devices": ["cpu"]},
        "compile": {"mode": "max-autotune"} if i % 7 == 0 else {},
        "precompile": i % 11 == 0,
        "environment": env,
        "plan": {"digest": f"{i % 10:032x}", "groups": ["Block x12"], "compiled": ["head"], "eager": []},
    }


def fill_store(path: str, entries: int) -> None:
    """``entries`` entries of 1-2 packs each, stats counters and a few miss records."""
    sys.path.insert(0, ROOT)
    from compile_cache.store import Store, misses

    store = Store(path, max_size=0)
    for i in range(entries):
        key = f"{i:08x}" + "ab" * 12
        for generation in range(1 + i % 2):
            members = {f"inductor/fxgraph/{i:04x}/{generation}/entry": os.urandom(4096),
                       f"inductor/{i:04x}/{generation}/kernel.cpp": os.urandom(2048),
                       f"inductor/{i:04x}/{generation}/kernel.so": os.urandom(8192)}
            store.publish(key, members, metadata={"fxgraph_misses": 3},
                          entry_info=_record(i), compile_seconds=10.0)
        if i % 3 == 0:
            store.record_hit(key, seconds_saved=10.0)
    for i in range(5):
        record = _record(i)
        record["environment"] = {**record["environment"], "cpu_threads": "8"}
        misses.record_miss(store, f"{i:08x}" + "cd" * 12, record, "benchmark")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time(argv: list[str], env: dict[str, str], repeats: int) -> dict[str, Any]:
    """Wall and CPU (user + sys of the child) seconds of ``repeats`` runs; CPU time is what the
    command costs when the cores are shared, wall what a user waits on a quiet machine."""
    samples, cpu = [], []
    for _ in range(repeats):
        cpu0, start = _cpu(), time.perf_counter()
        done = subprocess.run(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        samples.append(time.perf_counter() - start)
        cpu.append(_cpu() - cpu0)
        if done.returncode not in (0, 1):
            return {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}", "samples": samples}
    return {"median_s": statistics.median(samples), "min_s": min(samples), "samples": samples,
            "cpu_median_s": statistics.median(cpu)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    args = parser.parse_args(argv)

    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: byte-compiled modules
    with tempfile.TemporaryDirectory(prefix="bench_cli_") as tmp:
        store = os.path.join(tmp, "store")
        start = time.perf_counter()
        fill_store(store, args.entries)
        print(f"filled {args.entries} entries in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        }
        for command in ("ls", "stats", "explain", "ls --json"):
            cases[command] = [sys.executable, "-m", "compile_cache", *command.split(), "--cache-dir", store]
        rows = []
        for name, case in cases.items():
            _time(case, env, 1)  # untimed: writes the bytecode cache, as an install would have
            result = _time(case, env, args.repeats)
            rows.append({"command": name, **result})
            shown = (f"{result['median_s']:.3f} s wall, {result['cpu_median_s']:.3f} s CPU"
                     if "median_s" in result else result["error"])
            print(f"  {name:28s} {shown}", file=sys.stderr)
    torch_s = next((r.get("median_s") for r in rows if "import torch" in r["command"]), None)
    floor_s = next((r.get("median_s") for r in rows if r["command"] == "python -c pass"), None)
    for row in rows:
        if "median_s" in row and torch_s:
            row["vs_import_torch"] = row["median_s"] / torch_s
        if "median_s" in row and floor_s:
            row["over_interpreter_s"] = row["median_s"] - floor_s
    goals = {c: next((r.get("median_s") for r in rows if r["command"] == c), None) for c in GOAL_COMMANDS}
    data = {
        "benchmark": "cli", "entries": args.entries, "repeats": args.repeats, "goal_s": GOAL_S,
        "rows": rows, "load_average": os.getloadavg()[0], "cores": os.cpu_count(),
        "goal_met": all(v is not None and v < GOAL_S for v in goals.values()),
    }
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        for row in rows:
            if "median_s" in row:
                ratio = f"{row['vs_import_torch']:.2f}x import torch" if "vs_import_torch" in row else ""
                print(f"{row['command']:28s} {row['median_s']:.3f} s wall  "
                      f"{row['cpu_median_s']:.3f} s CPU  {ratio}")
            else:
                print(f"{row['command']:28s} {row['error']}")
        print(f"goal: {', '.join(GOAL_COMMANDS)} under {GOAL_S} s wall each: "
              f"{'met' if data['goal_met'] else 'not met'} (load average {data['load_average']:.1f} "
              f"on {data['cores']} cores)")
    return 0 if all("median_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
