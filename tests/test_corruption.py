"""Damaged store content met by a real job: every kind is a counted miss, set aside, and the job
compiles and gives eager's outputs. (Byte-level decoding of damaged packs is in test_store.py;
these drive ``compile_regions(..., cache_dir=store)`` end to end with the FakeInductor backend,
and one real Inductor job restores a library ``dlopen`` refuses.) Issue 15: broken libraries
(15.1), bounds (15.4), the smaller problems (15.7)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from _fault_helpers import (
    STORE_ENV,
    FakeInductor,
    clean_env,
    env_with_repo,
    pack_members,
    run_job,
    store_warnings,
)
from _store_helpers import craft_pack, tiny_elf

import compile_cache.store as store_mod
from compile_cache.errors import CorruptPackError
from compile_cache.store import Store, encode_pack
from compile_cache.store import pack as pack_format

JOB_CHILD = Path(__file__).with_name("_job_child.py")


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
        (store.layout.stats_dir / f"shard-{n}.json").write_bytes(b"\xff\xfe garbage")
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


# ---------------------------------------------------------------------------------------------
# Issue 15.1: a pack whose shared library torch cannot load is a counted miss, never a crash


def _poison(store: Store, key: str, library: bytes, recorded: int | None = None) -> Path:
    """Replace the key's packs by one holding the same members plus a bad kernel library."""
    members = pack_members(store, key)
    for path in store.layout.pack_paths(key):
        path.unlink()
    info = {"inductor/ab/ckernel.main.so": {"file_size": recorded}} if recorded is not None else None
    name, chunks, _ = encode_pack(key, {**members, "inductor/ab/ckernel.main.so": library},
                                  member_info=info)
    target = store.layout.pack_path(key, name)
    target.write_bytes(b"".join(bytes(c) for c in chunks))
    return target


@pytest.mark.parametrize(
    "library, recorded, why",
    [
        (b"", None, "empty"),  # the linker's 0-byte file, packed mid-link
        (tiny_elf(b"k" * 4000, sections=4)[:-100], None, "truncated"),  # mid-write
        (tiny_elf(b"k" * 4000)[:64], None, "truncated"),  # the header alone
        (b"\x7fELF1", None, "truncated"),  # the magic and one byte: no header to read
        (b"#!/bin/sh\necho not an ELF\n" * 50, None, "no ELF"),
        (tiny_elf(b"k" * 4000), 9999, "captured file had 9999"),  # complete, but not what capture saw
    ],
    ids=["0-byte", "truncated", "header-only", "magic-only", "not-elf", "size-differs"],
)
def test_a_pack_with_a_broken_library_is_reported_by_verify_and_a_counted_miss(
    env, capsys, library, recorded, why
) -> None:
    store_path, inductor, monkeypatch = env
    key, _pack = _first_job(store_path)
    bad = _poison(Store(store_path), key, library, recorded)
    # verify runs the checks a restoring job runs: the checksum covers the bad bytes, not them.
    report = Store(store_path).verify()
    assert [p for p, _ in report.corrupt_packs] == [bad] and why in report.corrupt_packs[0][1]
    from compile_cache import cli

    assert cli.main(["verify", "--cache-dir", str(store_path)]) == 1
    assert "not a complete shared library" in capsys.readouterr().out or recorded is not None
    shutil.rmtree(inductor)  # a fresh node

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result, backend = run_job(store_path)  # asserts outputs == eager
    assert result.restored_packs == 0 and backend.misses >= 1 and result.published_packs == 1
    assert not (inductor / "ab" / "ckernel.main.so").exists()  # torch never saw it
    assert len(store_warnings(record)) == 1
    stats = Store(store_path).stats()
    assert stats["corrupt"] == 1 and stats["quarantined"] == 1 and stats["hits"] == 0
    assert Store(store_path).verify().ok and not bad.exists()
    shutil.rmtree(inductor)
    again, backend = run_job(store_path)
    assert again.hit and backend.misses == 0  # the republished pack is whole


