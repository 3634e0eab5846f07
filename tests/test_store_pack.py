"""The pack format: checksums, signatures, format versions (compile_cache.store.pack)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from _fault_helpers import STORE_ENV
from _store_helpers import K1, K2, MEMBERS
from _store_helpers import packs as _packs

from compile_cache.errors import (
    CorruptPackError,
)
from compile_cache.store import Store, decode_pack

REPO = str(Path(__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, fresh_state):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "cache")


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
        assert signed.load(K1) == []  # unsigned while a key is set: a miss for this reader...
    stats = signed.stats()
    assert stats["signature_mismatch"] == 1 and stats["corrupt"] == 0
    assert len(_packs(signed, K1)) == 1  # ...left for the readers without a key
    assert [dict(p.members) for p in plain.load(K1)] == [{"unsigned": b"1"}]

    # An attacker who can write the store alters a member and fixes up the checksum: only the
    # signature catches it, and as the pack claims our key it is damaged, not another reader's.
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
    assert signed.stats()["corrupt"] == 1 and _packs(signed, K2) == []  # quarantined
    assert Store(tmp_path / "c", signing_key=b"other").load(K1) == []


def test_packs_of_different_signers_have_different_names_and_never_block_each_other(tmp_path) -> None:
    a = Store(tmp_path / "c", signing_key=b"team-a")
    b = Store(tmp_path / "c", signing_key=b"team-b")
    info_a, info_b = a.publish(K1, MEMBERS), b.publish(K1, MEMBERS)
    assert info_a and info_b and info_a.name != info_b.name  # same content, two signers
    assert [p.info.name for p in a.load(K1)] == [info_a.name]
    assert [p.info.name for p in b.load(K1)] == [info_b.name]
    assert a.usable(info_a) and not a.usable(info_b)
    # A file planted at our pack's name that our key did not sign is replaced, not trusted.
    (path,) = [p for p in _packs(a, K1) if p.stem == info_a.name]
    forged = bytearray(path.read_bytes())
    forged[52:84] = bytes(32)  # a MAC of zeros
    path.write_bytes(bytes(forged))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert a.publish(K1, MEMBERS) is not None  # the next compile's publish takes its place
    assert [p.info.name for p in a.load(K1)] == [info_a.name] and a.stats()["quarantined"] == 1


def test_the_member_table_keeps_what_capture_recorded(store: Store) -> None:
    store.publish(K1, MEMBERS, member_info={"inductor/fxgraph/ab/xyz": {"file_size": 500}})
    (pack,) = store.load(K1)
    assert pack.members.info("inductor/fxgraph/ab/xyz") == {
        "name": "inductor/fxgraph/ab/xyz", "size": 500, "file_size": 500,
    }
    assert pack.members.size("triton/0/abc/kernel.cubin") == 1024
    assert b"".join(pack.members.chunks("triton/0/abc/kernel.cubin", 100)) == MEMBERS["triton/0/abc/kernel.cubin"]
