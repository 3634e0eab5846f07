"""compile_cache.torch_compat.autotune: autotune results ride with the region group that used them.

No GPU and no Triton here, so torch's own autotune-cache functions are driven with stand-in
artifacts: ``AutotuneCache.create`` during a (stand-in) compile of the group, ``save`` at the
kernel's first run (outside the compile, inside the group's call), then the capture, a pack, a
restore on a fresh node, and torch's ``AutotuneCache._read`` there, at the path torch derives.
The max-autotune selection cache goes the same way as a part merged into torch's file.
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch

from compile_cache import artifacts, capture
from compile_cache.store import Store, generations
from compile_cache.torch_compat import autotune, cache_use

pytestmark = pytest.mark.usefixtures("fresh_state")

KEY = "cd" * 16
KERNEL = "ab/cabq7xkernelstandin0000000000000000000000000000000000000000.py"
META = {"autotune_local_cache": True}


def _node(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
    return root


def _compiling(frame: int) -> object:
    from torch._guards import CompileContext, CompileId, compile_context

    return compile_context(CompileContext(CompileId(frame_id=frame, frame_compile_id=0)))


def _publish_and_restore(store: Store, owners: list[str], node: Path) -> dict[str, str]:
    """Publish what ``owners`` used as one pack; restore their units on the node now current."""
    found = capture.usage(owners)
    members, manifest = capture.resolve(found, {})
    assert store.publish(KEY, members, metadata={generations.MANIFEST_KEY: manifest}) is not None
    packs = store.load(KEY)
    selection = generations.select([p.info for p in packs], owners)
    restored: dict[str, str] = {}
    for pack in packs:
        wanted = [n for n, src in selection.sources.items() if src == pack.info.name]
        result = artifacts.restore(pack.members.only(wanted))
        restored.update({name: real for name, (real, _, _) in result.files.items()})
        pack.close()
    return restored


def test_a_best_config_is_captured_packed_restored_and_found_where_torchs_autotuner_looks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    node_a = _node(monkeypatch, tmp_path / "node-a" / "inductor")
    assert capture.install() and autotune.install_possible()
    published: list[set[str]] = []
    cache_use.on_compiled(published.append)
    kernel = node_a / KERNEL
    kernel.parent.mkdir(parents=True)
    kernel.write_text("# a Triton kernel's source (stand-in)\n")
    owners = cache_use.owner_stack()
    owners.append("region_A")
    try:
        with _compiling(7):  # the group's compile loads the kernel: torch creates its cache
            tuner = AutotuneCache.create(META, str(kernel), "configs-hash")
        assert tuner is not None
        # The kernel's first run, in the group's call, after the compile: torch benchmarks and
        # saves the winner (a stand-in for triton.Config: what save() reads of it).
        winner = types.SimpleNamespace(kwargs={"XBLOCK": 64}, num_warps=4, num_stages=2)
        tuner.save(winner, 1_500_000)
    finally:
        owners.pop()
    path = autotune.best_config_path(str(kernel))  # torch's own key functions
    assert os.path.isfile(path) and path.endswith(".best_config")
    assert os.path.dirname(path) == str(kernel.parent)
    member = "inductor/" + os.path.relpath(path, node_a).replace(os.sep, "/")
    units, _ = cache_use.snapshot(["region_A"])
    assert [member in unit.entries for _, unit in units] == [True]  # in the kernel's unit only
    assert published == [{"region_A"}]  # a publish was queued after the first run
    assert autotune.counts()["best_config_saved"] == 1

    node_b = _node(monkeypatch, tmp_path / "node-b" / "inductor")
    restored = _publish_and_restore(Store(tmp_path / "store"), ["region_A"], node_b)
    assert member in restored
    kernel_b = node_b / KERNEL  # the FX entry's bundle writes the kernel at the same place
    reader = AutotuneCache.create(META, str(kernel_b), "configs-hash")
    assert reader is not None and reader.local_cache is not None
    assert reader.local_cache[1] == restored[member] == autotune.best_config_path(str(kernel_b))
    best = reader._read()  # what torch's read_best (check_autotune_cache) reads before benchmarking
    assert best is not None
    assert best["XBLOCK"] == 64 and best["num_warps"] == 4 and best["configs_hash"] == "configs-hash"


def test_a_best_config_read_at_load_counts_as_used_and_nobodys_kernel_is_not_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm local dir: torch reads the result instead of benchmarking; the group that loaded the
    kernel still publishes it. A kernel no region call ran stays out of every pack."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    node = _node(monkeypatch, tmp_path / "inductor")
    assert capture.install() and autotune.install_possible()
    kernel = node / KERNEL
    kernel.parent.mkdir(parents=True)
    kernel.write_text("# stand-in\n")
    winner = types.SimpleNamespace(kwargs={"XBLOCK": 32}, num_warps=2, num_stages=1)
    AutotuneCache.create(META, str(kernel), "h").save(winner, 1)  # nobody's: not kept
    assert cache_use.snapshot(["region_B"])[0] == []
    owners = cache_use.owner_stack()
    owners.append("region_B")
    try:
        with _compiling(3):
            assert AutotuneCache.create(META, str(kernel), "h")._read()["XBLOCK"] == 32
    finally:
        owners.pop()
    units, _ = cache_use.snapshot(["region_B"])
    assert [sorted(unit.entries) for _, unit in units] == [
        ["inductor/" + os.path.relpath(autotune.best_config_path(str(kernel)), node)]]


def test_the_selection_cache_part_a_compile_used_is_merged_into_torchs_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """max-autotune's choice timings: only the lookups' own entries travel, and a restore merges
    them into torch's selection cache, where PersistentCache.lookup finds them (no benchmark)."""
    from torch._inductor.codecache import PersistentCache

    _node(monkeypatch, tmp_path / "node-a" / "inductor")
    assert capture.install() and autotune.install_possible()
    system = {"device": {"name": "stand-in GPU"}, "version": {"triton": "x"}, "hash": "syshash"}
    monkeypatch.setattr(PersistentCache, "get_system", staticmethod(lambda: system))

    class Choice:
        def __init__(self, name: str) -> None:
            self.name = name

        def hash_key(self) -> str:
            return self.name

    choices = [Choice("triton_mm_1"), Choice("aten_mm")]
    cache = PersistentCache()
    cache.update_local_cache({"other_op": {"x": {"highest": {"c": 1.0}}}})  # another model's
    owners = cache_use.owner_stack()
    owners.append("region_A")
    try:
        with _compiling(5):
            timings = cache.lookup(choices, "mm", "[(4, 4)]", lambda cs: {c: 0.5 for c in cs})
    finally:
        owners.pop()
    assert len(timings) == 2 and autotune.counts()["selection_parts"] == 1
    units, _ = cache_use.snapshot(["region_A"])
    (part_member, part_bytes), = units[0][1].entries.items()
    assert autotune.PART_DIR_SUFFIX + "/" in part_member
    assert "other_op" not in json.loads(part_bytes)["cache"]  # not another model's entries

    node_b = _node(monkeypatch, tmp_path / "node-b" / "inductor")
    restored = _publish_and_restore(Store(tmp_path / "store"), ["region_A"], node_b)
    session_merge = autotune.merge_restored_parts(list(restored.values()))
    assert session_merge == 1
    assert PersistentCache.get_local_cache_path() == Path(autotune.selection_cache_path())

    def no_benchmark(cs: object) -> dict:
        raise AssertionError("benchmarked although the restored timings were there")

    again = PersistentCache().lookup(choices, "mm", "[(4, 4)]", no_benchmark)
    assert {c.name: t for c, t in again.items()} == {"triton_mm_1": 0.5, "aten_mm": 0.5}
    assert torch.get_float32_matmul_precision() in json.dumps(PersistentCache().get_local_cache())


