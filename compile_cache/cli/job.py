"""The job that ``warm`` and ``explain`` mirror: the model, its inputs, and how the job runs it.

The model comes from a factory (``package.module:factory`` or ``path/to/file.py:factory``) or
from a transformers config (``--hf NAME``, random weights, never a download). Torch compiles
different graphs for eval and train mode, with and without autograd, per dtype, device, shape
and ``use_cache``, so every one of these is a flag here, shown by ``--help`` and in the summary
(:meth:`Job.mode_line`). Defaults are an inference job's: ``model.eval()``, ``torch.no_grad()``,
``use_cache=False``, the model's own dtype and device, one batch of 1 x 128 tokens (``--hf``).
Torch is imported when a command runs, not when the CLI starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .output import UsageError

__all__ = ["MODE_HELP", "Job", "add_job_arguments", "build_job"]

MODE_HELP = (
    "By default the model runs as an inference job does: model.eval(), under torch.no_grad(), "
    "use_cache=False, in the model's own dtype and on its device, with one batch of 1 x 128 "
    "tokens for --hf models. Torch compiles other graphs when any of these differ, so pass the "
    "flags that make the run mirror your job (--train --grad --use-cache --dtype --device "
    "--batch-size --seq-len), and the same torch.compile settings (--mode --backend --dynamic "
    "--fullgraph --precompile)."
)


def _bool_arg(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the job to mirror (warm, explain)."""
    parser.add_argument("target", nargs="?", metavar="TARGET",
                        help="package.module:factory or path/to/file.py:factory; the factory returns a model, "
                        "(model, example_inputs) or (model, [example_inputs, ...])")
    parser.add_argument("--hf", metavar="NAME", help="a transformers model type built from its config with "
                        "random weights (never downloads): a causal LM (gpt2, llama, qwen2, mamba), else a "
                        "sequence-to-sequence LM (t5, bart), else the base model (bert, vit, whisper, clip), "
                        "with token, image, speech and decoder inputs as it takes them")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for --hf (repeatable)")
    run = parser.add_argument_group("how the job runs the model (default: eval, no_grad, use_cache=False)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--train", dest="train", action="store_true", default=False,
                      help="model.train() and a backward pass, as a training step")
    mode.add_argument("--eval", dest="train", action="store_false", help="model.eval() (the default)")
    run.add_argument("--grad", action=argparse.BooleanOptionalAction, default=None,
                     help="autograd on or off during the forward (default: on with --train, off otherwise)")
    run.add_argument("--use-cache", action=argparse.BooleanOptionalAction, default=None,
                     help="use_cache= for models whose config has it (default: --no-use-cache)")
    run.add_argument("--dtype", help="cast the model and floating inputs (float32, bfloat16, ...; default: the model's)")
    run.add_argument("--device", help="move the model and inputs (cpu, cuda, cuda:0, ...; default: the model's)")
    run.add_argument("--batch-size", action="append", metavar="N[,N...]", help="batch sizes of the input grid (default 1)")
    run.add_argument("--seq-len", action="append", metavar="N[,N...]",
                     help="sequence lengths of the input grid (default 128, or the model's positions if fewer)")
    comp = parser.add_argument_group("torch.compile settings (part of the cache key: use the job's)")
    comp.add_argument("--mode", help="torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    comp.add_argument("--backend", help="torch.compile backend (default inductor)")
    comp.add_argument("--dynamic", type=_bool_arg, metavar="true|false", help="torch.compile dynamic=")
    comp.add_argument("--fullgraph", action="store_true", help="torch.compile fullgraph=True")
    comp.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                      help="also cache Dynamo's traced code (default: COMPILE_CACHE_PRECOMPILE, else off "
                           "while it is under review)")


# ------------------------------------------------------------------------------- parsing input
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


