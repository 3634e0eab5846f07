"""compile_cache.explain and ``python -m compile_cache explain``: a miss names every field that
differs from the closest entry of the same model: in ``last_report().miss_reason``, in one warning
at the user's ``compile_regions`` line, and on the command line (with and without a TARGET)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_helpers import TARGET, call, run_cli
from _cli_targets import mlp, mlp_wide

import compile_cache
from compile_cache.api import key_for
from compile_cache.explain import CacheMissWarning, explain, partial_causes
from compile_cache.store import Store, misses

pytestmark = pytest.mark.usefixtures("no_env_store", "fresh_state", "dynamo_reset")


def _plant(store: Store, model: torch.nn.Module, **kwargs: Any) -> str:
    """An entry of ``model`` as a start with these settings would have published it."""
    fields = key_for(model, backend="eager", **kwargs)
    assert store.publish(fields.key, {"inductor/fxgraph/x/entry": b"artifact"},
                         entry_info=fields.record) is not None
    return fields.key


@pytest.fixture
def three_entries(tmp_path: Path) -> Path:
    """A store with entries of TinyMLP that differ from the default eager job in one field each."""
    store = Store(tmp_path / "store")
    _plant(store, mlp()[0], mode="max-autotune")
    _plant(store, mlp()[0].double())
    _plant(store, mlp()[0], precompile=True)
    return store.root


def test_a_compile_kwarg_a_dtype_and_precompile_are_each_named(
    capsys: pytest.CaptureFixture[str], three_entries: Path
) -> None:
    code, out, _ = call(capsys, "explain", TARGET, "--backend", "eager", "--cache-dir", str(three_entries),
                        "--json")
    assert code == 1  # not in the store
    data = json.loads(out)
    assert data["status"] == "miss" and data["key"] == key_for(mlp()[0], backend="eager").key
    named = sorted(tuple(d["field"] for d in c["differences"]) for c in data["candidates"])
    assert named == [("compile.mode",), ("model.dtypes",), ("precompile",)]
    code, out, _ = call(capsys, "explain", TARGET, "--backend", "eager", "--cache-dir", str(three_entries))
    assert "torch.compile mode: default here, 'max-autotune' in the entry" in out
    assert "parameter dtypes: float32 here, float64 in the entry" in out
    assert "precompile: off here, on in the entry" in out


def test_ls_shows_the_settings_that_differ_between_entries_of_one_model(
    capsys: pytest.CaptureFixture[str], three_entries: Path
) -> None:
    code, out, _ = call(capsys, "ls", "--cache-dir", str(three_entries))
    assert code == 0 and "DIFFERS (same model)" in out.splitlines()[0]
    rows = out.splitlines()[1:4]
    assert any("mode='max-autotune'" in row for row in rows)
    assert any("dtype=float64" in row for row in rows)
    assert any("precompile=on" in row for row in rows)
    code, out, _ = call(capsys, "ls", "--json", "--cache-dir", str(three_entries))
    entries = json.loads(out)["entries"]
    assert {e["compile"].get("mode") for e in entries} == {"max-autotune", None}
    assert all(e["metadata"]["environment"]["cpu_threads"] for e in entries)


def test_a_miss_names_the_thread_count_in_the_report_and_one_warning_at_the_users_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = Store(tmp_path / "store")
    model, x = mlp()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # an entry compiled where torch used one thread more
    try:
        planted = _plant(store, model)
    finally:
        torch.set_num_threads(threads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_cache.compile_regions(model, cache_dir=store.root, backend="eager")
        compile_cache.compile_regions(mlp()[0], cache_dir=store.root, backend="eager")  # same key
    report = compile_cache.last_report()
    assert report.key != planted and report.restored_packs == 0
    expected = (f"CPU threads (torch.get_num_threads()): {threads} here, {threads + 1} in the entry "
                f"(set OMP_NUM_THREADS={threads + 1}")
    assert expected in report.miss_reason and planted[:12] in report.miss_reason
    shown = [w for w in caught if issubclass(w.category, CacheMissWarning)]
    assert len(shown) == 1 and expected in str(shown[0].message)
    assert shown[0].filename == __file__  # the user's compile_regions line, not the library's
    # Recorded in the store: explain without a TARGET (no torch needed) says it again later.
    code, out, _ = call(capsys, "explain", "--cache-dir", str(store.root))
    assert code == 0
    assert f"miss of key {report.key} (TinyMLP)" in out and expected in out


def test_explain_says_whether_the_store_is_empty_holds_other_models_or_the_key() -> None:
    here = key_for(mlp()[0], backend="eager")
    wide = key_for(mlp_wide()[0], backend="eager")
    assert explain(here.key, here.record, []).reason.endswith("which is empty")
    other = explain(here.key, here.record, [(wide.key, wide.record, 1)])
    assert other.status == "miss" and not other.candidates and other.same_class == 1
    assert "other parameter names or shapes" in other.reason
    assert explain(here.key, here.record, [(here.key, here.record, 2)]).status == "present"
    unusable = explain(here.key, here.record, [(here.key, here.record, 0)])
    assert unusable.status == "unusable" and "no pack that could be restored" in unusable.reason
    old = explain(here.key, here.record, [("ef" * 16, {"model_class": here.record["model"]["class"]}, 1)])
    assert old.unrecorded == 1 and "written by an older compile_cache" in old.reason


def test_only_the_newest_misses_are_kept(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    for n in range(misses.MISS_KEEP + 5):
        misses.record_miss(store, f"{n:032x}", {"model_class": "M"}, "why")
    kept = misses.last_misses(store, limit=100)
    assert len(kept) == misses.MISS_KEEP
    assert len(list(store.layout.misses_dir.iterdir())) == misses.MISS_KEEP


def test_a_record_with_a_time_that_is_no_number_is_listed_last_not_a_crash(tmp_path: Path) -> None:
    """Miss records come from every writer of a shared store: a bad one must not break explain."""
    store = Store(tmp_path / "store")
    misses.record_miss(store, "a" * 32, {"model_class": "M"}, "why")
    bad = {"key": "b" * 32, "time": "soon", "reason": "?", "record": {}}
    (store.layout.misses_dir / f"{'b' * 32}.json").write_text(json.dumps(bad))
    assert [m["key"] for m in misses.last_misses(store)] == ["a" * 32, "b" * 32]


@pytest.mark.inductor
def test_omp_num_threads_miss_is_named_with_both_counts(
    warmed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The user's case: warm ran with one thread count, the job with another."""
    store, data = warmed
    threads = Store(store).entry(data["key"]).metadata["environment"]["cpu_threads"]
    other = "1" if threads != "1" else "2"  # torch caps OMP_NUM_THREADS at the cores it may use
    proc = run_cli(tmp_path, "explain", TARGET, "--cache-dir", str(store), OMP_NUM_THREADS=other)
    assert proc.returncode == 1, proc.stderr
    assert (f"CPU threads (torch.get_num_threads()): {other} here, {threads} in the entry "
            f"(set OMP_NUM_THREADS={threads}") in proc.stdout
    # With warm's thread count, explain computes warm's key and finds it.
    proc = run_cli(tmp_path, "explain", TARGET, "--cache-dir", str(store), "--json", OMP_NUM_THREADS=threads)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "present" and result["key"] == data["key"]


