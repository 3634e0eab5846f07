"""The store's counters, sharded per process (compile_cache.store.stats)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _fault_helpers import STORE_ENV
from _store_helpers import K1, K2, MEMBERS

from compile_cache.store import Store

REPO = str(Path(__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, fresh_state):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "cache")


# -- stats -------------------------------------------------------------------------------------------
def test_stats_count_hits_misses_and_time_saved(store: Store) -> None:
    store.publish(K1, MEMBERS, compile_seconds=30.0)
    store.record_hit(K1)  # defaults to the compile seconds the packs recorded
    store.record_hit(K1, seconds_saved=5.0, nbytes=100)
    store.record_miss(K2)
    store.record_error("restore")
    store.record_backend_fallback()
    s = Store(store.root).stats()  # persisted: another process/instance sees them
    assert (s["hits"], s["misses"], s["seconds_saved"], s["bytes_restored"]) == (2, 1, 35.0, 100)
    assert s["errors_by_kind"] == {"restore": 1} and s["backend_fallbacks"] == 1
    assert s["hit_rate"] == pytest.approx(2 / 3)
    assert s["entries"] == 1 and s["size"] > 0 and s["max_size"] == 20 << 30
    assert s["location_source"] == "argument" and s["read_only"] is False
    json.dumps(s)
    store.zero_stats()
    assert store.stats()["hits"] == 0 and store.stats()["entries"] == 1


STATS_WORKER = """
import sys
sys.path.insert(0, {repo!r})
from compile_cache.store import Store
s = Store(sys.argv[1])
for _ in range(20):
    s.record_hit(sys.argv[2], seconds_saved=1.0)
"""


def test_stats_are_safe_under_concurrent_processes(store: Store) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STATS_WORKER.format(repo=REPO), str(store.root), K1],
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    s = store.stats()
    assert s["hits"] == 40 and s["seconds_saved"] == 40.0 and s["errors"] == 0
