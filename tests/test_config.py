"""compile_cache.config: every COMPILE_CACHE_* variable in one registry, parsed one way per type."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from compile_cache import config
from compile_cache.errors import ConfigError

REPO = str(Path(__file__).resolve().parents[1])

# Each variable: (a good value, what it parses to), and a value it must refuse.
CASES: dict[str, tuple[str, object, str]] = {
    "COMPILE_CACHE_DIR": ("/tmp/cc", "/tmp/cc", ""),  # any path; nothing to refuse
    "COMPILE_CACHE_MAX_SIZE": ("512M", 512 << 20, "20X"),
    "COMPILE_CACHE_SHARED": ("group", True, "world"),
    "COMPILE_CACHE_READ_ONLY": ("yes", True, "maybe"),
    "COMPILE_CACHE_LOCK": ("MKDIR", "mkdir", "posix"),
    "COMPILE_CACHE_SIGNING_KEY": ("hunter2", "hunter2", ""),
    "COMPILE_CACHE_BACKEND": ("python", "python", "bogus"),
    "COMPILE_CACHE_PRECOMPILE": ("on", True, "sometimes"),
    "COMPILE_CACHE_PREFETCH": ("off", False, "later"),
    "COMPILE_CACHE_DEFER_HEADER": ("0", False, "lazy"),
    "COMPILE_CACHE_PREFETCH_HEADER": ("false", False, "early"),
    "COMPILE_CACHE_DISTRIBUTED": ("broadcast", "broadcast", "nfs"),
    "COMPILE_CACHE_BROADCAST_SCOPE": ("node", "node", "host"),
    "COMPILE_CACHE_WAIT_TIMEOUT": ("2.5", 2.5, "-1"),
    "COMPILE_CACHE_LOCK_TIMEOUT": ("10", 10.0, "soon"),
    "COMPILE_CACHE_LOCK_STALE": ("30", 30.0, "0"),
    "COMPILE_CACHE_MAX_PACK_SIZE": ("512M", 512 << 20, "0"),
    "COMPILE_CACHE_MAX_PACK_MEMBERS": ("5_000", 5000, "-3"),
    "COMPILE_CACHE_MAX_MEMBER_NAME": ("300", 300, "8"),
    "COMPILE_CACHE_TRUST_LOCAL_DIRS": ("yes", True, "perhaps"),
    "COMPILE_CACHE_LOCAL_TIER": ("/scratch/tier", "/scratch/tier", ""),
    "COMPILE_CACHE_REMOTE_RETRIES": ("3", 3, "many"),
    "COMPILE_CACHE_REMOTE_TIMEOUT": ("2.5", 2.5, "-1"),
    "COMPILE_CACHE_REMOTE_FIRST_TIMEOUT": ("1.5", 1.5, "0"),
    "COMPILE_CACHE_S3_CLIENT": ("S3FS", "s3fs", "boto3"),
    "COMPILE_CACHE_REMOTE_CLIENT": ("FSSPEC", "fsspec", "obstore"),
    "COMPILE_CACHE_PACK_COMPRESSION": ("9", 9, "20"),
    "COMPILE_CACHE_RUN_NAME": ("gen-1.b", "gen-1.b", "../x"),
    "COMPILE_CACHE_RUN_DIR": ("/shared/cc", "/shared/cc", ""),  # any path or URL
}


def test_the_registry_holds_every_variable_the_package_mentions() -> None:
    assert set(config.VARIABLES) == set(CASES)
    mentioned: set[str] = set()
    for path in (Path(REPO) / "compile_cache").rglob("*.py"):
        mentioned.update(re.findall(r"COMPILE_CACHE_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    assert mentioned <= set(CASES), sorted(mentioned - set(CASES))


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_variable_parses_its_value_and_defaults_when_unset(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    variable = config.VARIABLES[name]
    good, parsed, _ = CASES[name]
    monkeypatch.delenv(name, raising=False)
    assert variable.value() == variable.default and variable.source == "default"
    monkeypatch.setenv(name, "  ")  # empty means the default, for every type
    assert variable.value() == variable.default
    monkeypatch.setenv(name, good)
    assert variable.value() == parsed and variable.source == "environment"


@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if case[2]))
def test_a_bad_value_names_the_variable_the_value_and_what_is_right(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    variable = config.VARIABLES[name]
    bad = CASES[name][2]
    monkeypatch.setenv(name, bad)
    with pytest.raises(ConfigError) as info:
        variable.value()
    text = str(info.value)
    assert name in text and repr(bad) in text and variable.allowed in text


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "On", " on "])
def test_one_boolean_parser_true(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (config.READ_ONLY, config.PRECOMPILE, config.PREFETCH):
        monkeypatch.setenv(variable.name, text)
        assert variable.value() is True


@pytest.mark.parametrize("text", ["0", "false", "No", "OFF"])
def test_one_boolean_parser_false(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (config.READ_ONLY, config.PRECOMPILE, config.PREFETCH):
        monkeypatch.setenv(variable.name, text)
        assert variable.value() is False


def test_aliases_keep_their_meaning(monkeypatch: pytest.MonkeyPatch) -> None:
    for text in ("0", "no", "false", "none"):
        monkeypatch.setenv("COMPILE_CACHE_DISTRIBUTED", text)
        assert config.DISTRIBUTED.value() == "off"
    for text in ("private", "user", "0", "off"):
        monkeypatch.setenv("COMPILE_CACHE_SHARED", text)
        assert config.SHARED.value() is False
    monkeypatch.setenv("COMPILE_CACHE_MAX_SIZE", "0")
    assert config.MAX_SIZE.value() == 0  # no cap


def test_an_argument_is_parsed_by_the_same_rule_and_named_in_the_error() -> None:
    assert config.DISTRIBUTED.parse("Broadcast", "distributed") == "broadcast"
    with pytest.raises(ConfigError, match="distributed='nfs'.*shared, broadcast, off"):
        config.DISTRIBUTED.parse("nfs", "distributed")


def test_describe_shows_every_variable_with_source_and_hides_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COMPILE_CACHE_SIGNING_KEY", "hunter2")
    monkeypatch.setenv("COMPILE_CACHE_LOCK", "posix")
    monkeypatch.delenv("COMPILE_CACHE_MAX_SIZE", raising=False)
    rows = {row["name"]: row for row in config.describe()}
    assert set(rows) == set(CASES)
    assert rows["COMPILE_CACHE_SIGNING_KEY"]["value"] == "set"
    assert "hunter2" not in str(rows)
    assert rows["COMPILE_CACHE_MAX_SIZE"]["source"] == "default"
    assert rows["COMPILE_CACHE_MAX_SIZE"]["default"] == "20.0 GiB"
    assert rows["COMPILE_CACHE_LOCK"]["source"] == "environment"
    assert "COMPILE_CACHE_LOCK='posix'" in rows["COMPILE_CACHE_LOCK"]["error"]
    assert all(row["meaning"] and row["allowed"] for row in rows.values())


def test_bad_values_are_raised_at_first_use_not_at_import() -> None:
    """Every variable set to garbage: importing the package (and the store's CLI) still works."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env.update({name: case[2] or "x" for name, case in CASES.items()})
    env["PYTHONPATH"] = REPO
    code = (
        "import compile_cache, compile_cache.config, compile_cache.store, compile_cache.cli\n"
        "print('imported')\n"
        "try:\n"
        "    compile_cache.config.MAX_SIZE.value()\n"
        "except compile_cache.ConfigError as exc:\n"
        "    print('first use:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "imported"
    assert "COMPILE_CACHE_MAX_SIZE='20X'" in lines[1]


def _reads_environ(node: ast.AST) -> bool:
    """``os.environ.get(...)``, ``os.environ[...]``, ``os.getenv(...)``, ``environ.pop(...)``."""
    target = node.func if isinstance(node, ast.Call) else getattr(node, "value", None)
    text = ast.unparse(target) if target is not None else ""
    return re.search(r"(^|\.)environ(\.\w+)?$|(^|\.)getenv$", text) is not None


def test_no_module_but_config_reads_a_compile_cache_variable() -> None:
    offenders = []
    for path in (Path(REPO) / "compile_cache").rglob("*.py"):
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Call, ast.Subscript)) and _reads_environ(node):
                names = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)
                         and isinstance(c.value, str) and c.value.startswith("COMPILE_CACHE_")]
                if names:
                    offenders.append(f"{path.name}:{node.lineno}: {names}")
    assert offenders == []


