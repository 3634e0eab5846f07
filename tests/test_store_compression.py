"""zstd-compressed packs (compile_cache.store.compression): on object storage and in export archives.

Content names, checksums and signatures are those of the uncompressed pack; the pack size limit
applies to the expanded size, read from the frame header before anything is expanded; a frame
that lies about its size is refused while expanding; old uncompressed packs still load. The
object-storage cases use fsspec's in-process ``memory://`` store (the S3 client's own path is
tested against moto in test_store_remote.py).
"""

from __future__ import annotations

import io
import os
import tarfile
import uuid
from pathlib import Path

import pytest

from compile_cache.errors import CorruptPackError
from compile_cache.store import Store, compression, decode_pack, encode_pack
from compile_cache.store import _reset as reset_store_warnings
from compile_cache.store.pack import PackLimitError

K1 = "c1" * 16
#: Members that compress well, as Inductor's do (source, pickles with repeated names).
MEMBERS = {
    "inductor/fxgraph/ab/graph": b"def kernel(in_ptr0, out_ptr0):\n    tmp0 = tl.load(in_ptr0)\n" * 400,
    "triton/0/abc/kernel.json": b'{"name": "kernel", "num_warps": 4}' * 50,
}


def _pack_bytes(members: dict[str, bytes] = MEMBERS, **kw) -> tuple[str, bytes]:
    name, chunks, _size = encode_pack(K1, members, compile_seconds=1.0, **kw)
    return name, b"".join(bytes(c) for c in chunks)


class _Counting(io.RawIOBase):
    """A sink that counts what is written to it (a bomb must never reach it)."""

    def __init__(self) -> None:
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        self.written += len(data)
        return len(data)


def _with_declared_size(frame: bytes, size: int) -> bytes:
    """``frame`` with its header's Frame_Content_Size field set to ``size`` (same field width)."""
    fhd = frame[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    width = {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fcs_flag]
    assert width in (4, 8), "the test needs a 4- or 8-byte size field"
    at = 5 + (0 if single else 1) + {0: 0, 1: 1, 2: 2, 3: 4}[dict_flag]
    return frame[:at] + size.to_bytes(width, "little") + frame[at + width:]


@pytest.fixture
def memory_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for name in list(os.environ):
        if name.startswith("COMPILE_CACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-publisher"))
    reset_store_warnings()
    return f"memory://cc-{uuid.uuid4().hex[:8]}/cache"


def _fresh_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, label: str) -> None:
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / f"tier-{label}"))


# -- the codec -----------------------------------------------------------------------------------
def test_a_compressed_pack_decodes_to_the_same_pack_and_name() -> None:
    name, raw = _pack_bytes(signing_key=b"k" * 32)
    frame = compression.compress(raw)
    assert compression.is_compressed(frame) and not compression.is_compressed(raw)
    assert len(frame) * 5 < len(raw)  # what the member bytes above allow
    header, members = decode_pack(frame, signing_key=b"k" * 32, key=K1)
    assert members == MEMBERS and header["signer"]
    assert decode_pack(raw, signing_key=b"k" * 32, key=K1)[1] == members
    assert compression.declared_size(frame[:18], 1 << 30) == len(raw)


def test_a_decompression_bomb_is_refused_from_its_header_before_expanding() -> None:
    bomb = compression.compress(b"\0" * (64 << 20), 3)  # 64 MiB of zeros in a few KiB
    assert len(bomb) < 64 << 10
    sink = _Counting()
    with pytest.raises(PackLimitError, match="over the limit of 1048576.*before expanding"):
        compression.decompress(io.BytesIO(bomb).read, sink, 1 << 20)
    assert sink.written == 0
    with pytest.raises(PackLimitError):
        decode_pack(bomb, key=K1)  # the configured limit (32M, the fixture below)
    # ... through the reader too, with the configured limit
    from compile_cache.store.pack import PackLimits

    with pytest.raises(PackLimitError):
        decode_pack(bomb, key=K1, limits=PackLimits(1 << 20, 100, 100))


@pytest.fixture(autouse=True)
def _small_limit_for_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_pack's default limits come from the config: 32 MiB keeps the bomb above them."""
    monkeypatch.setenv("COMPILE_CACHE_MAX_PACK_SIZE", "32M")


