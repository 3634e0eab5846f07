"""The keys: the store key of a compile, and the environment key inside it.

**Store key** (:func:`entry_key`) = hash of the model's fingerprint, the region plan, the
``torch.compile`` keywords (canonical form, :func:`canonical_compile_kwargs`: a keyword equal to
torch's default is dropped, aliases map to one form), the environment key and whether precompile
is on. Equal compiles give one key: ``{}``, ``backend="inductor"``, ``mode="default"``,
``fullgraph=False`` and ``dynamic=None`` are one ``torch.compile``. An entry of the store is one
key; :func:`key_fields` also gives the readable record an entry keeps (``entry.json``) so that
:mod:`compile_cache.explain` can name what differs when a key misses.

**Environment key** (:func:`environment`, :func:`environment_digest`): everything outside the
model that makes torch's compiled code differ. An artifact compiled under one environment is
only restored under an equal one, because torch's own cache keys (``FxGraphHashDetails`` in
``torch/_inductor/codecache.py``) contain the same things and any difference is a silent miss at
best. The fields mirror that key: torch build, Python, the default dtype, deterministic-algorithm
settings, digests of the Inductor, AOTAutograd (functorch) and Dynamo configs (read through
:mod:`compile_cache.torch_compat.configs`), ``compile_on_one_rank`` when set
(``torch.compiler.config``; ``torch.distributed.config`` on torch 2.13), and the facts of the devices the model's graphs are compiled for:

* **CPU graphs** (a parameter or buffer on the CPU): the thread count (``get_num_threads()`` is
  in the FX key of CPU graphs; ``torchrun`` sets ``OMP_NUM_THREADS=1``) and the vector ISA;
* **GPU graphs** (a parameter or buffer on another device than ``cpu``/``meta``): CUDA/HIP and
  Triton versions, the device name and capability. Not the device count: a rank with
  ``--virtual-local-rank`` sees one GPU where a ``warm`` on the same node sees eight, and torch's
  keys do not hold it.

**Which devices a model's graphs are for** (:func:`region_devices`): the device types of its
parameters and buffers, the same fact its fingerprint holds (a model moved to another device
type has another fingerprint, hence another key). A model with neither counts as both kinds
(its inputs decide, which the key cannot know): both sets of facts are kept. Callers that
compare whole machines (``doctor``, the distributed hazard check) pass no devices: every fact.

Everything here is cheap (no Triton import, no CUDA initialisation when CUDA is absent) and stable
across processes (no ``hash()``, no ids, no addresses, no paths).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import platform
import re
import sys
from typing import Any

from .fingerprint import fingerprint
from .torch_compat import configs as torch_configs
from .torch_compat import isa

__all__ = [
    "KEY_FORMAT",
    "KeyFields",
    "canonical_compile_kwargs",
    "entry_key",
    "environment",
    "environment_digest",
    "key_fields",
    "model_structure",
    "region_devices",
]

#: 2: the environment holds the facts of the model's device kinds only, no device count, and
#: ``compile_on_one_rank`` when set.
KEY_FORMAT = 2


# --------------------------------------------------------------------------------------------
# The store key


def _describe_callable(value: object) -> str:
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    module = getattr(value, "__module__", None) or type(value).__module__
    return f"{module}.{name}"


def _canonical_kwargs(value: Any) -> Any:
    """A JSON-able, process-independent form of a torch.compile keyword value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _canonical_kwargs(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical_kwargs(v) for v in value]
    if callable(value):
        return _describe_callable(value)
    return repr(value)


#: Values torch.compile treats as its default, per keyword (torch 2.13's ``backend`` default is
#: None and means "inductor"; older torch spells it "inductor").
_DEFAULT_SPELLINGS: dict[str, tuple[Any, ...]] = {
    "backend": (None, "inductor"),
    "mode": (None, "default"),
    "options": (None, {}),
}


def _compile_defaults() -> dict[str, Any]:
    """torch.compile's keyword defaults, read from its signature (a torch that changes one is
    handled without a change here)."""
    import torch

    try:
        params = inspect.signature(torch.compile).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - a torch whose compile has no signature
        return {}
    return {p.name: p.default for p in params
            if p.default is not inspect.Parameter.empty and p.name != "model"}


def _same(value: Any, default: Any) -> bool:
    if value is None or default is None:
        return value is default
    return type(value) is type(default) and value == default


