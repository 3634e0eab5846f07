"""``python -m compile_cache doctor`` (compile_cache.cli.doctor)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cli_helpers import call, cli_env
from _object_emulators import MISCONFIGURED, BlackHole, misconfigured
from conftest import fresh_node_env

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


#: The client each scheme's store falls back to without credentials.
_FALLBACK = {"s3": "s3fs", "gs": "gcsfs", "az": "adlfs"}


@pytest.mark.parametrize("case", MISCONFIGURED)
@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_doctor_on_a_misconfigured_object_store_answers_in_seconds_one_line_each(
        scheme: str, case: str, black_hole: BlackHole, tmp_path: Path) -> None:
    """issue 57: the command a user runs because something is wrong finishes within 15 s on a
    store without credentials, behind a name that does not resolve, or behind a port that
    never answers; no traceback or third-party log line; one problem line, and one line each
    for the client (or why the small one declined), the credential sources looked at and
    found (names only), and whether the endpoint answered."""
    url, env = misconfigured(scheme, case, black_hole, fresh_node_env(tmp_path / "node"))
    env["COMPILE_CACHE_DIR"] = url
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "compile_cache", "doctor"], env=env, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False)
    elapsed = time.monotonic() - start
    out, err = proc.stdout, proc.stderr
    assert elapsed < 15, (elapsed, out[-3000:], err[-3000:])
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in out + err and err.strip() == "", err[-3000:]
    assert "cc-SECRET-not-a-real-key" not in out
    rows = dict(re.findall(r"^  (local tier|client|credentials|endpoint) +(.*)$", out, re.M))
    assert rows["local tier"].startswith(str(tmp_path / "node" / "xdg" / "compile_cache" / "remote" / scheme
                                             / "bucket-x")), rows
    if case == "no-credentials":
        assert rows["client"].startswith(_FALLBACK[scheme]) and "declines this store: " in rows["client"], rows
    else:
        assert rows["client"].startswith("small "), rows
    looked_at, found = rows["credentials"].split("; found: ")
    assert looked_at.startswith("looked at ") and len(looked_at.split(", ")) >= 3, rows
    if case != "no-credentials":
        assert found != "none", rows
    answer = {"unresolvable": "did not answer: its host name does not resolve",
              "black-hole": "did not answer: no answer within 5 s"}.get(case, "")
    assert answer in rows["endpoint"] and ("not asked" in rows["endpoint"] or "did not answer" in rows["endpoint"])
    problems = out.split("\nProblems\n", 1)[1].splitlines()
    about = [line for line in problems if "object storage" in line]
    assert len(about) == 1 and about[0].startswith(f"  - object storage {url}"), problems
    assert "credentials found: " in about[0] and "client: " in about[0]


def test_doctor_v_shows_what_the_fallback_packages_log(black_hole: BlackHole, tmp_path: Path) -> None:
    """The protocol packages' log lines (gcsfs, google.auth, ...), quiet without ``-v``, reach
    stderr with it, each named by its logger."""
    url, env = misconfigured("gs", "no-credentials", black_hole, fresh_node_env(tmp_path / "node"))
    proc = subprocess.run([sys.executable, "-m", "compile_cache", "doctor", "-v", "--cache-dir", url], env=env,
                          cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 1
    assert re.search(r"^(gcsfs|google\.auth[\w.]*): ", proc.stderr, re.M), proc.stderr[-3000:]