def _parse_overrides(items: Sequence[str]) -> dict[str, tuple[str, Any]]:
    """``KEY=VALUE`` items -> {key: (text, value)}."""
    out: dict[str, tuple[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: expected key=value, e.g. n_layer=2")
        out[key.strip()] = (value, _parse_value(value))
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


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
        device = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name!r}: {exc}") from None
    if device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as exc:  # AssertionError "Torch not compiled with CUDA enabled", ...
            raise UsageError(f"--device {name!r} is not usable with this torch "
                             f"({torch.__version__}): {_first_line(exc)}") from None
    return device


# ------------------------------------------------------------------------------- the model
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
    if isinstance(result, tuple) and len(result) == 2 and _is_function(result[0]):
        fn, inputs = result  # compile_cache.compile(fn)'s key; warmed by calling it
        return fn, list(inputs) if isinstance(inputs, list) else [inputs]
    if _is_function(result):
        raise UsageError(f"TARGET {target!r} returned a function without example inputs: return "
                         "(function, example_inputs) or (function, [example_inputs, ...])")
    raise UsageError(
        f"TARGET {target!r} returned {type(result).__name__}; expected a torch.nn.Module, "
        "(model, example_inputs), (model, [example_inputs, ...]) or (function, example_inputs)"
    )


def _is_function(value: Any) -> bool:
    """A function (or other callable that is not a module or a class): what
    ``compile_cache.compile(fn)`` compiles."""
    from torch import nn

    return callable(value) and not isinstance(value, (nn.Module, type))


def _check_override_types(name: str, defaults: Any, overrides: dict[str, tuple[str, Any]]) -> None:
    """A ``--set`` value of another type than the config's default (``n_layer=two``) is bad input."""
    expected = {bool: "true or false", int: "a whole number", float: "a number"}
    for key, (text, value) in overrides.items():
        default = getattr(defaults, key, None)
        kind = type(default)
        if kind not in expected or value is None:
            continue
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, int) and not isinstance(value, bool) if kind is int else
              isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            raise UsageError(f"--set {key}={text!r}: expected {expected[kind]} "
                             f"(the {name} config's default is {default!r})")


#: What ``--hf`` builds (random weights from the config), tried in this order: for an
#: encoder-decoder config, then for any other.
HF_CLASSES = {
    True: ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", "AutoModel"),
    False: ("AutoModelForCausalLM", "AutoModel"),
}

#: transformers' public mapping (config class -> model class) behind each auto class.
HF_MAPPINGS = {
    "AutoModelForSeq2SeqLM": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
    "AutoModelForSpeechSeq2Seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING",
    "AutoModel": "MODEL_MAPPING",
}


def _build_hf(name: str, overrides: dict[str, tuple[str, Any]]) -> Any:
    """A random-weight model from its config: an encoder-decoder LM (T5, BART, Whisper), a
    causal LM (GPT-2, Llama, Qwen2, Mamba), else the base model (an encoder such as BERT, whose
    causal-LM head is for decoders only; ViT, CLIP). Never downloads anything."""
    import torch

    try:
        import transformers
        from transformers import AutoConfig
    except ImportError as exc:
        raise UsageError(f"--hf needs transformers: {exc}") from None
    try:
        defaults = AutoConfig.for_model(name)
    except (ValueError, KeyError) as exc:
        raise UsageError(f"--hf {name!r}: unknown model type ({str(exc).splitlines()[0]})") from None
    _check_override_types(name, defaults, overrides)
    values = {key: value for key, (_text, value) in overrides.items()}
    sets = " ".join(f"--set {k}={t}" for k, (t, _v) in overrides.items())
    torch.manual_seed(0)
    try:
        config = AutoConfig.for_model(name, **values)
    except Exception as exc:  # built from the flags alone: any failure is the flags' doing
        raise UsageError(f"--hf {name!r}{' ' + sets if sets else ''}: cannot build the model "
                         f"(its config: {_first_line(exc)})") from None
    tried = []
    classes = HF_CLASSES[bool(getattr(config, "is_encoder_decoder", False))]
    for cls_name in classes:
        auto = getattr(transformers, cls_name)
        if type(config) not in getattr(transformers, HF_MAPPINGS[cls_name]):  # no model for the type
            tried.append(f"{cls_name}: no {name} model")
            continue
        masked_lm = transformers.MODEL_FOR_MASKED_LM_MAPPING
        if cls_name == "AutoModelForCausalLM" and type(config) in masked_lm:
            tried.append(f"{cls_name}: {name} is an encoder (its causal-LM head needs is_decoder)")
            continue
        try:
            return auto.from_config(config)
        except Exception as exc:  # noqa: BLE001 - the next class may fit; all failing is reported
            tried.append(f"{cls_name}: {_first_line(exc)}")
    raise UsageError(f"--hf {name!r}{' ' + sets if sets else ''}: cannot build the model with "
                     f"{', '.join(classes)} ({'; '.join(tried)})")