def test_capture_records_each_finished_library_and_restore_checks_it(env) -> None:
    store_path, inductor, _ = env
    report, backend = run_job(store_path, FakeInductor(library=True))
    store = Store(store_path)
    (pack,) = store.load(report.key)
    libraries = [n for n in pack.members if n.endswith(".so")]
    assert libraries and all(
        pack.members.info(n)["file_size"] == pack.members.size(n) for n in libraries
    )
    pack.close()
    shutil.rmtree(inductor)
    again, backend = run_job(store_path, FakeInductor(library=True))
    assert again.hit and backend.misses == 0


def test_a_library_still_being_linked_is_left_out_of_the_pack(env) -> None:
    store_path, inductor, _ = env
    from compile_cache import artifacts

    capture = artifacts.Capture()
    (inductor / "ab").mkdir(parents=True)
    (inductor / "ab" / "ck.main.so").write_bytes(b"")  # torch's linker writes in place
    (inductor / "ab" / "cj.main.so").write_bytes(tiny_elf(b"done"))
    members = capture.collect()
    assert "inductor/ab/ck.main.so" not in members and "inductor/ab/cj.main.so" in members
    assert capture.recorded == {"inductor/ab/cj.main.so": {"file_size": len(tiny_elf(b"done"))}}


@pytest.mark.inductor
def test_a_library_torch_cannot_load_is_built_again_and_its_pack_quarantined(warmed, tmp_path) -> None:
    """Structurally complete, but dlopen refuses it: the job rebuilds it, stays eager-equal, and
    the pack is set aside and counted, on a really fresh node."""
    store_path = tmp_path / "store"
    shutil.copytree(warmed[0], store_path)
    store = Store(store_path)
    (entry,) = store.entries()
    (pack,) = store.load(entry.key)
    probe_libraries = set(pack.info.metadata.get("isa_probe") or {})
    members = dict(pack.members)
    pack.close()
    kernels = [n for n in members if n.endswith(".so") and n not in probe_libraries]
    assert kernels, sorted(members)
    garbage = {n: (tiny_elf(bytes(4096)) if n in kernels else data) for n, data in members.items()}
    for path in store.layout.pack_paths(entry.key):
        path.unlink()
    craft_pack(store, entry.key, garbage, metadata=pack.info.metadata)
    assert store.verify().ok  # structurally sound: only loading it tells
    before = store.stats()

    node = tmp_path / "node"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env.update({name: str(node / name.lower()) for name in
                ("TMPDIR", "HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")})
    for name in ("TMPDIR", "HOME", "XDG_CACHE_HOME"):
        Path(env[name]).mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, str(JOB_CHILD), str(store_path), f"{Path(__file__).with_name('_cli_targets.py')}:mlp"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["max_diff"] < 1e-5  # the rebuilt kernels give eager's outputs
    report = result["report"]
    assert report["restored_packs"] == 1 and report["load_failures"] >= 1 and not report["hit"]
    assert any(e.startswith("load:") for e in report["errors"])
    stats = Store(store_path).stats()
    assert stats["load_failures"] == 1 and stats["quarantined"] == 1
    # The bad pack is set aside; capture by use then publishes what the job used (the rebuilt
    # kernels with the graphs), since the store lacks it now: whole libraries, loadable by the next.
    for fresh in Store(store_path).load(entry.key):
        assert all(fresh.members[n] != garbage.get(n) for n in kernels if n in fresh.members)
        fresh.close()
    # the restore's hit became a miss
    assert (stats["hits"], stats["misses"]) == (before["hits"], before["misses"] + 1)
    assert any("StoreWarning" in line for line in done.stderr.splitlines())


# ---------------------------------------------------------------------------------------------
# Issue 15.4: no pack costs more than its limits; nothing is read whole


