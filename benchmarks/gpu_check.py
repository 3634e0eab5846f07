"""The GPU check's steps after the build (run by benchmarks/gpu_check.sh; see its header).

1. ``doctor``: the private torch names compile_cache uses (its capabilities) and the ones the
   counters below wrap must exist in the installed torch;
2. a CUDA smoke test, for ``mode="default"`` and ``mode="reduce-overhead"``: one tiny model's
   region compiled on node A into a store, then restored on a fresh node B, where no Triton
   kernel may be compiled from source and no FX graph may miss, outputs equal eager's;
3. the goal rows (``bench_cold_start.py --strategies eager,regional``, fresh nodes), each row
   written as it finishes, with Triton kernels compiled and autotune benchmarks per row.

Everything goes into one JSON (``--json-out``), rewritten after every step and row, so a run
cut short still leaves what was measured. ``--deadline`` (seconds since the epoch) bounds it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    COUNTED_TORCH_NAMES,
    KernelCounters,
    fresh_node_env,
    machine,
    run_child,
    synchronize,
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SMOKE_MODES = ("default", "reduce-overhead")


# --------------------------------------------------------------------------------------------
# The smoke test's child: one process on one node


def _smoke_child(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    import torch

    import compile_cache
    from compile_cache.demo import TinyTransformer

    warnings.simplefilter("always")
    caught: list[str] = []
    show = warnings.showwarning
    warnings.showwarning = lambda message, *a, **k: caught.append(str(message))  # type: ignore[assignment]
    kernels = KernelCounters()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = TinyTransformer(layers=2, width=64, heads=2, vocab=128).eval().to(args.device, dtype)
    tokens = torch.randint(0, 128, (2, 16), device=args.device)
    with torch.no_grad():
        expected = model(tokens).float()
    kwargs = {} if args.mode == "default" else {"mode": args.mode}
    t0 = time.perf_counter()
    compile_cache.compile_regions(model, cache_dir=args.store, **kwargs)
    with torch.no_grad():
        first = model(tokens).float()
        synchronize(args.device)
        ttfo = time.perf_counter() - t0
        second = model(tokens).float()  # with CUDA graphs: a replay
        synchronize(args.device)
    compile_cache.session.flush(60)
    warnings.showwarning = show
    from torch._dynamo.utils import counters

    report = compile_cache.last_report()
    groups = {g["label"]: f"{g['status']}" + (f" ({g['reason']})" if g.get("reason") else "")
              for g in (report.precompile_groups.values() if report else ())}
    return {
        "mode": args.mode,
        "ttfo_s": ttfo,
        "max_diff": max(float((first - expected).abs().max()), float((second - expected).abs().max())),
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "cudagraph_counters": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k},
        **kernels.read(),
        "outcome": report.outcome if report else None,
        "restored_packs": report.restored_packs if report else None,
        "published_packs": report.published_packs if report else None,
        "precompile": groups,
        "warnings": [w for w in caught if "compile_cache" in w][:5],
    }


# --------------------------------------------------------------------------------------------
# The steps


class Check:
    """The JSON being built, rewritten after every change."""

    def __init__(self, path: str, deadline: float) -> None:
        self.path = path
        self.deadline = deadline
        self.started = time.time()
        self.data: dict[str, Any] = {"partial": True, "steps": {}}

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.time() - self.started, 1)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def step(self, name: str, value: Any) -> None:
        self.data["steps"][name] = value
        self.save()


def _pythonpath() -> str:
    """What a fresh node's process needs on its path to import what this one does: the repo
    (nothing installed) and the user site (a fresh HOME hides ~/.local)."""
    import site

    paths = [REPO]
    user_site = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if user_site and os.path.isdir(user_site):
        paths.append(user_site)
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(paths)


def _child_env(node: str) -> dict[str, str]:
    env = fresh_node_env(node)
    env["PYTHONPATH"] = _pythonpath()
    return env


def doctor_step(check: Check) -> bool:
    """``doctor --json``: every capability available (the private torch names compile_cache
    uses), plus the names the counters wrap."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "compile_cache", "doctor", "--json"],
                          capture_output=True, text=True, timeout=max(30, min(120, check.left())),
                          env=dict(os.environ, PYTHONPATH=_pythonpath()),
                          check=False)
    try:
        data = json.loads(done.stdout)
    except ValueError:
        check.step("doctor", {"ok": False, "error": done.stderr[-2000:]})
        return False
    missing = [c for c in data["capabilities"] if not c["available"]]
    import importlib

    absent = []
    for dotted in COUNTED_TORCH_NAMES:
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for name in parts[cut:]:
                    obj = getattr(obj, name)
            except AttributeError:
                absent.append(dotted)
            break
        else:
            absent.append(dotted)
    check.step("doctor", {
        "ok": not missing and not absent,
        "seconds": round(time.perf_counter() - started, 1),
        "capabilities_missing": missing,
        "counter_names_missing": absent,
        "capabilities": len(data["capabilities"]),
        "environment": data["environment"]["fields"],
        "not_carried": data.get("not_carried"),
        "problems": data.get("problems"),
        "fingerprint": data.get("fingerprint"),
    })
    return not missing


