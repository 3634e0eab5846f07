"""The on-disk pack store (compile_cache.store): pure file I/O, no torch.compile."""

from __future__ import annotations

import errno
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

import pytest
from _fault_helpers import STORE_ENV

import compile_cache._paths as paths
import compile_cache.store as store_mod
from compile_cache.errors import (
    ConfigError,
    CorruptPackError,
    StoreError,
    UnsafePathError,
    UnsafeStoreError,
)
from compile_cache.store import Store, StoreWarning, decode_pack, encode_pack

REPO = str(Path(__file__).resolve().parents[1])
K1, K2, K3 = "a1" * 16, "b2" * 16, "c3" * 16
MEMBERS = {
    "inductor/fxgraph/ab/xyz": b"graph" * 100,
    "triton/0/abc/kernel.cubin": bytes(range(256)) * 4,
    "megacache/artifacts.bin": b"\x00mega",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(store_mod, "_warned", set())  # one-time warnings: once per test


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "cache")


def _packs(s: Store, key: str) -> list[Path]:
    return sorted((s._entry_dir(key) / "packs").glob("*.pack"))


def _warnings_of(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, StoreWarning)]


# -- location, creation, permissions ------------------------------------------------------------
def test_location_precedence(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    s = Store()
    assert (s.root, s.location_source) == (tmp_path / "home/.cache/compile_cache", "default")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert (Store().root, Store().location_source) == (
        tmp_path / "xdg/compile_cache",
        "XDG_CACHE_HOME",
    )
    monkeypatch.setenv("COMPILE_CACHE_DIR", str(tmp_path / "env"))
    assert (Store().root, Store().location_source) == (tmp_path / "env", "COMPILE_CACHE_DIR")
    s = Store(tmp_path / "arg")
    assert (s.root, s.location_source) == (tmp_path / "arg", "argument")


def test_store_is_created_private(tmp_path) -> None:
    s = Store(tmp_path / "new" / "cache")
    s.publish(K1, MEMBERS)
    assert stat.S_IMODE(s.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(_packs(s, K1)[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(s._entry_dir(K1).stat().st_mode) == 0o700


def test_group_mode_creates_setgid_group_writable_dirs(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("COMPILE_CACHE_SHARED", "group")
    s = Store(tmp_path / "shared")
    s.publish(K1, MEMBERS)
    assert stat.S_IMODE(s.root.stat().st_mode) == 0o2775
    assert stat.S_IMODE(s._entry_dir(K1).stat().st_mode) == 0o2775
    assert stat.S_IMODE(_packs(s, K1)[0].stat().st_mode) == 0o664
    Store(tmp_path / "shared")  # its own group-writable dirs are accepted in group mode


def test_a_file_where_the_store_should_be_is_an_error(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match=str(tmp_path / "file")):
        Store(tmp_path / "file")


def test_world_writable_store_is_refused_with_a_fix(tmp_path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(UnsafeStoreError) as info:
        Store(root)
    assert f"chmod go-w {root}" in str(info.value) and "COMPILE_CACHE_SHARED=group" in str(
        info.value
    )


def test_group_writable_store_needs_group_mode_and_our_group(tmp_path, monkeypatch) -> None:
    root = tmp_path / "c"
    root.mkdir()
    root.chmod(0o770)
    with pytest.raises(UnsafeStoreError, match="COMPILE_CACHE_SHARED=group"):
        Store(root)
    monkeypatch.setenv("COMPILE_CACHE_SHARED", "group")
    assert not Store(root).read_only
    if os.geteuid() == 0:  # only root can hand the directory to a foreign group
        os.chown(root, -1, 54321)
        with pytest.raises(UnsafeStoreError, match="not one of this process's groups"):
            Store(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")
def test_store_owned_by_another_user_and_writable_is_refused(tmp_path) -> None:
    root = tmp_path / "c"
    root.mkdir(mode=0o755)
    os.chown(root, 54321, -1)
    with pytest.raises(UnsafeStoreError, match="belongs to user 54321"):
        Store(root)


def test_bad_settings_raise_config_error_naming_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("COMPILE_CACHE_MAX_SIZE", "20X")
    with pytest.raises(ConfigError, match="COMPILE_CACHE_MAX_SIZE.*20X"):
        Store(tmp_path / "c")
    monkeypatch.delenv("COMPILE_CACHE_MAX_SIZE")
    monkeypatch.setenv("COMPILE_CACHE_SHARED", "world")
    with pytest.raises(ConfigError, match="COMPILE_CACHE_SHARED"):
        Store(tmp_path / "c")
    monkeypatch.delenv("COMPILE_CACHE_SHARED")
    monkeypatch.setenv("COMPILE_CACHE_READ_ONLY", "maybe")
    with pytest.raises(ConfigError, match="COMPILE_CACHE_READ_ONLY"):
        Store(tmp_path / "c")


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
    assert len(os.listdir(store.quarantine_dir)) == 1  # ...into quarantine, for inspection
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


def test_crafted_pack_with_unsafe_member_is_rejected_on_read(store: Store, monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "check_member_name", lambda name: name)  # a malicious writer
    name, chunks, _ = encode_pack(K1, {"../../evil.so": b"\x7fELF"})
    monkeypatch.undo()
    target = store._entry_dir(K1) / "packs" / f"{name}.pack"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"".join(bytes(c) for c in chunks))
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
    (store._entry_dir(K1) / "entry.json").write_bytes(b"\x00not json{")
    other_shard = (store._shard() + 1) % store_mod.STATS_SHARDS  # not the one this process writes
    (store.stats_dir / f"shard-{other_shard}.json").write_text("[1, 2")
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
        monkeypatch.setattr(store_mod, "_warned", set())
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
        store_mod.os, "access", lambda p, m: False if m & os.W_OK else real_access(p, m)
    )
    ro = Store(tmp_path / "c")
    assert ro.read_only and "not writable" in ro.read_only_reason
    assert ro.load(K1)[0].members == MEMBERS


def test_store_that_cannot_be_created_is_an_empty_read_only_store(tmp_path, monkeypatch) -> None:
    def denied(path, mode=0o777):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(store_mod.os, "mkdir", denied)
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
    real = store_mod.Store._write_entry_json
    calls = []

    def vanish_once(self, entry, data):
        if not calls:
            calls.append(1)
            import shutil

            shutil.rmtree(entry)
            raise FileNotFoundError(errno.ENOENT, "gone", str(entry))
        return real(self, entry, data)

    monkeypatch.setattr(store_mod.Store, "_write_entry_json", vanish_once)
    assert store.publish(K1, MEMBERS) is not None
    assert store.load(K1)[0].members == MEMBERS


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


# -- eviction ------------------------------------------------------------------------------------------
def _age(store: Store, key: str, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(store._entry_dir(key) / "used", (t, t))


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
    packs_dir = store._entry_dir(K1) / "packs"
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
    stale = store.locks_dir / f"{K1}.lockdir"
    stale.mkdir()
    (stale / "owner").write_text(f"{paths.HOSTNAME}:{int(dead.stdout)}:{time.time():.3f}")
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


# -- export / import -------------------------------------------------------------------------------------
def test_export_import_round_trip_and_twice_is_harmless(store: Store, tmp_path) -> None:
    store.publish(K1, MEMBERS, entry_info={"model": "GPT2"})
    store.publish(K1, {"second": b"shape"})
    store.publish(K2, {"x": b"y"})
    for archive in (tmp_path / "all.tar", tmp_path / "all.tar.gz"):
        assert store.export(archive) == 3
        other = Store(tmp_path / f"other-{archive.suffix}")
        first = other.import_archive(archive)
        assert (sorted(first.keys), first.packs_added, first.packs_present) == (
            sorted([K1, K2]),
            3,
            0,
        )
        again = other.import_archive(archive)
        assert (again.packs_added, again.packs_present) == (0, 3)
        assert {m for p in other.load(K1) for m in p.members} == set(MEMBERS) | {"second"}
        assert other.entry(K1).metadata["model"] == "GPT2"
        assert len(_packs(other, K1)) == 2
    assert store.export(tmp_path / "one.tar", keys=[K2]) == 1
    with pytest.raises(StoreError, match=K3):
        store.export(tmp_path / "none.tar", keys=[K3])


def _evil_tar(path: Path, store: Store, evil: tarfile.TarInfo, evil_data: bytes = b"") -> None:
    good = path.with_suffix(".good.tar")
    store.export(good)
    with tarfile.open(good) as src, tarfile.open(path, "w") as dst:
        for member in src.getmembers():
            dst.addfile(member, src.extractfile(member))
        dst.addfile(evil, io.BytesIO(evil_data) if evil.isreg() else None)


def _member(
    name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x", link: str = ""
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.linkname = link
    return info


@pytest.mark.parametrize(
    "evil",
    [
        _member(f"entries/{K2}/packs/link.pack", tarfile.SYMTYPE, link="/etc/passwd"),
        _member(f"entries/{K2}/packs/hard.pack", tarfile.LNKTYPE, link="/etc/passwd"),
        _member("../outside.pack"),
        _member("/abs/evil.pack"),
        _member(f"entries/{K2}/../../../x"),
        _member(f"entries/{K2}/dev", tarfile.CHRTYPE),
        _member(f"entries/{K2}/packs/{'0' * 32}.pack", data=b"not a pack"),
        _member("entries/not-a-key/entry.json", data=b"{}"),
        _member("README.txt"),
    ],
    ids=[
        "symlink",
        "hardlink",
        "dotdot",
        "absolute",
        "inner-dotdot",
        "device",
        "bad-pack",
        "bad-key",
        "stray",
    ],
)
def test_import_rejects_unsafe_archives_before_writing_anything(
    store: Store, tmp_path, evil
) -> None:
    store.publish(K1, MEMBERS)
    archive = tmp_path / "evil.tar"
    _evil_tar(
        archive,
        store,
        evil,
        b"x"
        if evil.name.endswith("README.txt")
        else (b"{}" if "entry.json" in evil.name else b"not a pack"),
    )
    target = Store(tmp_path / "target")
    with pytest.raises(CorruptPackError):  # UnsafePathError is a CorruptPackError
        target.import_archive(archive)
    assert target.entries() == [] and not target.has(K1)  # the good members were not written either
    assert not (tmp_path / "outside.pack").exists()


def test_import_of_a_non_archive_is_a_clear_error(store: Store, tmp_path) -> None:
    (tmp_path / "x.tar").write_bytes(b"definitely not tar" * 100)
    with pytest.raises(CorruptPackError, match="tar"):
        store.import_archive(tmp_path / "x.tar")


# -- signing -------------------------------------------------------------------------------------------
def test_signed_round_trip_and_unsigned_or_altered_packs_are_rejected(
    tmp_path, monkeypatch
) -> None:
    plain = Store(tmp_path / "c")
    plain.publish(K1, {"unsigned": b"1"})
    monkeypatch.setenv("COMPILE_CACHE_SIGNING_KEY", "s3cret")
    signed = Store(tmp_path / "c")
    info = signed.publish(K2, MEMBERS)
    assert info is not None and info.signed
    (pack,) = signed.load(K2)
    assert pack.members == MEMBERS and pack.info.signed
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert signed.load(K1) == []  # unsigned while a key is set
    assert signed.stats()["corrupt"] == 1

    # An attacker who can write the store alters a member and fixes up the checksum: only the
    # signature catches it.
    (path,) = _packs(signed, K2)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    import hashlib

    data[20:52] = hashlib.sha256(bytes(data[84:])).digest()
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPackError, match="signature"):
        decode_pack(bytes(data), signing_key=b"s3cret")
    decode_pack(bytes(data))  # checksum alone is satisfied
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert signed.load(K2) == []
    assert Store(tmp_path / "c", signing_key=b"other").load(K1) == []


def test_lock_for_a_key(store: Store, tmp_path) -> None:
    with store.lock(K1, timeout=5) as lock:
        assert lock.is_locked
    ro = Store(tmp_path / "c2", read_only=True)
    with ro.lock(K1) as lock:
        assert lock.mode == "none"
