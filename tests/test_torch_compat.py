"""compile_cache.torch_compat: every private torch name behind a capability, and what happens
when torch moves one.

For each capability the private name is monkeypatched away; then the product feature that needs
it runs and must (1) warn exactly once, (2) show the capability as missing in capabilities(),
doctor and last_report(), and (3) still work, or degrade in the documented, visible way.
"""

from __future__ import annotations

import contextvars
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import compile_cache
from compile_cache import cli, torch_compat
from compile_cache.torch_compat import TorchCompatWarning, dynamo

pytestmark = pytest.mark.usefixtures("fresh_state", "dynamo_reset")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _compile_and_run(tmp_path: Path, **kwargs: Any) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = model(x)
        compile_cache.compile_regions(model, **{"backend": "eager", "cache_dir": tmp_path / "s", **kwargs})
        out = model(x)
    return model, ref, out


def _compat_warnings(record: list[warnings.WarningMessage], name: str) -> list[str]:
    return [str(w.message) for w in record
            if issubclass(w.category, TorchCompatWarning) and repr(name) in str(w.message)]


def _row(name: str) -> torch_compat.CapabilityStatus:
    (row,) = [c for c in torch_compat.capabilities() if c.name == name]
    return row


def _doctor_row(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str) -> dict[str, Any]:
    code = cli.main(["doctor", "--json", "--cache-dir", str(tmp_path / "doctor-store")])
    assert code in (0, 1)
    data = json.loads(capsys.readouterr().out)
    (row,) = [c for c in data["capabilities"] if c["name"] == name]
    return row


def _load_compile_stack() -> None:
    """Torch imports parts of its compile stack lazily, by the very names taken away here: one
    throwaway compile first, so that torch itself is not what breaks."""
    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))
    torch._dynamo.reset()


@pytest.fixture
def missing(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Any, str], None]]:
    """``missing(obj, attr)``: take a private name away from torch (and forget earlier probes)."""

    def take_away(obj: Any, attr: str) -> None:
        _load_compile_stack()
        monkeypatch.delattr(obj, attr)
        torch_compat._reset()

    yield take_away


def _check_missing(record: list[warnings.WarningMessage], name: str) -> None:
    assert len(_compat_warnings(record, name)) == 1, [str(w.message) for w in record]
    row = _row(name)
    assert not row.available and name in torch_compat.degraded()
    assert row.detail  # why, and what breaks


# ------------------------------------------------------------------------------ the registry


#: The capabilities a supported torch is known to lack (docs/getting-started.md, "Supported
#: versions"), each with what doctor says of it: every other one must be available.
KNOWN_MISSING: dict[tuple[int, int], dict[str, str]] = {
    (2, 11): {
        "dynamo.precompile": "config overrides are process-wide, not per thread",
        "dynamo.isolate_recompiles": "torch.compile takes no 'isolate_recompiles'",
    },
}


def _known_missing() -> dict[str, str]:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return KNOWN_MISSING.get((major, minor), {})


def test_known_missing_capabilities_are_documented() -> None:
    text = (Path(__file__).parents[1] / "docs" / "getting-started.md").read_text()
    section = text.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    for (major, minor), names in KNOWN_MISSING.items():
        lacks = section.split(f"torch {major}.{minor} lacks", 1)
        assert len(lacks) == 2, f"torch {major}.{minor}"
        assert all(f"`{name}`" in lacks[1].split("\n\n", 1)[0] for name in names), names


def test_every_capability_is_available_on_this_torch() -> None:
    """Every capability, but those this torch is known to lack (each missing for the reason
    doctor gives)."""
    rows = torch_compat.capabilities()
    assert {r.name for r in rows} == {
        "dynamo.counters", "dynamo.guard_failures", "dynamo.cache_entries", "dynamo.config",
        "dynamo.precompile", "dynamo.optimized_module", "inductor.cache_dir", "isa.probe_hook",
        "inductor.header_dir", "inductor.load_guard",
        "isa.prefetch", "c10d.default_store", "configs.portable",
        "dynamo.isolate_recompiles", "dynamo.resume_functions", "dynamo.nested_graph_breaks",
        "dynamo.maybe_mark_dynamic", "cache_use.capture", "cpp_header.defer",
        "autotune.capture", "cudagraphs.modes", "pgo.code_state",
        "inductor.lazy_compile_stack", "pgo.automatic_dynamic", "inductor.light_restored_code",
        "inductor.light_cpp_paths", "dynamo.lazy_decomp_table", "kernels.resumable_forward",
        "dynamo.module_by_name",
    }
    known = _known_missing()
    missing = {r.name: r.detail for r in rows if not r.available}
    assert set(missing) == set(known), [tuple(r) for r in rows if not r.available]
    assert all(known[name] in detail for name, detail in missing.items()), missing
    name, available, detail = rows[0]  # rows unpack as (name, available, detail)
    assert available and detail.startswith("uses ")
    assert set(torch_compat.degraded()) <= set(known)


