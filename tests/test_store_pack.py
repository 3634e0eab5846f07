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
