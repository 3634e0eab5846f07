"""The store session (compile_cache.session): a fresh process on a "new node" restores instead of
compiling, and what a forward compiled is published.

The real Inductor runs happen in child processes (tests/_cache_child.py), each with its own empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, as on a new node; they share one store. The fault
cases (corrupt, truncated, unsafe pack, read-only store) run in this process with the eager
backend: what is checked there is the store path, not Inductor's output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from _store_helpers import craft_pack
from conftest import drop_precompiled_headers, fresh_node_env, publisher_env

import compile_cache
from compile_cache import session
from compile_cache.demo import TinyTransformer
from compile_cache.keys import entry_key
from compile_cache.store import Store

CHILD = Path(__file__).with_name("_cache_child.py")


def _start(tmp: Path, store: Path, *args: str, machine: Path | None = None) -> dict:
    """One job start in a fresh process on a fresh node (new TMPDIR, HOME, local cache dirs);
    with ``machine``, a cold publisher on that build machine (conftest.publisher_env: its own
    local cache dirs, the machine's temp dir and torch's precompiled header there)."""
    local = Path(os.path.realpath(tmp)) / f"node-{len(list(tmp.glob('node-*')))}"
    env = fresh_node_env(local) if machine is None else publisher_env(machine, local)
    done = subprocess.run(
        [sys.executable, str(CHILD), str(store), *args],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def new_node(tmp_path_factory: pytest.TempPathFactory, build_machine: Path) -> dict:
    """A cold start that publishes (on the build machine, with local cache dirs of its own),
    then a start on a new node with the same store."""
    tmp = tmp_path_factory.mktemp("new_node")
    store = tmp / "store"
    cold = _start(tmp, store, "2", "64", "float32", machine=build_machine)
    warm = _start(tmp, store, "2", "64", "float32")
    changed = _start(tmp, store, "2", "32", "float32", machine=build_machine)
    drop_precompiled_headers(tmp)
    return {"store": store, "cold": cold, "warm": warm, "changed": changed, "tmp": tmp,
            "machine": build_machine}


def test_cold_start_compiles_and_publishes(new_node: dict) -> None:
    cold = new_node["cold"]
    assert cold["fxgraph_miss"] >= 1
    assert cold["report"]["restored_packs"] == 0
    assert cold["report"]["published_packs"] == 1
    assert cold["max_diff"] < 1e-4
    assert Store(new_node["store"]).stats()["misses"] >= 1


def test_new_node_restores_with_zero_fx_graph_misses(new_node: dict) -> None:
    warm = new_node["warm"]
    assert warm["fxgraph_miss"] == 0
    assert warm["fxgraph_hit"] >= 1
    assert warm["report"]["restored_packs"] == 1
    assert warm["report"]["hit"] is True
    assert warm["report"]["published_packs"] == 0
    assert warm["eager_calls"] == 0
    assert warm["max_diff"] < 1e-4


def test_new_node_answers_the_isa_probe_as_the_publisher_did(new_node: dict) -> None:
    """The restored probe libraries are not loaded again in child processes (1.5 s each on
    torch 2.11): every question gets the answer the publisher's probe gave for that file."""
    cold, warm = new_node["cold"]["isa_probe"], new_node["warm"]["isa_probe"]
    assert cold["answered"] + cold["asked_torch"] >= 1  # the publisher's probe ran, observed
    assert warm["asked_torch"] == 0, warm
    assert warm["answered"] == cold["answered"] + cold["asked_torch"]


def test_changed_shape_is_a_miss_and_compiles_correctly(new_node: dict) -> None:
    changed = new_node["changed"]
    assert changed["report"]["key"] != new_node["cold"]["report"]["key"]
    assert changed["report"]["restored_packs"] == 0
    assert changed["fxgraph_miss"] >= 1
    assert changed["max_diff"] < 1e-4
    assert len(Store(new_node["store"]).entries()) == 2


