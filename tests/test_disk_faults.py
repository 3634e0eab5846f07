"""Disk faults met by a real job (compile_regions + FakeInductor): a full disk, a read-only store,
permission denied, a store that vanishes mid-run. The job always finishes with eager's outputs,
with at most one warning, and the error is counted."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import warnings

import pytest
from _fault_helpers import (
    FORK,
    FakeInductor,
    clean_env,
    join_or_fail,
    run_job,
    store_warnings,
    temp_files,
)

import compile_cache.session as session_mod
from compile_cache.store import Store


@pytest.fixture
def env(tmp_path, monkeypatch):
    inductor = clean_env(monkeypatch, tmp_path)
    return tmp_path, inductor, monkeypatch


def _sessions_stores(monkeypatch) -> list[Store]:
    """Record the Store objects the jobs open (their in-memory counters, when the disk refuses)."""
    seen: list[Store] = []

    class Recording(Store):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen.append(self)

    monkeypatch.setattr(session_mod, "Store", Recording)
    return seen


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs when we may mount one (root), else None (the ENOSPC is then simulated)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                        capture_output=True).returncode == 0 if os.geteuid() == 0 else False
    yield mnt if ok else None
    if ok:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_during_publish(env, tiny_disk) -> None:
    tmp_path, inductor, monkeypatch = env
    root = (tiny_disk or tmp_path) / "store"
    if tiny_disk is None:  # no tmpfs here: the writer itself reports ENOSPC
        import compile_cache._paths as paths

        def full(fd, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(paths, "_write_all", full)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        report, backend = run_job(root, FakeInductor(payload=2 << 20))  # a 2 MiB artifact
        second, _ = run_job(root, FakeInductor(payload=2 << 20, salt="v2"))  # another publish
    assert backend.misses >= 1 and report.published_packs == 0 and second.published_packs == 0
    messages = store_warnings(record)
    assert len(messages) == 1 and "ENOSPC" in messages[0], messages
    assert Store(root).stats()["errors_by_kind"].get("ENOSPC", 0) >= 1
    assert temp_files(root) == []  # the half-written temp file is gone: the space is back
    if tiny_disk is not None:
        assert shutil.disk_usage(tiny_disk).used < 256 << 10


def test_read_only_store_restores_and_skips_publishing_with_one_warning(env) -> None:
    tmp_path, inductor, monkeypatch = env
    root = tmp_path / "store"
    run_job(root)
    shutil.rmtree(inductor)
    monkeypatch.setenv("COMPILE_CACHE_READ_ONLY", "1")
    before = sorted(p for p in root.rglob("*") if p.is_file() and "packs" in p.parts)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hit, _ = run_job(root)
        new_shape, backend = run_job(root, FakeInductor(salt="v2"))  # new artifact: would publish
        run_job(root, FakeInductor(salt="v3"))
    assert hit.hit and backend.misses >= 1 and new_shape.published_packs == 0
    messages = store_warnings(record)
    assert len(messages) == 1 and "read-only" in messages[0]
    assert sorted(p for p in root.rglob("*") if p.is_file() and "packs" in p.parts) == before


def _as_nobody(root: str, key: str, out) -> None:
    try:
        _as_nobody_inner(root, key, out)
    except BaseException:
        import traceback

        out.put(traceback.format_exc())
        raise


def _as_nobody_inner(root: str, key: str, out) -> None:
    os.setgid(65534)
    os.setgroups([])
    os.setuid(65534)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        store = Store(root)
        loaded = store.load(key)
        published = store.publish(key, {"inductor/x": b"1"})
        again = store.load(key)
    out.put((store.read_only, len(loaded), published, len(again), store.stats()["errors"],
             len(store_warnings(record))))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another user")
def test_permission_denied_for_real_as_another_user(env) -> None:
    tmp_path, inductor, monkeypatch = env
    tmp_path.chmod(0o755)
    root = tmp_path / "store"
    run_job(root)  # root's 0700 store with a pack
    key = Store(root).entries()[0].key
    out = FORK.Queue()
    child = FORK.Process(target=_as_nobody, args=(str(root), key, out))
    child.start()
    join_or_fail(child, 60)
    assert child.exitcode == 0, out.get(timeout=5)
    read_only, loaded, published, again, errors, n_warnings = out.get(timeout=5)
    # Not an exception: a read-only, empty store; the refused read is counted; one warning per
    # problem (cannot read: EACCES; cannot write: read-only), however many loads and publishes.
    assert read_only and loaded == 0 and published is None and again == 0
    assert errors >= 1 and n_warnings == 2


def test_permission_denied_during_a_job(env) -> None:
    tmp_path, inductor, monkeypatch = env
    root = tmp_path / "store"
    run_job(root)
    shutil.rmtree(inductor)
    stores = _sessions_stores(monkeypatch)
    from compile_cache.store.fs import StoreFS

    real_listdir = StoreFS.listdir

    def denied(fs, path):
        if str(path).startswith(str(root)) and "packs" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_listdir(fs, path)

    monkeypatch.setattr(StoreFS, "listdir", denied)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        report, backend = run_job(root)
    assert report.restored_packs == 0 and backend.misses >= 1  # compiled instead
    messages = store_warnings(record)
    assert len(messages) == 1 and "EACCES" in messages[0]
    assert stores[-1].stats()["errors_by_kind"].get("EACCES") == 1


def test_store_removed_between_restore_and_publish(env) -> None:
    tmp_path, inductor, monkeypatch = env
    root = tmp_path / "store"
    stores = _sessions_stores(monkeypatch)
    import torch
    from _fault_helpers import Net

    import compile_cache

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = model(x)
        compile_cache.compile_regions(model, cache_dir=root, backend=FakeInductor())
        shutil.rmtree(root)  # an admin's rm -rf, an unmounted NFS path
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = model(x)  # compiles, then publishes into the vanished store
            out2 = model(torch.randn(5, 8))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert out2.shape == (5, 4)
    messages = store_warnings(record)
    assert len(messages) == 1 and "ENOENT" in messages[0], messages
    assert not root.exists()  # not silently re-created (it may be an unmounted mount point)
    assert stores[-1].stats()["errors_by_kind"].get("ENOENT", 0) >= 1
