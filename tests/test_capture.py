"""Capture by use (compile_cache.capture, torch_compat.cache_use): a really fresh node hits.

The real Inductor runs happen in child processes on nodes made by ``fresh_node_env`` (new
TMPDIR, HOME, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), so nothing machine-wide
(the precompiled header, the ISA probe's libraries) is left over from an earlier process:

* a cold one-step job on node A publishes a forward (no_grad) and a training step and exits at
  once (the backward must reach the store without a later forward);
* fresh nodes then run the forward, or the training step, from that store;
* node A again, now warm, publishes into an EMPTY store, and a fresh node runs from that one.

The publishers in one process (two models; ten edits) check nothing about the header: they run
on the build machine (conftest.publisher_env: its header, local cache dirs of their own).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import drop_precompiled_headers, run_child

from compile_cache import torch_compat
from compile_cache.store import Store, generations

pytestmark = pytest.mark.inductor

#: Whether precompile runs on this torch (torch 2.11 lacks the capability: precompile=True stays
#: off there, and the "precompile" jobs are plain ones: FX-graph entries, Dynamo traces).
PRECOMPILE = torch_compat.available("dynamo.precompile")


def _job(node: Path, store: Path, mode: str, *flags: str) -> dict:
    return run_child("_node_child.py", node, str(store), mode, *flags)


@pytest.fixture(scope="session", params=["precompile", "plain"])
def nodes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The jobs above, with ``precompile=True`` (each region group precompiled: a hit traces
    nothing) and with ``precompile=False`` (FX-graph and AOTAutograd entries: Dynamo traces, then every
    graph hits), each on its own nodes and stores."""
    flags = ("--plain",) if request.param == "plain" else ()
    tmp = tmp_path_factory.mktemp(f"fresh_nodes_{request.param}")
    store, empty = tmp / "store", tmp / "empty-store"
    out = {"tmp": tmp, "store": store, "empty": empty,
           "precompile": request.param == "precompile" and PRECOMPILE}  # in effect
    out["cold"] = _job(tmp / "node-a", store, "both", *flags)
    out["fwd"] = _job(tmp / "node-b", store, "fwd", *flags)
    out["train"] = _job(tmp / "node-c", store, "train", *flags)
    out["warm_publisher"] = _job(tmp / "node-a", empty, "both", *flags)  # node A's local dirs are warm
    out["from_warm"] = _job(tmp / "node-d", empty, "both", *flags)
    drop_precompiled_headers(tmp)
    return out


def _assert_fresh_hit(run: dict, precompile: bool) -> None:
    assert run["fxgraph_miss"] == 0 and run["aot_miss"] == 0, run
    if precompile:  # the groups' Dynamo entries loaded: nothing traced, no FX-graph lookup
        assert run["report"]["precompile_hits"] >= 1 and run["frames_traced"] == 0, run
    else:  # traced, and every graph came from the restored FX-graph entries
        assert run["fxgraph_hit"] >= 1 and run["report"]["precompile_hits"] == 0, run
    assert run["use"]["fx_write"] == 0 and run["use"]["aot_write"] == 0  # nothing compiled
    assert run["header"]["built"] == 0, run["header"]  # no precompiled header...
    assert run["gch"] == []  # ...anywhere under this node's temp dir
    assert run["eager_calls"] == 0
    assert run["report"]["hit"] is True and run["report"]["published_packs"] == 0
    assert run["report"]["outcome"] == "hit"


def _is_precompile_entry(name: str) -> bool:
    return "/dynamo/" in name  # a region group's Dynamo entry (torch's DynamoCache dir)


def test_cold_one_step_job_compiles_and_publishes_forward_and_backward(nodes: dict) -> None:
    cold = nodes["cold"]
    assert cold["fxgraph_miss"] >= 3  # inference forward, training forward, backward
    assert cold["header"]["built"] == 1 and cold["report"]["capture"] == "by use"
    assert cold["out_diff"] < 1e-4 and cold["grad_diff"] < 1e-4
    packs = Store(nodes["store"]).entries()[0].packs
    names = [n for p in packs for n in p.member_names]
    assert sum("/fxgraph/" in n for n in names) == cold["fxgraph_miss"]  # the backward too
    compiled = [n for n in names if not _is_precompile_entry(n)]
    assert len(compiled) == len(set(compiled))  # no graph or kernel published twice
    # The group's Dynamo entry grows as the job traces more (no_grad, then grad mode): each
    # publish carries its newer version, which supersedes the older one on restore.
    assert any(_is_precompile_entry(n) for n in names) is nodes["precompile"]


def test_fresh_node_forward_hits_builds_no_header_and_matches_eager(nodes: dict) -> None:
    _assert_fresh_hit(nodes["fwd"], nodes["precompile"])
    assert nodes["fwd"]["out_diff"] < 1e-4


