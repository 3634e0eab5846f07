"""What the per-call checks of a precompiled region cost: the pins, and the hook watch.

A precompiled region compares the globals its code relies on without a guard (its *pins*:
functions, classes and enum members reached through globals) by identity at every call
(``compile_cache.torch_compat.precompile.pins.Pins.changed``), and every region call looks at
torch's hook counter before it runs (``compile_cache.regions``, hooks added after compiling).
This times both on GPT-2 from transformers (random weights), compiled with Inductor and
precompile on a fresh node of its own (new TMPDIR, HOME, XDG_CACHE_HOME and local dirs), and the
whole region call against the group's compiled function called directly.

    python benchmarks/bench_region_call.py                  # GPT-2 4 x 256, seq 128
    python benchmarks/bench_region_call.py --layers 2 --width 64 --seq 16   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _best_us(stmt, number: int, repeat: int = 7) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * 1e6


def _child(args: argparse.Namespace) -> dict:
    import torch
    from torch.utils.hooks import RemovableHandle
    from transformers import AutoConfig, AutoModelForCausalLM

    import compile_cache

    config = AutoConfig.for_model("gpt2", n_layer=args.layers, n_embd=args.width,
                                  n_head=max(1, args.width // 64), vocab_size=1000, n_positions=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 1000, (1, args.seq))
    compile_cache.compile_regions(model, cache_dir=os.path.join(os.environ["TMPDIR"], "store"),
                                  precompile=True)
    with torch.no_grad():
        model(ids, use_cache=False)
        block = model.transformer.h[0]
        runner = block._compiled_call_impl
        pf = runner.state.pf
        pins_us = _best_us(pf.pins.changed, number=20000)
        hook_id = RemovableHandle.next_id
        hook_check_us = _best_us(lambda: RemovableHandle.next_id != hook_id, number=200000)
        hidden = torch.randn(1, args.seq, args.width)
        region_call_ms = statistics.median(
            timeit.repeat(lambda: block(hidden), number=20, repeat=7)) / 20 * 1e3
        direct_ms = statistics.median(
            timeit.repeat(lambda: runner.compiled(hidden), number=20, repeat=7)) / 20 * 1e3
    compile_cache.session.flush(60)
    return {"pins": len(pf.pins), "pins_check_us": round(pins_us, 3),
            "hook_counter_check_us": round(hook_check_us, 3),
            "block_region_call_ms": round(region_call_ms, 4),
            "block_compiled_direct_ms": round(direct_ms, 4),
            "groups": {k: g["status"] for k, g in compile_cache.last_report().precompile_groups.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_region_call_") as node:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILE_CACHE_", "TORCH_"))}
        for name in ("TMPDIR", "HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            env[name] = os.path.join(node, name.lower())
            os.makedirs(env[name])
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                               "--layers", str(args.layers), "--width", str(args.width),
                               "--seq", str(args.seq)], env=env, capture_output=True, text=True,
                              timeout=1800, check=False)
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
        return 1
    result = next(json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT "))
    print(json.dumps({"model": f"gpt2 {args.layers}x{args.width}", "seq": args.seq, **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
