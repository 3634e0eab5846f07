"""compile_cache.prefetch: a cold CPU compile's ISA probe libraries built ahead, torch's answer kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from compile_cache import prefetch
from compile_cache.torch_compat import isa

_CHILD = Path(__file__).with_name("_prefetch_child.py")


def _cold_regional_compile(tmp: Path, prefetch_on: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        TRITON_CACHE_DIR=str(tmp / "triton"),
        COMPILE_CACHE_PREFETCH="1" if prefetch_on else "0",
        PYTHONPATH=os.pathsep.join([str(_CHILD.parents[1]), env.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(
        [sys.executable, str(_CHILD)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def test_prefetch_spares_torch_the_probe_builds_and_changes_no_kernel(tmp_path: Path) -> None:
    """One real cold Inductor compile with the prefetch, one without, in fresh cache dirs."""
    with_prefetch = _cold_regional_compile(tmp_path / "on", prefetch_on=True)
    without = _cold_regional_compile(tmp_path / "off", prefetch_on=False)

    assert without["prefetch"] is None
    assert without["torch_builds"], "without the prefetch torch builds its probe libraries"
    run = with_prefetch["prefetch"]
    assert run["built"] == run["planned"] == len(without["torch_builds"])
    assert run["loads_answered"] == run["planned"]  # no child-process load left to torch
    assert with_prefetch["torch_builds"] == []  # torch found every library it needed built
    # Torch's own probe still chose, and chose the same; so every kernel key is the same.
    assert with_prefetch["isa"] == without["isa"]
    assert with_prefetch["flags"] == without["flags"]
    assert with_prefetch["files"] == without["files"]


def test_only_cpu_inductor_compiles_prefetch() -> None:
    cpu = [torch.zeros(1)]
    assert prefetch.wants_cpu_inductor(cpu, {})
    assert prefetch.wants_cpu_inductor([], {"mode": "max-autotune"})
    assert not prefetch.wants_cpu_inductor(cpu, {"backend": "eager"})
    assert not prefetch.wants_cpu_inductor(cpu, {"disable": True})
    assert not prefetch.wants_cpu_inductor([torch.zeros(1, device="meta")], {})


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_switched_off_by_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, fresh_state: None
) -> None:
    monkeypatch.setenv(prefetch.ENV_SWITCH, value)
    assert prefetch.start_probe_builds() is None and prefetch.current() is None


def test_prefetched_loads_answer_torchs_probe_and_unknown_ones_go_to_torch(
    tmp_path: Path, fresh_state: None
) -> None:
    answered, unknown, unanswered = (os.path.realpath(tmp_path / n) for n in ("a", "b", "c"))
    for path, result in ((answered, False), (unanswered, None)):
        future: Future[bool | None] = Future()
        future.set_result(result)
        prefetch._load_answers[path] = future
    assert prefetch._answer_from_prefetch(None, answered) is False  # the early load's "no"
    assert prefetch._answer_from_prefetch(None, unknown) is None  # torch probes it
    assert prefetch._answer_from_prefetch(None, unanswered) is None  # build failed here: torch


def test_a_cancelled_run_starts_no_further_build(tmp_path: Path) -> None:
    """A rank that turns out to be a follower stops building: the leader's packs bring them."""
    run = prefetch.ProbePrefetch(planned=1)
    run.cancel()
    class Builder:  # a build that must not start
        builds = 0

        def get_target_file_path(self) -> str:
            return str(tmp_path / "probe.so")

        def build(self) -> None:
            self.builds += 1

    builder = Builder()
    answer: Future[bool | None] = Future()
    outcome = isa.build_and_load("k4", builder, None, lambda isa, path: True, answer, run.stop)
    assert outcome == "cancelled"
    assert builder.builds == 0
    assert answer.result(timeout=1) is None


@pytest.mark.parametrize(("cold", "env", "builds"), [
    (True, None, True), (False, None, False), (True, "0", False),
], ids=["cold-start-builds-by-default", "restored-start-builds-none", "switched-off"])
def test_a_cold_start_builds_the_kernel_header_in_the_background(
    monkeypatch: pytest.MonkeyPatch, cold: bool, env: str | None, builds: bool
) -> None:
    """The header a cold CPU compile waits for is built while Dynamo traces, unless the start
    restored its kernels (then it needs no header) or COMPILE_CACHE_PREFETCH_HEADER=0."""
    from compile_cache.torch_compat import cpp_header

    started = []
    monkeypatch.setattr(cpp_header, "start_background_build", lambda: started.append(1))
    monkeypatch.setattr(prefetch, "start_probe_builds", lambda: None)
    monkeypatch.setattr(prefetch, "defer_header_for", lambda model, kwargs: True)
    if env is None:
        monkeypatch.delenv("COMPILE_CACHE_PREFETCH_HEADER", raising=False)
    else:
        monkeypatch.setenv("COMPILE_CACHE_PREFETCH_HEADER", env)
    prefetch.start_for(torch.nn.Linear(2, 2), {}, cold=cold)
    assert bool(started) is builds
    started.clear()
    prefetch.start_for(torch.nn.Linear(2, 2), {"backend": "aot_eager"}, cold=cold)
    assert not started  # no CPU kernels: no header
