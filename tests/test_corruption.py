"""Damaged store content met by a real job: every kind is a counted miss, set aside, and the job
compiles and gives eager's outputs. (Byte-level decoding of damaged packs is in test_store.py;
these drive ``compile_regions(..., cache_dir=store)`` end to end with the FakeInductor backend.)"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
from _fault_helpers import clean_env, run_job, store_warnings

import compile_cache.store as store_mod
from compile_cache.store import Store, encode_pack
from compile_cache.store import pack as pack_format


@pytest.fixture
def env(tmp_path, monkeypatch):
    inductor = clean_env(monkeypatch, tmp_path)
    return tmp_path / "store", inductor, monkeypatch


def _first_job(store_path):
    report, backend = run_job(store_path)
    assert report.published_packs == 1 and backend.misses >= 1
    store = Store(store_path)
    (pack,) = (store.layout.packs_dir(report.key)).glob("*.pack")
    return report.key, pack


def _flip(pack, monkeypatch, key):
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x40
    pack.write_bytes(bytes(data))


def _truncate(pack, monkeypatch, key):
    pack.write_bytes(pack.read_bytes()[:-100])


def _foreign_torch(pack, monkeypatch, key):
    # The same members under our key, but written by "torch 1.13.1": a crafted or misfiled pack.
    members = {}
    for p in Store(pack.parents[4].parent).load(key):
        members.update(p.members)
    monkeypatch.setattr(pack_format, "torch_version", lambda: "1.13.1")
    _name, chunks, _ = encode_pack(key, members)
    monkeypatch.undo()
    pack.write_bytes(b"".join(bytes(c) for c in chunks))


@pytest.mark.parametrize("damage", [_flip, _truncate, _foreign_torch], ids=["flipped-byte", "truncated", "foreign-torch"])
def test_damaged_pack_is_a_counted_miss_set_aside_and_the_job_compiles(env, damage) -> None:
    store_path, inductor, monkeypatch = env
    key, pack = _first_job(store_path)
    damage(pack, monkeypatch, key)
    clean_env(monkeypatch, store_path.parent)  # (restores the env var the damage may have undone)
    before = Store(store_path).verify()
    found = [p for p, _ in before.corrupt_packs] + before.incompatible_packs
    if damage is _foreign_torch:
        # verify compares packs, not environments: a pack of another torch is fine in a shared
        # store (other keys); under *our* key only load() can tell, and it sets it aside.
        assert found == []
    else:
        assert found == [pack] and not before.ok
    shutil.rmtree(inductor)  # a new node: nothing local

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        report, backend = run_job(store_path)  # asserts outputs == eager
    assert report.restored_packs == 0 and backend.misses >= 1 and backend.hits == 0
    assert report.published_packs == 1  # the job republished a good pack
    messages = store_warnings(record)
    assert len(messages) == 1 and str(pack) in messages[0]
    stats = Store(store_path).stats()
    counter = "incompatible" if damage is _foreign_torch else "corrupt"
    assert stats[counter] == 1 and stats["misses"] == 2 and stats["hits"] == 0
    assert stats["quarantined"] == 1
    assert Store(store_path).verify().ok
    shutil.rmtree(inductor)
    again, backend = run_job(store_path)
    assert again.hit and backend.misses == 0  # the republished pack is whole


def test_garbage_entry_json_and_stats_shards_do_not_stop_a_hit(env) -> None:
    store_path, inductor, monkeypatch = env
    key, pack = _first_job(store_path)
    store = Store(store_path)
    (store.layout.entry_json(key)).write_bytes(b"{\"key\": tru")
    for n in range(store_mod.STATS_SHARDS):  # every shard, whichever this process writes
        (store.stats_dir / f"shard-{n}.json").write_bytes(b"\xff\xfe garbage")
    report = store.verify()
    assert report.bad_entries == [store.layout.entry_json(key)]
    assert len(report.bad_stats) == store_mod.STATS_SHARDS
    shutil.rmtree(inductor)
    result, backend = run_job(store_path)
    assert result.hit and backend.misses == 0  # the pack itself is fine: still a hit
    stats = Store(store_path).stats()
    assert stats["errors_by_kind"].get("stats_file", 0) >= 1  # counted, not crashed
    assert stats["hits"] >= 1
    assert Store(store_path).verify(fix=True).bad_entries
    assert Store(store_path).verify().ok


def test_file_deleted_from_the_local_dir_after_restore_is_rewritten(env) -> None:
    store_path, inductor, monkeypatch = env
    key, _pack = _first_job(store_path)
    shutil.rmtree(inductor)
    first, backend = run_job(store_path)
    assert first.hit
    restored = [p for p in inductor.rglob("*") if p.is_file() and "fake" in p.parts]
    assert restored
    content = {p: p.read_bytes() for p in restored}
    os.unlink(restored[0])  # a tmp cleaner, a user, a full-disk cleanup...
    second, backend = run_job(store_path)
    assert second.restored_files == first.restored_files and second.hit and backend.misses == 0
    assert {p: p.read_bytes() for p in restored} == content