def smoke_step(check: Check, args: argparse.Namespace, tmp: str) -> bool:
    """A tiny region, compiled on node A, restored on fresh node B, per mode."""
    results: dict[str, Any] = {}
    ok = True
    for mode in SMOKE_MODES:
        store = os.path.join(tmp, f"smoke-store-{mode}")
        rows = {}
        for role in ("publisher", "fresh node"):
            node = os.path.join(tmp, f"smoke-{mode}-{role.replace(' ', '-')}")
            argv = [os.path.abspath(__file__), "--smoke-child", "--mode", mode, "--store", store,
                    "--device", args.device, "--dtype", args.dtype]
            try:
                rows[role] = run_child(argv, _child_env(node), timeout=max(30, min(240, check.left())))
            except Exception as exc:  # a child that failed or ran out of time: reported
                rows[role] = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
            shutil.rmtree(node, ignore_errors=True)
            results[mode] = rows
            check.step("smoke", results)
        fresh = rows.get("fresh node", {})
        tolerance = 5e-2 if args.dtype == "bfloat16" else 1e-3  # compiled vs eager, max |diff|
        verdict = ("error" not in fresh and fresh.get("triton_compiled") == 0
                   and fresh.get("fxgraph_miss") == 0 and fresh.get("max_diff", 1.0) < tolerance)
        rows["ok"] = verdict
        ok = ok and verdict
        check.step("smoke", results)
    return ok


def goal_step(check: Check, args: argparse.Namespace) -> str:
    """The goal rows: bench_cold_start.py eager,regional on fresh nodes, rows as they finish."""
    out = os.path.join(args.out_dir or os.path.dirname(check.path), "cold_start.json")
    if os.path.exists(out):
        os.unlink(out)
    limit = check.left() - 10
    if limit < 60:
        check.step("goal", {"status": f"not run: {limit:.0f} s left"})
        return "not run"
    argv = [sys.executable, os.path.join(HERE, "bench_cold_start.py"), "--arch", args.arch,
            "--models", args.model, "--device", args.device, "--dtype", args.dtype,
            "--seq", str(args.seq), "--strategies", "eager,regional", "--modes", "forward",
            "--repeats", "1", "--no-plain", "--goal-only", "--timeout", str(int(limit)), "--json-out", out]
    env = dict(os.environ, PYTHONPATH=_pythonpath())  # bench_cold_start's nodes inherit it
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    status = "completed"
    seen = 0
    while proc.poll() is None:
        time.sleep(2)
        seen = _copy_rows(check, out, seen)
        if check.left() < 5:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            status = "cut short by the time limit (rows so far kept)"
            break
    if status == "completed" and proc.returncode != 0:
        status = f"failed (exit {proc.returncode})"
    _copy_rows(check, out, -1)
    check.data["goal_status"] = status
    check.save()
    return status


def _copy_rows(check: Check, path: str, seen: int) -> int:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return seen
    rows = data.get("rows", [])
    if len(rows) != seen:
        keep = ("model", "strategy", "scenario", "ttfo_s", "process_s", "fxgraph_miss", "fxgraph_hit",
                "frames_traced", "triton_compiled", "triton_restored", "autotune_benchmarks",
                "select_algorithm_autotune", "coordesc_tuning_bench", "precompile", "counting_missing")
        check.step("goal", {"machine": data.get("machine"), "ratios": data.get("ratios"),
                            "rows": [{k: r[k] for k in keep if k in r} for r in rows]})
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--model", default="16x2048")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json-out", default="gpu_check.json")
    parser.add_argument("--out-dir", default=None, help="where cold_start.json goes (default: "
                        "next to --json-out)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds since the epoch")
    parser.add_argument("--build", default="", help="how the extension was built (for the JSON)")
    args = parser.parse_args(argv)
    if args.smoke_child:
        print(json.dumps(_smoke_child(args)))
        return 0
    check = Check(os.path.abspath(args.json_out), args.deadline or time.time() + 480)
    import torch

    check.data.update({
        "machine": machine(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": args.device, "dtype": args.dtype, "model": f"{args.arch} {args.model} x{args.seq}",
        "python": sys.version.split()[0], "build": args.build,
    })
    check.save()
    names_ok = doctor_step(check)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        smoke_ok = smoke_step(check, args, tmp)
    goal = goal_step(check, args)
    check.data.update(partial=False, names_ok=names_ok, smoke_ok=smoke_ok,
                      ok=names_ok and smoke_ok and goal == "completed")
    check.save()
    print(json.dumps({"names_ok": names_ok, "smoke_ok": smoke_ok, "goal": goal,
                      "elapsed_s": check.data["elapsed_s"]}))
    return 0 if check.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
