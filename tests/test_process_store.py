"""``python -m compile_cache run --name NAME -- CMD``: the store for compiles we do not own.

Cost: the two publishing programs under ``run`` (transformers' static-cache ``generate`` with its
own compile, then a plain ``torch.compile(model)`` program under the same name) share the
session's build machine (conftest.build_machine: no header or ISA build of their own); one fresh
node then runs both programs, restored; the plain program with another batch runs once more on
the build machine with an inductor dir of its own (its graph misses: ``explain --name``). The
fault test runs on the build machine (torch's local cache serves it); the chain, exit-code and
explain tests compile nothing. Measured 2026-12-03 alone (so the generate publisher also built
the build machine's header, which test_whole's publisher builds in a full run): 152 s of CPU,
243 s wall at load average 3-9 on the 2 shared cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import fresh_node_env

from compile_cache.cli.run import child_env

SCRIPTS = Path(__file__).with_name("_run_scripts.py")


def _run(node: Path, store: Path | str, name: str, script: str, **env: str) -> dict[str, Any]:
    """``run --name NAME -- python _run_scripts.py SCRIPT`` on ``node``; the script's RESULT."""
    done = subprocess.run(
        [sys.executable, "-m", "compile_cache", "run", "--cache-dir", str(store), "--name", name,
         "--", sys.executable, str(SCRIPTS), script],
        env=fresh_node_env(node, **env), capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    rec = json.loads(line[len("RESULT "):])
    rec["stderr"] = done.stderr
    return rec


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, build_machine: Path) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("run")
    store = root / "store"
    out = {}
    # the publishers, on the session's build machine
    out["gen1"] = _run(build_machine, store, "gen", "generate")
    out["plain1"] = _run(build_machine, store, "gen", "plain")  # another program, same name
    # a fresh node runs both programs (each a process of its own under run)
    out["gen2"] = _run(root / "fresh", store, "gen", "generate")
    out["plain2"] = _run(root / "fresh", store, "gen", "plain")
    # the plain program with another input batch: its graph misses (explain --name says why);
    # on the build machine with an inductor dir of its own (it restores, then compiles)
    out["plain_b8"] = _run(build_machine, store, "gen", "plain_b8",
                           TORCHINDUCTOR_CACHE_DIR=str(root / "inductor_b8"))
    out["store"] = {"path": str(store), "root": str(root)}
    return out


def test_generate_with_its_own_compile_hits_on_a_fresh_node(runs: dict[str, dict[str, Any]]) -> None:
    first, again = runs["gen1"], runs["gen2"]
    for rec in (first, again):
        assert rec["name"] == "gen" and rec["errors"] == [] and rec["flushed"] is True
        assert rec["diff"] == 0  # the same tokens as eager
    assert first["fx_misses"] > 0 and first["published_packs"] >= 1
    assert again["key"] == first["key"] and again["restored_packs"] >= 1
    assert again["fx_misses"] == 0 and again["fx_hits"] > 0


def test_two_programs_under_one_name_no_wrong_hit(runs: dict[str, dict[str, Any]]) -> None:
    plain1, plain2 = runs["plain1"], runs["plain2"]
    # the plain program restored generate's entry, yet torch's keys made it compile its own
    assert plain1["restored_packs"] >= 1 and plain1["fx_misses"] == 1 and plain1["fx_hits"] == 0
    assert plain1["diff"] < 1e-5 and plain1["published_packs"] >= 1
    # a fresh node then has both programs' graphs: each hits its own
    assert plain2["fx_misses"] == 0 and plain2["fx_hits"] == 1 and plain2["diff"] < 1e-5
    assert runs["gen2"]["fx_misses"] == 0


def test_store_fault_the_child_still_completes(runs: dict[str, Any], build_machine: Path,
                                               tmp_path: Path) -> None:
    bad = tmp_path / "not_a_dir"
    bad.write_text("a file where the store should be")
    # on the build machine, where plain ran before (runs): torch's own local cache serves it,
    # exactly as without compile_cache (no compile to pay for a fault)
    rec = _run(build_machine, bad, "gen", "plain")
    assert rec["diff"] < 1e-5 and rec["fx_misses"] == 0 and rec["fx_hits"] == 1
    assert rec["store"] is False  # enabled, but without a usable store
    assert "store unusable" in rec["stderr"]  # the fault was said, not hidden


