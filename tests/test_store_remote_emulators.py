"""``gs://`` and ``az://`` stores against their emulators on 127.0.0.1: gcp-storage-emulator and
Azurite's blob service, started once per session and stopped at its end, served by the small
standard-library clients (compile_cache.store.backends.gcs, .azure), and once each by the
fsspec fallback (gcsfs, adlfs).

A real Inductor job publishes to each from one "build machine" (the publishers share its TMPDIR,
HOME and Inductor dirs: the second one's compile hits torch's local cache); a fresh node
restores each with zero FX-graph misses and outputs equal to eager's. The rest are direct Store
and backend calls in this process (backend="eager"-cheap): a create that finds the object
there, a damaged object, doctor, the fallback. The clients are pointed at the emulators only
through the configuration gcsfs and adlfs read too (``STORAGE_EMULATOR_HOST``, ``FSSPEC_GCS_TOKEN``,
``AZURE_STORAGE_CONNECTION_STRING``), as a user would.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _object_emulators import AZURITE_KEY, AzuriteServer, GcsEmulator
from _store_helpers import damaged_object_read
from conftest import fresh_node_env

from compile_cache.store import Store
from compile_cache.store import _reset as reset_store_warnings

HERE = Path(__file__).resolve().parent
REMOTE_CHILD = HERE / "_remote_child.py"
K1 = "c3" * 16
MEMBERS = {"inductor/fxgraph/ab/xyz": b"graph" * 100, "triton/0/abc/kernel.json": b"{}" * 30}
#: The client that serves each scheme here (the small one), and the fallback's package.
CLIENTS = {"gs": "small GCS client", "az": "small Azure Blob client"}
FALLBACK = {"gs": "gcsfs", "az": "adlfs"}


@pytest.fixture(scope="session")
def gcs(tmp_path_factory: pytest.TempPathFactory):
    """gcp-storage-emulator on a free port of 127.0.0.1, for the whole session."""
    server = GcsEmulator(tmp_path_factory.mktemp("gcs") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory):
    """Azurite's blob service on a free port of 127.0.0.1, for the whole session."""
    server = AzuriteServer(tmp_path_factory.mktemp("azurite") / "server.log")
    yield server
    server.stop()


def _bucket(server: GcsEmulator | AzuriteServer, name: str) -> str:
    """A new bucket (container) on ``server``; its URL's scheme."""
    if isinstance(server, GcsEmulator):
        server.make_bucket(name)
        return "gs"
    server.make_container(name)
    return "az"


