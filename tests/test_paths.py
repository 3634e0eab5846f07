"""Safe member names, safe joins, atomic writes (compile_cache._paths) and human sizes (_sizes)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_cache._paths import (
    atomic_write,
    check_key,
    check_member_name,
    is_temp_name,
    temp_path,
)
from compile_cache._sizes import format_age, format_size, parse_age, parse_size
from compile_cache.errors import ConfigError, UnsafePathError

GOOD_NAMES = [
    "inductor/fxgraph/ab/xyz",
    "triton/0/abc/kernel.cubin",
    "megacache/artifacts.bin",
    "a",
    "..hidden/file..name",
    "x/.y",
]
BAD_NAMES = [
    "",
    "../x",
    "/abs",
    "a/../../b",
    "a/..",
    "./a",
    "a/./b",
    "a//b",
    "a/",
    "a\\b",
    "..\\x",
    "a\x00b",
    "a\nb",
    "C:/windows",
    "c:x",
]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_safe_member_names_are_accepted(name: str) -> None:
    assert check_member_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_unsafe_member_names_are_rejected(name: str) -> None:
    with pytest.raises(UnsafePathError):
        check_member_name(name)


@pytest.mark.parametrize("name", [None, b"bytes/name", 3])
def test_non_string_member_names_are_rejected(name: object) -> None:
    with pytest.raises(UnsafePathError):
        check_member_name(name)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab./\\\x00:C")), min_size=0, max_size=12))
def test_any_accepted_name_stays_inside_its_root(
    tmp_path_factory: pytest.TempPathFactory, name: str
) -> None:
    """Property: whatever a name looks like, if it is accepted it cannot leave the root."""
    root = tmp_path_factory.getbasetemp() / "root"
    try:
        check_member_name(name)
    except UnsafePathError:
        return
    target = os.path.realpath(os.path.join(root, name))
    assert target.startswith(os.path.realpath(root) + os.sep)
    assert not os.path.isabs(name)


@pytest.mark.parametrize("key", ["0123abcd", "ab" * 32])
def test_hex_keys_are_accepted(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize(
    "key", ["", "abc", "ABCDEF12", "../../etc", "ab" * 65, "0123abcg", 12345678]
)
def test_non_hex_keys_are_rejected(key: object) -> None:
    with pytest.raises(ValueError):
        check_key(key)


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path) -> None:
    target = tmp_path / "f.bin"
    assert atomic_write(target, b"old")
    assert atomic_write(target, [b"ne", memoryview(b"w")], mode=0o640)
    assert target.read_bytes() == b"new"
    assert oct(target.stat().st_mode & 0o777) == oct(0o640)
    assert os.listdir(tmp_path) == ["f.bin"]


def test_atomic_write_exclusive_keeps_the_first_writer(tmp_path) -> None:
    target = tmp_path / "entry.json"
    assert atomic_write(target, b"first", exclusive=True) is True
    assert atomic_write(target, b"second", exclusive=True) is False
    assert target.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["entry.json"]


def test_atomic_write_failure_removes_its_temp_file(tmp_path, monkeypatch) -> None:
    import compile_cache._paths as paths

    def disk_full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(paths, "_write_all", disk_full)
    with pytest.raises(OSError):
        atomic_write(tmp_path / "x", b"data")
    assert os.listdir(tmp_path) == []


def test_temp_names_are_unique_and_recognisable(tmp_path) -> None:
    a, b = temp_path(tmp_path / "x.pack"), temp_path(tmp_path / "x.pack")
    assert a != b and a.parent == tmp_path
    assert is_temp_name(a.name) and str(os.getpid()) in a.name
    assert not is_temp_name("x.pack")


# -- sizes and ages ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20G", 20 << 30),
        ("512M", 512 << 20),
        ("1.5GiB", int(1.5 * (1 << 30))),
        ("100", 100),
        ("10kb", 10 << 10),
        (" 2 T ", 2 << 40),
        ("0", 0),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["20X", "", "G", "-1G", "1.2.3M", "ten", "nan"])
def test_bad_sizes_raise_config_error_naming_the_value(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text, name="COMPILE_CACHE_MAX_SIZE")
    assert "COMPILE_CACHE_MAX_SIZE" in str(info.value) and repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30d", 30 * 86400),
        ("12h", 12 * 3600),
        ("90m", 5400),
        ("45s", 45),
        ("2w", 14 * 86400),
        ("10", 10),
    ],
)
def test_parse_age(text: str, expected: float) -> None:
    assert parse_age(text) == expected


@pytest.mark.parametrize("text", ["30x", "d", "-3d", "", "1y"])
def test_bad_ages_raise_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="older_than"):
        parse_age(text, name="older_than")


def test_formatting_is_human() -> None:
    assert format_size(512) == "512 B"
    assert format_size(20 << 30) == "20.0 GiB"
    assert format_size(1536) == "1.5 KiB"
    assert format_age(40) == "40s"
    assert format_age(3 * 86400 + 5) == "3d"
    assert format_age(7200) == "2h"
