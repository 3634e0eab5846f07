"""Hostile input met by a real job: unsafe store permissions, crafted packs, planted symlinks,
replayed packs and signing, end to end through compile_regions (byte-level checks of member
names and archives are in test_paths.py / test_store.py / test_artifacts.py)."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import warnings

import pytest
from _fault_helpers import FakeInductor, clean_env, pack_members, run_job, store_warnings
from _store_helpers import craft_pack

from compile_cache import UnsafeStoreError, artifacts
from compile_cache.errors import CorruptPackError, UnsafePathError
from compile_cache.store import Store, read_pack_header


@pytest.fixture
def env(tmp_path, monkeypatch):
    inductor = clean_env(monkeypatch, tmp_path)
    return tmp_path, inductor, monkeypatch


@pytest.mark.parametrize("where", ["root", "layout-dir", "symlinked-root"])
def test_a_store_others_can_write_is_refused_by_the_job_with_a_fix(env, where) -> None:
    tmp_path, _, monkeypatch = env
    root = tmp_path / "store"
    Store(root)
    if where == "root":
        root.chmod(0o777)
    elif where == "layout-dir":
        (root / "v1").chmod(0o757)
    else:
        root.chmod(0o777)
        os.symlink(root, tmp_path / "link")
        root = tmp_path / "link"
    with pytest.raises(UnsafeStoreError, match="chmod") as info:
        run_job(root)
    assert "writable" in str(info.value)
    monkeypatch.setenv("COMPILE_CACHE_SHARED", "group")  # group mode does not allow o+w either
    with pytest.raises(UnsafeStoreError, match="world-writable"):
        run_job(root)


def _plant(store: Store, key: str, members: dict[str, bytes]) -> None:
    """Write a pack with any member names, as an attacker with write access to the store would."""
    craft_pack(store, key, members)


@pytest.mark.parametrize(
    "evil",
    ["/tmp/evil.so", "inductor/../../evil.so", "inductor/a/../../../evil.so", "elsewhere/evil.so"],
)
def test_crafted_pack_never_writes_outside_the_local_dirs(env, evil) -> None:
    tmp_path, inductor, _ = env
    root = tmp_path / "store"
    report, _ = run_job(root)
    store = Store(root)
    good = pack_members(store, report.key)
    store.clear()
    _plant(store, report.key, {**good, evil: b"\x7fELF evil"})
    shutil.rmtree(inductor)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        again, backend = run_job(root)  # outputs == eager
    assert again.restored_packs == 0 and again.restored_files == 0 and backend.misses >= 1
    # Names that escape fail the pack's checks on read; "elsewhere/evil.so" is not a complete
    # library either (and its label is unknown): each pack is set aside once, counted.
    assert Store(root).stats()["corrupt"] == 1 and Store(root).stats()["quarantined"] == 1
    assert not list(tmp_path.rglob("evil.so")) and not os.path.exists("/tmp/evil.so")
    # Rejected before any write: restore() checks every member before it writes the first one.
    fresh = tmp_path / "fresh"
    with pytest.raises(UnsafePathError):
        artifacts.restore({**good, evil: b"x"}, dirs={"inductor": fresh / "i", "triton": fresh / "t"})
    assert not fresh.exists()


def test_symlink_planted_in_the_local_inductor_dir_is_not_followed(env) -> None:
    tmp_path, inductor, _ = env
    root = tmp_path / "store"
    run_job(root)
    shutil.rmtree(inductor)
    outside = tmp_path / "outside"
    outside.mkdir()
    (inductor / "fxgraph").mkdir(parents=True)
    os.symlink(outside, inductor / "fxgraph" / "fake")  # the attacker's link, where restore writes
    packed = {m.rsplit("/", 1)[1] for m in pack_members(Store(root), Store(root).entries()[0].key)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # (salt: this run's own compile writes other names, so only restore could write `packed`)
        report, _ = run_job(root, FakeInductor(salt="other"))  # the job goes on; compiles
    assert report.restored_packs == 0 and any("restore" in e for e in report.errors)
    assert not packed & {p.name for p in outside.iterdir()}
    assert any("link" in str(w.message) for w in record)
    # And restore() alone: every member is checked before the first byte is written.
    with pytest.raises(UnsafePathError, match="link"):
        artifacts.restore({"inductor/aaa/first": b"1", "inductor/fxgraph/fake/x": b"2"})
    assert not (inductor / "aaa").exists()


def test_a_pack_replayed_under_another_key_is_rejected(env) -> None:
    tmp_path, inductor, _ = env
    root = tmp_path / "store"
    report, _ = run_job(root)
    store = Store(root)
    victim = "ee" * 16
    (pack,) = (store.layout.packs_dir(report.key)).glob("*.pack")
    (store.layout.packs_dir(victim)).mkdir(parents=True)
    shutil.copy(pack, store.layout.packs_dir(victim) / pack.name)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert store.load(victim) == []
    assert "belongs to key" in store_warnings(record)[0] and store.stats()["corrupt"] == 1


def test_signing_key_end_to_end(env) -> None:
    tmp_path, inductor, monkeypatch = env
    root = tmp_path / "store"
    report, _ = run_job(root)  # an unsigned pack, e.g. from before signing was turned on
    monkeypatch.setenv("COMPILE_CACHE_SIGNING_KEY", "k3y")
    shutil.rmtree(inductor)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        unsigned, backend = run_job(root)
    assert unsigned.restored_packs == 0 and backend.misses >= 1 and unsigned.published_packs == 1
    assert any("unsigned" in m for m in store_warnings(record))
    shutil.rmtree(inductor)
    signed, backend = run_job(root)
    assert signed.hit and backend.misses == 0  # the re-published, signed pack restores
    # The unsigned pack is a miss for keyed readers only: it stays for the readers without a key.
    packs = sorted((Store(root).layout.packs_dir(report.key)).glob("*.pack"))
    assert len(packs) == 2 and Store(root).stats()["signature_mismatch"] == 2  # once per keyed job
    (pack,) = [p for p in packs if read_pack_header(p)[1]]  # the signed one
    # Downgrade: clear the signed flag and zero the MAC (the checksum still matches): rejected.
    data = bytearray(pack.read_bytes())
    data[10:12] = b"\0\0"
    data[52:84] = bytes(32)
    pack.write_bytes(bytes(data))
    shutil.rmtree(inductor)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        downgraded, backend = run_job(root)
    assert downgraded.restored_packs == 0 and backend.misses >= 1
    # An unsigned archive is refused before anything is written.
    monkeypatch.delenv("COMPILE_CACHE_SIGNING_KEY")
    plain = Store(tmp_path / "plain")
    plain.publish("ab" * 16, {"inductor/x": b"1"})
    plain.export(tmp_path / "a.tar")
    target = Store(tmp_path / "signed-target", signing_key="k3y")
    with pytest.raises(CorruptPackError, match="unsigned"):
        target.import_archive(tmp_path / "a.tar")
    assert target.entries() == []


@pytest.mark.parametrize("kind", [tarfile.FIFOTYPE, tarfile.BLKTYPE, tarfile.CONTTYPE])
def test_import_refuses_fifos_block_devices_and_odd_members(env, kind) -> None:
    tmp_path, _, _ = env
    src = Store(tmp_path / "src")
    src.publish("ab" * 16, {"inductor/x": b"1"})
    src.export(tmp_path / "good.tar")
    with tarfile.open(tmp_path / "good.tar") as good, tarfile.open(tmp_path / "evil.tar", "w") as evil:
        for m in good.getmembers():
            evil.addfile(m, good.extractfile(m))
        info = tarfile.TarInfo(f"entries/{'ab' * 16}/packs/{'0' * 32}.pack")
        info.type = kind
        evil.addfile(info, io.BytesIO(b"") if kind == tarfile.CONTTYPE else None)
    target = Store(tmp_path / "target")
    with pytest.raises(CorruptPackError):
        target.import_archive(tmp_path / "evil.tar")
    assert target.entries() == []


# ---------------------------------------------------------------------------------------------
# Issue 15.5: a reader with another signing key misses, and wipes nobody's packs


def test_two_teams_with_different_signing_keys_share_a_store_without_wiping_it(env, capsys) -> None:
    tmp_path, inductor, monkeypatch = env
    root = tmp_path / "store"

    def team(key: str):
        monkeypatch.setenv("COMPILE_CACHE_SIGNING_KEY", key)
        shutil.rmtree(inductor, ignore_errors=True)  # each start on a fresh node
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            report, backend = run_job(root)  # outputs == eager
        return report, backend, store_warnings(record)

    first_a, _, _ = team("team-a")
    assert first_a.published_packs == 1
    first_b, backend, messages = team("team-b")  # a's pack is not b's: a miss for b only
    assert first_b.restored_packs == 0 and backend.misses >= 1 and first_b.published_packs == 1
    assert any("signed with this COMPILE_CACHE_SIGNING_KEY" in m for m in messages)
    packs = sorted(Store(root).layout.packs_dir(first_a.key).glob("*.pack"))
    assert len(packs) == 2  # same content, one pack per signer: neither blocks the other
    stats = Store(root).stats()
    assert stats["signature_mismatch"] == 1 and stats["corrupt"] == 0 and stats["quarantined"] == 0
    again_a, backend_a, messages_a = team("team-a")
    again_b, backend_b, messages_b = team("team-b")
    assert again_a.hit and backend_a.misses == 0 and again_b.hit and backend_b.misses == 0
    assert messages_a == [] and messages_b == []  # the other team's pack is no one's problem
    assert Store(root).stats()["quarantined"] == 0
    assert sorted(Store(root).layout.packs_dir(first_a.key).glob("*.pack")) == packs
    # verify with either key: the other team's pack is listed, not a problem; doctor counts them.
    report = Store(root).verify()
    assert report.ok and len(report.other_signer_packs) == 1
    from compile_cache import cli

    cli.main(["doctor", "--cache-dir", str(root)])
    assert "signed with another key" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# issue 31.1 / 31.5: no link inside the store is followed, nothing outside it is touched, and a
# FIFO where a pack, a stats shard or a record should be never hangs


def _outside(tmp_path, key: str):
    """Somebody's files outside the store, laid out as an entry would be."""
    victim = tmp_path / "victim"
    (victim / key[:2] / key / "packs").mkdir(parents=True)
    (victim / key[:2] / key / "packs" / "precious.txt").write_text("keep me")
    (victim / "thesis.tex").write_text("keep me too")
    old = 1_000_000.0
    for path in victim.rglob("*"):
        os.utime(path, (old, old))
    return victim


