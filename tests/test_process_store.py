"""``python -m compile_cache run --name NAME -- CMD``: the store for compiles we do not own.

Cost: six child programs under ``run`` (each a fresh node): transformers' static-cache
``generate`` with its own compile, published then restored; a plain ``torch.compile(model)``
program under the same name (publisher, then a fresh node); a store fault. Measured 8 min for
the file on the 2 shared cores of development (load average 13); Inductor compiles only on the
publishing nodes and in the fault test. The chain, exit-code and explain tests compile nothing.
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


def _run(node: Path, store: Path | str, name: str, script: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "compile_cache", "run", "--cache-dir", str(store), "--name", name,
         "--", sys.executable, str(SCRIPTS), script],
        env=fresh_node_env(node), capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    rec = json.loads(line[len("RESULT "):])
    rec["stderr"] = done.stderr
    return rec


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("run")
    store = root / "store"
    out = {}
    out["gen1"] = _run(root / "n1", store, "gen", "generate")
    out["plain1"] = _run(root / "n2", store, "gen", "plain")  # another program, same name
    out["gen2"] = _run(root / "n3", store, "gen", "generate")
    out["plain2"] = _run(root / "n4", store, "gen", "plain")
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


def test_store_fault_the_child_still_completes(tmp_path: Path) -> None:
    bad = tmp_path / "not_a_dir"
    bad.write_text("a file where the store should be")
    rec = _run(tmp_path / "n", bad, "gen", "plain")
    assert rec["diff"] < 1e-5 and rec["fx_misses"] == 1
    assert rec["store"] is False  # enabled, but without a usable store
    assert "store unusable" in rec["stderr"]  # the fault was said, not hidden


def test_sitecustomize_chains_the_existing_one(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    env = fresh_node_env(tmp_path / "node")
    env["PYTHONPATH"] = str(theirs) + ":" + env["PYTHONPATH"]
    code = ("import os, sys; m = sys.modules.get('compile_cache.process_store'); "
            "print(os.environ.get('THEIRS_RAN'), m is not None and m.enabled())")
    done = subprocess.run(
        [sys.executable, "-m", "compile_cache", "run", "--cache-dir", str(tmp_path / "store"),
         "--name", "chain", "--", sys.executable, "-c", code],
        env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "chain"]


def test_run_exit_code_and_bad_name(tmp_path: Path) -> None:
    env = fresh_node_env(tmp_path / "node")
    done = subprocess.run([sys.executable, "-m", "compile_cache", "run", "--name", "x", "--",
                           sys.executable, "-c", "raise SystemExit(7)"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 7
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