def test_fresh_node_training_step_hits_builds_no_header_and_matches_eager(nodes: dict) -> None:
    run = nodes["train"]
    _assert_fresh_hit(run, nodes["precompile"])
    assert run["out_diff"] < 1e-4 and run["grad_diff"] < 1e-4


def test_fresh_node_restores_only_what_it_needs_and_nothing_else(nodes: dict) -> None:
    """The pack holds FX/AOT (and precompile) entries, kernels, ISA libraries and the groups'
    automatic-dynamic record (precompiled or not): no sources, objects, headers."""
    names = [n for p in Store(nodes["store"]).entries()[0].packs for n in p.member_names]
    kinds = {("entry" if "/fxgraph/" in n or "/aotautograd/" in n or _is_precompile_entry(n)
              else "record" if n.startswith("inductor/compile_cache_dynamic/")
              else n.rsplit(".", 1)[-1]) for n in names}
    # the record: of the groups' functions, or of their precompiled functions
    assert kinds == {"entry", "so", "record"}, kinds


def test_warm_local_publisher_fills_an_empty_store_that_a_fresh_node_hits(nodes: dict) -> None:
    warm = nodes["warm_publisher"]
    # Everything hit locally. A local precompile entry without the store's record of its pins
    # does not load: the group traces again, and its graphs hit.
    assert warm["fxgraph_miss"] == 0 and warm["fxgraph_hit"] >= 3
    assert warm["report"]["restored_packs"] == 0 and warm["report"]["outcome"] == "local"
    assert Store(nodes["empty"]).stats()["packs"] >= 1  # and still it published
    _assert_fresh_hit(nodes["from_warm"], nodes["precompile"])
    run = nodes["from_warm"]
    assert run["out_diff"] < 1e-4 and run["grad_diff"] < 1e-4


# ------------------------------------------------------------------------------ in one process


@pytest.fixture(scope="session")
def one_process(tmp_path_factory: pytest.TempPathFactory, build_machine: Path) -> dict:
    """Two models and more in one process: a publisher on the build machine, with local cache
    dirs of its own (conftest.publisher_env: its ISA probe runs, its graphs compile cold)."""
    tmp = tmp_path_factory.mktemp("one_process")
    result = run_child("_use_child.py", build_machine, "two", str(tmp / "stores"), own=tmp / "node")
    drop_precompiled_headers(tmp)
    return result


def _names(packs: dict[str, list[str]]) -> set[str]:
    return {n for names in packs.values() for n in names}


def _isa_libraries(names: set[str]) -> set[str]:
    return {n for n in names if n.endswith(".so") and ".main." not in n}


def test_two_models_in_one_process_get_packs_without_each_others_files(one_process: dict) -> None:
    a, b = _names(one_process["a"]), _names(one_process["b"])
    assert any("/fxgraph/" in n for n in a) and any("/fxgraph/" in n for n in b)
    shared = a & b
    assert shared and shared == _isa_libraries(a)  # only the ISA probe's libraries: every process


def test_an_identical_second_model_still_publishes_everything(one_process: dict) -> None:
    """It compiles nothing (Dynamo reuses the group's compiled code), yet its store gets all."""
    assert one_process["misses"] >= 2 and one_process["a2_misses"] == 0
    assert _names(one_process["a2"]) == _names(one_process["a"])


def test_a_pack_never_holds_a_library_torch_is_still_linking(one_process: dict) -> None:
    linked = one_process["linked"]
    assert linked["partial_seen"]  # the capture ran while the file was half written...
    assert linked["in_pack"] and linked["whole"] and linked["complete"]  # ...and waited for it


def test_a_truncated_library_is_left_out_and_counted(one_process: dict) -> None:
    assert one_process["truncated"] == {"in_pack": False, "skipped": 1}


EDITS = 10


@pytest.fixture(scope="session")
def edited(tmp_path_factory: pytest.TempPathFactory, build_machine: Path) -> dict:
    """Ten jobs of an edited model in one publishing process (on the build machine, with local
    cache dirs of its own), then a fresh node with the last edit."""
    tmp = tmp_path_factory.mktemp("edited")
    store = tmp / "store"
    # precompile on (off by default): the last test below checks how its entries generations go
    jobs = run_child("_use_child.py", build_machine, "edits", str(store), str(EDITS),
                     own=tmp / "node", COMPILE_CACHE_PRECOMPILE="1")["jobs"]
    before = Store(store).entries()[0].packs
    selection = generations.select(before)
    fresh = run_child("_use_child.py", tmp / "fresh", "last", str(store), str(EDITS),
                      COMPILE_CACHE_PRECOMPILE="1")
    compacted = Store(store).compact()
    drop_precompiled_headers(tmp)
    return {"jobs": jobs, "packs_before": len(before), "selection": selection,
            "compacted": compacted, "after": Store(store).entries()[0].packs, "fresh": fresh}


