"""The store commands (compile_cache.cli.store_cmds): ls, stats, verify, prune, clear, export,
import, on the store one real ``warm`` filled (the ``warmed`` fixture), copied where changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _cli_helpers import call, one_line_error, run_cli

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
