"""Six processes publish, load and restore real Inductor artifacts into one store, for several rounds.

CI budget: one real Inductor compile (a subprocess, captured with ``artifacts.Capture``) gives the
members; 6 forked processes x ROUNDS rounds then publish/load/restore them under one shared key
and one key each, with and without the key lock; a last fresh process restores the shared key
into an empty Inductor dir and compiles with Inductor: zero FX-graph misses, no new ``.so`` (g++
never ran) and outputs equal to eager prove the bytes that went through the races are right.
"""

from __future__ import annotations

import os
import pickle
import shutil
import traceback
import warnings
from pathlib import Path

import pytest
from _fault_helpers import FORK, join_or_fail, temp_files
from conftest import run_mlp_child

from compile_cache import artifacts
from compile_cache.store import Store, StoreWarning

PROCESSES = 6
ROUNDS = 4
SHARED = "c0" * 16
members_out: list = []  # the captured compile's outputs: a restored kernel must give exactly these

@pytest.fixture(scope="module")
def real_members(mlp_capture) -> dict[str, bytes]:
    """One real Inductor compile, captured: FX-graph entry, AOTAutograd entry, the .so."""
    first, pack = mlp_capture
    with open(pack, "rb") as f:
        members = pickle.load(f)
    members_out[:] = first["out"]
    assert any(k.endswith(".so") for k in members) and any("fxgraph" in k for k in members)
    return members


def _worker(root: str, n: int, members: dict[str, bytes], scratch: str, errors) -> None:
    try:
        warnings.simplefilter("error", StoreWarning)  # any corrupt pack or I/O error fails us
        store = Store(root)
        own = f"{n + 1:02x}" * 16
        extra = {f"inductor/extra/worker-{n}": os.urandom(64 << 10)}
        for r in range(ROUNDS):
            for key, content in ((SHARED, members), (own, {**members, **extra} if r == 0 else members)):
                local = Path(scratch) / f"w{n}-r{r}-{key[:4]}"  # a fresh "node" every round
                dirs = {"inductor": local / "inductor", "triton": local / "triton"}
                use_lock = (r + n) % 2 == 0  # half the time without the lock: races must be safe
                lock = store.lock(key, timeout=60) if use_lock else None
                if lock:
                    lock.acquire()
                try:
                    packs = store.load(key)
                    if packs:
                        for pack in packs:
                            artifacts.restore(pack.members, dirs=dirs)
                        for name, data in members.items():
                            label, rel = name.split("/", 1)
                            assert (dirs[label] / rel).read_bytes() == data, name
                        store.record_hit(key, nbytes=1)
                    else:
                        store.record_miss(key)
                    store.publish(key, content, compile_seconds=1.0)
                finally:
                    if lock:
                        lock.release()
                shutil.rmtree(local, ignore_errors=True)
    except BaseException:
        errors.put(f"worker {n}: {traceback.format_exc()}")
        raise SystemExit(1) from None


@pytest.mark.inductor
def test_six_processes_publish_and_restore_real_artifacts(tmp_path, monkeypatch, real_members) -> None:
    for name in ("COMPILE_CACHE_LOCK", "COMPILE_CACHE_SIGNING_KEY", "COMPILE_CACHE_READ_ONLY", "COMPILE_CACHE_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "store"
    Store(root)
    errors = FORK.Queue()
    procs = [FORK.Process(target=_worker, args=(str(root), n, real_members, str(tmp_path / "nodes"), errors))
             for n in range(PROCESSES)]
    for p in procs:
        p.start()
    for p in procs:
        join_or_fail(p, 180)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures and all(p.exitcode == 0 for p in procs), failures

    store = Store(root)
    report = store.verify(temp_age=0)
    assert report.ok, report
    assert temp_files(root) == []
    # No duplicate packs for the same content: one pack for the shared key, two per own key.
    assert len(store.entry(SHARED).packs) == 1
    for n in range(PROCESSES):
        assert len(store.entry(f"{n + 1:02x}" * 16).packs) == 2
    stats = store.stats()
    lookups = PROCESSES * ROUNDS * 2
    assert stats["hits"] + stats["misses"] == lookups, stats
    assert stats["misses"] <= PROCESSES * 2  # only first lookups (and racing ones) can miss
    assert stats["errors"] == 0 and stats["corrupt"] == 0 and stats["incompatible"] == 0

    # The bytes that went through the races compile for real: a fresh node restores and hits.
    result = run_mlp_child(tmp_path / "check", "restore-store", str(root), SHARED)
    assert result["counters"]["fxgraph_miss"] == 0 and result["counters"]["fxgraph_hit"] >= 1, result
    assert not [k for k in result["added"] if k.endswith(".so")], result["added"]
    assert result["out"] == members_out  # bit for bit the compiled kernel's outputs (and ~eager)
