#!/usr/bin/env bash
# GPU check for compile_cache: one 15-minute run on a borrowed machine with an NVIDIA GPU, torch already
# installed (2.11 there), no network, maybe only `python3`, and the repo's working tree copied in
# (nothing installed). At most 8 minutes (BUDGET_S, default 480) in all:
#
#   1. environment, and the extension built in place (`setup.py build_ext --inplace`: ninja if
#      present, else setuptools' own build; at most BUILD_TIMEOUT_S) or, failing that, the
#      pure-Python fingerprint backend (same digests, slower); the package imports from the tree
#      (PYTHONPATH=repo root), so neither pip nor network is needed;
#   2. `doctor`: every private torch name compile_cache uses (its capabilities) and the ones
#      the counters wrap must exist in the installed torch;
#   3. a CUDA smoke test, mode="default" and mode="reduce-overhead": one tiny model's regions
#      compiled on node A into a store, restored on a fresh node B: 0 Triton kernels compiled,
#      0 FX-graph misses, outputs equal to eager's;
#   4. the goal rows (bench_cold_start.py --strategies eager,regional --goal-only: eager, cold,
#      torch warm, cc publish, cc node; Llama-3.2-1B shape, every node fresh), each row written
#      as it finishes, with Triton kernels compiled from source and autotune benchmarks per row.
#
#   bash benchmarks/gpu_check.sh                       # from anywhere; writes under $OUT
#   DEVICE=cpu bash benchmarks/gpu_check.sh            # dry run without a GPU (tiny model)
#
# Outputs under OUT (default benchmarks/results/gpu): gpu_check.json (rewritten after every step
# and row: "partial": true until the end), cold_start.json (the goal rows), gpu_check.log.
# Knobs: PYTHON, OUT, BUDGET_S, BUILD_TIMEOUT_S (default 150), SKIP_BUILD=1, MODEL (default
# 16x2048 on cuda, 2x128 on cpu), SEQ (128 / 16), DTYPE (bfloat16 / float32), ARCH (llama),
# JSON (the JSON's path, default $OUT/gpu_check.json).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd)"
export DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
JSON="${JSON:-$OUT/gpu_check.json}"
if [[ -z "${PYTHON:-}" ]]; then
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
BUDGET_S="${BUDGET_S:-480}"
BUILD_TIMEOUT_S="${BUILD_TIMEOUT_S:-150}"
if [[ "$DEVICE" == cuda* ]]; then
    MODEL="${MODEL:-16x2048}"; SEQ="${SEQ:-128}"; DTYPE="${DTYPE:-bfloat16}"
else
    MODEL="${MODEL:-2x128}"; SEQ="${SEQ:-16}"; DTYPE="${DTYPE:-float32}"
fi
ARCH="${ARCH:-llama}"
DEADLINE=$(( $(date +%s) + BUDGET_S - 15 ))  # the summary's few seconds inside the budget
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec > >(tee "$OUT/gpu_check.log") 2>&1

START=$SECONDS
step() { echo; echo "=== [$((SECONDS - START)) s] $*"; }

