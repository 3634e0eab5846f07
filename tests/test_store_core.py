"""The store: publish, load, quarantine, read-only and I/O errors, locks (compile_cache.store.core).

Pure file I/O, no torch.compile.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import pytest
from _fault_helpers import STORE_ENV
from _store_helpers import K1, K2, K3, MEMBERS, craft_pack
from _store_helpers import packs as _packs
from _store_helpers import store_warnings_of as _warnings_of

import compile_cache._paths as paths
import compile_cache.store as store_mod
from compile_cache.errors import (
    StoreError,
    UnsafePathError,
)
from compile_cache.store import Store, decode_pack
from compile_cache.store.counters import STATS_SHARDS, shard_index
from compile_cache.store.keeper import Keeper

REPO = str(Path(__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, fresh_state):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "cache")


# -- publish / load -------------------------------------------------------------------------------
def test_round_trip(store: Store) -> None:
    info = store.publish(
        K1, MEMBERS, {"shapes": [[1, 128]]}, {"model": "GPT2", "device": "cpu"}, 12.5
    )
    assert info is not None and info.members == 3 and info.compile_seconds == 12.5
    assert store.has(K1) and not store.has(K2)
    (pack,) = store.load(K1)
    assert pack.members == MEMBERS
    assert pack.header["metadata"] == {"shapes": [[1, 128]]} and pack.header["key"] == K1
    assert pack.info.name == info.name
    (entry,) = store.entries()
    assert (
        entry.key == K1 and entry.metadata["model"] == "GPT2" and entry.metadata["device"] == "cpu"
    )
    assert entry.size >= info.size and entry.packs[0].name == info.name
    assert store.load(K2) == []


def test_same_content_twice_makes_one_pack(store: Store) -> None:
    assert store.publish(K1, MEMBERS) is not None
    assert store.publish(K1, dict(reversed(list(MEMBERS.items()))), {"other": "metadata"}) is None
    assert len(_packs(store, K1)) == 1
    assert store.publish(K1, {"inductor/other": b"second shape"}) is not None
    packs = store.load(K1)
    assert len(packs) == 2 and packs[0].members == MEMBERS  # oldest first: restore order
    assert store.stats()["publishes"] == 2


def test_entry_json_is_written_once_by_the_first_publisher(store: Store) -> None:
    store.publish(K1, {"a": b"1"}, entry_info={"model": "first"})
    store.publish(K1, {"b": b"2"}, entry_info={"model": "second"})
    assert store.entry(K1).metadata["model"] == "first"


@pytest.mark.parametrize("name", ["../x", "/abs", "a/../../b", "a\\b", ""])
def test_unsafe_member_names_are_rejected_on_publish(store: Store, name: str) -> None:
    with pytest.raises(UnsafePathError):
        store.publish(K1, {"ok": b"1", name: b"evil"})
    assert not store.has(K1)


def test_non_bytes_members_and_bad_keys_are_programming_errors(store: Store) -> None:
    with pytest.raises(TypeError):
        store.publish(K1, {"a": "text"})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        store.publish("../../etc", {"a": b"1"})
    with pytest.raises(TypeError):
        store.publish(K1, {"a": b"1"}, metadata={"obj": object()})


def _corrupt_and_load(store: Store, damage) -> list:
    store.publish(K1, MEMBERS)
    (path,) = _packs(store, K1)
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(damage(data)))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loaded = store.load(K1)
    assert any("unusable" in m for m in _warnings_of(record))
    return loaded


def _flip(data: bytearray) -> bytearray:
    data[-7] ^= 0x01
    return data


@pytest.mark.parametrize(
    "damage",
    [_flip, lambda d: d[: len(d) // 2], lambda d: d[:10], lambda d: bytearray(b"garbage" * 20)],
    ids=["flipped-byte", "truncated", "truncated-prefix", "garbage"],
)
def test_damaged_pack_is_a_counted_quarantined_miss(store: Store, damage) -> None:
    assert _corrupt_and_load(store, damage) == []
    assert _packs(store, K1) == []  # moved aside...
    assert len(os.listdir(store.layout.quarantine_dir)) == 1  # ...into quarantine, for inspection
    assert store.stats()["corrupt"] == 1
    assert store.publish(K1, MEMBERS) is not None  # the next compile republishes it


def test_pack_from_another_format_version_is_a_miss_left_in_place(store: Store) -> None:
    store.publish(K1, MEMBERS)
    (path,) = _packs(store, K1)
    data = bytearray(path.read_bytes())
    data[8:10] = (2).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    assert store.load(K1) == []
    assert _packs(store, K1) == [path]  # a newer compile_cache sharing the dir keeps its data
    assert store.stats()["incompatible"] == 1
    report = store.verify(fix=True)
    assert report.incompatible_packs == [path] and path.exists()


def test_crafted_pack_with_unsafe_member_is_rejected_on_read(store: Store) -> None:
    target = craft_pack(store, K1, {"../../evil.so": b"\x7fELF"})  # a malicious writer
    with pytest.raises(UnsafePathError):
        decode_pack(target.read_bytes())
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert store.load(K1) == []
    assert store.stats()["corrupt"] == 1 and not target.exists()


def test_symlinked_pack_is_refused(store: Store, tmp_path) -> None:
    store.publish(K1, MEMBERS)
    (path,) = _packs(store, K1)
    real = tmp_path / "elsewhere.pack"
    path.rename(real)
    path.symlink_to(real)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert store.load(K1) == []
    assert store.stats()["corrupt"] == 1


def test_garbage_entry_json_and_stats_file_do_not_crash(store: Store) -> None:
    store.publish(K1, MEMBERS)
    (store.layout.entry_json(K1)).write_bytes(b"\x00not json{")
    other_shard = (shard_index() + 1) % STATS_SHARDS  # not the one this process writes
    (store.layout.stats_dir / f"shard-{other_shard}.json").write_text("[1, 2")
    assert store.load(K1)[0].members == MEMBERS
    assert store.entries()[0].metadata == {}
    stats = store.stats()
    assert stats["errors_by_kind"].get("stats_file") == 1 and stats["publishes"] == 1
    report = store.verify()
    assert report.bad_entries and report.bad_stats and not report.ok
    store.verify(fix=True)
    assert store.verify().ok
    store.publish(K1, {"new": b"x"}, entry_info={"model": "M"})
    assert store.entry(K1).metadata["model"] == "M"  # a garbage entry.json is replaced


# -- read-only, I/O errors ---------------------------------------------------------------------------
def test_read_only_store_loads_and_warns_once_on_publish(tmp_path, monkeypatch) -> None:
    Store(tmp_path / "c").publish(K1, MEMBERS)
    for make in (
        lambda: Store(tmp_path / "c", read_only=True),
        lambda: (monkeypatch.setenv("COMPILE_CACHE_READ_ONLY", "1"), Store(tmp_path / "c"))[1],
    ):
        store_mod._reset()  # its one-time warnings, once per way of making it read-only
        ro = make()
        assert ro.read_only
        assert ro.load(K1)[0].members == MEMBERS
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert ro.publish(K2, {"a": b"1"}) is None
            assert ro.publish(K3, {"b": b"2"}) is None
        messages = _warnings_of(record)
        assert len(messages) == 1 and "read-only" in messages[0]
        assert not ro.has(K2)
        with pytest.raises(StoreError, match="read-only"):
            ro.evict(max_size=0)


def test_store_not_writable_by_this_user_is_read_only(tmp_path, monkeypatch) -> None:
    Store(tmp_path / "c").publish(K1, MEMBERS)
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, m: False if m & os.W_OK else real_access(p, m)
    )
    ro = Store(tmp_path / "c")
    assert ro.read_only and "not writable" in ro.read_only_reason
    assert ro.load(K1)[0].members == MEMBERS


def test_store_that_cannot_be_created_is_an_empty_read_only_store(tmp_path, monkeypatch) -> None:
    def denied(path, mode=0o777):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "mkdir", denied)
    s = Store(tmp_path / "no" / "cache")
    assert s.read_only and "Permission denied" in s.read_only_reason
    assert s.load(K1) == [] and s.entries() == []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert s.publish(K1, MEMBERS) is None
    assert len(_warnings_of(record)) == 1


@pytest.mark.parametrize(
    ("where", "code"),
    [("_write_all", errno.ENOSPC), ("replace", errno.EACCES), ("replace", errno.EROFS)],
)
def test_io_errors_while_publishing_warn_once_and_count(
    store: Store, monkeypatch, where, code
) -> None:
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    if where == "_write_all":
        monkeypatch.setattr(paths, "_write_all", fail)
    else:
        monkeypatch.setattr(paths.os, "replace", fail)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert store.publish(K1, MEMBERS) is None  # no exception reaches the job
        assert store.publish(K1, MEMBERS) is None
    messages = _warnings_of(record)
    assert len(messages) == 1 and errno.errorcode[code] in messages[0]
    stats = store.stats()  # counted even though the disk refused the stats file too
    assert stats["errors"] == 2 and stats["errors_by_kind"] == {errno.errorcode[code]: 2}
    monkeypatch.undo()
    assert not store.has(K1)
    assert not [p for p in store.root.rglob("*") if paths.is_temp_name(p.name)]  # no debris
    assert store.publish(K1, MEMBERS) is not None
    assert Store(store.root).stats()["errors"] == 2  # the pending counts reached the disk


def test_entry_evicted_during_publish_is_retried(store: Store, monkeypatch) -> None:
    real = Keeper.write_entry_json
    calls = []

    def vanish_once(self, entry, data):
        if not calls:
            calls.append(1)
            import shutil

            shutil.rmtree(entry)
            raise FileNotFoundError(errno.ENOENT, "gone", str(entry))
        return real(self, entry, data)

    monkeypatch.setattr(Keeper, "write_entry_json", vanish_once)
    assert store.publish(K1, MEMBERS) is not None
    assert store.load(K1)[0].members == MEMBERS


# -- locks --------------------------------------------------------------------------------------
def test_lock_for_a_key(store: Store, tmp_path) -> None:
    with store.lock(K1, timeout=5) as lock:
        assert lock.is_locked
    ro = Store(tmp_path / "c2", read_only=True)
    with ro.lock(K1) as lock:
        assert lock.mode == "none"


def _load_under_a_small_fd_limit(root: str, key: str, out) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    store = Store(root)
    packs = store.load(key)
    contents = {name: bytes(p.members[name]) for p in packs for name in p.members}
    with open(os.devnull, "rb"):  # the process can still open files
        pass
    for p in packs:
        p.close()
    out.put((len(packs), len(contents), store.stats()["errors"]))


def test_a_load_of_more_packs_than_the_file_limit_opens_them_a_few_at_a_time(tmp_path) -> None:
    """issue 31.10: an entry of 150 packs loads whole under a limit of 100 open files (1,100
    packs under 1,024 failed 81 opens and left the process unable to open files)."""
    import multiprocessing

    from _fault_helpers import join_or_fail

    store = Store(tmp_path / "store")
    key = "fd" * 16
    for n in range(150):
        store.publish(key, {f"inductor/m{n}": f"member {n}".encode()})
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_load_under_a_small_fd_limit, args=(str(store.root), key, out))
    child.start()
    join_or_fail(child, 60)
    assert out.get(timeout=5) == (150, 150, 0)
