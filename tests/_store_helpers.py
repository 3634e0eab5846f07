"""Shared helpers of the store tests (tests/test_store_*.py and the fault tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

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
