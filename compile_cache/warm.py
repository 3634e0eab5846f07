"""Ahead-of-time compile: run a model over a grid of input shapes so the store holds its code.

``warm(model, [inputs_a, inputs_b, ...], cache_dir=...)`` compiles ``model`` with
:func:`compile_cache.compile_regions` (restoring whatever the store already has), then runs one
forward (and, with ``train=True``, one backward) per example input. Whatever those calls compile
is published to the store, so the training job that follows on any node restores it instead of
compiling. The CLI's ``compile-cache warm`` is a thin layer over this module.

Each example input is a tensor (one positional argument), a tuple (positional arguments) or a dict
(keyword arguments). A *list* of them is the grid of shapes. This module logs; it never prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .cache import CacheReport, last_report
from .errors import ConfigError
from .regions import compile_regions

logger = logging.getLogger("compile_cache")

__all__ = ["WarmResult", "describe_inputs", "warm"]


@dataclasses.dataclass
class WarmResult:
    """What warming one input shape did.

    ``status``: ``"hit"`` (nothing compiled; code came from the store or the local cache),
    ``"compiled"`` (Inductor compiled at least one graph for this shape), or ``"none"`` (nothing
    went through Inductor's cache at all: a non-Inductor backend such as ``eager``, or code this
    process had already compiled). ``seconds`` is the wall time of this shape's forward (and
    backward); the first shape's also includes ``compile_regions`` (the store restore), so it is
    the time to first output. The counters are this shape's share of :func:`last_report`.
    """

    shape: str
    status: str
    seconds: float
    fxgraph_hits: int = 0
    fxgraph_misses: int = 0
    published_packs: int = 0
    published_bytes: int = 0
    restored_packs: int = 0
    restored_bytes: int = 0
    key: str | None = None
    errors: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``warm --json``)."""
        return dataclasses.asdict(self)


def _shape_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "x".join(str(s) for s in value.shape) or "scalar"
    return type(value).__name__


def describe_inputs(inputs: Any) -> str:
    """A short label for one example input: ``"1x64"``, ``"1x64, 8"``, ``"input_ids=2x128"``."""
    if isinstance(inputs, dict):
        parts = [f"{k}={_shape_of(v)}" for k, v in inputs.items() if isinstance(v, torch.Tensor)]
        return ", ".join(parts) or "no tensors"
    if isinstance(inputs, (tuple, list)):
        return ", ".join(_shape_of(v) for v in inputs) or "no inputs"
    return _shape_of(inputs)


def _check_inputs(inputs: Any) -> None:
    if isinstance(inputs, (torch.Tensor, tuple, dict)):
        return
    raise ConfigError(
        "an example input must be a tensor, a tuple of positional arguments or a dict of "
        f"keyword arguments, got {type(inputs).__name__}"
    )


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    logits = getattr(value, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _loss(output: Any) -> torch.Tensor:
    """A scalar to backpropagate: ``logits.float().mean()`` for model outputs, else ``sum()``."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits.float().mean()
    tensor = _first_tensor(output)
    if tensor is None or not tensor.requires_grad:
        raise ConfigError("--train: the model's output has no tensor that requires grad")
    return tensor.float().sum()


def _progress(items: Sequence[Any], enabled: bool) -> Iterator[tuple[Any, Callable[[str], None]]]:
    """Iterate ``items`` under a tqdm bar on stderr (if enabled and tqdm is installed)."""
    bar = None
    if enabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(items), file=sys.stderr, unit="shape", desc="warming")
        except ImportError:
            bar = None
    try:
        for item in items:
            def note(text: str) -> None:
                if bar is not None:
                    bar.set_postfix_str(text, refresh=True)

            yield item, note
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _status(misses: int, hits: int, restored: int) -> str:
    if misses:
        return "compiled"
    if hits or restored:
        return "hit"
    return "none"


def warm(
    model: nn.Module,
    example_inputs_list: Sequence[Any],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    train: bool = False,
    precompile: bool | None = None,
    progress: bool = False,
    **compile_kwargs: Any,
) -> list[WarmResult]:
    """Compile ``model`` for every example input in ``example_inputs_list``; publish to the store.

    ``model`` is compiled in place with :func:`compile_regions` (``cache_dir``, ``precompile`` and
    ``compile_kwargs`` such as ``backend``, ``mode``, ``dynamic``, ``fullgraph`` go to it: use the
    same ones as the job you warm for, they are part of the cache key). Inference runs under
    ``torch.no_grad()`` with ``model.eval()``; ``train=True`` uses ``model.train()`` and runs a
    backward too, so the backward graphs are cached as well. ``progress=True`` shows a tqdm bar
    on stderr. Returns one :class:`WarmResult` per input, in order.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"warm needs a torch.nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs_list, (torch.Tensor, dict, tuple)):
        raise ConfigError("example_inputs_list must be a list of example inputs, one per shape")
    inputs_list = list(example_inputs_list)
    if not inputs_list:
        raise ConfigError("warm needs at least one example input")
    for inputs in inputs_list:
        _check_inputs(inputs)

    model.train(train)
    before = last_report()
    start = time.perf_counter()
    compile_regions(model, cache_dir=cache_dir, precompile=precompile, **compile_kwargs)
    setup_seconds = time.perf_counter() - start
    report: CacheReport | None = last_report()
    if report is before:
        report = None  # no store this time (unusable, or cache_dir=False): nothing to count
    if report is not None:
        logger.info("compile_cache warm: %s", report.summary())

    results: list[WarmResult] = []
    seen = _snapshot(report)
    seen_errors = 0
    restored = (report.restored_packs, report.restored_bytes) if report else (0, 0)
    for index, (inputs, note) in enumerate(_progress(inputs_list, progress)):
        label = describe_inputs(inputs)
        note(label)
        t0 = time.perf_counter()
        _run_once(model, inputs, train)
        seconds = time.perf_counter() - t0 + (setup_seconds if index == 0 else 0.0)
        now = _snapshot(report)
        delta = [a - b for a, b in zip(now, seen, strict=True)]
        seen = now
        errors = list(report.errors[seen_errors:]) if report else []
        seen_errors += len(errors)
        result = WarmResult(
            shape=label,
            status=_status(delta[1], delta[0], restored[0] if index == 0 else 0),
            seconds=seconds,
            fxgraph_hits=delta[0],
            fxgraph_misses=delta[1],
            published_packs=delta[2],
            published_bytes=delta[3],
            restored_packs=restored[0] if index == 0 else 0,
            restored_bytes=restored[1] if index == 0 else 0,
            key=report.key if report else None,
            errors=errors,
        )
        logger.info("compile_cache warm: %s %s in %.2f s", label, result.status, seconds)
        results.append(result)
    return results


def _snapshot(report: CacheReport | None) -> tuple[int, int, int, int]:
    if report is None:
        return (0, 0, 0, 0)
    return (report.fxgraph_hits, report.fxgraph_misses, report.published_packs,
            report.published_bytes)


def _run_once(model: nn.Module, inputs: Any, train: bool) -> None:
    """One forward (inference), or forward + backward and a flush forward (training).

    The session publishes what was compiled when a forward ends; a backward is compiled lazily,
    after that, so in training one more forward at the same shape (no new compile) publishes it.
    """
    if not train:
        with torch.no_grad():
            _call(model, inputs)
        return
    _loss(_call(model, inputs)).backward()
    with contextlib.suppress(Exception):
        model.zero_grad(set_to_none=True)
    _call(model, inputs)
    model.zero_grad(set_to_none=True)