def test_dynamo_job_profile_rides_with_the_first_group_when_a_job_id_is_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compiler.config.job_id set: the job's code_state_* file (torch's own path) is a unit
    of the model's first group; without a job id, nothing of the kind is carried."""
    from torch._dynamo import pgo

    from compile_cache.torch_compat import pgo as our_pgo

    node = _node(monkeypatch, tmp_path / "inductor")
    assert capture.install()
    owners = cache_use.owner_stack()
    owners.append("region_A")
    try:
        with _compiling(9):
            cache_use.note_file(str(node / "xx" / "nothing.best_config"))  # the group compiled
    finally:
        owners.pop()
    assert our_pgo.code_state_file() is None
    assert [u["slot"] for u in capture.usage(["region_A", "region_B"]).units] == ["graph#0"]
    with torch.compiler.config.patch(job_id="cc-test-job"):  # a config module: patch(), not setattr
        path = our_pgo.code_state_file()
        assert path == pgo.code_state_path(pgo.get_cache_key())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"profile v1")
        found = capture.usage(["region_A", "region_B"])
        member = "inductor/" + os.path.relpath(path, node).replace(os.sep, "/")
        assert {"scope": "region_A", "slot": "dynamo-pgo#0", "members": [member]} in found.units
        with open(path, "wb") as f:
            f.write(b"profile v2")
        assert capture.usage(["region_A", "region_B"]).generation != found.generation  # published again


def test_a_gpu_model_is_warned_once_when_triton_kernels_would_not_ride_in_packs() -> None:
    import warnings

    import torch._inductor.config as inductor_config

    from compile_cache import session

    assert autotune.triton_bundling() is True  # torch's default outside fbcode
    with inductor_config.patch(bundle_triton_into_fx_graph_cache=False):
        assert autotune.triton_bundling() is False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session._warn_unbundled("cpu")  # CPU graphs have no Triton kernels
            session._warn_unbundled("cuda")
            session._warn_unbundled("cuda")
        texts = [str(w.message) for w in caught]
        assert len(texts) == 1 and "bundle_triton_into_fx_graph_cache is off" in texts[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session._reset()
        session._warn_unbundled("cuda")  # on again: nothing to say
    assert caught == []


def test_a_torch_without_make_local_cache_key_still_carries_best_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch 2.11 inlines the .best_config name (sha256 of the kernel's key and torch_key()) in
    # AutotuneCache._setup_local_cache; the hooks need nothing else, so the capability stays.
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    from compile_cache import torch_compat

    kernel = str(tmp_path / "ab" / "cabcdef.py")
    torchs_own = autotune.best_config_path(kernel)  # AutotuneCache._make_local_cache_key
    monkeypatch.delattr(AutotuneCache, "_make_local_cache_key")
    torch_compat._reset()
    assert autotune.install_possible()
    assert autotune.best_config_path(kernel) == torchs_own
