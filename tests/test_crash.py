"""Publishers killed with SIGKILL at chosen and at random points: readers never see half a pack,
the next process gets the lock and publishes within the lock timeout, verify(fix=True) cleans up."""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
import warnings

import pytest
from _fault_helpers import (
    FORK,
    clean_env,
    join_or_fail,
    pack_members,
    run_job,
    store_warnings,
    temp_files,
)

import compile_cache._paths as paths
from compile_cache.store import Store

KEY = "5e" * 16
# Big enough that a pack is written in several os.write calls.
MEMBERS = {f"inductor/fxgraph/{i:02d}/entry": os.urandom(1 << 20) for i in range(4)}
LOCK_TIMEOUT = 15.0


def _publisher(root: str, phase: str, ready, members=MEMBERS, key=KEY) -> None:
    """Publish under the key's lock, stopping forever at ``phase`` (the parent then kills us)."""

    def stop() -> None:
        ready.set()
        time.sleep(3600)

    real_write_all, real_replace = paths._write_all, os.replace

    def write_all(fd, data):
        target = os.readlink(f"/proc/self/fd/{fd}")
        marker = {"mid-pack": ".pack.tmp-", "mid-entry-json": "entry.json.tmp-", "mid-stats": "shard-"}
        if phase in marker and marker[phase] in target and len(data) > 1:
            real_write_all(fd, memoryview(data)[: len(data) // 2])
            stop()
        real_write_all(fd, data)

    def replace(src, dst, *a, **kw):
        if phase == "before-rename" and str(dst).endswith(".pack"):
            stop()
        return real_replace(src, dst, *a, **kw)

    paths._write_all = write_all
    paths.os.replace = replace
    store = Store(root)
    with store.lock(key, timeout=LOCK_TIMEOUT):
        if phase == "locked":
            stop()
        store.publish(key, members)
        if phase == "published":
            stop()
    ready.set()


def _next_process(root: str, key: str, members, result) -> None:
    start = time.monotonic()
    store = Store(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a corrupt pack or I/O error would be a warning
        with store.lock(key, timeout=LOCK_TIMEOUT):
            if pack_members(store, key) != members:
                store.publish(key, members)
        assert pack_members(store, key) == members
    result.value = time.monotonic() - start


def _kill_at(root, phase):
    ready = FORK.Event()
    child = FORK.Process(target=_publisher, args=(str(root), phase, ready))
    child.start()
    assert ready.wait(60), f"publisher never reached {phase}"
    os.kill(child.pid, signal.SIGKILL)
    join_or_fail(child, 10)  # also reaps it, so its pid reads as dead
    assert child.exitcode == -signal.SIGKILL


@pytest.fixture
def env(tmp_path, monkeypatch):
    clean_env(monkeypatch, tmp_path)
    return tmp_path / "store", monkeypatch


PHASES = ["locked", "mid-entry-json", "mid-pack", "before-rename", "published", "mid-stats"]


@pytest.mark.parametrize("lock_mode", ["fcntl", "mkdir"])
@pytest.mark.parametrize("phase", PHASES)
def test_publisher_killed_at_each_point(env, phase, lock_mode) -> None:
    root, monkeypatch = env
    monkeypatch.setenv("COMPILE_CACHE_LOCK", lock_mode)
    Store(root)
    _kill_at(root, phase)

    reader = Store(root)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        visible = pack_members(reader, KEY)
    # All of the pack, or none of it: never a part, never a corrupt pack.
    assert visible == (MEMBERS if phase in ("published", "mid-stats") else {})
    assert store_warnings(record) == [] and reader.stats()["corrupt"] == 0

    found = reader.verify(temp_age=0)
    if phase.startswith("mid-") or phase == "before-rename":
        assert found.orphaned_temp, found
    if lock_mode == "mkdir" and phase != "mid-stats":
        assert [p.name for p in found.stale_locks] == [f"{KEY}.lockdir"]  # dead holder
    # The next process is not blocked by the dead holder: it gets the lock and finishes in time.
    took = FORK.Value("d", -1.0)
    nxt = FORK.Process(target=_next_process, args=(str(root), KEY, MEMBERS, took))
    nxt.start()
    join_or_fail(nxt, LOCK_TIMEOUT + 30)
    assert nxt.exitcode == 0 and 0 <= took.value < LOCK_TIMEOUT

    reader.verify(fix=True, temp_age=0)
    after = reader.verify(temp_age=0)
    assert after.ok, after
    assert temp_files(root) == []
    assert not list((root / "v1" / "locks").glob("*.lockdir"))
    assert pack_members(reader, KEY) == MEMBERS
    assert reader.stats()["corrupt"] == 0


def _publish_forever(root: str, seed: int) -> None:
    store = Store(root)
    rng = random.Random(seed)
    for i in range(10_000):
        key = f"{rng.randrange(4):02x}" * 16
        with store.lock(key, timeout=LOCK_TIMEOUT):
            store.publish(key, {f"inductor/r{seed}/{i}": os.urandom(rng.randrange(1, 3 << 20))})


def test_random_kills_never_leave_a_visible_half_pack(env) -> None:
    root, _ = env
    rng = random.Random(1234)
    kills = 6
    for n in range(kills):
        child = FORK.Process(target=_publish_forever, args=(str(root), n))
        child.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        join_or_fail(child, 10)
    store = Store(root)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        keys = [e.key for e in store.entries()]
        loaded = sum(len(store.load(k)) for k in keys)
    assert keys and loaded == sum(len(e.packs) for e in store.entries())
    assert store_warnings(record) == [] and store.stats()["corrupt"] == 0
    store.verify(fix=True, temp_age=0)
    assert store.verify(temp_age=0).ok and temp_files(root) == []


def test_job_after_a_killed_publisher_of_its_own_key_compiles_normally(env) -> None:
    root, monkeypatch = env
    report, _ = run_job(root)
    key = report.key
    store = Store(root)
    members = pack_members(store, key)
    store.clear()
    ready = FORK.Event()
    child = FORK.Process(target=_publisher, args=(str(root), "mid-pack", ready, members, key))
    child.start()
    assert ready.wait(60)
    os.kill(child.pid, signal.SIGKILL)
    join_or_fail(child, 10)
    shutil.rmtree(root.parent / "inductor")  # a new node: nothing local
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        again, backend = run_job(root)  # outputs checked against eager inside
    assert store_warnings(record) == []
    assert again.restored_packs == 0 and again.published_packs == 1 and backend.misses >= 1
    store.verify(fix=True, temp_age=0)
    assert store.verify(temp_age=0).ok and pack_members(store, key) == members