# -- strict at first use: a bad value stops the compile with one line, never turns the store off ---
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("COMPILE_CACHE_MAX_SIZE", "abc"),
        ("COMPILE_CACHE_WAIT_TIMEOUT", "-5"),
        ("COMPILE_CACHE_DISTRIBUTED", "bogus"),
        ("COMPILE_CACHE_PREFETCH", "banana"),
        ("COMPILE_CACHE_BACKEND", "rust"),
    ],
)
def test_a_bad_value_stops_compile_regions_instead_of_turning_the_store_off(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_state: None,
    dynamo_reset: None,
) -> None:
    import torch

    import compile_cache

    for other in config.VARIABLES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    before = compile_cache.last_report()
    with pytest.raises(ConfigError) as info:
        compile_cache.compile_regions(model, cache_dir=tmp_path / "store", backend="eager")
    text = str(info.value)
    assert "\n" not in text and f"{name}={value!r}" in text and config.VARIABLES[name].allowed in text
    assert compile_cache.last_report() is before
    assert not list((tmp_path / "store").rglob("*.pack"))


def test_a_bad_backend_is_raised_at_the_first_fingerprint_not_at_import() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env.update(COMPILE_CACHE_BACKEND="rust", PYTHONPATH=REPO)
    code = (
        "import compile_cache\n"
        "print('imported')\n"
        "import torch\n"
        "try:\n"
        "    compile_cache.fingerprint(torch.nn.Linear(2, 2))\n"
        "except compile_cache.ConfigError as exc:\n"
        "    print('first fingerprint:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "imported", "first fingerprint: COMPILE_CACHE_BACKEND='rust' is not a valid value: "
        "expected 'native' or 'python'"]
