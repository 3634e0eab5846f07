"""Hooks registered or removed after a region's compiled code was traced (compile_cache.regions).

Dynamo does not guard on hook dicts that were empty when it traced (``skip_nnmodule_hook_guards``),
so a hook added there later is skipped by the compiled code. The block must then run eagerly
(warned once, counted) so the hook fires, and the other blocks stay compiled. In-process with a
counting backend, then across two processes with Inductor, with and without precompile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _region_models import Block, SeqModel
from conftest import fresh_node_env, publisher_env
from torch.nn.modules.module import register_module_forward_hook

from compile_cache import compile_regions
from compile_cache.regions import RegionEagerWarning, get_plan, region_stats

CHILD = Path(__file__).with_name("_hooks_child.py")
X = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))


def _pair() -> tuple[SeqModel, SeqModel]:
    """A model to compile and its eager twin, with the same weights."""
    torch.manual_seed(0)
    model = SeqModel()
    torch.manual_seed(0)
    return model, SeqModel()


def _eager_calls(model: torch.nn.Module) -> dict[str, int]:
    return {name[:12]: s["eager_calls"] for name, s in region_stats(model).items()}


def _eager_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RegionEagerWarning)]


def _double_input(module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0] * 2,)


def _add_one(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + 1


def _scale_blocks(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    return output * 1.5 if isinstance(module, Block) else None


def test_hooks_added_after_the_first_forward_fire(counting_backend):
    model, ref = _pair()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    torch.testing.assert_close(model(X), ref(X))
    graphs, calls = len(counting_backend.graphs), counting_backend.calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (model, ref):
            m.blocks[1].register_forward_pre_hook(_double_input)
        torch.testing.assert_close(model(X), ref(X))
        torch.testing.assert_close(model(X), ref(X))
        # blocks 0 and 2 and the head still ran their compiled graphs; block 1 ran eagerly
        assert counting_backend.calls == calls + 2 * 3
        assert _eager_calls(model) == {"region_Block": 2, "part_Head_b8": 0}
        first = _eager_warnings(caught)
        assert len(first) == 1 and "forward pre-hook on the module itself" in first[0], first
        assert "(Block)" in first[0] and "register hooks before compile_regions" in first[0]

        for m in (model, ref):  # a forward hook on the head (a part of its own)
            m.head.register_forward_hook(_add_one)
        torch.testing.assert_close(model(X), ref(X))
        assert _eager_calls(model) == {"region_Block": 3, "part_Head_b8": 1}
        assert "forward hook on the module itself" in _eager_warnings(caught)[-1]

        handle = register_module_forward_hook(_scale_blocks)  # a global one, on every module
        try:
            torch.testing.assert_close(model(X), ref(X))
            assert _eager_calls(model) == {"region_Block": 6, "part_Head_b8": 2}
        finally:
            handle.remove()
        torch.testing.assert_close(model(X), ref(X))
        # one warning per group and cause: the block group's and the head's, no more
        assert len(_eager_warnings(caught)) == 2, _eager_warnings(caught)
    assert len(counting_backend.graphs) == graphs  # nothing recompiled for the hooks


def test_a_hook_removed_after_the_first_forward_stops(counting_backend):
    model, ref = _pair()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    model(X)
    handles = [m.blocks[0].register_forward_pre_hook(_double_input) for m in (model, ref)]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        torch.testing.assert_close(model(X), ref(X))
    for h in handles:
        h.remove()
    calls = counting_backend.calls
    torch.testing.assert_close(model(X), ref(X))
    assert counting_backend.calls == calls + 4  # every block compiled again, and the head
    assert _eager_calls(model)["region_Block"] == 1

    # a hook present when compiling (traced in, guarded by Dynamo) removed after the first forward
    model, ref = _pair()
    handles = [m.blocks[1].register_forward_hook(_add_one) for m in (model, ref)]
    compile_regions(model, backend=counting_backend, cache_dir=False)
    torch.testing.assert_close(model(X), ref(X))
    for h in handles:
        h.remove()
    torch.testing.assert_close(model(X), ref(X))
    assert sum(_eager_calls(model).values()) == 0


def test_a_hook_on_one_of_identical_blocks_before_the_first_forward(counting_backend):
    """Block 0 traces the group's graph without hooks; block 1, hooked after compile_regions,
    would reuse it (no guard on the empty hook dict): it runs eagerly instead."""
    model, ref = _pair()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    for m in (model, ref):
        m.blocks[1].register_forward_pre_hook(_double_input)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(model(X), ref(X))
    assert _eager_calls(model)["region_Block"] == 1 and len(_eager_warnings(caught)) == 1


def test_a_retrace_with_the_hooks_stays_compiled(counting_backend):
    """fully_shard after a warm-up changes the block's class and adds hooks: Dynamo's class
    guard fails and it traces again, hooks included; the blocks stay compiled."""
    model, ref = _pair()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    model(X)
    sharded = type("FSDPBlock", (Block,), {})
    for m in (model, ref):
        for block in m.blocks:
            block.__class__ = sharded
            block.register_forward_pre_hook(_double_input)
    torch.testing.assert_close(model(X), ref(X))
    assert sum(_eager_calls(model).values()) == 0
    assert len(counting_backend.graphs) == get_plan(model).expected_graphs + 1


# ------------------------------------------------- two processes, Inductor, with and without precompile


def _start(root: Path, store: Path, phase: str, precompile: bool,
           machine: Path | None = None) -> subprocess.Popen:
    """The child on the fresh node ``root``; with ``machine`` (conftest.build_machine), a
    publisher on that build machine with local cache dirs of its own under ``root``."""
    path = os.pathsep.join([str(CHILD.parent), str(CHILD.parents[1]), os.environ.get("PYTHONPATH", "")])
    env = (fresh_node_env(root, PYTHONPATH=path) if machine is None
           else publisher_env(machine, root, PYTHONPATH=path))
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(store), phase, "1" if precompile else "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _result(proc: subprocess.Popen) -> dict[str, Any]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    lines = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, err[-4000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="session")
def nodes(tmp_path_factory: pytest.TempPathFactory,
          build_machine: Path) -> dict[tuple[bool, str], dict[str, Any]]:
    """Per precompile setting: a publisher fills a store (on the build machine, with local
    cache dirs of its own), then a fresh node restores from it. Both settings run side by side."""
    tmp = tmp_path_factory.mktemp("hooks")
    settings = (True, False)
    results = {}
    for phase, node in (("publish", "node-a"), ("load", "node-b")):
        machine = build_machine if phase == "publish" else None
        procs = {p: _start(tmp / f"{node}-{int(p)}", tmp / f"store-{int(p)}", phase, p, machine)
                 for p in settings}
        for p, proc in procs.items():
            results[(p, phase)] = _result(proc)
    return results


@pytest.mark.parametrize("phase", ["publish", "load"])
@pytest.mark.parametrize("precompile", [True, False], ids=["precompile", "graphs_only"])
def test_a_hook_after_the_first_forward_fires_across_nodes(nodes, precompile: bool, phase: str) -> None:
    r = nodes[(precompile, phase)]
    assert r["before"] < 1e-5 and r["after"] < 1e-5 and r["again"] < 1e-5, r
    assert list(r["eager_calls"].values()) == [2], r["eager_calls"]  # block 1, twice
    assert len(r["eager_warnings"]) == 1 and "forward pre-hook" in r["eager_warnings"][0], r


@pytest.mark.parametrize("precompile", [True, False], ids=["precompile", "graphs_only"])
def test_the_fresh_node_restored_what_the_publisher_compiled(nodes, precompile: bool) -> None:
    publish, load = nodes[(precompile, "publish")], nodes[(precompile, "load")]
    assert publish["fxgraph_misses"] >= 1 and load["fxgraph_misses"] == 0, (publish, load)
    if precompile:  # the fresh node loaded Dynamo's traced code: it traced nothing
        assert [g["status"] for g in load["groups"].values()] == ["loaded"], load["groups"]
        assert load["frames_traced"] == 0
    else:
        assert load["groups"] == {} or all(g["status"] != "loaded" for g in load["groups"].values())
