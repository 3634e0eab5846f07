"""``warm``: compile a model into the store ahead of a job, over a grid of input shapes.

The model comes from a factory (``package.module:factory`` or ``path/to/file.py:factory``) or
from a transformers config (``--hf NAME``, random weights, never a download); the grid from the
factory, or ``--batch-size``/``--seq-len``. The work itself is :func:`compile_cache.api.warm`.
Torch is imported when the command runs, not when the CLI starts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._sizes import format_size
from ..errors import CompileCacheError
from .output import PROG, UsageError, is_tty, print_json, table

__all__ = ["cmd_warm"]


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: expected key=value, e.g. n_layer=2")
        out[key.strip()] = _parse_value(value)
    return out


def _int_list(values: Sequence[str] | None, flag: str) -> list[int] | None:
    if not values:
        return None
    out = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                number = int(part)
            except ValueError:
                raise UsageError(f"{flag} {value!r}: expected whole numbers, e.g. 1,4,8") from None
            if number <= 0:
                raise UsageError(f"{flag} {number}: must be positive")
            out.append(number)
    return out or None


def _load_target(target: str) -> Any:
    """The factory named by ``package.module:factory`` or ``path/to/file.py:factory``."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"TARGET {target!r}: expected package.module:factory or path/to/file.py:factory")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            # Imported under its own name with its directory on sys.path, as `import stem` in a
            # job would: the class's module name is part of the fingerprint, hence of the key.
            path = Path(module_name).resolve()
            if not path.is_file():
                raise UsageError(f"TARGET {target!r}: no such file {module_name}")
            sys.path.insert(0, str(path.parent))
            module = importlib.import_module(path.stem)
            origin = getattr(module, "__file__", None)
            if origin is None or Path(origin).resolve() != path:
                raise UsageError(
                    f"TARGET {target!r}: the name {path.stem!r} is already taken by {origin or 'a built-in module'}; "
                    "rename the file or use package.module:factory"
                )
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:  # the console script's case
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except Exception as exc:  # ImportError, SyntaxError, or an error the module raised on import
        raise UsageError(f"TARGET {target!r} does not import: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UsageError(f"TARGET {target!r}: module {module_name} has no attribute {attr!r}")
    if not callable(factory):
        raise UsageError(f"TARGET {target!r}: {attr} is not callable")
    return factory


def _unpack_factory_result(result: Any, target: str) -> tuple[Any, list[Any] | None]:
    from torch import nn

    if isinstance(result, nn.Module):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        model, inputs = result
        return model, list(inputs) if isinstance(inputs, list) else [inputs]
    raise UsageError(
        f"TARGET {target!r} returned {type(result).__name__}; expected a torch.nn.Module, "
        "(model, example_inputs) or (model, [example_inputs, ...])"
    )


def _build_hf(name: str, overrides: dict[str, Any]) -> Any:
    """A random-weight causal LM from its config: never downloads anything."""
    import torch

    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise UsageError(f"--hf needs transformers: {exc}") from None
    try:
        config = AutoConfig.for_model(name, **overrides)
    except (ValueError, KeyError) as exc:
        raise UsageError(f"--hf {name!r}: unknown model type ({str(exc).splitlines()[0]})") from None
    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        raise UsageError(f"--hf {name!r}: cannot build a causal LM ({str(exc).splitlines()[0]})") from None


def _token_grid(model: Any, batch_sizes: list[int] | None, seq_lens: list[int] | None) -> list[Any]:
    """Random ``input_ids`` for every (batch, seq) pair; ``use_cache=False`` for causal LMs."""
    import torch

    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise UsageError(
            "the model needs example inputs: make the TARGET factory return (model, example_inputs)"
        )
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq_lens = seq_lens or [min(128, max_pos) if isinstance(max_pos, int) else 128]
    if isinstance(max_pos, int) and max(seq_lens) > max_pos:
        raise UsageError(f"--seq-len {max(seq_lens)}: longer than the model's {max_pos} positions")
    generator = torch.Generator().manual_seed(0)
    grid = []
    for b in batch_sizes or [1]:
        for s in seq_lens:
            inputs: dict[str, Any] = {"input_ids": torch.randint(0, vocab, (b, s), generator=generator)}
            if hasattr(config, "use_cache"):
                inputs["use_cache"] = False
            grid.append(inputs)
    return grid


def _parse_dtype(name: str | None) -> Any:
    import torch

    if name is None:
        return None
    value = getattr(torch, name.strip().removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise UsageError(f"--dtype {name!r}: not a torch dtype (e.g. float32, bfloat16, float16)")
    return value


def _parse_device(name: str | None) -> Any:
    import torch

    if name is None:
        return None
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name!r}: {exc}") from None


def _move(value: Any, device: Any, dtype: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value.to(device) if device is not None else value
    if isinstance(value, tuple):
        return tuple(_move(v, device, dtype) for v in value)
    if isinstance(value, list):
        return [_move(v, device, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _move(v, device, dtype) for k, v in value.items()}
    return value


def cmd_warm(args: argparse.Namespace) -> int:
    """Compile a model into the store ahead of a job, over a grid of input shapes."""
    if bool(args.target) == bool(args.hf):
        raise UsageError("give a TARGET (package.module:factory or file.py:factory) or --hf NAME, not both"
                         if args.target else "give a TARGET (package.module:factory) or --hf NAME")
    overrides = _parse_overrides(args.set or [])
    if overrides and not args.hf:
        raise UsageError("--set only applies to --hf models")
    batch_sizes = _int_list(args.batch_size, "--batch-size")
    seq_lens = _int_list(args.seq_len, "--seq-len")
    dtype = _parse_dtype(args.dtype)
    device = _parse_device(args.device)
    if args.cache_dir is not None:
        path = Path(args.cache_dir).expanduser()
        if os.path.lexists(path) and not path.is_dir():
            raise UsageError(f"--cache-dir {args.cache_dir}: exists and is not a directory")

    if args.hf:
        model, inputs = _build_hf(args.hf, overrides), None
    else:
        factory = _load_target(args.target)
        model, inputs = _unpack_factory_result(factory(), args.target)
    if inputs is None:
        inputs = _token_grid(model, batch_sizes, seq_lens)
    elif batch_sizes or seq_lens:
        raise UsageError("--batch-size/--seq-len apply to --hf or to factories that return a model alone")
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
        inputs = [_move(x, device, dtype) for x in inputs]

    compile_kwargs: dict[str, Any] = {}
    if args.mode is not None:
        compile_kwargs["mode"] = args.mode
    if args.backend is not None:
        compile_kwargs["backend"] = args.backend
    if args.dynamic is not None:
        compile_kwargs["dynamic"] = args.dynamic
    if args.fullgraph:
        compile_kwargs["fullgraph"] = True

    from ..api import warm
    from ..session import last_report

    progress = not args.json and is_tty(sys.stderr)
    start = time.perf_counter()
    results = warm(model, inputs, cache_dir=args.cache_dir, train=args.train,
                   precompile=True if args.precompile else None, progress=progress, **compile_kwargs)
    seconds = time.perf_counter() - start
    report = last_report()
    key = results[0].key if results else None
    if report is not None and report.key != key:
        report = None
    problems = list(report.errors) if report else ["no store was used (see the warning above)"]
    compiled = sum(r.status == "compiled" for r in results)
    published = sum(r.published_bytes for r in results)
    if report is not None and compiled and not published:
        from ..store import Store

        with contextlib.suppress(CompileCacheError, OSError):
            store = Store(report.store)
            if store.read_only:
                problems.append(f"the store is read-only ({store.read_only_reason}): compiled code was not saved")
    summary = {
        "key": key,
        "store": report.store if report else None,
        "results": [r.to_dict() for r in results],
        "seconds": seconds,
        "first_output_seconds": results[0].seconds if results else 0.0,
        "compiled": compiled,
        "fxgraph_hits": sum(r.fxgraph_hits for r in results),
        "fxgraph_misses": sum(r.fxgraph_misses for r in results),
        "restored_packs": report.restored_packs if report else 0,
        "published_packs": sum(r.published_packs for r in results),
        "published_bytes": published,
        "hit": bool(report and report.hit),
        "errors": problems,
        "ok": not problems,
    }
    if args.json:
        print_json(summary)
    else:
        rows = [
            (r.shape, r.status, f"{r.seconds:.2f}", format_size(r.published_bytes) if r.published_bytes else "-")
            for r in results
        ]
        print(table(("SHAPE", "RESULT", "SECONDS", "PUBLISHED"), rows, right={2, 3}))
        restored = f"restored {report.restored_packs} pack(s)" if report and report.restored_packs else "nothing restored"
        print(f"\nkey {str(key)[:12]}: {restored}, {compiled} of {len(results)} shape(s) compiled, "
              f"{format_size(published)} published, {seconds:.1f} s in all")
        if report:
            print(f"store: {report.store}")
    if problems:
        for p in problems:
            print(f"{PROG} warm: not everything is in the store: {p}", file=sys.stderr)
        return 1
    return 0