def canonical_compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` keywords in one canonical, JSON-able form: every keyword equal to
    torch's default (read from ``torch.compile``'s signature) or to another spelling of it
    (``backend="inductor"``, ``mode="default"``, ``options={}``) is dropped, the rest sorted."""
    defaults = _compile_defaults()
    out: dict[str, Any] = {}
    for name in sorted(kwargs):
        value = kwargs[name]
        if name in defaults:
            spellings = _DEFAULT_SPELLINGS.get(name, ())
            default = defaults[name]
            if _same(value, default) or (
                any(_same(value, s) for s in spellings) and any(_same(default, s) for s in spellings)
            ):
                continue
        out[name] = _canonical_kwargs(value)
    return out


def model_structure(model: Any) -> dict[str, Any]:
    """What identifies "the same model" apart from how it is set up: the class of every
    submodule and the names and shapes of its parameters and buffers, but not their dtypes,
    devices, ``requires_grad``, attributes or code (those are named by ``explain`` when they
    differ). ``digest`` matches entries of one model; ``dtypes``/``devices`` are readable."""
    modules = [(name, f"{type(m).__module__}.{type(m).__qualname__}") for name, m in model.named_modules()]
    tensors = [(name, list(t.shape)) for name, t in model.named_parameters()]
    tensors += [(name, list(t.shape)) for name, t in model.named_buffers()]
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in model.parameters()})
    devices = sorted({t.device.type for t in model.parameters()})
    blob = json.dumps({"modules": modules, "tensors": tensors}, separators=(",", ":"))
    return {
        "digest": hashlib.sha256(blob.encode()).hexdigest()[:32],
        "dtypes": dtypes or sorted({str(t.dtype).removeprefix("torch.") for t in model.buffers()}),
        "devices": devices or sorted({t.device.type for t in model.buffers()}) or ["cpu"],
    }


def _plan_summary(plan: Any) -> dict[str, Any]:
    data = plan.to_dict() if hasattr(plan, "to_dict") else {"repr": repr(plan)}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=repr)
    return {
        "digest": hashlib.sha256(blob.encode()).hexdigest()[:32],
        "groups": [f"{g.class_name.rsplit('.', 1)[-1]} x{g.size}" for g in getattr(plan, "groups", ())],
        "compiled": [p.name or "<root>" for p in getattr(plan, "compiled_rest", ())],
        "eager": [p.name or "<root>" for p in getattr(plan, "eager_rest", ())],
    }


@dataclasses.dataclass(frozen=True)
class KeyFields:
    """A store key and the readable record of what went into it (``entry.json``, miss records).

    ``record``: ``model`` (class, fingerprint, structure digest, parameter dtypes and devices),
    ``compile`` (canonical keywords), ``precompile``, ``environment`` (every field, not only the
    digest) and ``plan`` (digest, region groups, compiled and eager parts).
    """

    key: str
    record: dict[str, Any]


def key_fields(model: Any, plan: Any, compile_kwargs: dict[str, Any], precompile: bool) -> KeyFields:
    """The store key of compiling ``model`` with ``plan`` and ``compile_kwargs``, and its record."""
    compile_settings = canonical_compile_kwargs(compile_kwargs)
    env = environment(region_devices(model))
    model_hex = fingerprint(model).hex
    material = {
        "format": KEY_FORMAT,
        "model": model_hex,
        "plan": plan.to_dict() if hasattr(plan, "to_dict") else repr(plan),
        "compile": compile_settings,
        "environment": environment_digest(env),
        "precompile": bool(precompile),
    }
    blob = json.dumps(material, sort_keys=True, separators=(",", ":"), default=repr)
    key = hashlib.sha256(blob.encode()).hexdigest()[:32]
    structure = model_structure(model)
    record = {
        "key_format": KEY_FORMAT,
        "model": {
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "fingerprint": model_hex,
            "structure": structure["digest"],
            "dtypes": structure["dtypes"],
            "devices": structure["devices"],
        },
        "compile": compile_settings,
        "precompile": bool(precompile),
        "environment": env,
        "environment_key": material["environment"],
        "plan": _plan_summary(plan),
    }
    return KeyFields(key=key, record=record)


def entry_key(model: Any, plan: Any, compile_kwargs: dict[str, Any], precompile: bool) -> str:
    """The store key: model fingerprint, plan, canonical torch.compile keywords, environment,
    precompile (see :func:`key_fields` for the record that goes with it)."""
    return key_fields(model, plan, compile_kwargs, precompile).key


# --------------------------------------------------------------------------------------------
# The environment key

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _canonical_config(value: Any) -> Any:
    """A JSON-able, process-independent form of a config value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical_config(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical_config(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, dict):
        return {str(k): _canonical_config(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    uuid = getattr(value, "uuid", None)
    if callable(uuid):  # custom passes (CustomGraphPass) identify themselves this way
        try:
            return f"uuid:{uuid()}"
        except Exception:
            pass
    if callable(value):
        mod = getattr(value, "__module__", None) or ""
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"callable:{mod}.{name}"
    return _ADDRESS.sub("", repr(value))


def _config_digest(data: dict[str, Any] | None) -> str:
    """sha256 (first 32 hex) of a torch config's portable dict, canonicalised."""
    if data is None:  # torch_compat's configs capability is missing (warned)
        return "unavailable"
    blob = json.dumps(_canonical_config(data), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _triton_version() -> str:
    """Triton's version from package metadata (never imports triton); "" when absent."""
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "" if importlib.util.find_spec("triton") is None else "unknown"


def _cpu_capability() -> str:
    """The CPU vector ISA torch dispatches to, plus the ISA flags Inductor picks from.

    Not in torch's FX-graph key: an entry compiled where AVX-512 is picked loads its AVX-512
    ``.so`` on an AVX2-only node (SIGILL), so our key must carry it. Read from cpuinfo (cheap),
    never from Inductor's build probe.
    """
    import torch

    parts = []
    try:
        parts.append(str(torch.backends.cpu.get_cpu_capability()))
    except Exception:
        parts.append("unknown")
    parts.extend(isa.cpu_isa_flags())
    return "+".join(parts)


def region_devices(model: Any) -> list[str] | None:
    """The device types of ``model``'s parameters and buffers, sorted; None when it has neither
    (then every device fact is keyed). The fingerprint holds the same device types."""
    found = {t.device.type for t in model.parameters()}
    found.update(t.device.type for t in model.buffers())
    return sorted(found) or None


#: Device types whose graphs are not GPU graphs (no GPU facts in their key).
_NOT_GPU = frozenset({"cpu", "meta"})


#: Where ``compile_on_one_rank`` lives, newest first: torch >= 2.14 moved it to
#: ``torch.compiler.config`` and left a deprecated alias in ``torch.distributed.config``, whose
#: every read warns (FutureWarning); torch 2.13 has it only there.
_ONE_RANK_HOMES = ("torch.compiler.config", "torch.distributed.config")


def _compile_on_one_rank() -> str | None:
    """``compile_on_one_rank`` (``torch.compiler.config``, torch >= 2.14;
    ``torch.distributed.config``, torch 2.13) when set, else None."""
    for name in _ONE_RANK_HOMES:
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a torch without that module: the next home
                continue
        # A config module answers only its own settings (AttributeError otherwise).
        value = getattr(module, "compile_on_one_rank", _ABSENT)
        if value is not _ABSENT:
            return str(bool(value)) if value else None
    return None


_ABSENT = object()


def environment(devices: list[str] | tuple[str, ...] | None = None) -> dict[str, str]:
    """The environment key fields, as strings, for graphs compiled for ``devices`` (device
    types, :func:`region_devices`; None: all facts, as for a whole machine).

    Torch and its configs must already be importable; the call costs a few milliseconds once
    torch is imported (it reads configs, never compiles, never initialises CUDA when absent).
    """
    import torch

    kinds = set(devices) if devices else None
    cpu = kinds is None or "cpu" in kinds
    gpu = kinds is None or bool(kinds - _NOT_GPU)
    configs = torch_configs.portable_configs()
    env: dict[str, str] = {
        "torch": torch.__version__,
        "torch_git": str(getattr(torch.version, "git_version", "")),
        "torch_debug": str(bool(getattr(torch.version, "debug", False))),
        "python": "{}.{}.{}".format(*sys.version_info[:3]),
        "python_impl": platform.python_implementation(),
        "machine": platform.machine(),
        "system": platform.system(),
        "devices": ",".join(sorted(kinds)) if kinds else "any",
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": f"{torch.are_deterministic_algorithms_enabled()}/"
        f"{torch.is_deterministic_algorithms_warn_only_enabled()}",
        "inductor_config": _config_digest(configs["inductor_config"]),
        "functorch_config": _config_digest(configs["functorch_config"]),
        "dynamo_config": _config_digest(configs["dynamo_config"]),
    }
    one_rank = _compile_on_one_rank()
    if one_rank is not None:
        env["compile_on_one_rank"] = one_rank
    if cpu:
        env["cpu_threads"] = str(torch.get_num_threads())
        env["cpu_capability"] = _cpu_capability()
    if gpu:
        env["torch_cuda"] = str(torch.version.cuda or "")
        env["torch_hip"] = str(getattr(torch.version, "hip", None) or "")
        env["triton"] = _triton_version()
        env["cuda_available"] = "0"
        try:
            if torch.cuda.is_available():
                idx = torch.cuda.current_device()
                props = torch.cuda.get_device_properties(idx)
                env["cuda_available"] = "1"
                env["device_name"] = str(props.name)
                env["device_capability"] = f"{props.major}.{props.minor}"
        except Exception:  # a broken driver must not stop key computation
            env["cuda_available"] = "error"
    return env


def environment_digest(env: dict[str, str] | None = None) -> str:
    """A stable 32-hex digest of an environment dict (sha256 over sorted compact JSON)."""
    if env is None:
        env = environment()
    blob = json.dumps(env, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]

