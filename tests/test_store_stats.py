"""The store's counters, sharded per process (compile_cache.store.stats)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _fault_helpers import STORE_ENV
from _store_helpers import K1, K2, K3, MEMBERS

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


# -- the size counter (what the cap is checked against after every publish) ----------------------
def _exact(s: Store) -> int:
    from compile_cache.store import maintenance

    return maintenance.total_size(s.parts)


def _tracked(s: Store) -> int:
    size, calibrated = Store(s.root).counters.tracked_size()  # as another process reads it
    assert calibrated
    return size


def test_the_size_counter_follows_publishes_evictions_quarantine_imports_and_clear(
    store: Store, tmp_path: Path
) -> None:
    store.publish(K1, MEMBERS)
    store.publish(K1, {"inductor/fxgraph/cd/more": b"m" * 300})
    store.publish(K2, MEMBERS)
    assert _tracked(store) == _exact(store) > 0
    store.export(tmp_path / "all.tar")
    store.evict(keys=[K2])
    assert _tracked(store) == _exact(store)
    (pack,) = sorted(store.layout.packs_dir(K1).glob("*.pack"))[:1]
    data = bytearray(pack.read_bytes())
    data[-1] ^= 0xFF
    pack.write_bytes(bytes(data))  # corrupt, same size: load quarantines it
    with pytest.warns(Warning):
        store.load(K1)
    assert _tracked(store) == _exact(store)
    store.import_archive(tmp_path / "all.tar")
    assert _tracked(store) == _exact(store)
    store.clear()
    assert _tracked(store) == _exact(store) == 0


def test_a_publish_under_the_cap_never_walks_the_store(store: Store, monkeypatch) -> None:
    """A store of many entries: publishing one more reads the counters, no other entry."""
    from compile_cache.store.layout import Layout
    from compile_cache.store.records import EntryInfo

    for i in range(40):
        store.publish(f"{i:02x}" * 16, {"inductor/x/y": bytes([i]) * 100})

    def walked(*args, **kwargs):
        raise AssertionError("the publish walked the store")

    monkeypatch.setattr(Layout, "keys", walked)
    monkeypatch.setattr(EntryInfo, "read", walked)
    before = _tracked(store)
    assert store.publish(K3, MEMBERS) is not None
    assert _tracked(store) > before
    monkeypatch.undo()
    assert _tracked(store) == _exact(store)


def test_over_the_cap_a_publish_evicts_by_the_counter(tmp_path: Path) -> None:
    s = Store(tmp_path / "cache", max_size=5 * 1024)  # two entries fit, not three
    s.publish(K1, MEMBERS)
    s.publish(K2, MEMBERS)
    s.publish(K3, MEMBERS)  # over the cap: the least recently used entry goes
    assert not s.has(K1) and s.has(K3)
    assert _tracked(s) == _exact(s) <= 5 * 1024
    assert s.stats()["evictions"] >= 1


def test_a_store_filled_before_the_counter_existed_is_counted_once(store: Store) -> None:
    store.publish(K1, MEMBERS)
    for shard in store.layout.stats_dir.iterdir():  # as an older version left it: no size counted
        shard.unlink()
    store.publish(K2, MEMBERS)
    assert _tracked(store) == _exact(store)


def test_verify_reports_a_drifted_counter_and_fix_corrects_it(store: Store) -> None:
    store.publish(K1, MEMBERS)
    store.publish(K2, MEMBERS)
    (pack,) = sorted(store.layout.packs_dir(K2).glob("*.pack"))
    size = pack.stat().st_size
    pack.unlink()  # removed by hand: the counter does not know
    report = store.verify()
    assert report.size_drift == size and report.to_dict()["size_drift"] == size
    assert store.verify(fix=True).size_drift == size
    assert store.verify().size_drift == 0 and _tracked(store) == _exact(store)


def test_zeroing_the_stats_keeps_the_size(store: Store) -> None:
    store.publish(K1, MEMBERS)
    store.zero_stats()
    assert store.stats()["publishes"] == 0 and _tracked(store) == _exact(store) > 0


def test_a_stats_lock_held_by_a_dead_holder_stalls_one_update_not_each(tmp_path, monkeypatch) -> None:
    """issue 31.9: a mkdir stats lock left by a dead holder whose clock ran ahead cost every
    counter update a 2 s wait; now the first waits, the next ones go on at once (counts kept)."""
    import time

    from compile_cache.store import counters as stats

    monkeypatch.setenv("COMPILE_CACHE_LOCK", "mkdir")
    monkeypatch.setattr(stats.Counters, "busy_until", {})
    store = Store(tmp_path / "store")
    lock_dir = store.layout.lock_base(f"stats-{stats.shard_index()}").with_name(
        f"stats-{stats.shard_index()}.lockdir")
    lock_dir.mkdir(parents=True)
    ahead = time.time() + 3600
    (lock_dir / "owner").write_text(f"othernode:4242:{ahead:.3f}")
    start = time.monotonic()
    for _ in range(5):
        store.record_error("test")
    assert time.monotonic() - start < 4.5  # one 2 s wait, not five
    assert store.stats()["errors_by_kind"].get("test") == 5  # none lost: pending, then summed


def test_an_unknown_counter_name_raises_not_dropped(tmp_path: Path) -> None:
    """issue 32: ``bump(hitz=1)`` used to be dropped without a word."""
    from compile_cache.store.counters import COUNTERS, Counter

    store = Store(tmp_path / "store")
    with pytest.raises(ValueError, match="hitz"):
        store.counters.bump(hitz=1)
    info = store.publish(K1, MEMBERS)
    assert info is not None
    with pytest.raises(ValueError, match="corupt"):
        store.quarantine(info, "a typo in the caller", counter="corupt")
    assert info.path.exists()  # refused before the pack moved
    store.counters.bump({Counter.HITS.value: 2}, errors_by_kind={"x": 1})
    stats = store.stats()
    assert stats["hits"] == 2 and stats["errors_by_kind"] == {"x": 1}
    assert set(COUNTERS) <= set(stats) and len(COUNTERS) == len(set(COUNTERS))


def test_counts_left_for_later_go_out_with_the_next_update_or_at_exit(tmp_path: Path) -> None:
    """A fresh node's restore counts its downloads with bump_later (no shard write on the way
    to the first output): another process sees them after this one's next update, or after it
    exits without one; a child forked meanwhile does not write them a second time."""
    store = Store(tmp_path / "store")
    store.counters.bump_later(remote_downloads=2)
    assert store.stats()["remote_downloads"] == 2  # this process sees its own
    assert Store(tmp_path / "store").stats()["remote_downloads"] == 0  # not written yet
    store.counters.bump(hits=1)
    assert Store(tmp_path / "store").stats()["remote_downloads"] == 2
    script = (
        "import os, sys\n"
        "from compile_cache.store import Store\n"
        "store = Store(sys.argv[1])\n"
        "store.counters.bump_later(remote_downloads=5)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)  # a child that exits through atexit: the counts are its parent's\n"
        "os.waitpid(pid, 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store")], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Store(tmp_path / "store").stats()["remote_downloads"] == 7