def test_an_edit_the_key_does_not_see_compiles_once_under_the_same_key(edited: dict) -> None:
    jobs = edited["jobs"]
    assert len({j["key"] for j in jobs}) == 1
    assert [j["misses"] for j in jobs] == [1] * EDITS  # every edit changed the graph
    assert all(j["diff"] < 1e-5 for j in jobs)
    assert all(j["restored_packs"] >= 1 for j in jobs[1:])
    assert edited["packs_before"] == EDITS


def test_a_model_edited_ten_times_restores_one_generation(edited: dict) -> None:
    selection = edited["selection"]
    assert selection.superseded_units == EDITS - 1
    assert sum("/fxgraph/" in n for n in selection.wanted) == 1
    assert sum("/aotautograd/" in n for n in selection.wanted) == 1
    fresh = edited["fresh"]
    assert fresh["misses"] == 0 and fresh["hits"] == 1 and fresh["diff"] < 1e-5
    # The helper is a global the group's precompiled entry pins: the first job's entry names
    # its first version, so every later edit (and this fresh node) declines it and runs the
    # compiled graphs of its own generation instead, never the first edit's traced code.
    assert fresh["report"]["precompile_hits"] == 0
    assert fresh["report"]["precompile_declined"] >= 1 or not PRECOMPILE
    assert fresh["fx_files"] == 1 and fresh["aot_files"] == 1  # one generation on disk
    assert fresh["report"]["restored_packs"] < EDITS


def test_compaction_keeps_one_pack_with_the_current_generation(edited: dict) -> None:
    (report,) = edited["compacted"]
    assert len(report.merged) == EDITS and report.bytes_after < report.bytes_before
    (pack,) = edited["after"]
    assert set(pack.member_names) == set(edited["selection"].wanted)


# ------------------------------------------------------------------------------ the fallback


def test_a_missing_hook_falls_back_to_the_directory_diff_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_state: None, dynamo_reset: None
) -> None:
    """Torch moved a name the capture needs: one warning, a counted fallback, and the job still
    publishes (by diffing the local dirs, as before capture by use)."""
    import warnings

    import torch
    from torch._dynamo.callback import CompilationCallbackHandler

    import compile_cache
    from compile_cache import torch_compat

    monkeypatch.delattr(CompilationCallbackHandler, "register_start_callback")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compile_cache.compile_regions(model, cache_dir=tmp_path / "store")
        with torch.no_grad():
            got = model(x)
    torch.testing.assert_close(got, expected)
    said = [w for w in record if issubclass(w.category, torch_compat.TorchCompatWarning)
            and "'cache_use.capture'" in str(w.message)]
    assert len(said) == 1 and "diffing the local cache dirs" in str(said[0].message)
    report = compile_cache.last_report()
    assert report.capture == "directory diff" and "cache_use.capture" in report.degraded
    stats = Store(tmp_path / "store").stats()
    assert stats["capture_fallbacks"] == 1
    assert stats["packs"] == 1 and report.published_packs == 1  # the diff still publishes


def test_a_groups_decode_entry_is_its_own_unit_that_a_restore_of_the_group_brings() -> None:
    """A group's precompiled decode steps (``<group>__views``) publish as a second unit of the
    group's own scope, in a slot of their own: a restore limited to the model's groups (their
    scopes) selects both entries, and neither replaces the other (the fresh-node test in
    test_generate.py loads both)."""
    from compile_cache import capture

    found = capture.usage([], extra={"region_A": {"dynamo/a/entry": b"main"},
                                     "region_A__views": {"dynamo/v/entry": b"decode"}})
    units = {(u["scope"], u["slot"]): u["members"] for u in found.units}
    assert units == {("region_A", "dynamo-precompile#0"): ["dynamo/a/entry"],
                     ("region_A", "dynamo-precompile-views#0"): ["dynamo/v/entry"]}
    assert capture.precompile_unit("region_A") == ("region_A", "dynamo-precompile#0")


def test_an_isa_probe_library_the_store_holds_under_its_name_is_not_published_again() -> None:
    """A second job whose probe built its own copy (the same source and flags, other embedded
    paths: other bytes) publishes nothing for it; a kernel with other bytes still goes."""
    from compile_cache import capture

    def candidate(member: str, data: bytes) -> capture.Candidate:
        return capture.Candidate(member, None, lambda: data)

    probe, kernel = "inductor/th/cthprobe.so", "inductor/ab/cabkernel.so"
    found = capture.Usage({probe: candidate(probe, b"probe built here"),
                           kernel: candidate(kernel, b"kernel built here")},
                          [], [probe], 1)
    held = {probe: {"digest-of-the-publishers-copy"}, kernel: {"digest-of-another-kernel"}}
    members, manifest = capture.resolve(found, held)
    assert set(members) == {kernel}
    assert manifest["digests"][probe] == "digest-of-the-publishers-copy"
    assert manifest["always"] == [probe]