def _hf_extra_inputs(config: Any, batch: int, seq: int, generator: Any) -> dict[str, Any] | None:
    """The inputs a transformers model takes besides (or instead of) ``input_ids``: pixels for
    an image model (ViT; CLIP takes both), log-mel features and decoder tokens for speech
    (Whisper), decoder tokens for an encoder-decoder LM (T5, BART). None: ``input_ids`` alone."""
    import torch

    inner = {key: getattr(config, key, None) for key in ("vision_config", "text_config")}
    vision = inner["vision_config"] or config
    extra: dict[str, Any] = {}
    image = getattr(vision, "image_size", None)
    if isinstance(image, int) and (inner["vision_config"] is not None
                                   or not isinstance(getattr(config, "vocab_size", None), int)):
        channels = getattr(vision, "num_channels", 3)
        extra["pixel_values"] = torch.randn(batch, channels, image, image, generator=generator)
    mels, frames = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if isinstance(mels, int) and isinstance(frames, int):
        extra["input_features"] = torch.randn(batch, mels, 2 * frames, generator=generator)
    if getattr(config, "is_encoder_decoder", False):
        vocab = config.vocab_size
        extra["decoder_input_ids"] = torch.randint(0, vocab, (batch, seq), generator=generator)
    return extra or None


def _token_grid(model: Any, batch_sizes: list[int] | None, seq_lens: list[int] | None,
                use_cache: bool | None) -> list[Any]:
    """Random ``input_ids`` for every (batch, seq) pair, with ``use_cache`` for causal LMs, and
    what else the model takes (:func:`_hf_extra_inputs`)."""
    import torch

    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    text = getattr(config, "text_config", None)
    if not isinstance(vocab, int) and text is not None:
        vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) and config is not None and isinstance(
            getattr(config, "image_size", None), int):
        generator = torch.Generator().manual_seed(0)
        return [_hf_extra_inputs(config, b, 0, generator) for b in batch_sizes or [1]]
    if not isinstance(vocab, int):
        raise UsageError(
            "the model needs example inputs: make the TARGET factory return (model, example_inputs)"
        )
    positions = text if text is not None else config
    max_pos = (getattr(positions, "max_position_embeddings", None)
               or getattr(positions, "n_positions", None))
    target = getattr(config, "max_target_positions", None)  # decoder tokens (Whisper)
    if isinstance(target, int):
        max_pos = min(max_pos, target) if isinstance(max_pos, int) else target
    seq_lens = seq_lens or [min(128, max_pos) if isinstance(max_pos, int) else 128]
    if isinstance(max_pos, int) and max(seq_lens) > max_pos:
        raise UsageError(f"--seq-len {max(seq_lens)}: longer than the model's {max_pos} positions")
    generator = torch.Generator().manual_seed(0)
    grid = []
    for b in batch_sizes or [1]:
        for s in seq_lens:
            inputs: dict[str, Any] = {"input_ids": torch.randint(0, vocab, (b, s), generator=generator)}
            extra = _hf_extra_inputs(config, b, s, generator)
            if extra is not None:
                if "input_features" in extra:  # speech: features in, no input_ids
                    del inputs["input_ids"]
                inputs.update(extra)
            if hasattr(config, "use_cache"):
                inputs["use_cache"] = bool(use_cache)
            grid.append(inputs)
    return grid


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