step "environment"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || echo "(nvidia-smi not found)"
if ! "$PYTHON" - <<'EOF'
import importlib, os, sys
needed = ("torch", "transformers", "filelock")
missing = []
for name in needed + ("xxhash", "ninja", "setuptools", "pytest", "accelerate"):
    try:
        module = importlib.import_module(name)
        print(f"  {name:<13} {getattr(module, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        print(f"  {name:<13} MISSING ({type(exc).__name__})")
        missing += [name] if name in needed else []
import torch
print(f"  python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"  GPU 0: {torch.cuda.get_device_name(0)}")
if missing:
    sys.exit(f"gpu_check: missing {', '.join(missing)}; there is no network here")
if os.environ["DEVICE"].startswith("cuda") and not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
EOF
then
    echo "gpu_check: FAILED (environment)"; exit 1
fi

BUILD="skipped"
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
    step "build the extension in place (at most ${BUILD_TIMEOUT_S} s)"
    rm -f compile_cache/_C*.so  # one built against another torch would not load
    if timeout --kill-after=5 "$BUILD_TIMEOUT_S" "$PYTHON" setup.py -q build_ext --inplace \
        >"$OUT/build.log" 2>&1; then
        BUILD="built in place"
    else
        BUILD="build failed (log: build.log): pure-Python fingerprint backend"
        tail -15 "$OUT/build.log"
    fi
    rm -rf build
    echo "  $BUILD"
fi
"$PYTHON" -c "import compile_cache; print('  compile_cache from', compile_cache.__file__, '| fingerprint backend:', compile_cache.backend)" 2>&1 | tail -1

step "doctor, smoke test (default, reduce-overhead), goal rows ($ARCH $MODEL, $DEVICE, $DTYPE, x$SEQ)"
"$PYTHON" benchmarks/gpu_check.py --device "$DEVICE" --dtype "$DTYPE" --arch "$ARCH" \
    --model "$MODEL" --seq "$SEQ" --json-out "$JSON" --out-dir "$OUT" --deadline "$DEADLINE" --build "$BUILD"
STATUS=$?

step "summary"
"$PYTHON" - "$JSON" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
steps = data["steps"]
doctor = steps.get("doctor", {})
print(f"{data.get('machine')}\ntorch {data.get('torch')}, build: {data.get('build')}")
print(f"doctor: capabilities missing {[c['name'] for c in doctor.get('capabilities_missing', [])]}, "
      f"counter names missing {doctor.get('counter_names_missing')}")
for mode, rows in steps.get("smoke", {}).items():
    for role in ("publisher", "fresh node"):
        r = rows.get(role, {})
        if "error" in r:
            print(f"smoke {mode:<16} {role:<10} ERROR {r['error'][:300]}")
            continue
        print(f"smoke {mode:<16} {role:<10} ttfo {r.get('ttfo_s', 0):6.2f} s  fx miss/hit "
              f"{r.get('fxgraph_miss')}/{r.get('fxgraph_hit')}  triton compiled "
              f"{r.get('triton_compiled')} restored {r.get('triton_restored')}  autotune benchmarks "
              f"{r.get('autotune_benchmarks')}  diff {r.get('max_diff', 0):.1e}  {r.get('outcome')}")
    print(f"smoke {mode}: {'OK' if rows.get('ok') else 'FAILED'}")
goal = steps.get("goal", {})
for r in goal.get("rows", []):
    print(f"goal  {r['strategy']:<9} {r['scenario']:<16} ttfo {r['ttfo_s']:6.2f} s  process "
          f"{r['process_s']:6.2f} s  fx miss/hit {r.get('fxgraph_miss')}/{r.get('fxgraph_hit')}  "
          f"triton compiled {r.get('triton_compiled')}  autotune benchmarks {r.get('autotune_benchmarks')}")
pick = {(r["strategy"], r["scenario"]): r["ttfo_s"] for r in goal.get("rows", [])}
node, warm = pick.get(("regional", "cc node")), pick.get(("regional", "torch warm"))
eager = pick.get(("eager", "first call"))
if node is not None and warm:  # issue 34's goals
    print(f"GOAL cc node <= 0.35x torch warm (regional): {node:.2f} / {warm:.2f} = {node / warm:.2f}x")
if node is not None and eager:
    print(f"GOAL cc node <= 2x eager's first call: {node:.2f} / {eager:.2f} = {node / eager:.2f}x")
print(f"goal rows: {data.get('goal_status')}; total {data.get('elapsed_s')} s; ok: {data.get('ok')}")
EOF
echo "outputs: $OUT"
echo "total:   $((SECONDS - START)) s"
if [[ $STATUS -ne 0 ]]; then echo "gpu_check: FAILED"; exit 1; fi
echo "gpu_check: OK"