# ------------------------------------------------------------------------------ partial hits


def _state(*codes: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    """An automatic-dynamic record (torch_compat.dynamic_shapes form): (key, name, inputs)."""
    return {"version": 1, "codes": {key: {"name": name, "inputs": inputs} for key, name, inputs in codes}}


def _tensor(*size: Any) -> dict[str, Any]:
    return {"scalar": "dyn", "size": list(size), "stride": [None] * len(size)}


def test_a_partial_hit_names_a_new_shape_a_new_path_a_dtype_and_a_value() -> None:
    restored = _state(("f:1:region_A", "region_A", {"L['x']": _tensor(2, 16, 8)}))
    now = _state(("f:1:region_A", "region_A", {"L['x']": _tensor(2, "dyn", 8)}),
                 ("f:9:torch_dynamo_resume_in_forward_at_9", "torch_dynamo_resume_in_forward_at_9",
                  {"L['y']": _tensor(2, 8)}))
    guards = {"region_A__pc_" + "a" * 20: ["tensor 'L['x']' dtype mismatch. expected Float, actual Half",
                                           "L['n'] == 3"]}
    causes = partial_causes(restored, now, guards, graphs=3, dynamic_false=False, publishes=True)
    by_kind = {c.kind: c for c in causes}
    assert set(by_kind) == {"shape", "path", "dtype", "value"}, causes
    assert by_kind["shape"].code == "region_A"
    assert "L['x'] dim 1: 16 in the store, another size here" in by_kind["shape"].text()
    assert "hits at any size" in by_kind["shape"].later
    # a branch on a tensor value: a resume function no publisher ran
    assert by_kind["path"].code.startswith("torch_dynamo_resume_in_forward")
    assert "branch on a tensor value" in by_kind["path"].detail and "takes this path" in by_kind["path"].later
    assert by_kind["dtype"].text().startswith("another dtype in region_A__pc_") and "this dtype" in by_kind["dtype"].later
    assert by_kind["value"].detail == "L['n'] == 3" and "this value" in by_kind["value"].later
    # pinned static graphs: a later node hits at that size only; a read-only store: no later hit
    static = partial_causes(restored, _state(("f:1:region_A", "region_A", {"L['x']": _tensor(2, 10, 8)})),
                            {}, graphs=1, dynamic_false=True, publishes=True)
    assert [c.detail for c in static] == ["L['x'] dim 1: 16 in the store, 10 here"]
    assert "at this size only (dynamic=False" in static[0].later
    ro = partial_causes(restored, now, {}, graphs=2, dynamic_false=False, publishes=False)
    assert all("compiles it again (a read-only store" in c.later for c in ro)


def test_a_partial_hit_of_a_varying_dimension_no_start_compiled_dynamic_is_named() -> None:
    """Node 2 of a chain: the store's record has the length varying (node 1 saw prefill and
    decode), but node 1 compiled its prefill static, so node 2's dynamic prefill is new."""
    varying = _state(("f:1:region_A", "region_A", {"L['x']": _tensor(1, "dyn", 8), "L['n']": {"scalar": 4}}))
    (cause,) = partial_causes(varying, varying, {}, graphs=2, dynamic_false=False, publishes=True)
    assert cause.kind == "shape" and cause.code == "region_A"
    assert cause.detail.startswith("L['x'] (dim 1) compiled dynamic here")
    assert "hits at any size" in cause.later
    (other,) = partial_causes(None, None, {}, graphs=2, dynamic_false=False, publishes=True)
    assert other.kind == "other" and "2 graph(s)" in other.detail
    assert partial_causes(None, None, {}, graphs=0, dynamic_false=False, publishes=True) == []


def test_explain_shows_the_partial_hits_a_store_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = Store(tmp_path / "store")
    key = _plant(store, mlp()[0])
    misses.record_miss(store, key, {"model_class": "x.TinyMLP"}, "not there then")
    (cause,) = partial_causes(_state(("k", "region_A", {"L['x']": _tensor(2, 16)})),
                              _state(("k", "region_A", {"L['x']": _tensor(2, "dyn")})), {},
                              graphs=3, dynamic_false=False, publishes=True)
    misses.record_partial(store, key, "ab" * 8, {
        "record": {"model_class": "x.TinyMLP"}, "restored_packs": 1, "graphs_compiled": 3,
        "graphs_hit": 2, "causes": [cause.to_dict()]})
    assert [m["key"] for m in misses.last_misses(store)] == [key]  # a partial hit is no miss
    assert [p["key"] for p in misses.last_partials(store, key=key)] == [key]
    assert misses.last_partials(store, key="0" * 32) == []
    code, out, _err = call(capsys, "explain", "--cache-dir", str(store.root))
    assert code == 0
    assert "resolved: the key is in the store now; 1 later start(s) still compiled" in out
    assert (f"partial hit of key {key} (TinyMLP)" in out
            and "restored 1 pack(s), then compiled 3 graph(s) the store lacked (2 hit)" in out)
    assert f"  - {cause.text()}" in out and "a new shape in region_A: L['x'] dim 1" in out
    code, out, _err = call(capsys, "explain", "--cache-dir", str(store.root), "--json")
    assert json.loads(out)["partials"][0]["causes"][0]["kind"] == "shape"
    with pytest.raises(ValueError):
        store.layout.partial_file(key, "../x")