def _all_files(root) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


def test_links_in_the_entries_tree_are_refused_by_load_and_never_followed_by_maintenance(env) -> None:
    tmp_path, _inductor, _ = env
    store = Store(tmp_path / "store")
    ours, theirs = "ab" * 16, "cd" * 16
    store.publish(ours, {"inductor/a": b"1"})
    victim = _outside(tmp_path, theirs)
    before = _all_files(victim)
    os.symlink(victim / theirs[:2], store.layout.entries_dir / theirs[:2])  # a prefix dir
    os.symlink(victim, store.layout.entry_dir(ours) / "elsewhere")  # a link in an entry
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert store.load(theirs) == []
        assert [p.info.key for p in store.load(ours)] == [ours]
        report = store.verify(fix=True, temp_age=0)
        store.evict(max_size=0)
        store.clear()
    assert _all_files(victim) == before  # nothing deleted, moved or added out there
    assert report.checked_entries >= 1
    assert not any("Traceback" in str(w.message) for w in record)


def test_a_path_outside_the_store_is_refused_by_its_file_layer(env) -> None:
    tmp_path, _inductor, _ = env
    store = Store(tmp_path / "store")
    (tmp_path / "victim.txt").write_text("keep")
    for bad in (tmp_path / "victim.txt", store.layout.tmp_dir / ".." / ".." / ".." / "victim.txt"):
        with pytest.raises(UnsafeStoreError, match="outside"):
            store.fs.unlink(bad)
        with pytest.raises(OSError):
            store.fs.rename(bad, store.layout.tmp_dir / "x")
    assert (tmp_path / "victim.txt").read_text() == "keep"