def test_doctor_lists_the_capabilities(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["doctor", "--cache-dir", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "Torch capabilities" in out and "dynamo.counters" in out
    missing = [line.split() for line in out.splitlines() if " MISSING " in line]
    assert {words[0] for words in missing} == set(_known_missing()), missing
    for name, why in _known_missing().items():  # doctor says why
        (line,) = [ln for ln in out.splitlines() if ln.split()[:2] == [name, "MISSING"]]
        assert why in line


# ------------------------------------------------------------------------------ dynamo


def test_counters_missing_publishes_nothing_and_says_so(
    tmp_path: Path, missing: Callable[[Any, str], None], capsys: pytest.CaptureFixture[str]
) -> None:
    import torch._dynamo.utils as dynamo_utils

    missing(dynamo_utils, "counters")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _model, ref, out = _compile_and_run(tmp_path)
    torch.testing.assert_close(out, ref)
    _check_missing(record, "dynamo.counters")
    report = compile_cache.last_report()
    assert "dynamo.counters" in report.degraded and "dynamo.counters" in report.summary()
    assert dynamo.CompileCounters.snapshot() == dynamo.CompileCounters()  # nothing to see
    assert not _doctor_row(capsys, tmp_path, "dynamo.counters")["available"]


def test_renamed_counters_are_noticed_after_an_inductor_compile() -> None:
    import torch._inductor.config  # noqa: F401 - the check reads whether torch's caches are on

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dynamo.check_counters(dynamo.CompileCounters(graphs=2, fxgraph_miss=2))  # names moved
        assert torch_compat.degraded() == []
        dynamo.check_counters(dynamo.CompileCounters(graphs=2))  # compiled, no counter moved
        dynamo.check_counters(dynamo.CompileCounters(graphs=1))
    assert len(_compat_warnings(record, "dynamo.counters")) == 1
    assert "names changed" in _compat_warnings(record, "dynamo.counters")[0]
    assert "dynamo.counters" in torch_compat.degraded()


def test_guard_failures_missing_still_compiles(
    tmp_path: Path, missing: Callable[[Any, str], None]
) -> None:
    import torch._dynamo.utils as dynamo_utils

    missing(dynamo_utils, "guard_failures")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, ref, out = _compile_and_run(tmp_path, cache_dir=False)
    torch.testing.assert_close(out, ref)
    _check_missing(record, "dynamo.guard_failures")
    assert all(s["block_recompiles"] == 0 for s in compile_cache.region_stats(model).values())


def test_cache_entries_missing_reports_minus_one(
    tmp_path: Path, missing: Callable[[Any, str], None]
) -> None:
    import torch._dynamo.eval_frame as eval_frame

    model, ref, out = _compile_and_run(tmp_path, cache_dir=False)
    missing(eval_frame, "_debug_get_cache_entry_list")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        stats = compile_cache.region_stats(model)
        compile_cache.region_stats(model)
    assert stats and all(s["cache_entries"] == -1 for s in stats.values())
    _check_missing(record, "dynamo.cache_entries")


def test_config_missing_compiles_with_the_group_size_as_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._dynamo.config as dynamo_config

    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = model(x)
    with monkeypatch.context() as patch:
        patch.delattr(dynamo_config, "recompile_limit")  # hidden: reads raise AttributeError
        torch_compat._reset()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            compile_cache.compile_regions(model, backend="eager", cache_dir=False)
        assert len(_compat_warnings(record, "dynamo.config")) == 1
        assert not _row("dynamo.config").available
    with torch.no_grad():  # torch itself needs the setting back to run
        torch.testing.assert_close(model(x), ref)
    assert "dynamo.config" in torch_compat.degraded()


def test_precompile_missing_compiles_normally(
    tmp_path: Path, missing: Callable[[Any, str], None]
) -> None:
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.guards import CheckFunctionManager

    # what the guard filter needs to know which guards can be saved
    missing(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _model, ref, out = _compile_and_run(tmp_path, precompile=True)
    torch.testing.assert_close(out, ref)
    _check_missing(record, "dynamo.precompile")
    assert not dynamo_config.caching_precompile  # never switched on
    assert "dynamo.precompile" in compile_cache.last_report().degraded


def test_precompile_is_off_where_config_overrides_are_process_wide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch 2.11 keeps one override per setting for the whole process: a region call's
    # caching_precompile=True would reach another thread's compile and drop its ID_MATCH guards.
    import torch._dynamo.config as dynamo_config

    class ProcessWide:  # an override that is not a ContextVar (it forwards, so torch still runs)
        def __init__(self, real: Any) -> None:
            self.real = real

        def get(self, *args: Any) -> Any:
            return self.real.get(*args)

        def set(self, value: Any) -> Any:
            return self.real.set(value)

    _load_compile_stack()
    entry = dynamo_config._config["caching_precompile"]
    if isinstance(entry.user_override, contextvars.ContextVar):  # torch >= 2.13: per thread
        monkeypatch.setattr(entry, "user_override", ProcessWide(entry.user_override))
    # (torch 2.11: the override is a plain value, process-wide as it is: nothing to take away)
    torch_compat._reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _model, ref, out = _compile_and_run(tmp_path, precompile=True)
    torch.testing.assert_close(out, ref)
    _check_missing(record, "dynamo.precompile")
    assert "per thread" in _row("dynamo.precompile").detail
    assert not dynamo_config.caching_precompile


def test_optimized_module_missing_still_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._dynamo.eval_frame as eval_frame

    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = model(x)
    with monkeypatch.context() as patch:
        patch.delattr(eval_frame, "OptimizedModule")
        torch_compat._reset()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            compile_cache.compile_regions(model, backend="eager", cache_dir=False)
            compile_cache.region_stats(model)  # checks again: no second warning
        _check_missing(record, "dynamo.optimized_module")
    with torch.no_grad():  # Dynamo itself needs the class back to trace
        torch.testing.assert_close(model(x), ref)


# ------------------------------------------------------------------------------ inductor, configs


def test_cache_dir_missing_falls_back_to_torchs_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: Callable[[Any, str], None]
) -> None:
    import torch._inductor.runtime.cache_dir_utils as cache_dir_utils

    from compile_cache import artifacts

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    missing(cache_dir_utils, "cache_dir")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dirs = artifacts.local_cache_dirs()
        artifacts.local_cache_dirs()
    assert dirs["inductor"] == tmp_path / "inductor"  # the same answer torch would give
    _check_missing(record, "inductor.cache_dir")


def test_portable_configs_missing_keys_without_them(
    missing: Callable[[Any, str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils._config_module import ConfigModule

    from compile_cache import keys

    missing(ConfigModule, "save_config_portable")  # the method of every torch config module
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        env = keys.environment()
        keys.environment()
    assert env["inductor_config"] == env["dynamo_config"] == "unavailable"
    assert len(env["cpu_capability"]) > 0  # the rest of the key is still there
    _check_missing(record, "configs.portable")


def test_portable_configs_of_an_older_torch_keep_the_private_settings(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch 2.11's save_config_portable takes no readonly_values; its own FX-graph key counts
    # the private (_-prefixed) settings, so the environment key must keep them there too.
    from torch.utils._config_module import ConfigModule

    from compile_cache.torch_compat import configs

    real = ConfigModule.save_config_portable

    def older(self: Any, *, ignore_private_configs: bool = True) -> dict[str, Any]:
        return real(self, ignore_private_configs=ignore_private_configs)

    monkeypatch.setattr(ConfigModule, "save_config_portable", older)
    inductor = configs.portable_configs()["inductor_config"]
    assert inductor and any(name.startswith("_") for name in inductor)


# ------------------------------------------------------------------------------ isa


def test_probe_hook_missing_leaves_the_probe_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor import cpu_vec_isa

    from compile_cache import artifacts
    from compile_cache.torch_compat import isa

    monkeypatch.delattr(cpu_vec_isa.VecISA, "_probe_load", raising=False)
    monkeypatch.delattr(cpu_vec_isa.VecISA, "check_build")
    torch_compat._reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert isa.watch() is False
        assert artifacts.trust_restored_isa_answers({"inductor/ab/ok.so": True}) == 0
        assert isa.torch_load_probe() is None
    _check_missing(record, "isa.probe_hook")


def test_prefetch_without_get_lock_dir_is_off_with_one_warning_not_a_wait(
    missing: Callable[[Any, str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    import platform
    import sys

    from torch._inductor import codecache

    from compile_cache import prefetch

    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.fail("the ISA prefetch exists for Linux x86-64 only; this CI machine is one")
    missing(codecache, "get_lock_dir")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert prefetch.start_probe_builds() is None
        assert prefetch.start_probe_builds() is None
    assert prefetch.current() is None  # no thread, no pending answer for torch to wait on
    _check_missing(record, "isa.prefetch")
    assert "get_lock_dir" in _row("isa.prefetch").detail


# ------------------------------------------------------------------------------ c10d


def test_default_store_missing_is_a_clear_error_not_a_collective(
    tmp_path: Path, missing: Callable[[Any, str], None]
) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from compile_cache import DistributedSetupError
    from compile_cache.distributed import rendezvous
    from compile_cache.torch_compat import c10d

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        missing(distributed_c10d, "_get_default_store")
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert c10d.default_store() is None
            with pytest.raises(DistributedSetupError, match="torchrun") as info:
                rendezvous.Ranks.current()
            assert "_get_default_store" in str(info.value)  # why: the capability is missing
        _check_missing(record, "c10d.default_store")
    finally:
        dist.destroy_process_group()