def test_a_frame_that_lies_about_its_size_is_refused_within_the_declared_size() -> None:
    data = os.urandom(1 << 16) * 40  # 2.5 MiB that compresses
    frame = compression.compress(data)
    small = _with_declared_size(frame, 1 << 20)  # says 1 MiB, holds 2.5 MiB
    sink = _Counting()
    with pytest.raises(CorruptPackError, match="past the 1048576 bytes its frame declares|damaged"):
        compression.decompress(io.BytesIO(small).read, sink, 8 << 20)
    assert sink.written <= 1 << 20
    big = _with_declared_size(frame, 3 << 20)  # says more than it holds
    with pytest.raises(CorruptPackError):
        compression.decompress(io.BytesIO(big).read, _Counting(), 8 << 20)
    # A frame that declares no size at all is refused unread.
    z = compression.zstd()
    comp = z.ZstdCompressor()
    unsized = comp.compress(data) + comp.flush()
    with pytest.raises(CorruptPackError, match="does not declare its size"):
        compression.decompress(io.BytesIO(unsized).read, _Counting(), 8 << 20)
    # Bytes after the frame, and a cut frame.
    with pytest.raises(CorruptPackError, match="after its frame"):
        compression.decompress(io.BytesIO(frame + b"x").read, _Counting(), 8 << 20)
    with pytest.raises(CorruptPackError):
        compression.decompress(io.BytesIO(frame[:-100]).read, _Counting(), 8 << 20)
    out = io.BytesIO()
    assert compression.decompress(io.BytesIO(frame).read, out, 8 << 20) == len(data)
    assert out.getvalue() == data


