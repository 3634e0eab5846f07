"""The store commands (compile_cache.cli.store_cmds): ls, stats, verify, prune, clear, export,
import, on the store one real ``warm`` filled (the ``warmed`` fixture), copied where changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _cli_helpers import HERE, call, cli_env, one_line_error, run_cli
from _fault_helpers import FakeInductor, clean_env, run_job

from compile_cache.store import Store

pytestmark = pytest.mark.usefixtures("no_env_store")


@pytest.mark.inductor
def test_ls_shows_one_row_per_entry(warmed: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    store, data = warmed
    proc = run_cli(tmp_path, "ls", "--cache-dir", str(store))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["KEY", "MODEL", "REGIONS"]
    row = lines[1]
    assert row.startswith(data["key"][:12])
    assert "TinyMLP" in row and "_Block x2" in row and "KiB" in row and "ago" in row and "cpu" in row
    assert "1 entry, 1 pack(s)" in proc.stdout


@pytest.mark.inductor
def test_ls_json_quiet_sort_limit(capsys: pytest.CaptureFixture[str], warmed: tuple[Path, dict[str, Any]]) -> None:
    store, data = warmed
    code, out, _ = call(capsys, "ls", "--cache-dir", str(store), "--json")
    assert code == 0
    entry = json.loads(out)["entries"][0]
    assert entry["key"] == data["key"] and entry["regions"] == "_Block x2" and entry["size"] > 0
    code, out, _ = call(capsys, "ls", "--cache-dir", str(store), "-q", "--sort", "size")
    assert out.split() == [data["key"]]
    code, out, _ = call(capsys, "ls", "--cache-dir", str(store), "-q", "--limit", "0")
    assert code == 0 and out == ""


def test_ls_empty_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = call(capsys, "ls", "--cache-dir", str(tmp_path / "empty"))
    assert code == 0 and out.startswith("No cache entries in")


@pytest.mark.inductor
def test_stats_counts_the_cold_warm(warmed: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    store, _data = warmed
    proc = run_cli(tmp_path, "stats", "--cache-dir", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["publishes"] >= 1 and stats["misses"] >= 1 and stats["size"] > 0
    assert stats["entries"] == 1 and stats["compile_seconds"] > 0


@pytest.mark.inductor
def test_stats_human_and_zero(capsys: pytest.CaptureFixture[str], store_copy: Path) -> None:
    code, out, _ = call(capsys, "stats", "--cache-dir", str(store_copy))
    assert code == 0
    for label in ("Hits", "Misses", "Hit rate", "Errors", "Corrupt packs", "Compile time saved", "Cache size"):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert "of 20.0 GiB" in out
    code, out, _ = call(capsys, "stats", "--zero", "--cache-dir", str(store_copy))
    assert code == 0 and "zeroed" in out
    code, out, _ = call(capsys, "stats", "--json", "--cache-dir", str(store_copy))
    stats = json.loads(out)
    assert stats["misses"] == 0 and stats["publishes"] == 0 and stats["entries"] == 1


@pytest.mark.inductor
def test_verify_clean_store(warmed: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "verify", "--cache-dir", str(warmed[0]))
    assert proc.returncode == 0, proc.stderr
    assert "Checked 1 entries, 1 packs" in proc.stdout and "OK: no problems found" in proc.stdout


@pytest.mark.inductor
def test_verify_finds_and_fixes_a_corrupt_pack(capsys: pytest.CaptureFixture[str], store_copy: Path) -> None:
    (pack,) = store_copy.glob("v1/entries/*/*/packs/*.pack")
    data = bytearray(pack.read_bytes())
    data[-1] ^= 0xFF
    pack.write_bytes(bytes(data))
    code, out, _ = call(capsys, "verify", "--cache-dir", str(store_copy))
    assert code == 1
    assert "corrupt pack" in out and "checksum" in out and "verify --fix" in out
    code, out, _ = call(capsys, "verify", "--fix", "--cache-dir", str(store_copy), "--json")
    assert code == 0
    data_json = json.loads(out)
    assert len(data_json["corrupt_packs"]) == 1 and data_json["remaining"]["ok"] is True
    code, out, _ = call(capsys, "verify", "--cache-dir", str(store_copy))
    assert code == 0 and "OK" in out


@pytest.mark.inductor
def test_prune_by_size_subprocess(store_copy: Path, tmp_path: Path, warmed: tuple[Path, dict[str, Any]]) -> None:
    proc = run_cli(tmp_path, "prune", "--max-size", "1K", "-y", "--cache-dir", str(store_copy))
    assert proc.returncode == 0, proc.stderr
    assert warmed[1]["key"][:12] in proc.stdout and "Removed 1 entry" in proc.stdout
    assert not list(store_copy.glob("v1/entries/*/*/packs/*.pack"))


@pytest.mark.inductor
def test_prune_dry_run_refusal_and_key(
    capsys: pytest.CaptureFixture[str], store_copy: Path, warmed: tuple[Path, dict[str, Any]]
) -> None:
    key = warmed[1]["key"]
    code, out, _ = call(capsys, "prune", "--older-than", "0s", "--dry-run", "--cache-dir", str(store_copy))
    assert code == 0 and "Would remove 1 entry" in out and key[:12] in out
    code, out, _ = call(capsys, "prune", "--max-size", "20G", "--cache-dir", str(store_copy))
    assert code == 0 and out.startswith("Nothing to prune")
    code, _out, err = call(capsys, "prune", "--key", key[:8], "--cache-dir", str(store_copy))
    assert code == 2
    one_line_error(err, "pass -y")
    code, out, _ = call(capsys, "prune", "--key", key[:8], "-y", "--json", "--cache-dir", str(store_copy))
    assert code == 0 and json.loads(out)["removed"] == [key]
    code, out, _ = call(capsys, "ls", "-q", "--cache-dir", str(store_copy))
    assert out == ""


@pytest.mark.inductor
def test_clear_refuses_without_yes_when_not_a_tty(store_copy: Path, tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "clear", "--cache-dir", str(store_copy))
    assert proc.returncode == 2
    one_line_error(proc.stderr, "pass -y")
    assert list(store_copy.glob("v1/entries/*/*/packs/*.pack"))


@pytest.mark.inductor
def test_clear_dry_run_then_yes(capsys: pytest.CaptureFixture[str], store_copy: Path) -> None:
    code, out, _ = call(capsys, "clear", "--dry-run", "--cache-dir", str(store_copy))
    assert code == 0 and "Would remove 1 entry" in out
    code, out, _ = call(capsys, "clear", "-y", "--cache-dir", str(store_copy))
    assert code == 0 and "Removed 1 entry" in out
    assert not list(store_copy.glob("v1/entries/*/*/packs/*.pack"))


@pytest.mark.inductor
def test_export_then_import_into_another_store(
    warmed: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, data = warmed
    archive = tmp_path / "cache.tar.gz"
    proc = run_cli(tmp_path, "export", str(archive), "--key", data["key"][:12], "--cache-dir", str(store))
    assert proc.returncode == 0, proc.stderr
    assert "Exported 1 pack(s) of 1 entry" in proc.stdout and archive.is_file()
    other = tmp_path / "other"
    proc = run_cli(tmp_path, "import", str(archive), "--cache-dir", str(other), "--json")
    assert proc.returncode == 0, proc.stderr
    first = json.loads(proc.stdout)
    assert first["keys"] == [data["key"]] and first["packs_added"] == 1
    code, out, _ = call(capsys, "import", str(archive), "--cache-dir", str(other))
    assert code == 0 and "0 pack(s) added, 1 already present" in out
    code, out, _ = call(capsys, "ls", "-q", "--cache-dir", str(other))
    assert out.split() == [data["key"]]


def test_import_rejects_a_bad_archive_before_writing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import tarfile

    archive = tmp_path / "evil.tar"
    payload = tmp_path / "payload"
    payload.write_text("x")
    with tarfile.open(archive, "w") as tar:
        tar.add(payload, arcname="../../escape.txt")
    code, _out, err = call(capsys, "import", str(archive), "--cache-dir", str(tmp_path / "s"))
    assert code == 2
    one_line_error(err, "import")
    assert not list((tmp_path / "s").glob("v1/entries/*/*"))


# -- one meaning of "hit" ------------------------------------------------------------------------
_JOB_SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
import torch
import compile_cache
from _cli_targets import mlp

model, x = mlp()
compile_cache.compile_regions(model, cache_dir=sys.argv[1], backend="inductor")  # as accelerate does
with torch.no_grad():
    model(x)
print(json.dumps(compile_cache.last_report().to_dict()))
"""


