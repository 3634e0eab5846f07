"""compile_cache.report: the one definition of a hit, as ``stats`` and ``warm`` count it.

A precompile hit loads a region group's whole Dynamo entry (its graphs bundled) and makes no
FX-graph cache lookup at all, so an outcome that looked only at FX-graph hits would call the
fastest start a miss.
"""

from __future__ import annotations

from compile_cache.api import _status
from compile_cache.report import CacheReport


def _report(**counts: int) -> CacheReport:
    return CacheReport(key="k" * 64, store="/store", **counts)


def test_a_start_from_the_store_is_a_hit_whether_its_code_came_as_graphs_or_precompiled() -> None:
    graphs = _report(restored_packs=1, fxgraph_hits=3)
    precompiled = _report(restored_packs=1, precompile_hits=1)
    for report in (graphs, precompiled):
        assert report.hit and report.outcome == "hit"


def test_a_start_from_the_local_cache_is_local_also_when_it_loaded_a_precompiled_entry() -> None:
    assert _report(fxgraph_hits=2).outcome == "local"
    assert _report(precompile_hits=1).outcome == "local"
    assert not _report(precompile_hits=1).hit  # nothing came from the store


def test_a_start_that_compiled_is_a_miss_or_partial_even_with_precompile_hits() -> None:
    assert _report(precompile_hits=1, fxgraph_misses=1).outcome == "miss"
    partial = _report(restored_packs=1, precompile_hits=1, fxgraph_misses=1)
    assert partial.outcome == "partial" and not partial.hit
    assert _report().outcome == "miss"  # compiled nothing through Inductor's caches either


def test_a_warm_shape_served_by_a_precompiled_entry_is_a_hit() -> None:
    assert _status(misses=0, hits=1, restored=0) == "hit"  # hits: FX graphs + precompile loads
    assert _status(misses=0, hits=0, restored=1) == "hit"
    assert _status(misses=1, hits=1, restored=1) == "compiled"
    assert _status(misses=0, hits=0, restored=0) == "none"


def test_a_hit_whose_precompiled_groups_traced_again_says_so_but_counts_as_a_hit() -> None:
    """A restored start whose precompiled entries did not load (graphs not proven here, or an
    entry torch could not read) traced those groups again: its outcome says so (issue 52: on
    torch 2.14 every start said "hit" while tracing every frame), and stats still count a hit."""
    traced = _report(restored_packs=1, fxgraph_hits=2, precompile_traced_again=1)
    assert traced.outcome == "hit, traced again" and traced.counted_outcome == "hit"
    assert traced.to_dict()["outcome"] == "hit, traced again"
    assert _report(restored_packs=1, precompile_hits=1).outcome == "hit"
    partial = _report(restored_packs=1, fxgraph_misses=1, precompile_traced_again=1)
    assert partial.outcome == partial.counted_outcome == "partial"
