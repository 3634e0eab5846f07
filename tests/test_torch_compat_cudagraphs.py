"""compile_cache.torch_compat.cudagraphs: CUDA graphs are never dropped silently.

CPU has no CUDA graphs, so the decision is exercised with torch's own config and mode table:
a ``reduce-overhead`` group whose tensors are not CPU-only declines precompile (warned, counted)
unless torch's global ``triton.cudagraphs`` (what torch's precompile load reads) agrees with the
mode; and regions compiled with CUDA graphs hand on copies of their outputs (the arrangement for
torch #152887/#160281), which is checked here on the copy function itself and on the install.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config

import compile_cache
import compile_cache.demo
from compile_cache import precompiled
from compile_cache.store import Store
from compile_cache.torch_compat import cudagraphs

pytestmark = pytest.mark.usefixtures("fresh_state")


def test_the_decision_follows_torchs_mode_table_and_global_setting() -> None:
    reduce = {"mode": "reduce-overhead"}
    assert inductor_config.triton.cudagraphs is False
    reason = cudagraphs.precompile_decline(reduce, ["cuda"])
    assert cudagraphs.is_decline(reason) and "triton.cudagraphs" in reason
    assert cudagraphs.precompile_decline({"mode": "max-autotune"}, ["cuda"]) is not None
    assert cudagraphs.precompile_decline({"options": {"triton.cudagraphs": True}}, None) is not None
    # No CUDA graphs asked for, or none possible (CPU tensors): precompile stays.
    assert cudagraphs.precompile_decline({}, ["cuda"]) is None
    assert cudagraphs.precompile_decline({"mode": "max-autotune-no-cudagraphs"}, ["cuda"]) is None
    assert cudagraphs.precompile_decline(reduce, ["cpu"]) is None
    assert cudagraphs.precompile_decline(
        {"mode": "reduce-overhead", "options": {"triton.cudagraphs": False}}, ["cuda"]) is None
    # When torch's global setting is what the mode asks for, the load keeps CUDA graphs.
    with inductor_config.patch({"triton.cudagraphs": True}):
        assert cudagraphs.precompile_decline(reduce, ["cuda"]) is None
        assert cudagraphs.precompile_decline({}, ["cuda"]) is None  # mode default: off either way
        off = cudagraphs.precompile_decline({"options": {"triton.cudagraphs": False}}, ["cuda"])
        assert cudagraphs.is_decline(off)  # the load would turn them on
    assert cudagraphs.wants_cudagraphs({"backend": "aot_eager", "mode": None}) is False


def test_a_reduce_overhead_group_on_a_gpu_declines_precompile_with_the_warning_and_counter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dynamo_reset: None) -> None:
    """The group's tensors stand in for CUDA ones (the devices its decision reads): installed
    with precompile asked for, it compiles without it, warned at the user's line, counted in
    the report and in the store's stats. Nothing compiles here (no forward)."""
    monkeypatch.setattr(precompiled, "region_devices", lambda module: ["cuda"])
    model = compile_cache.demo.TinyTransformer(layers=2, width=16, heads=2, vocab=32).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_cache.compile_regions(model, cache_dir=tmp_path / "store", mode="reduce-overhead",
                                      precompile=True)
    ours = [w for w in caught if issubclass(w.category, compile_cache.RegionPrecompileWarning)]
    assert len(ours) == 1 and "CUDA graphs" in str(ours[0].message)
    assert "precompile is off" in str(ours[0].message) and ours[0].filename == __file__
    report = compile_cache.last_report()
    assert report is not None and report.precompile_declined >= 1
    compile_cache.session.flush(30)
    assert Store(tmp_path / "store").stats()["precompile_declined"] == report.precompile_declined


def test_a_cpu_reduce_overhead_group_keeps_precompile(tmp_path: Path, dynamo_reset: None) -> None:
    model = compile_cache.demo.TinyTransformer(layers=2, width=16, heads=2, vocab=32).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_cache.compile_regions(model, cache_dir=tmp_path / "store", mode="reduce-overhead",
                                      precompile=True)
    assert not [w for w in caught if "CUDA graphs" in str(w.message)]
    report = compile_cache.last_report()
    assert report is not None and report.precompile_declined == 0
    runners = [m._compiled_call_impl for m in model.modules()
               if getattr(m, "_compiled_call_impl", None) is not None]
    assert runners and not any(r.copy_out for r in runners)  # no CUDA graphs on the CPU


def test_regions_with_cuda_graphs_copy_their_outputs_out(monkeypatch: pytest.MonkeyPatch,
                                                          dynamo_reset: None) -> None:
    from compile_cache import regions

    monkeypatch.setattr(regions, "region_devices", lambda module: ["cuda"])
    model = compile_cache.demo.TinyTransformer(layers=2, width=16, heads=2, vocab=32).eval()
    compile_cache.compile_regions(model, cache_dir=False, mode="reduce-overhead")
    runners = [m._compiled_call_impl for m in model.modules()
               if getattr(m, "_compiled_call_impl", None) is not None]
    assert runners and all(r.copy_out for r in runners)
    plain = compile_cache.demo.TinyTransformer(layers=2, width=16, heads=2, vocab=32).eval()
    compile_cache.compile_regions(plain, cache_dir=False)  # default mode: no copies
    assert not any(m._compiled_call_impl.copy_out for m in plain.modules()
                   if getattr(m, "_compiled_call_impl", None) is not None)


def test_detach_outputs_copies_cuda_tensors_and_their_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is checked on CPU by treating CPU tensors as the pool's (the device test is the
    only CUDA-specific part): values equal, storage new, gradients flow and are copies too."""
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")),
                        raising=True)
    x = torch.ones(3, requires_grad=True)
    pooled = x * 2  # stands for a region's output in the cudagraph pool
    out = cudagraphs.detach_outputs((pooled, {"h": pooled}, [pooled.detach()], 7))
    monkeypatch.undo()
    copy, mapping, (plain,), seven = out
    assert seven == 7
    for tensor in (copy, mapping["h"], plain):
        assert torch.equal(tensor, pooled) and tensor.data_ptr() != pooled.data_ptr()
    seen: list[torch.Tensor] = []
    pooled.register_hook(lambda g: seen.append(g))
    (copy.sum() * 3).backward()
    assert torch.equal(x.grad, torch.full((3,), 6.0)) and len(seen) == 1
    assert cudagraphs.detach_outputs("not a tensor") == "not a tensor"
