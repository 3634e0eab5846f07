"""``compile_cache.compile``: a drop-in for ``torch.compile`` on a whole module or a function.

*A module* is compiled in place, whole, as one part of its own: the plan is the root module
(:func:`whole_plan`), and everything else is ``compile_regions``' pipeline
(:func:`compile_cache.api.compile_planned`): the key (fingerprint, plan, keywords, environment),
the store restore before compiling, capture by use, publishing off the step, rank sharing,
precompile under the same soundness checks (a part whose guards cannot be saved faithfully
compiles without precompile, warned), ``last_report()`` and ``explain``.

*A function* is keyed by its code (the code objects, recursively, with their constants and
names), its defaults, what it closes over (tensors by shape, dtype, device; modules by
fingerprint; functions by code; primitives by value) and the functions it calls by global name.
The key only chooses which packs are restored: torch's own content keys decide what hits, so a
key that is too coarse costs restored files, never a wrong answer. Dynamo's precompile is not
used for functions (their guards on globals and closures are not checked by the key; asking
for it warns and compiles without it). The wrapper names the function's compiles as its own
(capture by use) and publishes after each call that compiled, in the background.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import _warnings, api, config, local_dirs, plan, regions
from .errors import ConfigError
from .fingerprint import fingerprint
from .keys import KEY_FORMAT, KeyFields, canonical_compile_kwargs, environment, environment_digest
from .plan import RegionPlan, RestPart
from .precompiled import RegionPrecompileWarning
from .session import CacheSession, open_session
from .torch_compat.cache_use import owner_stack

logger = logging.getLogger("compile_cache")

__all__ = ["CompiledFunction", "compile", "function_key", "warm", "whole_plan"]

#: The reason a whole-model part gives in its plan (also part of its key: not the regional plan's).
WHOLE_REASON = plan.REASONS["whole_model"]
FUNCTION_REASON = "compiled: compile_cache.compile(function)"


def whole_plan(model: nn.Module) -> RegionPlan:
    """The plan of ``compile_cache.compile(model)``: the root module compiled as one part."""
    return plan.whole_plan(model, WHOLE_REASON)


def compile(  # noqa: A001 - the drop-in for torch.compile keeps its name
    obj: Any,
    *,
    cache_dir: str | os.PathLike[str] | bool | None = None,
    precompile: bool | None = None,
    example_inputs: Any = None,
    distributed: str | None = None,
    **torch_compile_kwargs: Any,
) -> Any:
    """``torch.compile(obj, **torch_compile_kwargs)`` with the artifact store.

    A module is compiled whole, in place, and returned (its class, parameters and hooks stay);
    ``cache_dir``, ``precompile``, ``example_inputs`` and ``distributed`` are as for
    :func:`compile_cache.compile_regions`. A function returns a :class:`CompiledFunction` that
    calls ``torch.compile(fn)``'s result; only ``cache_dir`` applies to it (``precompile=True``
    warns and compiles without precompile; ``example_inputs`` and ``distributed`` are for modules).
    """
    if isinstance(obj, nn.Module):
        return api.compile_planned(obj, whole_plan, "compile_cache.compile", cache_dir=cache_dir,
                                   precompile=precompile, example_inputs=example_inputs,
                                   distributed=distributed, **torch_compile_kwargs)
    if not callable(obj):
        raise TypeError(f"compile_cache.compile needs a torch.nn.Module or a function, got "
                        f"{type(obj).__module__}.{type(obj).__qualname__}")
    if example_inputs is not None or distributed is not None:
        raise TypeError("compile_cache.compile(function): example_inputs and distributed are for "
                        "modules; call the function to compile it")
    return _compile_function(obj, cache_dir, precompile, torch_compile_kwargs)


# --------------------------------------------------------------------------------------------
# functions


class _FunctionHolder(nn.Module):
    """Stands for a function where the session wants a model (its entry's class and device
    come from the key's record)."""


class CompiledFunction:
    """What ``compile_cache.compile(fn)`` returns: calls ``torch.compile(fn)``'s result.

    Around each call it names the function's part as the owner of what torch compiles
    (capture by use) and, after a call that compiled, queues the publish of what it used.
    """

    def __init__(self, fn: Callable[..., Any], compiled: Callable[..., Any], owner: str,
                 session: CacheSession | None, key: str | None) -> None:
        self._fn = fn
        self._compiled = compiled
        self._owner = owner
        self.session = session
        #: The store key (None without a store).
        self.key = key
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        owners = owner_stack()
        owners.append(self._owner)
        try:
            out = self._compiled(*args, **kwargs)
        finally:
            owners.pop()
        if self.session is not None:
            self.session.after_forward(time.perf_counter() - start)
        return out

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """As a method, bound like the function it wraps."""
        return self if instance is None else types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<compile_cache.CompiledFunction {getattr(self._fn, '__qualname__', self._fn)!r}>"


def _compile_function(fn: Callable[..., Any], cache_dir: Any, precompile: bool | None,
                      kwargs: dict[str, Any]) -> CompiledFunction:
    regions.validate_kwargs(kwargs)
    api.check_cache_dir(cache_dir)
    config.check_all()
    if precompile:
        _warnings.warn("compile_cache: precompile is not used for functions (their guards on "
                       "globals and closures are not covered by the key); compiling without it",
                       RegionPrecompileWarning)
    fields = function_key(fn, kwargs)
    name = _qualname(fn)
    digest = fields.record["model"]["fingerprint"]
    fplan = RegionPlan(name, (), (RestPart("", name, True, FUNCTION_REASON, digest),),
                       disabled=bool(kwargs.get("disable", False)), compile_kwargs=dict(kwargs))
    owner = fplan.rest[0].code_name
    session = None
    if not fplan.disabled and cache_dir is not False:
        local_dirs.secure_local_dirs()
        session = open_session(_FunctionHolder(), fplan, fields.key, cache_dir, False,
                               record=fields.record)
    compiled = torch.compile(fn, **kwargs)
    return CompiledFunction(fn, compiled, owner, session, session.key if session else None)


def _qualname(fn: Any) -> str:
    target = getattr(fn, "__func__", fn)
    module = getattr(target, "__module__", None) or type(target).__module__
    qual = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}.{qual}"


