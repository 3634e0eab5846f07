"""Bad arguments to every public entry point: a clear exception that names the bad value."""

from __future__ import annotations

import pytest
import torch

import compile_cache
from compile_cache import CompileCacheError, Fingerprint, Store

K = "ab" * 16


class Weird:
    def __repr__(self) -> str:
        return "<Weird-7>"


def _raises(call, types, *needles):
    with pytest.raises(types) as info:
        call()
    text = str(info.value)
    assert any(n in text for n in needles), f"{text!r} names none of {needles}"
    assert isinstance(info.value, (CompileCacheError, TypeError, ValueError))


@pytest.fixture
def store(tmp_path, monkeypatch) -> Store:
    for name in ("COMPILE_CACHE_DIR", "COMPILE_CACHE_READ_ONLY", "COMPILE_CACHE_SIGNING_KEY", "COMPILE_CACHE_SHARED"):
        monkeypatch.delenv(name, raising=False)
    return Store(tmp_path / "s")


def test_fingerprint_functions_and_type() -> None:
    _raises(lambda: compile_cache.fingerprint(Weird()), TypeError, "Weird")
    _raises(lambda: compile_cache.fingerprint_tree(42), TypeError, "int")
    _raises(lambda: Fingerprint(b"short"), ValueError, "b'short'")
    _raises(lambda: Fingerprint("ab" * 16), ValueError, repr("ab" * 16))
    _raises(lambda: Fingerprint.from_hex("xyz"), ValueError, "'xyz'")
    _raises(lambda: Fingerprint.from_hex(7), ValueError, "7")


def test_compile_regions_and_plan_regions() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    _raises(lambda: compile_cache.compile_regions(Weird()), TypeError, "Weird")
    _raises(lambda: compile_cache.plan_regions("model"), TypeError, "str")
    _raises(lambda: compile_cache.compile_regions(model, cache_dir=3), TypeError, "3")
    _raises(lambda: compile_cache.compile_regions(model, bakend="eager"), TypeError, "bakend")
    _raises(lambda: compile_cache.compile_regions(model, options="fast"), TypeError, "'fast'")


def test_store_constructor(tmp_path) -> None:
    _raises(lambda: Store(42), TypeError, "int")
    _raises(lambda: Store(tmp_path / "a", max_size="lots"), ValueError, "'lots'")
    _raises(lambda: Store(tmp_path / "a", read_only="no"), TypeError, "'no'")
    _raises(lambda: Store(tmp_path / "a", signing_key=123), TypeError, "int")
    (tmp_path / "file").write_text("x")
    _raises(lambda: Store(tmp_path / "file"), CompileCacheError, str(tmp_path / "file"))


def test_store_methods(store: Store, tmp_path) -> None:
    bad = "../etc"
    for call in (store.load, store.has, store.lock, store.record_miss, store.record_hit, store.entry,
                 lambda k: store.publish(k, {"a": b"1"})):
        _raises(lambda c=call: c(bad), ValueError, repr(bad))
    _raises(lambda: store.publish(K, [("a", b"1")]), TypeError, "list")
    _raises(lambda: store.publish(K, {"a": 1}), TypeError, "'a'", "int")
    _raises(lambda: store.publish(K, {"../x": b"1"}), CompileCacheError, "'../x'")
    _raises(lambda: store.publish(K, {"a": b"1"}, metadata={"f": Weird()}), TypeError, "Weird")
    _raises(lambda: store.evict(max_size="big"), ValueError, "'big'")
    _raises(lambda: store.evict(older_than="soon"), ValueError, "'soon'")
    _raises(lambda: store.evict(keys=K), TypeError, repr(K))
    _raises(lambda: store.export(tmp_path / "x.tar", keys=K), TypeError, repr(K))
    _raises(lambda: store.export(tmp_path / "x.tar", keys=["zz"]), ValueError, "'zz'")
    _raises(lambda: store.verify(temp_age="1h"), TypeError, "'1h'")
    _raises(lambda: store.record_hit(K, seconds_saved="x"), ValueError, "'x'")
    _raises(lambda: store.import_archive(Weird()), TypeError, "Weird")
    missing = tmp_path / "missing.tar"
    with pytest.raises(OSError, match="missing.tar"):
        store.import_archive(missing)
