"""Fingerprint speed: the native backend against the pure-Python reference on real model shapes.

Models are built on the meta device (no weights are allocated): GPT-2 small (transformers'
default gpt2 config) and the Llama-3-70B shape, optionally at several depths (``--layers``) to
show how time grows with model size. Each measurement is the median of ``--repeats`` runs after
warm-up. ``python`` and ``native`` call the backends directly (``compile_cache._reference`` and
``compile_cache._C``); ``api`` is the public ``compile_cache.fingerprint_tree``, which adds
building the ``Fingerprint`` objects on top of the backend chosen at import.

    python benchmarks/bench_fingerprint.py [--layers 8 20 40 80] [--repeats 20] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import compile_cache
from compile_cache import _reference

LLAMA_70B = dict(
    hidden_size=8192,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
)


def build(kind: str, layers: int | None = None) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "gpt2-small":
        config = transformers.AutoConfig.for_model("gpt2")
    else:
        config = transformers.AutoConfig.for_model("llama", num_hidden_layers=layers, **LLAMA_70B)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config)


def timings_ms(call: Callable[[], object], repeats: int, warmup: int = 3) -> tuple[float, float]:
    """(median, minimum) of `repeats` timed calls, in milliseconds."""
    for _ in range(warmup):
        call()
    # The garbage collector stays on (the young-generation collections that a call's allocations
    # trigger are part of its cost), but the heap that exists before timing (torch,
    # transformers, the model) is frozen: otherwise an occasional full collection walks it in
    # the middle of some run, and medians jump by milliseconds from run to run.
    gc.collect()
    gc.freeze()
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            call()
            times.append(time.perf_counter_ns() - start)
    finally:
        gc.unfreeze()
    return statistics.median(times) / 1e6, min(times) / 1e6


def measure(name: str, model: nn.Module, repeats: int, native) -> dict[str, object]:  # noqa: ANN001
    tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    expected = _reference.fingerprint_tree(model, True)
    if native.fingerprint_tree(model, True) != expected:
        raise SystemExit(f"{name}: native and python digests differ")
    python_ms, python_min = timings_ms(lambda: _reference.fingerprint_tree(model, True), repeats)
    native_ms, native_min = timings_ms(lambda: native.fingerprint_tree(model, True), repeats)
    api_ms, api_min = timings_ms(lambda: compile_cache.fingerprint_tree(model), repeats)
    return {
        "model": name,
        "modules": len(expected),
        "tensors": tensors,
        "python_ms": round(python_ms, 4),
        "native_ms": round(native_ms, 4),
        "api_ms": round(api_ms, 4),
        "python_us_per_tensor": round(1000 * python_ms / tensors, 3),
        "native_us_per_tensor": round(1000 * native_ms / tensors, 3),
        "speedup": round(python_ms / native_ms, 1),
        "python_min_ms": round(python_min, 4),  # the minimum is steadier on a busy machine
        "native_min_ms": round(native_min, 4),
        "api_min_ms": round(api_min, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[80],
                        help="depths of the Llama-3-70B shape to measure (default: 80)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per median")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    try:
        from compile_cache import _C as native
    except ImportError as exc:
        raise SystemExit(f"the native backend is not built ({exc}); run "
                         "`pip install --no-build-isolation -e .`") from exc

    rows = [measure("gpt2-small", build("gpt2-small"), args.repeats, native)]
    for layers in args.layers:
        model = build("llama", layers)
        rows.append(measure(f"llama3-70b-shape/{layers}L", model, args.repeats, native))
        del model
        gc.collect()

    result = {
        "benchmark": "fingerprint",
        "api_backend": compile_cache.backend,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    header = (f"{'model':<24} {'modules':>7} {'tensors':>7} {'python ms':>10} {'native ms':>10} "
              f"{'api ms':>8} {'py us/t':>8} {'nat us/t':>8} {'speedup':>8}")
    print(f"fingerprint_tree(attributes=True), median of {args.repeats}, "
          f"api backend: {compile_cache.backend}")
    print(header)
    for row in rows:
        print(f"{row['model']:<24} {row['modules']:>7} {row['tensors']:>7} "
              f"{row['python_ms']:>10.3f} {row['native_ms']:>10.3f} {row['api_ms']:>8.3f} "
              f"{row['python_us_per_tensor']:>8.2f} {row['native_us_per_tensor']:>8.2f} "
              f"{row['speedup']:>7.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