def test_precompile_start_skips_tracing_and_matches_eager(new_node: dict) -> None:
    tmp, store = new_node["tmp"], new_node["tmp"] / "store-precompile"
    cold = _start(tmp, store, "2", "64", "float32", "precompile", machine=new_node["machine"])
    warm = _start(tmp, store, "2", "64", "float32", "precompile")
    drop_precompiled_headers(tmp)
    assert cold["report"]["published_packs"] == 1
    assert warm["report"]["restored_packs"] == 1
    assert warm["fxgraph_miss"] == 0
    assert warm["max_diff"] < 1e-4
    assert warm["eager_calls"] == 0
    # Tracing skipped for every block, also those sharing the group's one precompile package;
    # without precompile a restored start still traces.
    assert warm["traced_graphs"] == 0
    assert new_node["warm"]["traced_graphs"] >= 1


def _model(width: int = 32, dtype: torch.dtype = torch.float32) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(layers=2, width=width, heads=2, vocab=64).eval().to(dtype)


def _planted(store_dir: Path, model: TinyTransformer, members: dict[str, bytes]) -> tuple[Store, str]:
    """A store holding one pack under the key compile_regions(model, backend="eager") will use."""
    store = Store(store_dir)
    key = entry_key(model, compile_cache.plan_regions(model), {"backend": "eager"}, False)
    assert store.publish(key, members) is not None
    return store, key


def _run_job(model: TinyTransformer, store_dir: Path) -> torch.Tensor:
    tokens = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        expected = model(tokens)
        compile_cache.compile_regions(model, cache_dir=store_dir, backend="eager")
        got = model(tokens)
    torch.testing.assert_close(got, expected)
    return got


