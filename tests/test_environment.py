"""Tests of compile_cache.environment: fields, digest stability across processes, sensitivity."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from compile_cache import environment as envmod

REPO = Path(__file__).resolve().parents[1]


def test_fields_present() -> None:
    env = envmod.environment()
    for key in (
        "torch",
        "torch_git",
        "torch_debug",
        "torch_cuda",
        "python",
        "triton",
        "machine",
        "cpu_threads",
        "cpu_capability",
        "default_dtype",
        "inductor_config",
        "functorch_config",
        "dynamo_config",
        "cuda_available",
    ):
        assert key in env, key
        assert isinstance(env[key], str)
    assert env["torch"] == torch.__version__
    assert env["cpu_threads"] == str(torch.get_num_threads())


def test_cheap_once_torch_configs_loaded() -> None:
    envmod.environment()
    t0 = time.perf_counter()
    envmod.environment()
    assert time.perf_counter() - t0 < 0.5  # measured ~6 ms; generous for a shared machine


def _digest_in_subprocess(seed: str, cwd: Path) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from compile_cache.environment import environment_digest; print(environment_digest())",
        ],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_digest_stable_across_processes(tmp_path: Path) -> None:
    a = _digest_in_subprocess("1", tmp_path)
    b = _digest_in_subprocess("12345", REPO)
    assert a == b
    assert len(a) == 32 and int(a, 16) >= 0


def test_digest_changes_with_threads() -> None:
    before = envmod.environment_digest()
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(n + 1)
        assert envmod.environment_digest() != before
    finally:
        torch.set_num_threads(n)
    assert envmod.environment_digest() == before


def test_digest_changes_with_inductor_config() -> None:
    import torch._inductor.config as ic

    before = envmod.environment_digest()
    with ic.patch({"cpp.vec_isa_ok": not ic.cpp.vec_isa_ok}):
        assert envmod.environment_digest() != before
    with ic.patch(max_autotune=not ic.max_autotune):
        assert envmod.environment_digest() != before
    assert envmod.environment_digest() == before


def test_digest_of_given_env_is_order_independent() -> None:
    assert envmod.environment_digest({"a": "1", "b": "2"}) == envmod.environment_digest(
        {"b": "2", "a": "1"}
    )


def test_cross_rank_hazards_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    hazards = envmod.cross_rank_hazards()
    assert any("set_num_threads" in h for h in hazards)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    monkeypatch.setenv("LOCAL_RANK", "1")
    hazards = envmod.cross_rank_hazards()
    assert isinstance(hazards, list)
    if not torch.cuda.is_available():
        assert hazards == []
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads() + 3))
    assert any("OMP_NUM_THREADS" in h for h in envmod.cross_rank_hazards())