def _code_parts(code: types.CodeType, out: list[Any], depth: int = 0) -> None:
    """The code object's bytecode, constants (nested code recursively) and names."""
    out.append((code.co_name, code.co_code.hex(), code.co_names, code.co_varnames,
                code.co_freevars, code.co_argcount, code.co_kwonlyargcount, code.co_flags))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if depth < 16:
                _code_parts(const, out, depth + 1)
        else:
            out.append(repr(const))


def _value_part(value: Any, seen: set[int], depth: int) -> Any:
    """What of a closed-over (or default, or global) value goes into the function's key."""
    if isinstance(value, (bool, int, float, str, bytes, type(None))):
        return [type(value).__name__, repr(value)]
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype), value.device.type,
                bool(value.requires_grad)]
    if isinstance(value, nn.Module):
        return ["module", _qualname(type(value)), fingerprint(value).hex]
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return [type(value).__name__, [_value_part(v, seen, depth) for v in value]]
    if isinstance(value, types.MethodType):
        return ["method", _value_part(value.__self__, seen, depth),
                _value_part(value.__func__, seen, depth)]
    if isinstance(value, types.FunctionType):
        if id(value) in seen or depth > 4:
            return ["function", _qualname(value)]
        seen.add(id(value))
        return ["function", _qualname(value), _function_parts(value, seen, depth + 1)]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    return ["object", _qualname(type(value))]


def _function_parts(fn: types.FunctionType, seen: set[int], depth: int) -> dict[str, Any]:
    code: list[Any] = []
    _code_parts(fn.__code__, code)
    cells = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            cells.append([name, _value_part(cell.cell_contents, seen, depth)])
        except ValueError:  # an empty cell
            cells.append([name, None])
    names: set[str] = set()
    stack = [fn.__code__]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    called = [[n, _value_part(fn.__globals__[n], seen, depth)] for n in sorted(names)
              if isinstance(fn.__globals__.get(n), (types.FunctionType, nn.Module, torch.Tensor))]
    return {
        "code": code,
        "defaults": [_value_part(v, seen, depth) for v in fn.__defaults__ or ()],
        "kwdefaults": {k: _value_part(v, seen, depth) for k, v in (fn.__kwdefaults__ or {}).items()},
        "closure": cells,
        "globals": called,
    }


def _devices(fn: Any) -> list[str] | None:
    """The device types of the tensors and modules the function closes over (None: none)."""
    kinds: set[str] = set()
    target = getattr(fn, "__func__", fn)
    values = [c.cell_contents for c in getattr(target, "__closure__", None) or ()
              if _cell_full(c)]
    if isinstance(fn, types.MethodType):
        values.append(fn.__self__)
    for value in values:
        if isinstance(value, torch.Tensor):
            kinds.add(value.device.type)
        elif isinstance(value, nn.Module):
            kinds.update(t.device.type for t in value.parameters())
    return sorted(kinds) or None


def _cell_full(cell: Any) -> bool:
    try:
        return cell.cell_contents is not cell  # reading an empty cell raises
    except ValueError:
        return False


