"""Shared helpers of the store tests (tests/test_store_*.py and the fault tests)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from compile_cache.store import Store, StoreWarning, encode_pack
from compile_cache.store import pack as pack_format

K1, K2, K3 = "a1" * 16, "b2" * 16, "c3" * 16
MEMBERS = {
    "inductor/fxgraph/ab/xyz": b"graph" * 100,
    "triton/0/abc/kernel.cubin": bytes(range(256)) * 4,
    "other/artifacts.bin": b"\x00mega",
}


def packs(s: Store, key: str) -> list[Path]:
    """The pack files of ``key`` on disk."""
    return sorted(s.layout.packs_dir(key).glob("*.pack"))


def store_warnings_of(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, StoreWarning)]


@contextlib.contextmanager
def malicious_writer() -> Iterator[None]:
    """Inside the block, ``encode_pack`` takes any member name, as an attacker's writer would."""
    with mock.patch.object(pack_format, "check_member_name", lambda name: name):
        yield


def craft_pack(store: Store, key: str, members: dict[str, bytes], **header: object) -> Path:
    """Write a pack with any member names straight into ``store`` (bypassing ``publish``)."""
    with malicious_writer():
        name, chunks, _ = encode_pack(key, members, **header)  # type: ignore[arg-type]
    target = store.layout.pack_path(key, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"".join(bytes(c) for c in chunks))
    return target


def tiny_elf(payload: bytes = b"", *, sections: int = 0) -> bytes:
    """A structurally complete 64-bit little-endian ELF shared object: header, one PT_LOAD that
    covers the file, ``payload``, and (``sections``) a section header table at the end. Truncate
    it and the checks must fail (the segment, or the table, then lies past the end)."""
    import struct

    phoff, phentsize = 64, 56
    body = 64 + phentsize + len(payload)
    shentsize = 64
    shoff = body if sections else 0
    total = body + sections * shentsize
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, phoff, shoff, 0, 64, phentsize, 1,
                          shentsize if sections else 0, sections, 0)
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, total, total, 0x1000)
    shdrs = b"".join(struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) for _ in range(sections))
    return header + phdr + payload + shdrs


def damaged_object_read(url: str, key: str, members: dict[str, bytes], tier: Path,
                        monkeypatch: pytest.MonkeyPatch) -> tuple[str, Store]:
    """Publishes ``members`` under ``key`` to the object store ``url``, flips a byte of the
    pack object, and checks that a reader with its local tier in ``tier`` finds nothing, says
    once that the pack is unusable, counts it corrupt and quarantined, and keeps it out of its
    local tier. Returns the pack's name and that reader."""
    info = Store(url).publish(key, members, compile_seconds=1.0)
    store = Store(url)
    name = store.remote.layout.pack_object_of(store.remote.listing()[key], info.name)  # .pack.zst
    data = bytearray(store.remote.backend.get(name, 1 << 20))
    data[-10] ^= 0xFF
    store.remote.backend.put(name, bytes(data))
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tier))
    reader = Store(url)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert reader.load(key) == []
    assert len([m for m in store_warnings_of(shown) if "unusable" in m]) == 1
    assert reader.stats()["corrupt"] == 1 and reader.stats()["quarantined"] == 1
    assert not reader.layout.pack_paths(key)  # never reached the local tier
    return info.name, reader