def test_sitecustomize_chains_the_existing_one_and_exit_code(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    env = fresh_node_env(tmp_path / "node")
    env["PYTHONPATH"] = str(theirs) + ":" + env["PYTHONPATH"]
    # the store is enabled when the program imports torch, not before: a process that never
    # does (torch's ISA-probe child) imports nothing of ours
    code = ("import os, sys; before = sorted({'torch', 'compile_cache.process_store'} & set(sys.modules)); "
            "import torch; m = sys.modules.get('compile_cache.process_store'); "
            "print(os.environ.get('THEIRS_RAN'), before, m is not None and m.enabled()); "
            "raise SystemExit(7)")
    done = subprocess.run(
        [sys.executable, "-m", "compile_cache", "run", "--cache-dir", str(tmp_path / "store"),
         "--name", "chain", "--", sys.executable, "-c", code],
        env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 7, done.stderr[-3000:]  # run's exit code is the child's
    assert done.stdout.split() == ["1", "[]", "chain"]


def test_run_bad_name_and_child_env(tmp_path: Path) -> None:
    env = fresh_node_env(tmp_path / "node")
    done = subprocess.run([sys.executable, "-m", "compile_cache", "run", "--name", "../x", "--",
                           "true"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--name" in done.stderr
    assert child_env("n", None, "/site", {"PYTHONPATH": "/a"})["PYTHONPATH"].split(":")[0] == "/site"


def test_ls_and_explain_show_the_process_entry(runs: dict[str, Any]) -> None:
    store, root = runs["store"]["path"], Path(runs["store"]["root"])
    env = fresh_node_env(root / "n5")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "compile_cache", *args, "--cache-dir", store],
                              env=env, capture_output=True, text=True, timeout=300, check=False)

    listed = cli("ls")
    assert listed.returncode == 0 and "process gen" in listed.stdout
    present = cli("explain", "--name", "gen")
    assert present.returncode == 0 and runs["gen1"]["key"][:12] in present.stdout
    absent = cli("explain", "--name", "other")
    assert absent.returncode == 1 and "not in the store" in absent.stdout
    # per graph: the batch-8 run missed one graph; the nearest published graph has the same code
    # and torch's key differs in the input's shape (its example input field)
    b8 = runs["plain_b8"]
    assert b8["fx_misses"] == 1 and b8["restored_packs"] >= 1 and b8["diff"] < 1e-5
    assert "missed 1 FX graph(s)" in present.stdout, present.stdout
    detail = json.loads(cli("explain", "--name", "gen", "--json").stdout)
    (graph,) = detail["graph_misses"]
    assert graph["same_code"] is True, graph
    fields = {d["field"]: d for d in graph["differences"]}
    shaped = [d for name, d in fields.items() if name.startswith("example_inputs")]
    assert shaped and all("[8, 32]" in str(d["here"]) and "[4, 32]" in str(d["there"])
                          for d in shaped), graph
    assert not any(name.startswith("inductor_config") for name in fields), graph


def test_explain_graphs_names_the_differing_fields() -> None:
    from compile_cache.process_store import explain_graphs
    from compile_cache.session_publish import graph_metadata

    def lookup(hit: bool, **fields: tuple[str, str]) -> dict[str, Any]:
        return {"hit": hit, "fields": {k.replace("__", "."): list(v) for k, v in fields.items()}}

    published = {
        "a": lookup(True, gm=("g1", "code 1"), cfg__x=("h1", "True"), inp=("i4", "shape [4]")),
        "b": lookup(True, gm=("g2", "code 2"), cfg__x=("h1", "True"), inp=("i8", "shape [8]")),
    }
    metadata = [graph_metadata(published)]
    assert metadata[0]["fx_values"]["h1"] == "True"
    here = {
        "c": lookup(False, gm=("g1", "code 1"), cfg__x=("h2", "False"), inp=("i8", "shape [8]")),
        "d": lookup(False, gm=("g9", "code 9"), cfg__x=("h1", "True"), inp=("i8", "shape [8]")),
        "a": lookup(True, gm=("g1", "code 1"), cfg__x=("h1", "True"), inp=("i4", "shape [4]")),
    }
    c, d = explain_graphs(here, metadata)
    # same code as a: a config field and the input differ, with both values
    assert c["key"] == "c" and c["same_code"] and c["nearest"] == "a"
    assert c["differences"] == [{"field": "cfg.x", "here": "False", "there": "True"},
                                {"field": "inp", "here": "shape [8]", "there": "shape [4]"}]
    # no graph with its code: the nearest of all (b: only the code differs), said so
    assert d["key"] == "d" and not d["same_code"] and d["nearest"] == "b"
    assert [x["field"] for x in d["differences"]] == ["gm"]
    assert explain_graphs(here, []) == [
        {"key": "c", "same_code": False, "nearest": None, "differences": [], "different_fields": 0},
        {"key": "d", "same_code": False, "nearest": None, "differences": [], "different_fields": 0}]
