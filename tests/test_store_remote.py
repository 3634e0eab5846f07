"""A store on object storage (compile_cache.store.remote, .backend), against a real S3 endpoint:
moto's standalone server on 127.0.0.1, started and stopped by the fixtures here.

One real Inductor job publishes to ``s3://``; a fresh node (new TMPDIR, HOME, XDG_CACHE_HOME,
Inductor and Triton dirs, and a new local tier) restores it, and another fresh node loses the
server mid-restore. The rest uses direct Store calls and the CLI in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
from _s3_server import SECRET, S3Server, make_bucket
from _store_helpers import damaged_object_read, store_warnings_of

from compile_cache.store import Store
from compile_cache.store import _reset as reset_store_warnings

HERE = Path(__file__).resolve().parent
REMOTE_CHILD = HERE / "_remote_child.py"
K1, K2 = "e1" * 16, "f2" * 16
#: What a pack of Inductor artifacts holds (labels every check, verify's too, accepts).
MEMBERS = {"inductor/fxgraph/ab/xyz": b"graph" * 100, "triton/0/abc/kernel.json": b"{}" * 30}


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """moto's S3 server on a free port of 127.0.0.1, for the whole session."""
    server = S3Server(tmp_path_factory.mktemp("moto") / "server.log")
    yield server
    server.stop()


@pytest.fixture
def s3_url(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """A new bucket, the S3 client's environment, and a private local tier for this test."""
    bucket = "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    make_bucket(s3, bucket)
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    for name in list(os.environ):
        if name.startswith("COMPILE_CACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    reset_store_warnings()
    return f"s3://{bucket}/cache"


def _node_env(base: Path, server: S3Server, **extra: str) -> dict[str, str]:
    """A fresh node: new TMPDIR, HOME, XDG_CACHE_HOME, Inductor/Triton dirs and local tier."""
    for name in ("tmp", "home", "xdg", "inductor", "triton", "tier"):
        (base / name).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILE_CACHE_", "AWS_"))}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    env.update(server.env(), TMPDIR=str(base / "tmp"), HOME=str(base / "home"),
               XDG_CACHE_HOME=str(base / "xdg"), TORCHINDUCTOR_CACHE_DIR=str(base / "inductor"),
               TRITON_CACHE_DIR=str(base / "triton"), COMPILE_CACHE_LOCAL_TIER=str(base / "tier"),
               PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]), **extra)
    return env


