"""Eviction, clear and verify (compile_cache.store.maintenance)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _fault_helpers import STORE_ENV
from _store_helpers import K1, K2, K3, MEMBERS
from _store_helpers import packs as _packs

import compile_cache._paths as paths
from compile_cache.locks import LOCAL_NAMESPACE, LockHolder
from compile_cache.store import Store

REPO = str(Path(__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, fresh_state):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "cache")


# -- eviction ------------------------------------------------------------------------------------------
def _age(store: Store, key: str, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(store.layout.used_file(key), (t, t))


def test_lru_eviction_by_last_use_with_dry_run(store: Store) -> None:
    for key in (K1, K2, K3):
        store.publish(key, {"blob": key.encode() * 500})
    _age(store, K1, 300)
    _age(store, K2, 100)
    _age(store, K3, 200)
    store.load(K1)  # a hit makes K1 the most recently used
    size = store.entries()[0].size
    planned = store.evict(max_size=size, dry_run=True)
    assert [e.key for e in planned] == [K3, K2]  # least recently used first
    assert all(store.has(k) for k in (K1, K2, K3))  # dry run touched nothing
    removed = store.evict(max_size=size)
    assert [e.key for e in removed] == [K3, K2]
    assert store.has(K1) and not store.has(K2) and not store.has(K3)
    assert store.stats()["evictions"] == 2


def test_evict_by_age_and_by_key(store: Store) -> None:
    for key in (K1, K2, K3):
        store.publish(key, {"blob": key.encode()})
    _age(store, K1, 40 * 86400)
    assert [e.key for e in store.evict(older_than="30d")] == [K1]
    assert [e.key for e in store.evict(keys=[K3])] == [K3]
    assert [e.key for e in store.entries()] == [K2]


def test_publish_enforces_the_size_cap(tmp_path) -> None:
    s = Store(tmp_path / "c", max_size="4K")  # two ~1.8K entries fit, three do not
    for i, key in enumerate((K1, K2, K3)):
        s.publish(key, {"blob": bytes([i]) * 1200})
        _age(s, key, 100 - i)
    assert [e.key for e in s.entries()] == [K2, K3]  # the oldest went; the newest is protected
    assert s.stats()["size"] <= 4 * 1024 and s.stats()["evictions"] == 1


def test_clear_removes_everything(store: Store) -> None:
    store.publish(K1, MEMBERS)
    store.publish(K2, MEMBERS)
    assert store.clear() == 2
    assert store.entries() == [] and store.load(K1) == []


# -- verify ----------------------------------------------------------------------------------------------
def test_verify_finds_and_fixes_orphans_stale_locks_and_corruption(store: Store) -> None:
    store.publish(K1, MEMBERS)
    store.publish(K2, MEMBERS)
    assert store.verify().ok
    packs_dir = store.layout.packs_dir(K1)
    old_tmp = paths.temp_path(packs_dir / "dead.pack")
    old_tmp.write_bytes(b"half a pack")
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))
    young_tmp = paths.temp_path(packs_dir / "live.pack")
    young_tmp.write_bytes(b"being written")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    stale = store.layout.locks_dir / f"{K1}.lockdir"
    stale.mkdir()
    # a fresh heartbeat, but the holder's pid is dead in our own pid namespace
    (stale / "owner").write_bytes(LockHolder(paths.HOSTNAME, int(dead.stdout), time.time(), LOCAL_NAMESPACE).encode())
    (bad,) = _packs(store, K2)
    bad.write_bytes(bad.read_bytes()[:-1])

    report = store.verify()
    assert report.orphaned_temp == [old_tmp] and report.stale_locks == [stale]
    assert [p for p, _ in report.corrupt_packs] == [bad] and not report.ok
    assert old_tmp.exists() and stale.exists()  # report only

    fixed = store.verify(fix=True)
    assert fixed.fixed and not old_tmp.exists() and not stale.exists() and not bad.exists()
    assert young_tmp.exists()  # someone's publish in progress is left alone
    assert store.verify().ok
    assert store.load(K1)[0].members == MEMBERS


def test_a_last_used_time_in_the_future_does_not_keep_an_entry_for_ever(tmp_path) -> None:
    """issue 31.10: a ``used`` mark dated next year counts as used now, not as newest for ever:
    an age-based prune next year, or the LRU order, treats it as any other entry."""
    import os
    import time

    from compile_cache.store import Store

    store = Store(tmp_path / "store")
    old, future = "aa" * 16, "bb" * 16
    for key in (old, future):
        store.publish(key, {"inductor/x": key.encode()})
    year = 365 * 86400
    os.utime(store.layout.used_file(future), (time.time() + year, time.time() + year))
    os.utime(store.layout.used_file(old), (time.time() - 10, time.time() - 10))
    day = 86400
    for path in [*store.layout.pack_paths(future), store.layout.entry_json(future)]:
        os.utime(path, (time.time() - 2 * day, time.time() - 2 * day))  # published 2 days ago
    removed = store.evict(older_than=day)  # prune --older-than 1d
    assert {e.key for e in removed} == {future}


# -- plans: what is shown is what runs (issue 32) ------------------------------------------------
def test_eviction_plan_is_frozen_and_executes_what_it_listed(tmp_path: Path) -> None:
    import dataclasses

    from compile_cache.errors import StoreError

    store = Store(tmp_path / "store")
    store.publish(K1, MEMBERS)
    time.sleep(0.02)
    plan = store.plan_eviction(older_than=0)
    assert [e.key for e in plan.entries] == [K1] and plan.size == plan.entries[0].size
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.entries = ()  # type: ignore[misc]
    time.sleep(0.02)
    store.publish(K2, MEMBERS)  # after the plan: chosen again it would go too
    assert [e.key for e in plan.execute()] == [K1]
    assert not store.has(K1) and store.has(K2)
    assert [e.key for e in store.evict(older_than=0, dry_run=True)] == [K2]
    assert store.stats()["evictions"] == 1
    ro = Store(tmp_path / "store", read_only=True)
    with pytest.raises(StoreError, match="read-only"):
        ro.plan_eviction(keys=[K2]).execute()
    assert store.has(K2)
    assert store.plan_eviction().entries == ()  # no criterion, no cap in reach: nothing


def test_verify_report_fix_fixes_only_what_the_scan_listed(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    first, second = store.publish(K1, MEMBERS), store.publish(K2, MEMBERS)
    assert first is not None and second is not None
    for info in (first, second):
        data = bytearray(info.path.read_bytes())
        data[-1] ^= 0xFF
        if info is first:
            info.path.write_bytes(bytes(data))
    report = store.verify()
    assert [p for p, _ in report.corrupt_packs] == [first.path] and not report.fixed
    assert first.path.exists()  # a scan changes nothing
    data = bytearray(second.path.read_bytes())
    data[-1] ^= 0xFF
    second.path.write_bytes(bytes(data))  # damaged after the scan
    assert report.fix() is report and report.fixed
    assert not first.path.exists() and second.path.exists()
    assert not store.has(K1)  # the entry its corrupt pack left empty went too
    assert str(first.path) in {p for p, _ in map(tuple, report.to_dict()["corrupt_packs"])}
    assert [p for p, _ in store.verify(fix=True).corrupt_packs] == [second.path]
    assert store.verify().ok
