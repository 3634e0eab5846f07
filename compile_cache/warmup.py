"""One runner of example inputs: how ``warm``, ``warm_up`` and the CLI call a model ahead of time.

An example input is a tuple or list (positional arguments), a dict (keyword arguments) or one
tensor. :func:`run` calls the model once with it, as the job will: under ``torch.no_grad()`` for
inference, forward and backward for training, inside :func:`preserved` so that the model's
training flags, gradients, buffers (BatchNorm statistics) and the RNG state are left as they were.

**The loss rule** (:func:`loss_of`), one for every caller: the output's ``logits`` if it has them
(a transformers model output: what a language-model loss backpropagates from), else every
floating tensor in the output that requires grad; each is cast to float and summed. The scale
does not matter (the gradients are thrown away); what matters is that the backward graphs torch
compiles are the ones a real loss would reach. No such tensor: no backward (``None``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .errors import ConfigError
from .torch_compat.dynamo import CompileCounters

__all__ = [
    "RunResult",
    "call",
    "check_inputs",
    "describe_inputs",
    "loss_of",
    "output_tensors",
    "preserved",
    "run",
    "signature",
]


def call(model: nn.Module, inputs: Any) -> Any:
    """``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a dict, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def output_tensors(value: Any, out: list[torch.Tensor] | None = None, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in a (nested) output: tensors, mappings, sequences, ``ModelOutput``s."""
    out = [] if out is None else out
    if depth > 8:
        return out
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            output_tensors(v, out, depth + 1)
    elif isinstance(value, (tuple, list)):
        for v in value:
            output_tensors(v, out, depth + 1)
    elif hasattr(value, "to_tuple"):
        output_tensors(value.to_tuple(), out, depth + 1)
    return out


def loss_of(output: Any) -> torch.Tensor | None:
    """The scalar to backpropagate from ``output`` (the loss rule in the module doc), or None."""
    logits = getattr(output, "logits", None)
    candidates = [logits] if isinstance(logits, torch.Tensor) else output_tensors(output)
    parts = [t.float().sum() for t in candidates if t.requires_grad and t.is_floating_point()]
    if not parts:
        return None
    return torch.stack(parts).sum()


def signature(example_inputs: Any, train: bool) -> str:
    """A digest of what a warm-up compiles for: train flag, grad mode and input metadata."""

    def describe(value: Any, depth: int = 0) -> Any:
        if depth > 8:
            return "..."
        if isinstance(value, torch.Tensor):
            return ["T", list(value.shape), str(value.dtype), value.device.type, value.requires_grad]
        if isinstance(value, Mapping):
            return {str(k): describe(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
        if isinstance(value, (tuple, list)):
            return [describe(v, depth + 1) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return type(value).__qualname__

    blob = json.dumps({"train": bool(train), "inputs": describe(example_inputs)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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


def check_inputs(inputs: Any) -> None:
    """ConfigError unless ``inputs`` is a tensor, a tuple or a dict (one shape of a grid)."""
    if isinstance(inputs, (torch.Tensor, tuple, dict)):
        return
    raise ConfigError(
        "an example input must be a tensor, a tuple of positional arguments or a dict of "
        f"keyword arguments, got {type(inputs).__name__}"
    )


@contextlib.contextmanager
def preserved(model: nn.Module, train: bool) -> Iterator[None]:
    """Runs a warm-up without leaving a trace: modes, grads, buffers and RNG state come back."""
    modes = {m: m.training for m in model.modules()}
    grads: dict[nn.Parameter, torch.Tensor | None] = {}
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
    if train:
        for p in model.parameters():
            grads[p] = None if p.grad is None else p.grad.detach().clone()
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices: list[int] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [torch.cuda.current_device()]
    try:
        with torch.random.fork_rng(devices=devices):
            if model.training != train:
                model.train(train)
            yield
    finally:
        for m, flag in modes.items():
            m.training = flag
        with torch.no_grad():
            for p, old in grads.items():
                if old is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == old.shape:
                    p.grad.copy_(old)  # in place: DDP's bucket views stay valid
                else:
                    p.grad = old
            for b, old in buffers:
                b.copy_(old)


class RunResult:
    """What one :func:`run` did: FX-graph cache hits and misses, seconds, whether it ran backward."""

    __slots__ = ("backward", "fxgraph_hits", "fxgraph_misses", "seconds")

    def __init__(self, fxgraph_hits: int, fxgraph_misses: int, seconds: float, backward: bool) -> None:
        self.fxgraph_hits = fxgraph_hits
        self.fxgraph_misses = fxgraph_misses
        self.seconds = seconds
        self.backward = backward


def run(
    model: nn.Module, inputs: Any, train: bool, session: Any = None, grad: bool | None = None
) -> RunResult:
    """One call of ``model`` with ``inputs``: forward under ``no_grad``, or forward and backward.

    ``train``: the model's mode during the call. ``grad`` (default: ``train``): whether autograd
    records the forward (torch compiles other graphs with and without it); a training run
    (``train`` and ``grad``) also runs the backward, an eval run with ``grad=True`` only the
    forward. State is preserved (:func:`preserved`). A training run whose output has nothing to
    backpropagate runs forward only (``RunResult.backward`` is False). ``session`` (the store
    session of the model, if any) hears of the end after the backward too, and what the run
    compiled is published before this returns (other ranks may be waiting for it).
    """
    before = CompileCounters.snapshot()
    start = time.perf_counter()
    backward = False
    grad = train if grad is None else bool(grad)
    with preserved(model, train):
        if grad:
            with torch.enable_grad():
                output = call(model, inputs)
                loss = loss_of(output) if train else None
                if loss is not None:
                    loss.backward()
                    backward = True
        else:
            with torch.no_grad():
                call(model, inputs)
    seconds = time.perf_counter() - start
    if session is not None:
        session.after_forward(seconds)  # the backward compiled after the forward ended
        session.flush()  # a warm-up publishes before it returns (the other ranks wait for it)
    diff = CompileCounters.snapshot().diff(before)
    return RunResult(diff.fxgraph_hit, diff.fxgraph_miss, seconds, backward)