def _job(base: Path, server: S3Server, url: str, kill: int = 0, **extra: str) -> tuple[dict, str]:
    """One job start (TinyTransformer 2x64) on a fresh node: (its result, its stderr)."""
    done = subprocess.run(
        [sys.executable, str(REMOTE_CHILD), str(kill), url, "2", "64", "float32"],
        env=_node_env(base, server, **extra), capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture(scope="session")
def published(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A cold job that publishes to s3://, then a fresh node that restores from it."""
    tmp = tmp_path_factory.mktemp("remote_job")
    make_bucket(s3, "jobs")
    url = "s3://jobs/team/cache"
    cold, cold_err = _job(tmp / "node-0", s3, url)
    warm, warm_err = _job(tmp / "node-1", s3, url)
    return {"url": url, "cold": cold, "warm": warm, "stderr": cold_err + warm_err, "tmp": tmp, "server": s3}


def _objects(server: S3Server, bucket: str) -> dict[str, bytes]:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=server.endpoint, key="testing", secret=SECRET)
    return {path: fs.cat_file(path) for path in fs.find(bucket)}


# ---------------------------------------------------------------------------------------------
# a real job: publish, then a fresh node restores with zero FX-graph misses
# ---------------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_fresh_node_restores_from_s3_with_no_fxgraph_miss(published: dict) -> None:
    cold, warm = published["cold"], published["warm"]
    assert cold["fxgraph_miss"] > 0 and cold["report"]["published_packs"] >= 1
    assert cold["report"]["store"] == published["url"]
    assert warm["report"]["restored_packs"] >= 1
    assert warm["fxgraph_miss"] == 0 and warm["fxgraph_hit"] > 0
    assert warm["report"]["outcome"] == "hit"
    assert warm["max_diff"] < 1e-4
    # The packs came over the network once, into this node's local tier.
    assert warm["local_tier"]["remote_downloads"] == cold["report"]["published_packs"]
    assert warm["local_tier"]["bytes_downloaded"] > 0
    assert warm["local_tier"]["remote_errors"] == 0
    assert not [w for w in warm["warnings"] if "compile cache" in w or "compile_cache" in w]
    # Keys in the environment: the small S3 client served both jobs, without s3fs or botocore.
    assert cold["imported"] == [] and warm["imported"] == []


@pytest.mark.inductor
def test_the_secret_is_never_logged_stored_or_shown(published: dict, s3: S3Server, tmp_path: Path) -> None:
    assert SECRET not in published["stderr"]
    from compile_cache.store.compression import decompress_bytes

    blobs = _objects(s3, "jobs")
    assert any(path.endswith(".pack.zst") for path in blobs)  # packs travel compressed (issue 39)
    blobs = {p: decompress_bytes(d, 1 << 30) if p.endswith(".zst") else d for p, d in blobs.items()}
    assert not any(SECRET.encode() in data for data in blobs.values())
    tiers = [p for p in published["tmp"].rglob("*") if p.is_file() and "tier" in p.parts]
    assert tiers and not any(SECRET.encode() in p.read_bytes() for p in tiers)
    env = _node_env(tmp_path / "doctor", s3)
    outputs = {}
    for args in (["doctor", "--json"], ["stats", "--json"], ["ls", "--json"]):
        done = subprocess.run([sys.executable, "-m", "compile_cache", *args, "--cache-dir", published["url"]],
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        assert SECRET not in done.stdout + done.stderr, args
        assert done.returncode == 0 or args[0] == "doctor", done.stderr
        outputs[args[0]] = json.loads(done.stdout)
    report = outputs["doctor"]
    assert report["store"]["location"] == published["url"] and report["store"]["entries"] == 1
    assert "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY" in report["store"]["remote"]["credentials_found"]
    assert report["store"]["remote"]["client"].startswith("small S3 client")


@pytest.mark.inductor
def test_server_stopped_mid_restore_the_job_compiles(published: dict, tmp_path: Path) -> None:
    """A second server with a copy of the published objects dies when the first pack download
    starts: the job warns once, counts it, compiles, and its outputs equal eager's."""
    import s3fs

    second = S3Server(tmp_path / "second.log")
    try:
        make_bucket(second, "jobs")
        blobs = _objects(published["server"], "jobs")
        fs = s3fs.S3FileSystem(endpoint_url=second.endpoint, key="testing", secret=SECRET)
        for path, data in blobs.items():
            fs.pipe_file(path, data)
        result, _err = _job(tmp_path / "node", second, published["url"], kill=second.proc.pid,
                            COMPILE_CACHE_REMOTE_RETRIES="1", COMPILE_CACHE_REMOTE_TIMEOUT="2")
    finally:
        second.stop()
    assert result["report"]["restored_packs"] == 0
    assert result["fxgraph_miss"] > 0  # it compiled
    assert result["max_diff"] < 1e-4
    assert result["local_tier"]["remote_errors"] >= 1
    faults = [w for w in result["warnings"] if "treated as a miss, the job goes on" in w]
    assert len(faults) == 1, result["warnings"]


# ---------------------------------------------------------------------------------------------
# the store's behaviour, with direct calls
# ---------------------------------------------------------------------------------------------
def test_publish_then_a_new_local_tier_loads_and_downloads_once(s3_url: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    writer = Store(s3_url)
    info = writer.publish(K1, MEMBERS, entry_info={"model_class": "M"}, compile_seconds=2.0)
    assert info is not None and writer.root != tmp_path / "tier"
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    reader = Store(s3_url)
    assert reader.root.parent == tmp_path / "tier" and reader.location == s3_url
    packs = reader.load(K1)
    assert [dict((n, p.members[n]) for n in p.members) for p in packs] == [MEMBERS]
    for p in packs:
        p.close()
    assert Path(packs[0].info.path).is_file() and str(packs[0].info.path).startswith(str(tmp_path / "tier"))
    reader.load(K1)  # already in the local tier: no second download
    stats = reader.stats()
    moved = reader.remote.listing()[K1].packs[info.name]  # the compressed object (issue 39)
    assert stats["remote_downloads"] == 1 and stats["bytes_downloaded"] == moved < info.size
    assert stats["publishes"] == 1 and stats["entries"] == 1 and stats["location"] == s3_url


def test_two_processes_publishing_the_same_key_at_once(s3_url: str, tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, time
        from compile_cache.store import Store
        MEMBERS = {MEMBERS!r}
        s = Store({s3_url!r})
        while not os.path.exists({str(tmp_path / 'go')!r}):
            time.sleep(0.01)
        s.publish({K1!r}, MEMBERS, compile_seconds=1.0)
        print(s.stats()["remote_errors"])
    """)
    procs = []
    for i in range(2):
        env = dict(os.environ, COMPILE_CACHE_LOCAL_TIER=str(tmp_path / f"tier-{i}"))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _o, e in outs]
    assert [o.strip() for o, _e in outs] == ["0", "0"]
    store = Store(s3_url)
    entry = store.remote.listing()[K1]
    assert len(entry.packs) == 1  # content-named: both wrote the same object
    assert store.verify().ok
    packs = Store(s3_url).load(K1)
    assert len(packs) == 1 and dict(packs[0].members.items()) == MEMBERS


def test_a_corrupt_object_is_counted_quarantined_and_skipped(s3_url: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    name, reader = damaged_object_read(s3_url, K1, MEMBERS, tmp_path / "tier", monkeypatch)
    assert name not in reader.remote.listing().get(K1, type("E", (), {"packs": {}})).packs
    # The next node finds nothing to download: the object is in the URL's quarantine.
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier2"))
    assert Store(s3_url).load(K1) == [] and Store(s3_url).stats()["corrupt"] == 1


def test_a_pack_over_this_readers_limit_is_refused_and_left_for_others(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = Store(s3_url).publish(K1, {"inductor/fxgraph/ab/big": os.urandom(50_000)}, compile_seconds=1.0)
    monkeypatch.setenv("COMPILE_CACHE_MAX_PACK_SIZE", "10K")
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    reader = Store(s3_url)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert reader.load(K1) == []
    assert any("skipped" in m for m in store_warnings_of(shown))
    assert reader.stats()["corrupt"] == 1 and not reader.layout.pack_paths(K1)
    assert info.name in reader.remote.listing()[K1].packs  # a reader with a larger limit uses it


def test_an_unreachable_store_is_a_miss_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from _s3_server import free_port

    for name in list(os.environ):
        if name.startswith("COMPILE_CACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody listens
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_RETRIES", "1")
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_TIMEOUT", "2")
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    reset_store_warnings()
    store = Store("s3://nowhere/cache")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert store.load(K1) == []
        info = store.publish(K1, MEMBERS, compile_seconds=1.0)  # kept in the local tier
        store.record_hit(K1)
        assert store.load(K1) != []  # from the local tier
    messages = store_warnings_of(shown)
    assert len(messages) == 1 and "treated as a miss" in messages[0], messages
    assert SECRET not in messages[0]
    assert info is not None and Store(store.root).stats()["remote_errors"] >= 1


@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_a_job_on_a_store_it_cannot_use_starts_within_seconds_with_a_counted_miss(
        scheme: str, black_hole: Any, tmp_path: Path) -> None:
    """issue 57: a job whose store has no credentials, a name that does not resolve, or a port
    that never answers has its first output within 15 s of compile_regions, equal to eager's;
    the miss is counted in its local tier (under the node's cache dir) and warned about once;
    nothing reaches stderr (the fallback packages' loggers are quiet)."""
    from _object_emulators import MISCONFIGURED, misconfigured
    from conftest import fresh_node_env

    env = fresh_node_env(tmp_path / "node")
    cases = []
    for case in MISCONFIGURED:
        url, with_cloud = misconfigured(scheme, case, black_hole, env)
        cases.append({"url": url, "env": {k: v for k, v in with_cloud.items() if env.get(k) != v}})
    done = subprocess.run([sys.executable, str(HERE / "_remote_fault_child.py"), json.dumps(cases)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr.strip() == "", done.stderr[-4000:]  # no traceback, no package's log line
    for result in json.loads(done.stdout.strip().splitlines()[-1]):
        assert result["seconds"] < 15 and result["equal"], result
        assert result["restored_packs"] == 0 and result["miss_reason"], result
        assert result["local_tier"]["misses"] >= 1 and result["local_tier"]["remote_errors"] >= 1, result
        ours = [w for w in result["warnings"] if result["url"] in w]
        assert len(ours) == 1 and "treated as a miss" in ours[0], result["warnings"]


def test_the_local_tier_is_private_under_the_users_cache_dir(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 57: a store on object storage keeps its local tier under the user's cache dir
    (XDG_CACHE_HOME, else ~/.cache), by scheme and bucket, each directory made 0700, never in
    a shared temporary directory; a symlink on the way is refused, not followed; the
    COMPILE_CACHE_LOCAL_TIER override still decides where it goes."""
    import stat

    from compile_cache.errors import UnsafeStoreError
    from compile_cache.store.remote import local_tier_dir

    for name in list(os.environ):
        if name.startswith("COMPILE_CACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    store = Store("memory://container-x/cc")
    remote = tmp_path / "xdg" / "compile_cache" / "remote"
    assert store.root == local_tier_dir("memory://container-x/cc")
    assert store.root.parent == remote / "memory" / "container-x" and len(store.root.name) == 16
    for made in (remote, remote / "memory", remote / "memory" / "container-x", store.root):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    assert not any(p.name.startswith(("memory:", "az:")) for p in tmp_path.iterdir())
    assert Store("memory://container-x/other").root.parent == store.root.parent  # one tier per URL
    assert Store("memory://container-x/other").root != store.root
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (remote / "memory" / "planted").symlink_to(elsewhere)
    with pytest.raises(UnsafeStoreError, match="symlink"):
        Store("memory://planted/cc")
    assert list(elsewhere.iterdir()) == []
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "chosen"))
    assert Store("memory://container-x/cc").root.parent == tmp_path / "chosen"


def test_last_use_is_one_object_per_use_and_prune_compacts(s3_url: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    Store(s3_url).publish(K1, MEMBERS, compile_seconds=1.0)
    Store(s3_url).publish(K2, {"inductor/fxgraph/cd/other": b"y" * 50}, compile_seconds=1.0)
    for i in range(2):  # two nodes use K1: two objects, nothing rewritten
        monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / f"tier-{i}"))
        store = Store(s3_url)
        for p in store.load(K1):
            p.close()
        store.record_hit(K1)
    entries = store.remote.listing()
    assert len(entries[K1].uses) == 3 and len(entries[K2].uses) == 1
    assert entries[K1].last_used >= entries[K2].last_used
    removed = store.evict(max_size=entries[K1].size)  # LRU: the least recently used goes
    assert [e.key for e in removed] == [K2]
    after = store.remote.listing()
    assert list(after) == [K1] and len(after[K1].uses) == 1  # compacted to the newest


def test_memory_url_and_the_base_install_imports_no_fsspec(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        from compile_cache.store import Store
        Store({str(tmp_path / 'local')!r}).stats()
        print("fsspec" in sys.modules)
        s = Store("memory://bucket/cc")
        s.publish({K1!r}, {{"inductor/fxgraph/ab/x": b"x"}}, compile_seconds=1.0)
        print("fsspec" in sys.modules, s.location, len(s.remote.listing()))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "memory://bucket/cc", "1"]


def test_a_url_without_its_package_says_what_to_install(tmp_path: Path) -> None:
    from compile_cache.errors import StoreError

    with pytest.raises(StoreError, match="not a usable store URL.*nosuchproto"):
        Store("nosuchproto://bucket/cc")
    # A node without the [gcs] and [azure] extras (a new process: fsspec keeps a protocol's
    # class once it has loaded it, and this test run's emulator tests load both).
    code = textwrap.dedent("""
        import sys
        sys.modules["gcsfs"] = sys.modules["adlfs"] = None
        from compile_cache.store import Store
        for url in ("gs://bucket/cc", "az://container/cc"):
            try:
                Store(url)
            except Exception as exc:
                print(type(exc).__name__, exc)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    gs, az = done.stdout.strip().splitlines()
    assert gs.startswith("StoreError") and "pip install" in gs
    assert "'compile-cache[gcs]' (gcsfs) for gs://" in gs
    assert az.startswith("StoreError") and "'compile-cache[azure]' (adlfs) for az://" in az


# ---------------------------------------------------------------------------------------------
# the CLI round trip on s3://
# ---------------------------------------------------------------------------------------------
def test_cli_round_trip_on_s3(s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    from _cli_helpers import call

    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115
    writer = Store(s3_url)
    writer.publish(K1, MEMBERS, entry_info={"model_class": "pkg.Model"}, compile_seconds=1.0)
    writer.publish(K2, {"inductor/fxgraph/cd/other": b"y" * 50}, compile_seconds=1.0)
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "cli-tier"))
    code, out, _ = call(capsys, "ls", "--json", "--cache-dir", s3_url)
    listed = json.loads(out)
    assert code == 0 and listed["store"] == s3_url
    assert sorted(e["key"] for e in listed["entries"]) == [K1, K2]
    assert {e["model_class"] for e in listed["entries"]} >= {"pkg.Model"}
    code, out, _ = call(capsys, "stats", "--json", "--cache-dir", s3_url)
    stats = json.loads(out)
    assert code == 0 and stats["publishes"] == 2 and stats["packs"] == 2 and stats["location"] == s3_url
    code, out, _ = call(capsys, "verify", "--cache-dir", s3_url)
    assert code == 0 and "Checked 2 entries, 2 packs" in out and "OK" in out
    archive = tmp_path / "cache.tar"
    code, out, _ = call(capsys, "export", str(archive), "--cache-dir", s3_url)
    assert code == 0 and "Exported 2 pack(s)" in out
    code, out, _ = call(capsys, "prune", "--key", K2[:12], "-y", "--cache-dir", s3_url)
    assert code == 0 and "Removed 1 entry" in out
    assert list(Store(s3_url).remote.listing()) == [K1]
    other = s3_url.rsplit("/", 1)[0] + "/imported"
    code, out, _ = call(capsys, "import", str(archive), "--cache-dir", other)
    assert code == 0 and "2 pack(s) added" in out
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "fresh-tier"))
    assert sorted(Store(other).remote.listing()) == [K1, K2]
    assert dict(Store(other).load(K1)[0].members.items()) == MEMBERS
    code, out, _ = call(capsys, "doctor", "--json", "--cache-dir", other)
    report = json.loads(out)
    assert report["store"]["location"] == other and report["store"]["remote"]["error"] is None
    assert report["store"]["remote"]["client"].startswith("small S3 client")
    assert "no s3fs" in report["store"]["remote"]["client_why"]  # which client, and why (issue 39)
    assert report["store"]["entries"] == 2 and SECRET not in out
    code, out, _ = call(capsys, "stats", "--zero", "--cache-dir", other)
    assert code == 0 and Store(other).stats()["publishes"] == 0


def test_verify_fix_quarantines_a_corrupt_object(s3_url: str) -> None:
    info = Store(s3_url).publish(K1, MEMBERS, compile_seconds=1.0)
    store = Store(s3_url)
    name = store.remote.layout.pack_object_of(store.remote.listing()[K1], info.name)  # .pack.zst
    store.remote.backend.put(name, b"garbage" * 10)
    report = store.verify()
    assert len(report.corrupt_packs) == 1 and s3_url in str(report.corrupt_packs[0][0])
    assert store.verify(fix=True).corrupt_packs and store.verify().ok
    assert store.stats()["quarantined"] == 1


def test_one_nodes_local_error_never_deletes_a_good_pack_from_the_bucket(
    s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """issue 31.8: only a content check quarantines; EMFILE while checking a download (or in
    verify --fix) is this node's counted error, and the bucket keeps the pack."""
    import errno

    from compile_cache.store.fs import StoreFS

    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-writer"))
    assert Store(s3_url).publish(K1, MEMBERS) is not None
    real_open, real_create = StoreFS.open_read, StoreFS.create

    def emfile(real):
        def opening(fs: StoreFS, path, *args, **kwargs):  # the node is out of file descriptors
            if ".tmp-" in str(path):
                raise OSError(errno.EMFILE, "Too many open files")
            return real(fs, path, *args, **kwargs)
        return opening

    monkeypatch.setattr(StoreFS, "open_read", emfile(real_open))  # a download checked from a file
    monkeypatch.setattr(StoreFS, "create", emfile(real_create))  # a download checked in memory
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-busy"))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        busy = Store(s3_url)
        assert busy.load(K1) == []  # a miss for this node only
        report = busy.verify(fix=True)
    assert report.unchecked and not report.corrupt_packs and not report.ok
    assert busy.stats()["errors_by_kind"].get("EMFILE", 0) >= 2 and busy.stats()["corrupt"] == 0
    monkeypatch.setattr(StoreFS, "open_read", real_open)
    monkeypatch.setattr(StoreFS, "create", real_create)
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-next"))
    packs = Store(s3_url).load(K1)  # the next node: the pack is still in the bucket, whole
    assert [dict((n, p.members[n]) for n in p.members) for p in packs] == [MEMBERS]
    for p in packs:
        p.close()


# ---------------------------------------------------------------------------------------------
# a fetch's downloads side by side (issue 39: a fresh node waits for the slowest pack, not the sum)
# ---------------------------------------------------------------------------------------------
#: Three packs of one key, largest first (random bytes: zstd cannot shrink them much).
THREE = [{f"inductor/fxgraph/ab/p{i}": os.urandom(size)} for i, size in enumerate((60_000, 30_000, 10_000))]


def _three_packs(s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """``THREE`` published to ``s3_url``; a reader on a new, empty local tier."""
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-writer"))
    writer = Store(s3_url)
    for members in THREE:
        assert writer.publish(K1, members, compile_seconds=1.0) is not None
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    return Store(s3_url)


def _loaded(packs: list) -> list[dict]:
    out = [dict((n, p.members[n]) for n in p.members) for p in packs]
    for p in packs:
        p.close()
    return sorted(out, key=lambda m: -len(next(iter(m.values()))))


def test_a_fetch_downloads_side_by_side_and_its_threads_import_nothing(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from compile_cache.store import compression
    from compile_cache.store.backends.s3 import S3Backend

    reader = _three_packs(s3_url, tmp_path, monkeypatch)
    threads: list[str] = []
    real = S3Backend.download

    def recording(self, name, out, limit):
        threads.append(threading.current_thread().name)
        return real(self, name, out, limit)

    class Watch:  # every module a download thread imports (one not yet in sys.modules)
        imported: list[tuple[str, str]] = []

        def find_spec(self, name, path=None, target=None):
            thread = threading.current_thread().name
            if thread.startswith("compile-cache-get"):
                self.imported.append((thread, name))
            return None

    monkeypatch.setattr(S3Backend, "download", recording)
    compression.zstd.cache_clear()  # the zstd module is looked up again: by the fetch, not a worker
    watch = Watch()
    sys.meta_path.insert(0, watch)
    try:
        packs = reader.load(K1)
    finally:
        sys.meta_path.remove(watch)
    assert _loaded(packs) == THREE
    assert watch.imported == []
    assert len(threads) == 3 and len(set(threads)) == 3  # one each, side by side
    here = threading.current_thread().name
    assert here in threads and all(t.startswith("compile-cache-get") for t in threads if t != here)
    assert not [t for t in threading.enumerate() if t.name.startswith("compile-cache-get")]  # none left
    stats = reader.stats()
    assert stats["remote_downloads"] == 3 and stats["remote_errors"] == 0
    assert (reader.root / "v1" / "entries" / K1[:2] / K1 / "entry.json").is_file()


def test_a_failed_get_on_this_thread_is_a_miss(s3_url: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _one_get_fails(s3_url, tmp_path, monkeypatch, 0)  # the largest pack: this thread's


def test_a_failed_get_on_a_worker_is_a_miss(s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _one_get_fails(s3_url, tmp_path, monkeypatch, 2)  # the smallest: a worker's


def _one_get_fails(s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int) -> None:
    """The download of pack ``failing`` (by size, largest first) fails: a miss, counted once,
    no temp file left; the next start fetches everything."""
    from compile_cache._paths import is_temp_name
    from compile_cache.store.backends import RemoteError
    from compile_cache.store.backends.s3 import S3Backend

    reader = _three_packs(s3_url, tmp_path, monkeypatch)
    listing = reader.remote.listing()[K1].packs
    bad = sorted(listing, key=lambda n: -listing[n])[failing]
    real = S3Backend.download

    def refusing(self, name, out, limit):
        if bad in name:
            out.write(b"partial")
            raise RemoteError("downloading failed: HTTP 403 AccessDenied")  # as after its tries
        return real(self, name, out, limit)

    monkeypatch.setattr(S3Backend, "download", refusing)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        packs = reader.load(K1)
    assert packs == []  # a fault is a miss: nothing of this fetch is put in place
    messages = store_warnings_of(shown)
    assert len(messages) == 1 and "treated as a miss" in messages[0], messages
    stats = reader.stats()
    assert stats["remote_errors"] == 1 and stats["remote_downloads"] == 0, (stats, messages)
    assert not [p for p in reader.root.rglob("*") if is_temp_name(p.name)]
    monkeypatch.setattr(S3Backend, "download", real)
    assert _loaded(Store(s3_url).load(K1)) == THREE  # the next start fetches what is missing


_PREFETCH_CHILD = """
import json, sys, threading
from compile_cache.store import Store

imported = []


class Watch:  # every module a compile_cache thread imports (one not yet in sys.modules)
    def find_spec(self, name, path=None, target=None):
        if threading.current_thread().name.startswith("compile-cache-"):
            imported.append(name)
        return None


store = Store(sys.argv[1])
sys.meta_path.insert(0, Watch())
started = store.prefetch(sys.argv[2])
packs = store.load(sys.argv[2])
print(json.dumps({"started": started, "imported": imported, "packs": len(packs),
                  "downloads": store.stats()["remote_downloads"]}))
"""


def test_a_prefetch_in_a_fresh_process_imports_nothing_on_its_threads(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing's parsers (XML, dates) are imported on first use: Store.prefetch imports
    them before its thread starts (a thread that imports can deadlock with the user's imports)."""
    _three_packs(s3_url, tmp_path, monkeypatch)
    env = dict(os.environ, COMPILE_CACHE_LOCAL_TIER=str(tmp_path / "fresh"))
    done = subprocess.run([sys.executable, "-c", _PREFETCH_CHILD, s3_url, K1], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"started": True, "imported": [], "packs": 3, "downloads": 3}


def test_a_prefetch_that_fails_is_a_miss_counted_once(s3_url: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from compile_cache.store.backends import RemoteError
    from compile_cache.store.backends.s3 import S3Backend

    reader = _three_packs(s3_url, tmp_path, monkeypatch)
    real = S3Backend.list

    def failing(self, prefix):
        raise RemoteError("listing failed: HTTP 503 SlowDown")  # as after its tries

    monkeypatch.setattr(S3Backend, "list", failing)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert reader.prefetch(K1) is True and reader.prefetch(K1) is False  # one at a time
        assert reader.load(K1) == []
    messages = store_warnings_of(shown)
    assert len(messages) == 1 and "treated as a miss" in messages[0], messages
    monkeypatch.setattr(S3Backend, "list", real)
    stats = reader.stats()
    assert stats["remote_errors"] == 1 and stats["remote_downloads"] == 0
    assert reader.prefetch(K1) is True and _loaded(reader.load(K1)) == THREE  # the next try
    assert Store(str(tmp_path / "dir")).prefetch(K1) is False  # a directory store: nothing to start


def test_a_loads_bookkeeping_is_written_off_its_thread_and_read_back(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load writes no counters object or use record on the job's thread (a start waits for
    no bookkeeping PUT); the background publisher writes them, and a listing or stats in the
    same process (another Store of the URL too) sees them."""
    import threading

    from compile_cache.store.backends.s3 import S3Backend

    reader = _three_packs(s3_url, tmp_path, monkeypatch)
    uses = len(reader.remote.listing()[K1].uses)
    puts: list[tuple[str, str]] = []
    real = S3Backend.put

    def recording(self, name, data):
        puts.append((threading.current_thread().name, name))
        return real(self, name, data)

    monkeypatch.setattr(S3Backend, "put", recording)
    packs = reader.load(K1)
    here = [name for thread, name in puts if thread == threading.current_thread().name]
    assert _loaded(packs) == THREE and here == []
    other = Store(s3_url)  # its stats read this process's counters object, written first
    assert other.stats()["remote_downloads"] == 3
    assert len(other.remote.listing()[K1].uses) == uses + 1


def test_a_starts_bookkeeping_waits_then_goes_out_as_one_write(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's counter updates (downloads, the local tier's size recount, ...) and its use
    record are not sent as they happen, during the start, but once, ``WRITE_DELAY_S`` later,
    from the background publisher: one PUT of the counters object for all of them."""
    import threading
    import time

    from compile_cache.store import remote
    from compile_cache.store.backends.s3 import S3Backend

    reader = _three_packs(s3_url, tmp_path, monkeypatch)
    tier = reader.remote
    uses = len(tier.listing()[K1].uses)  # (a listing writes what waits: the writer's counters)
    puts: list[tuple[str, str, float]] = []
    real = S3Backend.put

    def recording(self, name, data):
        if self is tier.backend:  # (not the writes other tests' stores left waiting)
            puts.append((threading.current_thread().name, name, time.monotonic()))
        return real(self, name, data)

    monkeypatch.setattr(S3Backend, "put", recording)
    monkeypatch.setattr(remote, "WRITE_DELAY_S", 5.0)
    started = time.monotonic()
    assert _loaded(reader.load(K1)) == THREE
    assert puts == []  # nothing during the start
    deadline = time.monotonic() + 60
    while not any(name == tier._stats_object for _, name, _ in puts) and time.monotonic() < deadline:
        time.sleep(0.05)
    # the write that sent the counters sends the use record next, in the same job: let it end
    from compile_cache import publisher
    assert publisher.get().drain(timeout=60)
    mine = list(puts)
    assert [name for _, name, _ in mine].count(tier._stats_object) == 1, mine  # one write for them all
    assert sum("/used/" in name for _, name, _ in mine) == 1, mine
    assert all(thread == "compile_cache-publish" for thread, _, _ in mine), mine
    assert min(at for _, _, at in mine) >= started + 5.0
    other = Store(s3_url)
    assert other.stats()["remote_downloads"] == 3 and len(other.remote.listing()[K1].uses) == uses + 1


_SIGTERM_CHILD = """
import os, signal, sys, time
from compile_cache.store import Store

packs = Store(sys.argv[1]).load(sys.argv[2])
assert len(packs) == 3
os.kill(os.getpid(), signal.SIGTERM)  # long before the waiting writes are due
time.sleep(60)
"""


def test_a_sigterm_writes_the_bookkeeping_that_waits(s3_url: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM (SLURM, Kubernetes) runs the publisher's exit drain, not atexit: the counters
    and use record a start left waiting are written then."""
    _three_packs(s3_url, tmp_path, monkeypatch)
    uses = len(Store(s3_url).remote.listing()[K1].uses)
    env = dict(os.environ, COMPILE_CACHE_LOCAL_TIER=str(tmp_path / "terminated"))
    done = subprocess.run([sys.executable, "-c", _SIGTERM_CHILD, s3_url, K1], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == -15, done.stderr[-3000:]
    other = Store(s3_url)
    assert other.stats()["remote_downloads"] == 3 and len(other.remote.listing()[K1].uses) == uses + 1


def test_a_prefetch_checks_each_pack_on_its_threads(s3_url: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks a load makes of a downloaded pack (limits, checksum, members, content name)
    run where it was downloaded, off the job's thread; the job's thread only puts it in place."""
    import threading

    from compile_cache.store.checker import PackChecker

    reader = _three_packs(s3_url, tmp_path, monkeypatch)
    checked: list[str] = []
    real = PackChecker.check_data  # a compressed download is checked in memory

    def recording(self, data, key, name):
        checked.append(threading.current_thread().name)
        return real(self, data, key, name)

    monkeypatch.setattr(PackChecker, "check_data", recording)
    assert reader.prefetch(K1) is True
    assert _loaded(reader.load(K1)) == THREE
    assert len(checked) == 3 and threading.current_thread().name not in checked, checked


def test_a_new_local_tier_is_counted_exact_without_a_walk(s3_url: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A local tier this process made is empty: its first fetch's cap check walks nothing, and
    its size counter is exact (the packs, entry.json), calibrated as by one recount; a tier that
    was there already, of unknown size, is still walked once."""
    from compile_cache.store import maintenance

    reader = _three_packs(s3_url, tmp_path, monkeypatch)
    walks: list[str] = []
    real = maintenance.total_size

    def walking(parts):
        walks.append(str(parts.fs.root))
        return real(parts)

    monkeypatch.setattr(maintenance, "total_size", walking)
    assert _loaded(reader.load(K1)) == THREE
    assert walks == []
    size, calibrated = reader.counters.tracked_size()
    assert calibrated and size == real(reader.parts) > sum(len(v) for m in THREE for v in m.values())
    assert reader.counters.totals()["size_recounts"] == 1
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-there"))
    Store(s3_url).root.mkdir(parents=True, exist_ok=True)  # made by an earlier process: not new
    for shard in (tmp_path / "tier-there").rglob("stats/*"):
        shard.unlink()  # what that process counted is lost: the size is unknown
    old = Store(s3_url)
    assert _loaded(old.load(K1)) == THREE
    assert walks == [str(old.root)]


@pytest.mark.parametrize("entry_info", [{"model_class": "M"}, None], ids=["header-record", "earlier-pack"])
def test_a_fresh_node_restores_one_pack_with_one_get_on_the_prefetch_thread(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry_info: dict | None) -> None:
    """An entry of one pack: one GET, on the prefetch's thread (no download thread, no second
    connection, whose start would take the GIL from the job's thread); the local entry.json is
    written from the record the pack's header carries. A pack published without one (as before
    headers carried it) costs a second GET, of the URL's entry.json. Several packs still come
    side by side (above)."""
    import threading

    from compile_cache.store.backends.s3 import S3Backend

    s3_url += "-with" if entry_info else "-without"  # the two cases' buckets are the same
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-writer"))
    assert Store(s3_url).publish(K1, MEMBERS, entry_info=entry_info, compile_seconds=1.0)
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    reader = Store(s3_url)
    requests: list[tuple[str, str]] = []
    real = S3Backend._object

    def recording(self, method, name, *args, **kwargs):
        requests.append((threading.current_thread().name, name.rsplit("/", 1)[-1]))
        return real(self, method, name, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "_object", recording)
    assert reader.prefetch(K1) is True
    assert _loaded(reader.load(K1)) == [MEMBERS]
    names = [name for _thread, name in requests]
    assert {t for t, _name in requests} == {"compile-cache-prefetch"}, requests
    assert len(names) == (1 if entry_info else 2) and names[0].endswith(".pack.zst"), names
    record = json.loads((reader.root / "v1" / "entries" / K1[:2] / K1 / "entry.json").read_bytes())
    assert record["key"] == K1 and record["format"] == 1 and {"created", "torch", "host"} <= record.keys()
    assert record.get("model_class") == (entry_info or {}).get("model_class")


def test_a_downloaded_pack_is_read_whole_once_unless_it_changed(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack checked whole as it was downloaded is not read whole again by the load that
    follows (its checksum is not computed twice); the load after that reads it whole. A pack
    file changed between the download and the load (same size) is read whole and refused."""
    import time

    from compile_cache.store import reader as pack_reader
    from compile_cache.store.checker import PackChecker

    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-writer"))
    assert Store(s3_url).publish(K1, MEMBERS, entry_info={"model_class": "M"})
    checksums: list[bool] = []
    real_open = pack_reader.open_pack

    def recording(*args, checksum: bool = True, **kwargs):
        checksums.append(checksum)
        return real_open(*args, checksum=checksum, **kwargs)

    monkeypatch.setattr(pack_reader, "open_pack", recording)
    monkeypatch.setattr("compile_cache.store.checker.open_pack", recording)
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    reader = Store(s3_url)
    assert _loaded(reader.load(K1)) == [MEMBERS]
    assert checksums == [True, False]  # the download's check, then the load's without the body
    assert _loaded(reader.load(K1)) == [MEMBERS]
    assert checksums == [True, False, True]

    real_vouch = PackChecker.vouch

    def changed_after(self, st):
        real_vouch(self, st)
        time.sleep(0.05)  # past the file system's timestamp granularity
        pack = next((tmp_path / "tier-changed").rglob("*.pack"))
        data = bytearray(pack.read_bytes())
        data[-1] ^= 0xFF  # the last member's last byte: same size
        with open(pack, "r+b") as fh:
            fh.write(data)

    monkeypatch.setattr(PackChecker, "vouch", changed_after)
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-changed"))
    checksums.clear()
    changed = Store(s3_url)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert changed.load(K1) == []
    assert checksums == [True, True] and changed.stats()["corrupt"] == 1


def test_a_fresh_node_loads_before_its_download_is_synced_and_the_sync_follows(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The job does not wait for the disk: a pack downloaded by a prefetch is in place and
    loaded while its fsync has not yet run; the prefetch thread syncs it later
    (``SYNC_DELAY_S`` after its result). A failing sync is logged, and the pack in place still
    loads (a later load checks it whole). Without a prefetch (a fetch on the job's thread) the
    pack is synced before it is put in place, as before."""
    import threading

    from compile_cache.store import remote

    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-writer"))
    assert Store(s3_url).publish(K1, MEMBERS, entry_info={"model_class": "M"})
    release, synced = threading.Event(), []
    real_fsync = os.fsync

    def held_fsync(fd: int) -> None:
        assert release.wait(30)
        synced.append(threading.current_thread().name)
        if len(synced) == 2:
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    def prefetch_threads_end() -> None:
        for thread in threading.enumerate():
            if thread.name == "compile-cache-prefetch":
                thread.join(30)

    prefetch_threads_end()  # earlier tests' (each syncs its packs SYNC_DELAY_S after its result)
    monkeypatch.setattr(remote.os, "fsync", held_fsync)
    monkeypatch.setattr(remote, "SYNC_DELAY_S", 0.2)
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    reader = Store(s3_url)
    assert reader.prefetch(K1) is True
    assert _loaded(reader.load(K1)) == [MEMBERS]  # its fsync still held
    assert synced == []
    release.set()
    prefetch_threads_end()
    assert synced == ["compile-cache-prefetch"]

    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-failing"))
    failing = Store(s3_url)
    with caplog.at_level("WARNING", logger="compile_cache"):
        assert failing.prefetch(K1) is True
        assert _loaded(failing.load(K1)) == [MEMBERS]
        prefetch_threads_end()
    assert len(synced) == 2 and "not synced to disk" in caplog.text and "Input/output error" in caplog.text
    assert _loaded(Store(s3_url).load(K1)) == [MEMBERS] and failing.stats()["corrupt"] == 0

    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-inline"))
    inline = Store(s3_url)
    assert _loaded(inline.load(K1)) == [MEMBERS]  # no prefetch: synced before it is in place
    assert synced[2:] == [threading.current_thread().name]
