"""The demo's cold and cached start on fresh nodes under the torch of the running interpreter,
with precompile on, then which capabilities ``doctor`` finds missing: one row of the "Supported
torch releases" table of RESULTS.md. Run it once per venv of the support window, e.g.

    .venv-latest/bin/python benchmarks/bench_torch_versions.py --json

Each start is a fresh node (new TMPDIR, HOME, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR) running ``python -m compile_cache warm compile_cache.demo:demo_model``; the
first publishes into an empty store, the second restores it. ``first_output_s`` is warm's time to
the first output, ``process_s`` the whole process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _run(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "compile_cache", *args], env=env,
                          capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False)
    return done, time.perf_counter() - start


def _fresh_node(work: str) -> dict[str, str]:
    node = tempfile.mkdtemp(dir=work)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(node, "inductor"),
               TRITON_CACHE_DIR=os.path.join(node, "triton"), COMPILE_CACHE_PRECOMPILE="1",
               PYTHONSAFEPATH="1")
    for name, sub in (("TMPDIR", "tmp"), ("HOME", "home"), ("XDG_CACHE_HOME", "xdg")):
        env[name] = os.path.join(node, sub)
        os.makedirs(env[name])
    return env


def measure() -> dict:
    import torch

    out: dict = {"torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="cc_torch_versions_") as work:
        store = os.path.join(work, "store")
        for label in ("cold", "cached"):
            done, wall = _run(["warm", "compile_cache.demo:demo_model", "--cache-dir", store,
                               "--json"], _fresh_node(work))
            if done.returncode:
                raise SystemExit(f"{label} start failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            warm = json.loads(done.stdout)
            out[label] = {"process_s": round(wall, 2),
                          "first_output_s": round(warm["first_output_seconds"], 2),
                          "outcome": warm["outcome"], "fx_misses": warm["fxgraph_misses"],
                          "fx_hits": warm["fxgraph_hits"], "precompile_hits": warm["precompile_hits"],
                          "restored_packs": warm["restored_packs"]}
        done, _ = _run(["doctor", "--json"], dict(os.environ, PYTHONSAFEPATH="1"))
        doctor = json.loads(done.stdout)
        out["missing_capabilities"] = [c["name"] for c in doctor["capabilities"] if not c["available"]]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = measure()
    print(json.dumps(result, indent=1) if args.json else result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