# -- object storage --------------------------------------------------------------------------------
def test_packs_travel_compressed_and_a_fresh_node_restores_them(
    memory_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Store(memory_url)
    info = store.publish(K1, MEMBERS, compile_seconds=1.0)
    entry = store.remote.listing()[K1]
    assert entry.compressed == {info.name}
    size_raw = store.layout.pack_paths(K1)[0].stat().st_size
    assert entry.packs[info.name] * 5 < size_raw  # what travels
    assert 0 < store.stats()["bytes_uploaded"] == entry.packs[info.name]
    assert [p.name for p in store.entries()[0].packs] == [info.name]  # the header, from the frame
    _fresh_node(tmp_path, monkeypatch, "reader")
    reader = Store(memory_url)
    packs = reader.load(K1)
    assert len(packs) == 1 and packs[0].info.name == info.name and dict(packs[0].members.items()) == MEMBERS
    assert reader.stats()["bytes_downloaded"] == entry.packs[info.name]
    # The local tier holds the pack uncompressed, under its content name.
    local = reader.layout.pack_paths(K1)
    assert [p.stem for p in local] == [info.name] and local[0].read_bytes()[:6] == b"CCPACK"
    assert reader.verify().ok
    # Dedupe by content name: a second publisher of the same content puts nothing.
    _fresh_node(tmp_path, monkeypatch, "second")
    assert Store(memory_url).publish(K1, MEMBERS, compile_seconds=1.0).name == info.name
    assert len(Store(memory_url).remote.objects(K1)) == len(store.remote.objects(K1))


def test_an_old_uncompressed_pack_object_still_loads(
    memory_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COMPILE_CACHE_PACK_COMPRESSION", "0")  # what versions before it wrote
    old = Store(memory_url)
    info = old.publish(K1, MEMBERS, compile_seconds=1.0)
    entry = old.remote.listing()[K1]
    assert entry.compressed == set()
    assert old.remote.backend.get(old.remote.layout.pack_object(K1, info.name), 1 << 20)[:6] == b"CCPACK"
    monkeypatch.delenv("COMPILE_CACHE_PACK_COMPRESSION")
    _fresh_node(tmp_path, monkeypatch, "new")
    new = Store(memory_url)
    packs = new.load(K1)
    assert len(packs) == 1 and dict(packs[0].members.items()) == MEMBERS
    assert [p.name for p in new.entries()[0].packs] == [info.name] and new.verify().ok
    # The new version's publish of the same content sees it there: no second object.
    _fresh_node(tmp_path, monkeypatch, "newer")
    Store(memory_url).publish(K1, MEMBERS, compile_seconds=1.0)
    assert Store(memory_url).remote.listing()[K1].compressed == set()


def test_a_bomb_object_is_refused_and_left_for_readers_with_a_bigger_limit(
    memory_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Store(memory_url)
    info = store.publish(K1, {"inductor/fxgraph/ab/big": b"\0" * (4 << 20)}, compile_seconds=1.0)
    obj = store.remote.layout.pack_object(K1, info.name, compressed=True)
    assert len(store.remote.backend.get(obj, 1 << 20)) < 64 << 10
    monkeypatch.setenv("COMPILE_CACHE_MAX_PACK_SIZE", "1M")
    _fresh_node(tmp_path, monkeypatch, "small")
    small = Store(memory_url)
    assert small.load(K1) == [] and small.stats()["corrupt"] == 1
    assert not small.layout.pack_paths(K1)
    assert info.name in small.remote.listing()[K1].packs  # not quarantined: over *this* limit
    leftovers = [p for p in (tmp_path / "tier-small").rglob("*") if p.is_file() and ".tmp-" in p.name]
    assert leftovers == []


def test_a_damaged_compressed_object_is_quarantined(
    memory_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Store(memory_url)
    info = store.publish(K1, MEMBERS, compile_seconds=1.0)
    obj = store.remote.layout.pack_object(K1, info.name, compressed=True)
    frame = store.remote.backend.get(obj, 1 << 20)
    damaged = _with_declared_size(frame, len(frame) * 100) if frame[4] >> 6 >= 2 else frame[:-50]
    store.remote.backend.put(obj, damaged)
    _fresh_node(tmp_path, monkeypatch, "reader")
    reader = Store(memory_url)
    assert reader.load(K1) == [] and reader.stats()["corrupt"] == 1
    assert info.name not in reader.remote.listing().get(K1, type("E", (), {"packs": {}})).packs
    # The URL's quarantine holds the object as it came (downloaded into memory, never a file).
    held = [n for n in reader.remote.backend.list("") if "quarantine" in n and info.name in n]
    assert len(held) == 1 and reader.remote.backend.get(held[0], 1 << 20) == damaged


def test_a_compressed_pack_is_expanded_from_memory_into_its_one_temp_file(
    memory_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compressed object of a few MB is downloaded into memory and expanded straight into
    its temp file: one file written per pack (no compressed copy written, then read back)."""
    from compile_cache.store.fs import StoreFS

    store = Store(memory_url)
    info = store.publish(K1, MEMBERS, compile_seconds=1.0)
    _fresh_node(tmp_path, monkeypatch, "reader")
    reader = Store(memory_url)
    created: list[str] = []
    real = StoreFS.create

    def recording(self, path, *args, **kwargs):
        created.append(Path(path).name)
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(StoreFS, "create", recording)
    packs = reader.load(K1)
    assert [p.info.name for p in packs] == [info.name] and dict(packs[0].members.items()) == MEMBERS
    assert len(created) == 1 and created[0].startswith(f".{info.name}.pack.tmp-"), created
    assert reader.stats()["bytes_downloaded"] == reader.remote.listing()[K1].packs[info.name]


# -- export archives -------------------------------------------------------------------------------
def test_export_archives_hold_compressed_packs_and_old_ones_still_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = Store(tmp_path / "src")
    info = src.publish(K1, MEMBERS, compile_seconds=1.0)
    raw_size = src.layout.pack_paths(K1)[0].stat().st_size
    archive = tmp_path / "out.tar"
    assert src.export(archive) == 1
    with tarfile.open(archive) as tar:
        packs = [m for m in tar.getmembers() if "/packs/" in m.name]
    assert [Path(m.name).name for m in packs] == [f"{info.name}.pack.zst"]
    assert packs[0].size * 5 < raw_size
    dst = Store(tmp_path / "dst")
    report = dst.import_archive(archive)
    assert report.packs_added == 1
    assert [p.name for p in dst.layout.pack_paths(K1)] == [f"{info.name}.pack"]
    assert dict(dst.load(K1)[0].members.items()) == MEMBERS
    # An archive of an older version (packs as they are) imports as before.
    monkeypatch.setenv("COMPILE_CACHE_PACK_COMPRESSION", "0")
    old = tmp_path / "old.tar"
    src.export(old)
    with tarfile.open(old) as tar:
        assert [Path(m.name).name for m in tar.getmembers() if "/packs/" in m.name] == [f"{info.name}.pack"]
    assert Store(tmp_path / "dst2").import_archive(old).packs_added == 1
    assert dict(Store(tmp_path / "dst2").load(K1)[0].members.items()) == MEMBERS


def test_an_archive_with_a_bomb_is_refused_before_expanding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = Store(tmp_path / "src")
    src.publish(K1, {"inductor/fxgraph/ab/big": b"\0" * (4 << 20)}, compile_seconds=1.0)
    archive = tmp_path / "bomb.tar"
    src.export(archive)
    assert archive.stat().st_size < 256 << 10
    monkeypatch.setenv("COMPILE_CACHE_MAX_PACK_SIZE", "1M")
    dst = Store(tmp_path / "dst")
    with pytest.raises(PackLimitError, match="refused before expanding"):
        dst.import_archive(archive)
    assert not dst.layout.pack_paths(K1)