def _rss_child(code: str, **env: str) -> dict:
    """Run ``code`` in a child that prints its peak RSS above its baseline (after imports)."""
    script = (
        "import json, resource, sys\n"
        "import compile_cache.store, compile_cache.artifacts\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"{code}\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'rss_mb': (peak - base) / 1024, 'result': result}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env_with_repo(**env),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _sparse_pack(path: Path, body: int, header: bytes = b"") -> None:
    """A pack whose valid prefix claims ``body`` bytes: sparse on disk (a few KB)."""
    import hashlib
    import struct

    prefix = struct.pack("<8sHHQ32s32s", b"CCPACK\r\n", 1, 0, body, hashlib.sha256(b"x").digest(), bytes(32))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(prefix + header)
        fh.truncate(len(prefix) + body)


def test_a_sparse_pack_that_claims_2_gib_is_refused_from_its_first_bytes(env) -> None:
    store_path, inductor, _ = env
    key, pack = _first_job(store_path)
    bogus = pack.with_name("f" * 32 + ".pack")
    _sparse_pack(bogus, 2 << 30)  # its header would be 2 GiB of zeros
    code = (f"s = compile_cache.store.Store({str(store_path)!r})\n"
            f"result = [len(s.load({key!r})), s.stats()['corrupt']]")
    got = _rss_child(code)
    assert got["result"] == [1, 1]  # the real pack loads; the bogus one is a counted miss
    assert got["rss_mb"] < 300
    assert not bogus.exists() and Store(store_path).stats()["quarantined"] == 1


def test_pack_limits_are_checked_before_the_body_and_on_publish(env, monkeypatch) -> None:
    store_path, inductor, _ = env
    key, pack = _first_job(store_path)
    monkeypatch.setenv("COMPILE_CACHE_MAX_PACK_SIZE", "1M")
    bogus = pack.with_name("e" * 32 + ".pack")
    _sparse_pack(bogus, 8 << 20)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert len(Store(store_path).load(key)) == 1
    assert any("COMPILE_CACHE_MAX_PACK_SIZE" in m for m in store_warnings(record)) and not bogus.exists()
    # A pack of 100,000 one-byte members: refused from its header, set aside, counted.
    monkeypatch.delenv("COMPILE_CACHE_MAX_PACK_SIZE")
    many = {f"inductor/m/{i:06d}": b"x" for i in range(100_000)}
    path = craft_pack(Store(store_path), key, many)
    store_mod._reset()  # a new process: the one-time "corrupt" warning not shown yet
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert len(Store(store_path).load(key)) == 1
    assert any("COMPILE_CACHE_MAX_PACK_MEMBERS" in m for m in store_warnings(record))
    assert not path.exists() and Store(store_path).stats()["corrupt"] == 2
    # ... and never written: a publish readers would refuse is a warning and a counted error.
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert Store(store_path).publish(key, many) is None
    assert any("COMPILE_CACHE_MAX_PACK_MEMBERS" in m for m in store_warnings(record))
    assert Store(store_path).stats()["errors_by_kind"]["pack_limit"] == 1


def test_a_large_member_is_restored_in_chunks_byte_for_byte(env, tmp_path) -> None:
    from compile_cache import artifacts

    store = Store(tmp_path / "big")
    blob = os.urandom(5 << 20) + b"tail"  # more than a few read chunks
    store.publish("ab" * 16, {"inductor/big/blob": blob, "inductor/big/small": b"s"})
    (pack,) = store.load("ab" * 16)
    assert pack.members.size("inductor/big/blob") == len(blob)
    dirs = {"inductor": tmp_path / "local", "triton": tmp_path / "triton"}
    result = artifacts.restore(pack.members, dirs=dirs)
    assert (tmp_path / "local/big/blob").read_bytes() == blob and len(result.written) == 2
    again = artifacts.restore(pack.members, dirs=dirs)  # idempotent: compared in chunks too
    assert again.present == sorted(pack.members) and again.written == []


