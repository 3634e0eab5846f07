"""Shared pieces of the benchmarks: the GPT-2 they measure and running one scenario per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any


def build_gpt2(layers: int, width: int, heads: int, seq: int) -> tuple[Any, Any]:
    """A transformers GPT-2 from its config (random weights, eval) and one batch of 1 x ``seq``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gpt2", n_layer=layers, n_embd=width, n_head=heads, n_positions=max(1024, seq)
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.randint(0, config.vocab_size, (1, seq))
    return model, tokens


# Llama-3.2-1B's proportions, scaled by width: heads of 64 channels, a quarter as many KV heads,
# an MLP four times as wide, Llama 3's vocabulary. 16x2048 gives Llama-3.2-1B's shape
# (32 heads, 8 KV heads, intermediate 8192, vocab 128256, tied embeddings).
LLAMA_VOCAB = 128256


def llama_shape(width: int) -> dict[str, int]:
    """Heads, KV heads and MLP width for a Llama of ``width`` (Llama-3.2-1B's proportions)."""
    heads = max(1, width // 64)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "intermediate_size": 4 * width,
    }


def parse_model_spec(spec: str) -> tuple[int, int]:
    """``"16x2048"`` -> (layers, width)."""
    try:
        layers, width = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"model spec {spec!r} is not LAYERSxWIDTH (e.g. 4x256)") from None
    if layers < 1 or width < 1:
        raise ValueError(f"model spec {spec!r}: layers and width must be positive")
    return layers, width


def build_model(
    arch: str,
    layers: int,
    width: int,
    seq: int,
    *,
    heads: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> tuple[Any, Any]:
    """A random-weight transformers model (``arch`` ``gpt2`` or ``llama``) built directly on
    ``device`` in ``dtype``, in eval mode, and one batch of 1 x ``seq`` tokens on that device.

    ``gpt2`` with float32 on CPU is exactly ``build_gpt2``; ``llama`` follows ``llama_shape``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch == "gpt2":
        if device == "cpu" and dtype == "float32":
            return build_gpt2(layers, width, heads or max(1, width // 64), seq)
        config = AutoConfig.for_model(
            "gpt2", n_layer=layers, n_embd=width, n_head=heads or max(1, width // 64),
            n_positions=max(1024, seq),
        )
    elif arch == "llama":
        shape = llama_shape(width)
        if heads:
            shape["num_attention_heads"] = heads
            shape["num_key_value_heads"] = max(1, heads // 4)
        config = AutoConfig.for_model(
            "llama", num_hidden_layers=layers, hidden_size=width, vocab_size=LLAMA_VOCAB,
            max_position_embeddings=max(2048, seq), tie_word_embeddings=True,
            rope_theta=500000.0, **shape,
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; choose gpt2 or llama")
    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    # Built in place on the target device and dtype: a 1B model initialised on the CPU in
    # float32 and then moved would cost more than the compile we time.
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.to(device=device, dtype=torch_dtype)
    tokens = torch.randint(0, config.vocab_size, (1, seq), device=device)
    return model, tokens


def synchronize(device: str) -> None:
    """Waits for queued GPU work, so that a timer stopped next measures finished work."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run_child(argv: list[str], env: dict[str, str], timeout: float = 1800) -> dict:
    """Runs ``python argv...`` in a fresh process; returns its last stdout line as JSON plus its
    whole-process wall time (start to exit, imports included) as ``process_s``."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def fresh_node_env(node: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process on a new machine (a new container, VM or CI runner): new
    TMPDIR, HOME, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR under ``node``.

    Torch keeps machine-wide state outside its cache dir (the 149 MB precompiled header under
    the temp dir, the ISA probe's libraries, Triton's ~/.triton), so a new cache dir alone is
    not a new node. Passing the same ``node`` again is the same machine again (its dirs warm).
    """
    env = dict(os.environ if base is None else base)
    env = {k: v for k, v in env.items() if not k.startswith("COMPILE_CACHE_")}
    paths = {
        "TMPDIR": os.path.join(node, "tmp"),
        "HOME": os.path.join(node, "home"),
        "XDG_CACHE_HOME": os.path.join(node, "xdg"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(node, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(node, "triton"),
    }
    for name in ("TMPDIR", "HOME", "XDG_CACHE_HOME"):
        os.makedirs(paths[name], exist_ok=True)
    env.update(paths)
    return env


def prime_precompiled_header(timeout: float = 600) -> None:
    """Builds torch's machine-wide precompiled kernel header with a throwaway CPU compile.

    Inductor keeps it outside TORCHINDUCTOR_CACHE_DIR, once per machine and compiler flags
    (``<tmp>/torchinductor_<user>/precompiled_headers``, about 5 s to build on 2 cores). Without
    this, whichever scenario runs first on a fresh machine pays for it and the others do not.
    """
    code = "import torch\ntorch.compile(lambda x: (x.sin() + 1).relu())(torch.randn(64, 64))\n"
    with tempfile.TemporaryDirectory(prefix="bench_prime_") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tmp, COMPILE_CACHE_PREFETCH="0")
        subprocess.run([sys.executable, "-c", code], env=env, timeout=timeout, check=True,
                       capture_output=True)


def machine() -> str:
    """One line naming the machine, for the results tables."""
    import torch

    gpu = ""
    if torch.cuda.is_available():
        gpu = f", GPU {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}"
    )
