"""Shared helpers for the fault, crash, concurrency and security tests.

``FakeInductor`` is a cheap ``torch.compile`` backend that behaves like Inductor *towards the
cache*: it writes one file per graph into the local Inductor dir and bumps torch's FX-graph
hit/miss counters, so ``compile_regions(..., cache_dir=store)`` restores, captures and publishes
for real, in a second instead of 20 s of g++. The graph itself runs as Dynamo captured it, so the
outputs must equal eager exactly.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import compile_cache.store as store_mod
from compile_cache._testing import reset_process_state

REPO = Path(__file__).resolve().parents[1]
STORE_ENV = (
    "COMPILE_CACHE_DIR",
    "COMPILE_CACHE_SHARED",
    "COMPILE_CACHE_READ_ONLY",
    "COMPILE_CACHE_MAX_SIZE",
    "COMPILE_CACHE_SIGNING_KEY",
    "COMPILE_CACHE_LOCK",
    "COMPILE_CACHE_PRECOMPILE",
    "XDG_CACHE_HOME",
)
# fork is what makes 6 processes x rounds cheap: the children inherit the imported package and
# only do file I/O (no torch ops, so no OpenMP pool is touched after the fork).
FORK = multiprocessing.get_context("fork")


def clean_env(monkeypatch: Any, tmp_path: Path) -> Path:
    """Unset every store setting, point Inductor at a private dir, reset one-time warnings."""
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    inductor = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    reset_process_state()  # one-time warnings (and the rest) as in a fresh process
    return inductor


def store_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, store_mod.StoreWarning)]


def temp_files(root: Path) -> list[Path]:
    from compile_cache._paths import is_temp_name

    return [p for p in root.rglob("*") if is_temp_name(p.name)]


class FakeInductor:
    """A backend that writes ``fxgraph/fake/<sha of graph code>`` (plus ``payload`` bytes) into the
    local Inductor dir on a miss and counts a hit when the file is there with the right content."""

    def __init__(self, payload: int = 0, salt: str = "", library: bool = False) -> None:
        self.payload = payload
        self.salt = salt.encode()  # a different salt: a different artifact name, as a new graph
        self.library = library  # also write <sha>.so (a complete ELF), as Inductor's kernels
        self.hits = 0
        self.misses = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from torch._dynamo.utils import counters

        from compile_cache import artifacts

        code = gm.code.encode()
        path = artifacts.local_cache_dirs()["inductor"] / "fxgraph" / "fake" / hashlib.sha256(code + self.salt).hexdigest()
        content = code + b"\0" * self.payload
        try:
            cached = path.read_bytes() == content
        except OSError:
            cached = False
        if cached:
            self.hits += 1
            counters["inductor"]["fxgraph_cache_hit"] += 1
        else:
            self.misses += 1
            counters["inductor"]["fxgraph_cache_miss"] += 1
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            if self.library:
                from _store_helpers import tiny_elf

                path.with_name(path.name + ".so").write_bytes(tiny_elf(code))
        return gm.forward


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


class Net(nn.Module):
    """Two identical blocks (one region group) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def run_job(cache_dir: Any, backend: Any = None, batch: int = 3) -> tuple[Any, FakeInductor]:
    """One "training job": fresh Dynamo state, a model, ``compile_regions`` with the store, one
    forward checked against eager. Returns (``last_report()``, the backend)."""
    from torch._dynamo.utils import counters

    import compile_cache
    from compile_cache.session import flush

    torch._dynamo.reset()
    counters.clear()
    backend = backend or FakeInductor()
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(batch, 8)
    with torch.no_grad():
        ref = model(x)
        compile_cache.compile_regions(model, cache_dir=cache_dir, backend=backend)
        out = model(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    flush(60.0)  # the job ends: what the publisher queued is written, as at interpreter exit
    return compile_cache.last_report(), backend


def join_or_fail(proc: Any, timeout: float) -> None:
    """Join a multiprocessing child; a child still alive after ``timeout`` is a deadlock: kill, fail."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        raise AssertionError(f"process {proc.pid} still running after {timeout}s (deadlock?)")


def pack_members(store: Any, key: str) -> dict[str, bytes]:
    members: dict[str, bytes] = {}
    for pack in store.load(key):
        members.update(pack.members)
    return members


def env_with_repo(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STORE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env
