"""Export and import of entries as one archive (compile_cache.store.archive)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from _fault_helpers import STORE_ENV
from _store_helpers import K1, K2, K3, MEMBERS
from _store_helpers import packs as _packs

from compile_cache.errors import (
    CorruptPackError,
    StoreError,
)
from compile_cache.store import Store

REPO = str(Path(__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, fresh_state):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "cache")


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


def test_an_archive_of_directory_entries_counts_against_the_limits(store: Store, tmp_path, monkeypatch) -> None:
    """issue 31.10: every member counts, directories included (3.6 MB of them took 62 s and
    738 MB before): past the member limit, or the size cap, the import stops at once."""
    from compile_cache.errors import CorruptPackError
    from compile_cache.store import archive

    path = tmp_path / "dirs.tar"
    with tarfile.open(path, "w") as tar:
        for n in range(300):
            info = tarfile.TarInfo(f"entries/{n:032x}")
            info.type = tarfile.DIRTYPE
            tar.addfile(info, io.BytesIO())
    monkeypatch.setattr(archive, "MAX_ARCHIVE_MEMBERS", 100)
    with pytest.raises(CorruptPackError, match="more than 100 members"):
        store.import_archive(path)
    monkeypatch.setattr(archive, "MAX_ARCHIVE_MEMBERS", 10_000)
    small = Store(store.root, max_size=100 * 512)
    with pytest.raises(CorruptPackError, match="size cap"):
        small.import_archive(path)
    assert store.entries() == []