@dataclasses.dataclass
class Job:
    """A model, its example inputs, and how the job runs and compiles it."""

    model: Any
    inputs: list[Any]
    train: bool
    grad: bool
    use_cache: bool | None  # None: the model takes no use_cache (or the factory gave the inputs)
    dtype: str
    device: str
    compile_kwargs: dict[str, Any]
    precompile: bool | None  # None: COMPILE_CACHE_PRECOMPILE decides

    @property
    def shapes(self) -> list[str]:
        from ..warmup import describe_inputs

        return [describe_inputs(x) for x in self.inputs]

    def mode(self) -> dict[str, Any]:
        """How the model runs, for the summary and ``--json``."""
        return {"train": self.train, "grad": self.grad, "use_cache": self.use_cache,
                "dtype": self.dtype, "device": self.device, "shapes": self.shapes}

    def mode_line(self) -> str:
        """``eval, no_grad, use_cache=False, float32, cpu; shapes input_ids=1x128``."""
        parts = ["train (forward and backward)" if self.train and self.grad else
                 "train" if self.train else "eval", "grad" if self.grad else "no_grad"]
        if self.use_cache is not None:
            parts.append(f"use_cache={self.use_cache}")
        parts += [self.dtype, self.device]
        return ", ".join(parts) + "; shapes " + " | ".join(self.shapes)


def _tensor_facts(model: Any) -> tuple[str, str]:
    """The dtype and device of a model's first parameter (of a function's first example tensor)."""
    from ..warmup import output_tensors

    tensors = model.parameters() if hasattr(model, "parameters") else iter(output_tensors(model))
    for tensor in tensors:
        return str(tensor.dtype).removeprefix("torch."), str(tensor.device)
    return "float32", "cpu"


def build_job(args: argparse.Namespace) -> Job:
    """The model, inputs and settings the flags describe; bad input raises UsageError."""
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

    if args.hf:
        model, inputs = _build_hf(args.hf, overrides), None
    else:
        factory = _load_target(args.target)
        model, inputs = _unpack_factory_result(factory(), args.target)
    use_cache = None
    if inputs is None:
        inputs = _token_grid(model, batch_sizes, seq_lens, args.use_cache)
        if hasattr(getattr(model, "config", None), "use_cache"):
            use_cache = bool(args.use_cache)
    elif batch_sizes or seq_lens or args.use_cache is not None:
        raise UsageError("--batch-size/--seq-len/--use-cache apply to --hf or to factories that "
                         "return a model alone (the factory gave its example inputs)")
    if args.use_cache is not None and use_cache is None:
        raise UsageError("--use-cache/--no-use-cache: the model's config has no use_cache")
    function = _is_function(model)
    if dtype is not None or device is not None:
        if function:
            raise UsageError("--dtype/--device: a function's factory places its own tensors")
        model = model.to(device=device, dtype=dtype)
        inputs = [_move(x, device, dtype) for x in inputs]
    if not function:
        model.train(args.train)
    dtype_name, device_name = _tensor_facts(model if not function else inputs)

    compile_kwargs: dict[str, Any] = {}
    if args.mode is not None:
        compile_kwargs["mode"] = args.mode
    if args.backend is not None:
        compile_kwargs["backend"] = args.backend
    if args.dynamic is not None:
        compile_kwargs["dynamic"] = args.dynamic
    if args.fullgraph:
        compile_kwargs["fullgraph"] = True
    grad = args.train if args.grad is None else bool(args.grad)
    return Job(model=model, inputs=inputs, train=bool(args.train), grad=grad, use_cache=use_cache,
               dtype=dtype_name, device=device_name, compile_kwargs=compile_kwargs,
               precompile=args.precompile)
