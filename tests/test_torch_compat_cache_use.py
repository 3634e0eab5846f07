"""compile_cache.torch_compat.cache_use: what each region group's compiles used, and who owns it.

The end-to-end checks (fresh nodes, two models in one process, a library being linked) are in
tests/test_capture.py; here the bookkeeping is driven through torch's own hooked functions, with
no compile: an entry written inside a region call belongs to that region's group only, an entry
written outside any region call belongs to nobody (a compile no region call started included),
and ``torch._dynamo.reset()`` (which clears Dynamo's callbacks) does not silently unhook the
capture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compile_cache.torch_compat import cache_use

pytestmark = pytest.mark.usefixtures("fresh_state")


@pytest.fixture
def local_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert cache_use.install()
    return tmp_path / "inductor"


def _write_fx(key: str, content: bytes) -> None:
    from torch._inductor.codecache import FxGraphCache

    FxGraphCache._write_to_local_cache(key, content)  # the hooked function torch calls


def _entries(owner: str) -> set[str]:
    units, _ = cache_use.snapshot([owner])
    return {member for _, unit in units for member in unit.entries}


def test_an_entry_written_during_a_region_call_belongs_to_that_group_only(local_dir: Path) -> None:
    stack = cache_use.owner_stack()
    stack.append("region_A")
    try:
        _write_fx("fakekeyaaaa", b"graph of A")
    finally:
        stack.pop()
    stack.append("region_B")
    try:
        _write_fx("fakekeybbbb", b"graph of B")
    finally:
        stack.pop()
    a, b = _entries("region_A"), _entries("region_B")
    assert len(a) == 1 and len(b) == 1 and a != b
    (member,) = a
    assert member.startswith("inductor/fxgraph/") and "fakekeyaaaa" in member
    assert (local_dir / member.split("/", 1)[1]).read_bytes() == b"graph of A"


def test_an_entry_written_outside_regions_and_compiles_belongs_to_nobody(local_dir: Path) -> None:
    _write_fx("fakekeycccc", b"someone else's graph")
    assert _entries("region_A") == set() and cache_use.counts()["fx_write"] == 1


def test_a_compile_no_region_call_started_is_kept_by_nobody(local_dir: Path) -> None:
    """The user's own ``torch.compile`` (no region call on the stack): its entries go into no
    pack, and a region that then records under the same compile id gets only its own."""
    from torch._guards import CompileContext, CompileId, compile_context

    with compile_context(CompileContext(CompileId(frame_id=9001, frame_compile_id=0))):
        _write_fx("fakekeydddd", b"the user's own graph")
        assert cache_use.counts()["unowned"] == 1
        stack = cache_use.owner_stack()
        stack.append("region_A")
        try:
            _write_fx("fakekeyeeee", b"graph of A")
        finally:
            stack.pop()
    (member,) = _entries("region_A")
    assert "fakekeyeeee" in member


def test_dynamo_reset_keeps_the_capture_hooked(local_dir: Path) -> None:
    from torch._dynamo.callback import callback_handler

    before = cache_use.counts()["resets"]
    torch._dynamo.reset()  # clears every callback torch knows of
    assert cache_use.counts()["resets"] == before + 1
    hooked = [cb for cb in callback_handler.end_callbacks
              if getattr(cb, "__module__", "") == cache_use.__name__]
    assert len(hooked) == 1
    torch._dynamo.reset()
    assert len([cb for cb in callback_handler.end_callbacks
                if getattr(cb, "__module__", "") == cache_use.__name__]) == 1


@pytest.mark.parametrize("shape", ["torch 2.13: (function, config)", "torch 2.11: a function",
                                   "a miss, torch 2.13", "a miss, torch 2.11"])
def test_an_aot_cache_lookup_of_either_torch_generation_passes_through(
        local_dir: Path, shape: str) -> None:
    # torch 2.11's AOTAutogradCache.try_load returns the function or None, 2.13 a pair: the hook
    # must hand either back unchanged (a hook that indexed a bare None broke every Inductor compile
    # on torch 2.11, seen on the GPU machine) and never fail the user's compile.
    import inspect

    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    def compiled(*args: object) -> None:
        return None

    returned = {"torch 2.13: (function, config)": (compiled, "config"),
                "torch 2.11: a function": compiled,
                "a miss, torch 2.13": (None, "config"),
                "a miss, torch 2.11": None}[shape]
    hook = inspect.getattr_static(AOTAutogradCache, "try_load").__func__
    original = hook._compile_cache_original
    cell = next(c for c in hook.__closure__ if c.cell_contents is original)
    cell.cell_contents = lambda *args, **kwargs: returned  # what that torch's try_load returns
    try:
        assert AOTAutogradCache.try_load(torch.nn.Identity(), [torch.ones(2)]) is returned
    finally:
        cell.cell_contents = original