def _fifo_child(root: str, key: str, out) -> None:
    store = Store(root)
    packs = store.load(key)
    store.record_miss(key)
    stats = store.stats()
    entries = store.entries()
    report = store.verify(fix=True, temp_age=0)
    out.put((len(packs), stats["corrupt"], len(entries), len(report.corrupt_packs)))


def test_a_fifo_where_a_pack_shard_or_record_should_be_never_hangs(env) -> None:
    import multiprocessing

    from _fault_helpers import join_or_fail

    tmp_path, _inductor, _ = env
    store = Store(tmp_path / "store")
    key = "ef" * 16
    store.publish(key, {"inductor/a": b"1"})
    os.mkfifo(store.layout.pack_path(key, "0" * 32))
    for n in range(8):
        store.layout.stats_shard(n).unlink(missing_ok=True)
        os.mkfifo(store.layout.stats_shard(n))
    os.unlink(store.layout.entry_json(key))
    os.mkfifo(store.layout.entry_json(key))
    os.unlink(store.layout.used_file(key))
    os.mkfifo(store.layout.used_file(key))
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_fifo_child, args=(str(store.root), key, out))
    child.start()
    join_or_fail(child, 15.0)  # a FIFO opened for reading would block for ever
    loaded, corrupt, entries, corrupt_listed = out.get(timeout=5)
    assert loaded == 1 and entries == 1  # the real pack; the FIFO set aside as a corrupt one
    assert corrupt >= 1