@pytest.mark.inductor
def test_stats_after_publish_hit_partial_hit_and_miss(
    capsys: pytest.CaptureFixture[str], warmed: tuple[Path, dict[str, Any]], store_copy: Path, tmp_path: Path
) -> None:
    """The warmed fixture published (a miss); then, each on a new node: a user's script that
    passes backend="inductor" where warm passed nothing (a hit: one key, zero FX misses), warm of
    the same model with a new shape (a partial hit), warm of another model (a miss)."""
    script = tmp_path / "job.py"
    script.write_text(_JOB_SCRIPT.format(here=str(HERE)))
    node = tmp_path / "node-hit"
    node.mkdir()
    done = subprocess.run([sys.executable, str(script), str(store_copy)], env=cli_env(node), cwd=node,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    job = json.loads(done.stdout.splitlines()[-1])
    assert job["key"] == warmed[1]["key"]  # the key warm printed
    # ...every graph it traced was a hit in the restored FX-graph cache (precompile is off by
    # default, so Dynamo traces)
    assert job["fxgraph_misses"] == 0 and job["fxgraph_hits"] >= 1 and job["outcome"] == "hit"
    assert job["precompile_hits"] == 0

    outcomes = []
    for factory in ("mlp_two_shapes", "mlp_wide"):
        node = tmp_path / f"node-{factory}"
        node.mkdir()
        proc = run_cli(node, "warm", f"{HERE / '_cli_targets.py'}:{factory}", "--cache-dir", str(store_copy),
                       "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        outcomes.append(json.loads(proc.stdout)["outcome"])
    assert outcomes == ["partial", "miss"]

    code, out, _ = call(capsys, "stats", "--json", "--cache-dir", str(store_copy))
    s = json.loads(out)
    assert (s["hits"], s["partial_hits"], s["misses"], s["local_hits"]) == (1, 1, 2, 0)
    assert s["hit_rate"] == pytest.approx(1 / 4)
    # One publish per job at least (the fixture's warm, the partial hit, the miss); a job may
    # publish more than one pack (each compile's end queues one, carrying what the store lacks).
    assert s["publishes"] >= 3 and s["bytes_restored"] > 0 and s["seconds_saved"] > 0
    code, out, _ = call(capsys, "stats", "--cache-dir", str(store_copy))
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    assert lines["Hits"].split()[1] == "1" and lines["Partial hits"].split()[2] == "1"
    assert lines["Misses"].split()[1] == "2" and "25.0 %" in lines["Hit rate"]


def test_stats_tell_torchs_local_cache_hits_from_store_hits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean_env(monkeypatch, tmp_path)
    run_job(False)  # compiles into torch's local dir only
    report, backend = run_job(tmp_path / "store")  # an empty store; torch's local cache has it all
    assert backend.misses == 0 and backend.hits >= 1 and report.restored_packs == 0
    assert report.outcome == "local" and not report.hit
    assert "from torch's local cache" in report.summary()
    code, out, _ = call(capsys, "stats", "--json", "--cache-dir", str(tmp_path / "store"))
    s = json.loads(out)
    assert (s["local_hits"], s["hits"], s["partial_hits"], s["misses"]) == (1, 0, 0, 0)
    assert s["hit_rate"] is None  # the store served no start, and none missed it
    report, backend = run_job(tmp_path / "store", FakeInductor(salt="new graphs"))
    assert backend.misses >= 1 and report.outcome == "miss" and report.published_packs == 1
    assert Store(tmp_path / "store").stats()["misses"] == 1


# -- the plan shown is the plan run (issue 32) ---------------------------------------------------
_GRAPH = {"inductor/fxgraph/ab/xyz": b"graph" * 100}
_KA, _KB = "a1" * 16, "b2" * 16


def test_prune_removes_the_entries_it_showed_not_a_new_choice(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An entry published between the plan shown and the confirmation is not evicted, though
    the same criteria chosen again at that moment would take it."""
    import time

    from compile_cache.cli import store_cmds

    root = tmp_path / "store"
    Store(root).publish(_KA, _GRAPH)
    time.sleep(0.05)
    asked = []

    def confirm_after_a_publish(args: Any, question: str) -> bool:
        time.sleep(0.05)
        Store(root).publish(_KB, _GRAPH)  # arrives while the user reads the plan
        time.sleep(0.05)
        asked.append(question)
        return True

    monkeypatch.setattr(store_cmds, "confirm", confirm_after_a_publish)
    code, out, _ = call(capsys, "prune", "--older-than", "0s", "--cache-dir", str(root))
    assert code == 0 and asked == [f"remove 1 cache entries from {root}"]
    assert _KA[:12] in out and _KB[:12] not in out and "Removed 1 entry" in out
    store = Store(root)
    assert not store.has(_KA) and store.has(_KB)
    assert store.evict(older_than="0s", dry_run=True)[0].key == _KB  # chosen again, it would go


def test_prune_refused_removes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from compile_cache.cli import store_cmds

    root = tmp_path / "store"
    Store(root).publish(_KA, _GRAPH)
    monkeypatch.setattr(store_cmds, "confirm", lambda args, question: False)
    code, out, _ = call(capsys, "prune", "--older-than", "0s", "--cache-dir", str(root))
    assert code == 1 and "Aborted" in out and Store(root).has(_KA)


def test_verify_fix_fixes_what_it_showed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pack damaged after the scan is not touched by the fix of that scan: the check after
    the fix reports it, and the next ``verify --fix`` quarantines it."""
    from compile_cache.store import VerifyReport

    root = tmp_path / "store"
    store = Store(root)
    first = store.publish(_KA, _GRAPH)
    second = store.publish(_KB, _GRAPH)
    assert first is not None and second is not None

    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

    damage(first.path)
    real_fix = VerifyReport.fix

    def fix_after_more_damage(self: VerifyReport) -> VerifyReport:
        damage(second.path)  # after the scan was shown, before it is fixed
        return real_fix(self)

    monkeypatch.setattr(VerifyReport, "fix", fix_after_more_damage)
    code, out, _ = call(capsys, "verify", "--fix", "--json", "--cache-dir", str(root))
    shown = json.loads(out)
    assert code == 1 and shown["fixed"] is True
    assert [p for p, _why in shown["corrupt_packs"]] == [str(first.path)]
    assert [p for p, _why in shown["remaining"]["corrupt_packs"]] == [str(second.path)]
    assert not first.path.exists() and second.path.exists()
    monkeypatch.setattr(VerifyReport, "fix", real_fix)
    code, out, _ = call(capsys, "verify", "--fix", "--cache-dir", str(root))
    assert code == 0 and not second.path.exists()