def _bomb(path: Path, size: int) -> None:
    """A .tar.gz with one pack member of ``size`` zero bytes: a gzip bomb."""
    import tarfile

    class Zeros(io.RawIOBase):
        def __init__(self, n: int) -> None:
            self.left = n

        def readable(self) -> bool:
            return True

        def readinto(self, buf) -> int:  # type: ignore[override]
            n = min(len(buf), self.left)
            buf[:n] = bytes(n)
            self.left -= n
            return n

    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo(f"entries/{'ab' * 16}/packs/{'0' * 32}.pack")
        info.size = size
        tar.addfile(info, io.BufferedReader(Zeros(size)))


def test_import_stops_a_gzip_bomb_at_its_first_bytes_and_checks_declared_sizes(tmp_path, monkeypatch) -> None:
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    bomb = tmp_path / "bomb.tar.gz"
    _bomb(bomb, 256 << 20)
    assert bomb.stat().st_size < 2 << 20
    target = Store(tmp_path / "target")
    got = _rss_child(
        f"from compile_cache.errors import CorruptPackError\n"
        f"s = compile_cache.store.Store({str(tmp_path / 'target')!r})\n"
        f"try:\n    s.import_archive({str(bomb)!r}); result = 'imported'\n"
        f"except CorruptPackError as exc:\n    result = str(exc)\n"
    )
    assert "bad magic" in got["result"] and got["rss_mb"] < 300
    assert target.entries() == [] and not list(target.layout.tmp_dir.iterdir())  # nothing left behind
    # A declared size over the pack limit, or a total over the store's cap: refused unread.
    monkeypatch.setenv("COMPILE_CACHE_MAX_PACK_SIZE", "1M")
    with pytest.raises(CorruptPackError, match=r"declares 256.0 MiB, over the limit of 1.0 MiB \(COMPILE_CACHE_MAX_PACK_SIZE\)"):
        Store(tmp_path / "target").import_archive(bomb)
    monkeypatch.delenv("COMPILE_CACHE_MAX_PACK_SIZE")
    with pytest.raises(CorruptPackError, match="size cap"):
        Store(tmp_path / "target", max_size="100M").import_archive(bomb)


# ---------------------------------------------------------------------------------------------
# Issue 15.7: the smaller problems


def test_a_load_racing_an_eviction_is_a_miss_never_a_part_of_the_entry(env, monkeypatch) -> None:
    store_path, inductor, _ = env
    report, _ = run_job(store_path)
    run_job(store_path, FakeInductor(salt="second shape"))  # a second pack under the key
    store = Store(store_path)
    assert len(store.layout.pack_paths(report.key)) == 2
    from compile_cache.store import loading, maintenance

    real_open = loading.open_pack_path
    opened = []

    def evicting_open(store_, path, *at):
        fh = real_open(store_, path, *at)
        opened.append(path)
        if len(opened) == 1:  # another process evicts the entry between our two opens
            maintenance.remove_entry_dir(store, store.layout.entry_dir(report.key))
        return fh

    monkeypatch.setattr(loading, "open_pack_path", evicting_open)
    assert store.load(report.key) == []  # not the first pack alone: the entry is gone, a miss
    monkeypatch.undo()
    clean_env(monkeypatch, store_path.parent)
    shutil.rmtree(inductor)
    again, backend = run_job(store_path)
    assert again.restored_packs == 0 and backend.misses >= 1  # compiled, counted as a miss


def test_a_pack_vanishing_mid_load_is_listed_again_not_half_restored(env, monkeypatch) -> None:
    store_path, inductor, _ = env
    report, _ = run_job(store_path)
    run_job(store_path, FakeInductor(salt="second shape"))
    store = Store(store_path)
    first, second = store.layout.pack_paths(report.key)
    from compile_cache.store import loading

    real_open = loading.open_pack_path
    calls = []

    def quarantining_open(store_, path, *at):
        calls.append(path)
        if len(calls) == 2:  # a verify --fix elsewhere sets the second pack aside meanwhile
            store.parts.keeper.quarantine(second, report.key)
        return real_open(store_, path, *at)

    monkeypatch.setattr(loading, "open_pack_path", quarantining_open)
    packs = store.load(report.key)
    assert [p.info.path for p in packs] == [first]  # the listing as it is now, read again


