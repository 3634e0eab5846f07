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
from compile_cache.explain import CacheMissWarning, explain
from compile_cache.store import Store, misses

pytestmark = pytest.mark.usefixtures("no_env_store", "fresh_state", "dynamo_reset")


def _plant(store: Store, model: torch.nn.Module, precompile: bool = False, **kwargs: Any) -> str:
    """An entry of ``model`` as a start with these settings would have published it (with
    ``precompile``: a version or node where precompile ran; this one declines it)."""
    from compile_cache.keys import key_fields

    fields = key_fields(model, compile_cache.plan_regions(model), {"backend": "eager", **kwargs},
                        precompile)
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
