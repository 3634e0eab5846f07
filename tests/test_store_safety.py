"""Where the store is and whether its directory is safe (compile_cache.store.safety)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from _fault_helpers import STORE_ENV
from _store_helpers import K1, MEMBERS
from _store_helpers import packs as _packs

from compile_cache.errors import (
    ConfigError,
    StoreError,
    UnsafeStoreError,
)
from compile_cache.store import Store
from compile_cache.store.safety import check_dir, check_safe_dir, describe_dir

REPO = str(Path(__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, fresh_state):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "cache")


# -- location, creation, permissions ------------------------------------------------------------
def test_location_precedence(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    s = Store()
    assert (s.root, s.location_source) == (tmp_path / "home/.cache/compile_cache", "default")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert (Store().root, Store().location_source) == (
        tmp_path / "xdg/compile_cache",
        "XDG_CACHE_HOME",
    )
    monkeypatch.setenv("COMPILE_CACHE_DIR", str(tmp_path / "env"))
    assert (Store().root, Store().location_source) == (tmp_path / "env", "COMPILE_CACHE_DIR")
    s = Store(tmp_path / "arg")
    assert (s.root, s.location_source) == (tmp_path / "arg", "argument")


def test_store_is_created_private(tmp_path) -> None:
    s = Store(tmp_path / "new" / "cache")
    s.publish(K1, MEMBERS)
    assert stat.S_IMODE(s.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(_packs(s, K1)[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(s.layout.entry_dir(K1).stat().st_mode) == 0o700


def test_group_mode_creates_setgid_group_writable_dirs(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("COMPILE_CACHE_SHARED", "group")
    s = Store(tmp_path / "shared")
    s.publish(K1, MEMBERS)
    assert stat.S_IMODE(s.root.stat().st_mode) == 0o2775
    assert stat.S_IMODE(s.layout.entry_dir(K1).stat().st_mode) == 0o2775
    assert stat.S_IMODE(_packs(s, K1)[0].stat().st_mode) == 0o664
    Store(tmp_path / "shared")  # its own group-writable dirs are accepted in group mode


def test_a_file_where_the_store_should_be_is_an_error(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match=str(tmp_path / "file")):
        Store(tmp_path / "file")


def test_world_writable_store_is_refused_with_a_fix(tmp_path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(UnsafeStoreError) as info:
        Store(root)
    assert f"chmod go-w {root}" in str(info.value) and "COMPILE_CACHE_SHARED=group" in str(
        info.value
    )


def test_group_writable_store_needs_group_mode_and_our_group(tmp_path, monkeypatch) -> None:
    root = tmp_path / "c"
    root.mkdir()
    root.chmod(0o770)
    with pytest.raises(UnsafeStoreError, match="COMPILE_CACHE_SHARED=group"):
        Store(root)
    monkeypatch.setenv("COMPILE_CACHE_SHARED", "group")
    assert not Store(root).read_only
    if os.geteuid() == 0:  # only root can hand the directory to a foreign group
        os.chown(root, -1, 54321)
        with pytest.raises(UnsafeStoreError, match="not one of this process's groups"):
            Store(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")
def test_store_owned_by_another_user_and_writable_is_refused(tmp_path) -> None:
    root = tmp_path / "c"
    root.mkdir(mode=0o755)
    os.chown(root, 54321, -1)
    with pytest.raises(UnsafeStoreError, match="belongs to user 54321"):
        Store(root)


def test_bad_settings_raise_config_error_naming_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("COMPILE_CACHE_MAX_SIZE", "20X")
    with pytest.raises(ConfigError, match="COMPILE_CACHE_MAX_SIZE.*20X"):
        Store(tmp_path / "c")
    monkeypatch.delenv("COMPILE_CACHE_MAX_SIZE")
    monkeypatch.setenv("COMPILE_CACHE_SHARED", "world")
    with pytest.raises(ConfigError, match="COMPILE_CACHE_SHARED"):
        Store(tmp_path / "c")
    monkeypatch.delenv("COMPILE_CACHE_SHARED")
    monkeypatch.setenv("COMPILE_CACHE_READ_ONLY", "maybe")
    with pytest.raises(ConfigError, match="COMPILE_CACHE_READ_ONLY"):
        Store(tmp_path / "c")


# -- one check for the store and for doctor -------------------------------------------------------
@pytest.mark.parametrize("mode", [0o700, 0o755, 0o770, 0o777])
@pytest.mark.parametrize("group_mode", [False, True])
def test_doctor_and_the_store_give_the_same_verdict(tmp_path, mode, group_mode) -> None:
    root = tmp_path / "c"
    root.mkdir()
    root.chmod(mode)
    text, safe = describe_dir(root, group_mode)
    problem = check_dir(root, group_mode)
    assert safe == (problem is None)
    if problem is None:
        check_safe_dir(root, group_mode)
        assert "safe" in text or "group-shared" in text
    else:
        assert f"UNSAFE, {problem.short}" in text
        with pytest.raises(UnsafeStoreError) as info:
            check_safe_dir(root, group_mode)
        assert str(info.value) == problem.message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")
def test_doctor_flags_a_store_owned_by_another_user(tmp_path, capsys) -> None:
    from compile_cache import cli

    root = tmp_path / "c"
    root.mkdir(mode=0o755)
    os.chown(root, 54321, -1)
    text, safe = describe_dir(root, False)
    assert not safe and "owned by user 54321" in text
    assert cli.main(["doctor", "--cache-dir", str(root)]) == 1
    assert "owned by user 54321" in capsys.readouterr().out
