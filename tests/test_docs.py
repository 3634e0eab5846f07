"""The docs: the generated reference matches the code, and the project speaks of itself.

The docs site itself is built strictly by ``make docs`` (part of ``make test``, before pytest).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))

import gen_reference  # noqa: E402

THIS = os.path.abspath(__file__)


@pytest.mark.parametrize("page", sorted(gen_reference.PAGES))
def test_reference_page_matches_the_code(page):
    """docs/reference/*.md is what the config registry and the CLI parsers give today: a new
    variable or flag without `python docs/gen_reference.py` fails here."""
    with open(os.path.join(ROOT, "docs", "reference", page), encoding="utf-8") as f:
        committed = f.read()
    assert committed == gen_reference.PAGES[page](), f"run python docs/gen_reference.py ({page})"


def test_reference_lists_every_variable_and_every_flag():
    from compile_cache import config
    from compile_cache.cli.main import build_parser

    env = gen_reference.env_page()
    for name in config.VARIABLES:
        assert f"| `{name}` |" in env, name
    cli = gen_reference.cli_page()
    help_text = build_parser().format_help()
    for command in ("warm", "ls", "stats", "verify", "prune", "clear", "export", "import",
                    "explain", "run", "doctor"):
        assert command in help_text and f"\n## {command}\n" in cli, command
    assert "`--older-than` `AGE`" in cli and "`--whole-model`" in cli


def test_reference_check_mode_reports_a_stale_page(tmp_path, monkeypatch):
    monkeypatch.setattr(gen_reference, "OUT", str(tmp_path))
    (tmp_path / "env.md").write_text("stale\n")
    assert gen_reference.main(["--check"]) == 1
    assert (tmp_path / "env.md").read_text() == "stale\n"  # --check writes nothing
    assert gen_reference.main([]) == 0 and gen_reference.main(["--check"]) == 0


# -- the project speaks of itself ----------------------------------------------------------------

# How the work on the project was organised is not the project. These catch that sense only:
# the product's own "session" (CacheSession, open_session, "every session" of a process), its
# "leader" and "follower" ranks, third-party names (requests.Session) and test helper modules
# are not matched.
PROCESS_WORDS = [
    re.compile(r"\bsessions?\s+\d+", re.IGNORECASE),  # "session 15"
    re.compile(r"\b(this|that|earlier|previous|next|last|later)\s+session('s)?\b", re.IGNORECASE),
    re.compile(r"\bhelper\s+sessions?\b", re.IGNORECASE),
    re.compile(r"\bhelper'?s?\s+(tests|benchmarks|branch|report|run)\b", re.IGNORECASE),
    re.compile(r"\bthe\s+lead\b(?!ing|er)", re.IGNORECASE),
    re.compile(r"\blead's\b", re.IGNORECASE),
    re.compile(r"\bleases?\b", re.IGNORECASE),
    re.compile(r"\bdevice\s+tool\b", re.IGNORECASE),
]
SCANNED_DIRS = ("compile_cache", "tests", "benchmarks", "docs", "csrc")
SCANNED_FILES = ("README.md", "Makefile", "pyproject.toml", "setup.py", "constraints.txt")
SUFFIXES = (".py", ".md", ".sh", ".cpp", ".h", ".json", ".toml", ".txt", ".cfg", ".html")
SKIPPED_DIRS = {"__pycache__", "_build", "third_party", ".venv"}


def _scanned() -> list[str]:
    paths = [os.path.join(ROOT, name) for name in SCANNED_FILES]
    for top in SCANNED_DIRS:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
            paths += [os.path.join(folder, f) for f in sorted(files) if f.endswith(SUFFIXES)]
    return [p for p in paths if os.path.isfile(p) and os.path.abspath(p) != THIS]


def process_mentions(text: str) -> list[str]:
    """The phrases of ``text`` that speak of how the work was organised, not of the project."""
    return [m.group(0) for pattern in PROCESS_WORDS for m in pattern.finditer(text)]


def test_words_catch_the_process_sense_only():
    for text in ("measured in session 15", "Sessions 18 and 19", "this session's branch",
                 "the lead's idle rerun", "as the lead reran it", "one 15-minute lease",
                 "the device tool's status", "a helper's tests ran", "four helper sessions"):
        assert process_mentions(text), text
    for text in ("CacheSession", "open_session(model)", "every session of the process",
                 "the session's publisher", "the leader rank", "a follower waits",
                 "requests.Session()", "aiohttp.ClientSession", "tests/_cli_helpers.py",
                 "an lru_cache helper's __wrapped__", "leading dimension",
                 "released", "please"):
        assert not process_mentions(text), text


def test_the_project_speaks_of_itself():
    """No docs, code, comment, benchmark or test names the working process: history is named
    by a commit or a date."""
    found = []
    for path in _scanned():
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                found += [f"{os.path.relpath(path, ROOT)}:{number}: {hit!r}"
                          for hit in process_mentions(line)]
    assert not found, "\n".join(found)


def test_gen_reference_runs_without_torch():
    """The reference comes from modules that do not import torch, so generating it is cheap."""
    code = ("import sys; sys.path.insert(0, 'docs'); import gen_reference; "
            "gen_reference.env_page(); gen_reference.cli_page(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