def _only_pack(store: Store, key: str) -> Path:
    (info,) = store.entry(key).packs
    return Path(info.path)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_pack_is_a_counted_miss_and_the_job_runs(
    tmp_path: Path, damage: str, dynamo_reset: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = _model()
    store, key = _planted(tmp_path / "store", model, {"inductor/x/entry": b"payload" * 100})
    pack = _only_pack(store, key)
    data = bytearray(pack.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    pack.write_bytes(bytes(data))

    _run_job(model, tmp_path / "store")

    report = compile_cache.last_report()
    assert report.restored_packs == 0
    assert not (tmp_path / "inductor" / "x" / "entry").exists()
    stats = Store(tmp_path / "store").stats()
    assert stats["corrupt"] == 1
    assert stats["quarantined"] == 1
    assert not pack.exists()


def test_a_failed_background_publish_is_the_sessions_to_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On torch 2.11 every publish raised on the publisher's thread (a torch field it lacked) and
    # the only trace was a log line there: the job looked fine and the store stayed empty. The
    # failure now goes to the session's on_error (record_failure: warned, in the report's
    # errors, counted in stats).
    from compile_cache import capture, publisher
    from compile_cache.session_publish import SessionPublisher

    def moved(*args: object, **kwargs: object) -> None:
        raise AttributeError("'CodeId' object has no attribute 'closure_hash'")

    monkeypatch.setattr(capture, "usage", moved)
    failures: list[tuple[str, str]] = []
    publishing = SessionPublisher(Store(tmp_path / "store"), "ab" * 16, None, owners=("region_A",),
                                  precompile=False, precompiled=None, entry_info={},
                                  lock=threading.RLock(),
                                  on_error=lambda kind, message: failures.append((kind, message)))
    publishing.by_use = True
    logged_before = len(publisher.get().errors)
    publishing.submit()
    assert publisher.get().drain(30)
    assert failures == [("publish", "AttributeError: 'CodeId' object has no attribute 'closure_hash'")]
    assert len(publisher.get().errors) == logged_before  # reported by the session, not also logged


def test_pack_with_parent_path_is_rejected_before_any_write(
    tmp_path: Path, dynamo_reset: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "node" / "inductor"))
    model = _model()
    store, key = _planted(tmp_path / "store", model, {"inductor/ok": b"fine"})
    # Craft a pack the publisher would refuse: a member that climbs out of the Inductor dir.
    craft_pack(store, key, {"inductor/../x": b"evil", "inductor/ok": b"a"})

    _run_job(model, tmp_path / "store")

    assert not (tmp_path / "node" / "x").exists()
    assert compile_cache.last_report().restored_packs == 1  # the honest pack still restores
    assert Store(tmp_path / "store").stats()["corrupt"] == 1


def test_read_only_store_restores_and_warns_once(
    tmp_path: Path, dynamo_reset: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = _model()
    _planted(tmp_path / "store", model, {"inductor/restored/file": b"data"})
    monkeypatch.setenv("COMPILE_CACHE_READ_ONLY", "1")
    _run_job(model, tmp_path / "store")
    assert compile_cache.last_report().restored_packs == 1
    assert (tmp_path / "inductor" / "restored" / "file").read_bytes() == b"data"
    read_only = Store(tmp_path / "store")
    assert read_only.read_only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert read_only.publish("ab" * 16, {"inductor/a": b"1"}) is None
        assert read_only.publish("cd" * 16, {"inductor/b": b"2"}) is None
    assert len([w for w in caught if "read-only" in str(w.message)]) == 1


def test_cache_dir_false_uses_no_store(tmp_path: Path, dynamo_reset: None) -> None:
    model = _model()
    before = compile_cache.last_report()
    compile_cache.compile_regions(model, cache_dir=False, backend="eager")
    assert compile_cache.last_report() is before


def test_bad_precompile_env_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILE_CACHE_PRECOMPILE", "maybe")
    with pytest.raises(compile_cache.ConfigError, match="maybe"):
        session.precompile_requested(None)


def test_unsafe_store_is_refused(tmp_path: Path, dynamo_reset: None) -> None:
    shared = tmp_path / "open"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(compile_cache.UnsafeStoreError, match="chmod"):
        compile_cache.compile_regions(_model(), cache_dir=shared, backend="eager")
    shutil.rmtree(shared)


def test_precompile_argument_then_variable_then_the_one_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from compile_cache import config

    monkeypatch.delenv("COMPILE_CACHE_PRECOMPILE", raising=False)
    assert session.precompile_requested(None) is config.PRECOMPILE_DEFAULT
    monkeypatch.setattr(config, "PRECOMPILE", dataclasses.replace(config.PRECOMPILE, default=True))
    assert session.precompile_requested(None) is True  # the default lives in the registry
    for text, want in (("1", True), ("0", False)):
        monkeypatch.setenv("COMPILE_CACHE_PRECOMPILE", text)
        assert session.precompile_requested(None) is want
        assert session.precompile_requested(not want) is (not want)


def test_the_publisher_reads_a_precompile_entry_again_only_when_it_changed(tmp_path, monkeypatch):
    """Every publish reads the noted precompile entries on the publisher thread; an entry file
    that did not change since is not read again, a replaced one is, and its newest bytes win."""
    from compile_cache import artifacts
    from compile_cache.session_publish import SessionPublisher

    entry = tmp_path / "inductor" / "precompile" / "entry"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"first")
    reads = []
    real = artifacts.read_members

    def counting(paths, dirs=None):
        reads.append(list(paths))
        return real(paths, {"inductor": tmp_path / "inductor"})

    monkeypatch.setattr(artifacts, "read_members", counting)
    publishing = SessionPublisher(None, "k", None, owners=(), precompile=True, precompiled=None,
                                  entry_info={}, lock=threading.RLock(), on_error=print)
    publishing._extra_paths = {"group": str(entry)}
    publishing.read_extra()
    publishing.read_extra()
    assert len(reads) == 1 and publishing._extra["group"] == {"inductor/precompile/entry": b"first"}
    replaced = entry.with_name("entry.tmp")
    replaced.write_bytes(b"second, longer")
    os.replace(replaced, entry)
    publishing.read_extra()
    assert len(reads) == 2 and publishing._extra["group"] == {"inductor/precompile/entry": b"second, longer"}
    entry.unlink()  # pruned: what was read stays, and nothing fails
    publishing.read_extra()
    assert len(reads) == 2 and publishing._extra["group"]["inductor/precompile/entry"] == b"second, longer"
