"""``python -m compile_cache doctor`` (compile_cache.cli.doctor)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_helpers import call, cli_env

pytestmark = pytest.mark.usefixtures("no_env_store")


def test_doctor_json_subprocess(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("compile-cache")  # the console script, when installed
    args = [str(script)] if script.exists() else [sys.executable, "-m", "compile_cache"]
    proc = subprocess.run(
        [*args, "doctor", "--cache-dir", str(tmp_path / "s"), "--json"],
        env=cli_env(tmp_path, COMPILE_CACHE_SIGNING_KEY="hunter2-secret"), cwd=tmp_path,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "hunter2-secret" not in proc.stdout
    data = json.loads(proc.stdout)
    assert data["store"]["source"] == "argument" and data["store"]["lock_mode"] in ("fcntl", "mkdir", "none")
    assert data["store"]["filesystem"] and data["fingerprint"]["backend"] in ("native", "python")
    variables = {v["name"]: v["value"] for v in data["variables"]}
    assert variables["COMPILE_CACHE_SIGNING_KEY"] == "set"
    assert set(variables) >= {"COMPILE_CACHE_DIR", "COMPILE_CACHE_MAX_SIZE", "TORCHINDUCTOR_CACHE_DIR"}
    assert len(data["environment"]["key"]) == 32
    assert any("CUTLASS" in line and "CUDACodeCache" in line for line in data["not_carried"])
    assert "device_count" not in data["environment"]["fields"]
    capabilities = {c["name"] for c in data["capabilities"]}
    assert {"autotune.capture", "cudagraphs.modes", "pgo.code_state"} <= capabilities


def test_doctor_human_output_and_env_source(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "from-env"
    store.mkdir(mode=0o700)
    monkeypatch.setenv("COMPILE_CACHE_DIR", str(store))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code, out, _ = call(capsys, "doctor")
    assert code == 0
    assert "COMPILE_CACHE_DIR environment variable" in out and str(store) in out
    assert "lock mode" in out and "private, safe" in out
    assert "thread count" in out  # the cross-node hazard, with its fix
    assert re.search(r"COMPILE_CACHE_SIGNING_KEY +unset +default", out)  # a secret shows set/unset
    assert re.search(r"COMPILE_CACHE_DIR +\S+ +environment", out)  # each value with its source
    assert "Not carried by packs" in out and "CUTLASS kernels" in out


def test_doctor_flags_a_world_writable_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = tmp_path / "open"
    store.mkdir()
    store.chmod(0o777)
    code, out, _ = call(capsys, "doctor", "--cache-dir", str(store))
    assert code == 1
    assert "UNSAFE, world-writable" in out and "Problems" in out


def test_doctor_shows_the_unresolved_misses_and_survives_a_bad_backend(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compile_cache.store import Store, misses

    store = Store(tmp_path / "s")
    misses.record_miss(store, "ab" * 16, {"model_class": "M"}, "key abababababab differs in: CPU threads")
    misses.record_miss(store, "cd" * 16, {"model_class": "M"}, "resolved since")
    store.publish("cd" * 16, {"inductor/x": b"1"})
    monkeypatch.setenv("COMPILE_CACHE_BACKEND", "rust")
    code, out, _ = call(capsys, "doctor", "--cache-dir", str(store.root))
    assert code == 1  # the bad variable is a problem doctor lists, not a crash
    assert "Recent misses" in out and "differs in: CPU threads" in out and "resolved since" not in out
    assert "COMPILE_CACHE_BACKEND='rust'" in out.split("Problems", 1)[1]