@pytest.mark.parametrize("member", ["elsewhere/graph", "inductor/fxgraph/" + "x" * 300],
                         ids=["unknown-label", "over-long-name"])
def test_unrestorable_packs_are_quarantined_once_not_warned_on_every_start(env, member) -> None:
    store_path, inductor, _ = env
    key, _pack = _first_job(store_path)
    store = Store(store_path)
    good = pack_members(store, key)
    for path in store.layout.pack_paths(key):
        path.unlink()
    craft_pack(store, key, {**good, member: b"data"})
    shutil.rmtree(inductor)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first, backend = run_job(store_path)  # compiles, republishes a good pack
    assert first.restored_packs == 0 and backend.misses >= 1 and len(store_warnings(record)) == 1
    assert Store(store_path).stats()["quarantined"] == 1
    shutil.rmtree(inductor)
    clean_env(env[2], store_path.parent)  # a new process: no warning shown yet
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        second, backend = run_job(store_path)
    assert second.hit and store_warnings(record) == []  # set aside once: the next start is clean


def test_a_dead_holder_of_a_mkdir_lock_on_another_host_goes_stale_by_heartbeat(tmp_path, monkeypatch) -> None:
    from compile_cache.locks import FileLock, is_stale
    from compile_cache.locks.scan import heartbeat_age

    lockdir = tmp_path / "key.lockdir"
    lockdir.mkdir()
    (lockdir / "owner").write_text(f"othernode:4242:{time.time() - 150:.3f}")
    past = time.time() - 150
    os.utime(lockdir / "owner", (past, past))
    assert heartbeat_age(lockdir) > 140
    # The lock timeout (300 s) does not apply: 150 s without a heartbeat (past
    # COMPILE_CACHE_LOCK_STALE, 120 s) is a dead holder, so a waiter takes it at once.
    assert is_stale(lockdir)
    with FileLock(tmp_path / "key", mode="mkdir", timeout=5.0) as lock:
        assert lock.is_locked
    # A fresh heartbeat (a live holder elsewhere) is respected.
    lockdir.mkdir()
    (lockdir / "owner").write_text(f"othernode:4242:{time.time() - 3600:.3f}")  # took it long ago...
    assert not is_stale(lockdir)  # ...but its owner file was refreshed just now


@pytest.mark.parametrize("kind", ["EMFILE", "dlopen-EMFILE", "bad-library"])
def test_only_a_bad_library_not_a_local_error_sets_its_pack_aside(env, kind) -> None:
    """issue 31.8: torch failing to load a restored library because this node is out of file
    descriptors (or memory, or disk) is this node's counted error; the pack is kept."""
    import errno

    from _store_helpers import tiny_elf

    from compile_cache import artifacts, recovery
    from compile_cache.report import CacheReport

    store_path, _inductor, _ = env
    store = Store(store_path)
    key = "ab" * 16
    store.publish(key, {"inductor/fake/lib.so": tiny_elf(b"x")})
    (pack,) = store.load(key)
    where = recovery.origin(store, pack.info)
    result = artifacts.restore(pack.members, origin=where)
    recovery.restored(where, store, pack.info, CacheReport(key=key, store=str(store_path)))
    path = str(next(iter(result.files.values()))[0])
    error = {"EMFILE": OSError(errno.EMFILE, "Too many open files", path),
             "dlopen-EMFILE": ImportError(f"{path}: cannot open shared object file: Too many open files"),
             "bad-library": ImportError(f"{path}: invalid ELF header")}[kind]
    assert recovery.on_load_failure(error)
    bad = kind == "bad-library"
    assert store.has(key) is not bad  # quarantined only for a bad library
    assert Store(store_path).stats()["load_failures"] == (1 if bad else 0)
    pack.close()