def function_key(fn: Callable[..., Any], compile_kwargs: dict[str, Any]) -> KeyFields:
    """The store key of ``compile_cache.compile(fn, **compile_kwargs)`` and its record: the
    function's code, defaults, closure and called globals (:func:`_function_parts`), the
    canonical keywords and the environment (the record is what ``explain`` and ``ls`` read)."""
    seen: set[int] = set()
    if isinstance(fn, types.MethodType):
        parts: Any = _value_part(fn, seen, 0)
    elif isinstance(fn, types.FunctionType):
        seen.add(id(fn))
        parts = _function_parts(fn, seen, 0)
    else:  # a callable object: its class's __call__ (and what the object is, if a module)
        parts = ["callable", _value_part(fn, seen, 0), _value_part(type(fn).__call__, seen, 0)]
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=repr)
    digest = hashlib.sha256(blob.encode()).hexdigest()
    settings = canonical_compile_kwargs(compile_kwargs)
    devices = _devices(fn)
    env = environment(devices)
    env_key = environment_digest(env)
    material = {"format": KEY_FORMAT, "function": digest, "compile": settings, "environment": env_key}
    key = hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":"),
                                    default=repr).encode()).hexdigest()[:32]
    name = _qualname(fn)
    record = {
        "key_format": KEY_FORMAT,
        "model_class": f"function {name}",
        "device": ",".join(devices) if devices else "any",
        "regions": "",
        "model": {"class": f"function {name}", "fingerprint": digest[:32], "structure": digest[:32],
                  "dtypes": [], "devices": devices or []},
        "compile": settings,
        "precompile": False,
        "environment": env,
        "environment_key": env_key,
        "plan": {"digest": digest[:32], "groups": [], "compiled": ["<function>"], "eager": []},
    }
    return KeyFields(key=key, record=record)


# --------------------------------------------------------------------------------------------
# warm: a module (api.warm) or a function


def warm(model: Any, example_inputs_list: Any, **kwargs: Any) -> list[api.WarmResult]:
    """``compile_cache.warm``: :func:`compile_cache.api.warm` for a module; for a function,
    ``compile_cache.compile(fn)`` (its key) and one call per example input (with ``train``, the
    output's loss backpropagated), the RNG state preserved, each call's compiles published
    before the next. Returns one :class:`~compile_cache.api.WarmResult` per input."""
    if isinstance(model, nn.Module) or not callable(model) or isinstance(model, type):
        return api.warm(model, example_inputs_list, **kwargs)
    kwargs.pop("whole_model", None)  # a function is always compiled whole
    return _warm_function(model, api.warm_inputs(example_inputs_list), **kwargs)


def _warm_function(fn: Callable[..., Any], inputs_list: list[Any], *, cache_dir: Any = None,
                   train: bool = False, grad: bool | None = None, precompile: bool | None = None,
                   progress: bool = False, **compile_kwargs: Any) -> list[api.WarmResult]:
    from . import warmup
    from .session import last_report

    grad = train if grad is None else bool(grad)
    before = last_report()
    start = time.perf_counter()
    compiled = compile(fn, cache_dir=cache_dir, precompile=precompile, **compile_kwargs)
    setup_seconds = time.perf_counter() - start
    session = compiled.session
    report = session.report if session is not None and last_report() is not before else None

    def counts() -> tuple[int, int, int, int]:
        if report is None:
            return 0, 0, 0, 0
        return (report.fxgraph_hits, report.fxgraph_misses, report.published_packs,
                report.published_bytes)

    results: list[api.WarmResult] = []
    seen = counts()
    seen_errors = 0
    restored = (report.restored_packs, report.restored_bytes) if report else (0, 0)
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(inputs_list), unit="shape", desc="warming")
        except ImportError:
            bar = None
    for index, inputs in enumerate(inputs_list):
        label = warmup.describe_inputs(inputs)
        t0 = time.perf_counter()
        devices = ([torch.cuda.current_device()]
                   if torch.cuda.is_available() and torch.cuda.is_initialized() else [])
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(grad):
            output = warmup.call(compiled, inputs)
            loss = warmup.loss_of(output) if train and grad else None
            if loss is not None:
                loss.backward()
        if train and grad and loss is None:
            raise ConfigError("--train: the function's output has no tensor that requires grad")
        if session is not None:
            session.after_forward(0.0)  # the backward compiled after the call ended
            session.flush()
        seconds = time.perf_counter() - t0 + (setup_seconds if index == 0 else 0.0)
        now = counts()
        hits, misses, packs, nbytes = (a - b for a, b in zip(now, seen, strict=True))
        seen = now
        errors = list(report.errors[seen_errors:]) if report else []
        seen_errors += len(errors)
        first = index == 0
        results.append(api.WarmResult(
            shape=label,
            status="compiled" if misses else "hit" if hits or (first and restored[0]) else "none",
            seconds=seconds, fxgraph_hits=hits, fxgraph_misses=misses, published_packs=packs,
            published_bytes=nbytes, restored_packs=restored[0] if first else 0,
            restored_bytes=restored[1] if first else 0, key=compiled.key, errors=errors))
        logger.info("compile_cache warm: %s %s in %.2f s", label, results[-1].status, seconds)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results
