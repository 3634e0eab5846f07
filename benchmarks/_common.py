"""Shared pieces of the benchmarks: the GPT-2 they measure and running one scenario per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
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


def machine() -> str:
    """One line naming the machine, for the results tables."""
    import torch

    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