@pytest.fixture(params=["gs", "az"])
def emulated(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket on the scheme's emulator, its client's settings, a private local tier."""
    server = request.getfixturevalue("gcs" if request.param == "gs" else "azurite")
    name = "t-" + request.node.name.lower().replace("_", "-").replace("[", "-").strip("]")[-40:].strip("-")
    scheme = _bucket(server, name)
    for var, value in server.env().items():
        monkeypatch.setenv(var, value)
    if scheme == "gs":
        import fsspec.config

        # FSSPEC_GCS_TOKEN is read when fsspec is imported; this process imported it already.
        monkeypatch.setitem(fsspec.config.conf, "gcs", {"token": "anon"})
        import gcsfs

        assert gcsfs.GCSFileSystem is gcsfs.core.GCSFileSystem, (
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set")
    for var in list(os.environ):
        if var.startswith("COMPILE_CACHE_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    reset_store_warnings()
    return f"{scheme}://{name}/cache"


# ---------------------------------------------------------------------------------------------
# a real job per scheme: a publisher on the build machine, then a fresh node restores
# ---------------------------------------------------------------------------------------------
def _job(node: Path, url: str, server_env: dict[str, str]) -> dict:
    """One job start (TinyTransformer 2x64, Inductor) on ``node`` with its own local tier."""
    env = fresh_node_env(node, COMPILE_CACHE_LOCAL_TIER=str(node / f"tier-{url.split(':')[0]}"),
                         **server_env)
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    done = subprocess.run([sys.executable, str(REMOTE_CHILD), "0", url, "2", "64", "float32"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # After the process exited: its exit-time writes (the stats object) counted no remote error.
    result["tier_after_exit"] = Store(env["COMPILE_CACHE_LOCAL_TIER"]).stats()
    # What this test costs CI, whatever the machine's load: wall and CPU seconds per process.
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)
    result["stderr"] = done.stderr
    return result


@pytest.fixture(scope="session")
def published(gcs: GcsEmulator, azurite: AzuriteServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """For gs:// then az://: a cold job on the build machine publishes, a fresh node restores."""
    tmp = tmp_path_factory.mktemp("emulated_jobs")
    out = {}
    for server in (gcs, azurite):
        scheme = _bucket(server, "jobs-bucket")
        url = f"{scheme}://jobs-bucket/team/cache"
        cold = _job(tmp / "build-machine", url, server.env())
        warm = _job(tmp / f"fresh-{scheme}", url, server.env())
        out[scheme] = {"url": url, "cold": cold, "warm": warm}
    return out


@pytest.mark.inductor
@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_fresh_node_restores_with_no_fxgraph_miss(published: dict, scheme: str) -> None:
    run = published[scheme]
    cold, warm = run["cold"], run["warm"]
    assert cold["report"]["store"] == run["url"] and cold["report"]["published_packs"] >= 1
    assert warm["report"]["restored_packs"] >= 1 and warm["report"]["outcome"] == "hit"
    assert warm["fxgraph_miss"] == 0 and warm["fxgraph_hit"] > 0
    assert warm["max_diff"] < 1e-4
    # The packs came over the network once, into the fresh node's local tier.
    assert warm["local_tier"]["remote_downloads"] == cold["report"]["published_packs"]
    assert warm["local_tier"]["bytes_downloaded"] > 0
    assert warm["local_tier"]["remote_errors"] == 0 and warm["local_tier"]["corrupt"] == 0
    assert not [w for w in warm["warnings"] if "compile cache" in w or "compile_cache" in w]
    # The small client served both: no fsspec, gcsfs, adlfs (nor the Azure SDK or aiohttp).
    assert not {"fsspec", "gcsfs", "adlfs", "s3fs"} & set(cold["imported"] + warm["imported"])
    # Exit-time writes (each node's stats object) succeed: no remote error once it has exited
    # (with adlfs every Azure node counted one: the SDK's executor is shut down before atexit).
    assert cold["tier_after_exit"]["remote_errors"] == 0 and warm["tier_after_exit"]["remote_errors"] == 0
    assert AZURITE_KEY not in cold["stderr"] + warm["stderr"]
    print(f"{scheme}: publisher {cold['wall_s']} s wall, {cold['cpu_s']} s CPU; fresh node "
          f"{warm['wall_s']} s wall, {warm['cpu_s']} s CPU")  # shown with -s: the test's cost


# ---------------------------------------------------------------------------------------------
# direct calls: no compile
# ---------------------------------------------------------------------------------------------
def test_a_create_that_finds_the_object_keeps_the_first(emulated: str, tmp_path: Path) -> None:
    """Two nodes put the same name: the second learns another node wrote it (False), and the
    object is the first writer's."""
    first, second = Store(emulated).remote.backend, Store(emulated).remote.backend
    assert first.client.startswith(CLIENTS[emulated[:2]])
    assert first.put_if_absent("v1/x/entry.json", b"first") is True
    assert second.put_if_absent("v1/x/entry.json", b"second") is False
    assert first.get("v1/x/entry.json", 100) == b"first"
    # Two stores publishing the same key: one pack object, both loads see it.
    Store(emulated).publish(K1, MEMBERS, compile_seconds=1.0)
    Store(emulated).publish(K1, MEMBERS, compile_seconds=1.0)
    entry = Store(emulated).remote.listing()[K1]
    assert len(entry.packs) == 1


@pytest.mark.parametrize("emulated", ["az"], indirect=True)
def test_azure_refuses_a_create_past_the_check(emulated: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Azure (Azurite) enforces the create (``If-None-Match: *``): the small client puts
    without a check first, and the second writer is told another node wrote it; the first's
    object stays. (gcp-storage-emulator ignores ``ifGenerationMatch=0``, which GCS enforces: for
    gs:// the check and content-named objects are what keep the first, as tested above.)"""
    backend = Store(emulated).remote.backend
    backend.put("v1/y/obj", b"first")
    with monkeypatch.context() as patched:
        patched.setattr(type(backend), "_exists", lambda self, name: pytest.fail("checked first"))
        assert backend.put_if_absent("v1/y/obj", b"second") is False
    assert backend.get("v1/y/obj", 100) == b"first"


def test_the_fsspec_fallback_still_serves_the_store(emulated: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``COMPILE_CACHE_REMOTE_CLIENT=fsspec`` (as any configuration the small client declines):
    gcsfs or adlfs reads what the small client published, and writes what it reads; a create
    racing past the check is refused where the server enforces it (Azurite)."""
    Store(emulated).publish(K1, MEMBERS, compile_seconds=1.0)
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_CLIENT", "fsspec")
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "fallback-tier"))
    store = Store(emulated)
    backend = store.remote.backend
    scheme = emulated[:2]
    assert backend.client == FALLBACK[scheme]
    assert "COMPILE_CACHE_REMOTE_CLIENT=fsspec" in backend.why
    assert f"served by {FALLBACK[scheme]} through fsspec" in backend.why
    packs = store.load(K1)
    assert [{n: p.members[n] for n in p.members} for p in packs] == [MEMBERS]
    for p in packs:
        p.close()
    assert store.stats()["remote_downloads"] == 1
    assert backend.put_if_absent("v1/w/obj", b"first") is True
    with monkeypatch.context() as patched:
        if scheme == "az":  # racing past the check: Azurite refuses the create (overwrite=False)
            patched.setattr(type(backend.fs), "exists", lambda self, path, **kw: False)
        assert backend.put_if_absent("v1/w/obj", b"second") is False
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_CLIENT", "auto")
    assert Store(emulated).remote.backend.get("v1/w/obj", 100) == b"first"


def test_an_empty_object_reads_as_empty_not_as_a_fault(emulated: str) -> None:
    """Azure answers a range on an empty blob with 416 InvalidRange (S3 and GCS with nothing):
    an empty object reads as b"" and the store stays up (a fault would make every call fail
    for 30 s: found by bench_remote, whose Azure nodes counted one remote error each)."""
    backend = Store(emulated).remote.backend
    backend.put("v1/z/empty", b"")
    assert backend.get("v1/z/empty", 100) == b""
    assert backend.head("v1/z/empty", 10) == b""
    assert backend.list("v1/z") == {"v1/z/empty": backend.list("v1/z")["v1/z/empty"]}
    assert backend.list("v1/z")["v1/z/empty"].size == 0


def test_a_damaged_object_is_a_counted_miss(emulated: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    damaged_object_read(emulated, K1, MEMBERS, tmp_path / "tier", monkeypatch)
    # The next node finds nothing to download: the object is in the URL's quarantine.
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier2"))
    assert Store(emulated).load(K1) == []


def test_doctor_names_the_client_and_why(emulated: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from _cli_helpers import call

    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115
    Store(emulated).publish(K1, MEMBERS, compile_seconds=1.0)
    code, out, err = call(capsys, "doctor", "--json", "--cache-dir", emulated)
    remote = json.loads(out)["store"]["remote"]
    scheme = emulated[:2]
    assert remote["error"] is None and remote["client"].startswith(CLIENTS[scheme])
    assert f"no {FALLBACK[scheme]}" in remote["client_why"]
    wanted = {"gs": "STORAGE_EMULATOR_HOST", "az": "AZURE_STORAGE_CONNECTION_STRING"}
    assert wanted[scheme] in remote["credentials_found"] and remote["answered"] is True
    assert AZURITE_KEY not in out + err
    assert json.loads(out)["store"]["entries"] == 1


def test_an_emulator_that_does_not_start_is_a_clear_failure(tmp_path: Path) -> None:
    from _object_emulators import _Server

    class Broken(_Server):
        name = "broken-emulator"

    with pytest.raises(RuntimeError, match=r"(?s)broken-emulator did not start on http://127\.0\.0\.1:\d+ "
                                           r"within 5 s \(exit 3\).*no such storage"):
        Broken()._start([sys.executable, "-c", "print('no such storage'); raise SystemExit(3)"],
                        tmp_path / "broken.log", timeout=5)