# ---------------------------------------------------------------------------------------------
# issue 31.2: every record we parse is bounded in size and depth; a nested value planted by a
# bucket writer without the key is a counted miss or a skipped record, never a traceback


def _raw_pack(header: bytes) -> bytes:
    """A pack whose checksum is right but whose header is ``header`` as it is (unsigned)."""
    import hashlib
    import struct

    from compile_cache.store.pack import FORMAT_VERSION, MAGIC

    body = struct.pack("<I", len(header)) + header
    return struct.pack("<8sHHQ32s32s", MAGIC, FORMAT_VERSION, 0, len(body),
                       hashlib.sha256(body).digest(), bytes(32)) + body


@pytest.mark.parametrize("depth", [100, 200_000], ids=["deeper-than-allowed", "past-recursion"])
def test_a_deeply_nested_record_is_a_miss_for_the_job_and_no_traceback_in_the_cli(env, capsys, depth) -> None:
    from compile_cache import cli

    tmp_path, inductor, _ = env
    root = tmp_path / "store"
    report, _ = run_job(root)
    store = Store(root)
    nested = b"[" * depth + b"]" * depth
    for path in store.layout.pack_paths(report.key):
        path.write_bytes(_raw_pack(b'{"format":1,"members":[],"metadata":{"x":' + nested + b"}}"))
    store.layout.entry_json(report.key).write_bytes(b'{"created":' + nested + b"}")
    for n in range(8):
        store.layout.stats_shard(n).write_bytes(b'{"hits":' + nested + b"}")
    store.layout.misses_dir.mkdir(exist_ok=True)
    store.layout.miss_file(report.key).write_bytes(b'{"key":"' + report.key.encode() + b'","record":' + nested + b"}")
    shutil.rmtree(inductor)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        again, backend = run_job(root)  # outputs equal eager's (checked inside)
    assert again.restored_packs == 0 and backend.misses >= 1
    capsys.readouterr()
    codes = {}
    for argv in (["ls"], ["ls", "--json"], ["stats"], ["stats", "--json"], ["verify"],
                 ["verify", "--fix"], ["export", str(tmp_path / "out.tar")], ["explain"]):
        codes[argv[0] + " " + " ".join(argv[1:2])] = cli.main([*argv, "--cache-dir", str(root)])
    out = capsys.readouterr()
    assert all(code in (0, 1) for code in codes.values()), (codes, out.err[-2000:])
    assert "Traceback" not in out.err and "RecursionError" not in out.err + out.out
    assert Store(root).stats()["corrupt"] >= 1  # the nested pack was counted and set aside


def test_an_entry_record_of_the_wrong_shape_is_listed_not_a_traceback(env, capsys) -> None:
    import json

    from compile_cache import cli

    tmp_path, _inductor, _ = env
    store = Store(tmp_path / "store")
    shapes = [{"created": "x", "torch": {"a": 1}, "model": 5, "compile": [1]},
              {"created": [], "model": {"structure": "s", "class": {}}, "compile": {"a": [1]}},
              {"created": 1.0, "model": {"structure": "s"}, "environment": "x", "plan": 3}]
    for n, shape in enumerate(shapes):
        key = f"{n:02d}" * 16
        store.publish(key, {"inductor/x": bytes([n])})
        store.layout.entry_json(key).write_text(json.dumps(shape))
    codes = [cli.main([*argv, "--cache-dir", str(store.root)])
             for argv in (["ls"], ["ls", "--json"], ["verify"], ["explain"])]
    out = capsys.readouterr()
    assert codes == [0, 0, 0, 0] and "Traceback" not in out.err
    assert out.out.count("000000000000") >= 2  # listed in both forms
