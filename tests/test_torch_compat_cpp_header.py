"""compile_cache.torch_compat.cpp_header: Inductor's precompiled header, built only when needed.

A restored start must build no header (tests/test_capture.py checks that on fresh nodes); here:
when a kernel really compiles, torch builds the header and runs every compiler command exactly
as it would without the deferral (the ``mlp_capture`` fixture's cold compile, torch as it is,
against the same compile with the deferral, each on its own fresh node; command lines compared
after naming each node's root and torch's random preprocessing dir the same way).
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import drop_precompiled_headers, fresh_node_env, run_mlp_child


def _normalized(commands: list[str], node: Path) -> list[str]:
    root = str(Path(node).resolve())
    out = []
    for command in commands:
        command = command.replace(root, "<NODE>")
        command = re.sub(r"<NODE>/tmp/tmp\w+", "<NODE>/tmp/<TMPDIR>", command)
        out.append(command)
    return sorted(out)


@pytest.fixture(scope="module")
def deferred(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The compile of the ``mlp_capture`` fixture (which runs torch as it is), with the deferral
    and the background header build."""
    tmp = tmp_path_factory.mktemp("cpp_header")
    result = run_mlp_child(tmp / "node", "capture", str(tmp / "pack.pkl"), "--defer",
                           "--background")
    drop_precompiled_headers(tmp)
    return result, tmp / "node"


@pytest.mark.inductor
def test_a_real_compile_builds_the_header_with_the_same_commands(
    mlp_capture: tuple[dict, Path], deferred: tuple[dict, Path]
) -> None:
    (plain, pack), (mine, node) = mlp_capture, deferred
    assert mine["out"] == plain["out"]
    assert mine["header"]["deferred"] >= 1 and mine["header"]["built"] >= 1
    assert plain["header"]["deferred"] == 0
    assert mine["gch"]  # torch built its header: a kernel really compiled
    assert any("c++-header" in c for c in plain["commands"])  # the header build is compared too
    # The background build (COMPILE_CACHE_PREFETCH_HEADER) ran torch's own header build ahead;
    # where it guessed the compile's arguments (every CPU tried here) it is the very same build.
    assert mine["header"]["background"] == 1
    theirs, ours = _normalized(plain["commands"], pack.parent / "node"), _normalized(
        mine["commands"], node)
    if mine["header"]["background_unused"] == 0:
        assert ours == theirs
    else:  # a wrong guess wastes one build, and changes nothing else
        assert all(ours.count(c) >= theirs.count(c) for c in theirs) and len(ours) == len(theirs) + 1


def test_without_what_it_needs_the_deferral_stays_off_with_one_warning(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import warnings
        from torch._inductor import codecache
        from compile_cache.torch_compat import cpp_header
        del codecache._worker_compile_cpp
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            print(cpp_header.install(), cpp_header.install(), cpp_header.installed())
        print(sum("'cpp_header.defer'" in str(w.message) for w in record))
    """)
    done = subprocess.run([sys.executable, "-c", code], env=fresh_node_env(tmp_path / "node"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False", "1"]


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() != "x86_64",
                    reason="the header guess is made on x86-64 Linux only")
def test_the_header_guess_ignores_the_probes_edit_of_torchs_own_isa_object() -> None:
    """The background header starts before the probe, so it must never read an ISA object while
    the probe has edited its flags (AVX512's bf16 check appends ``-mavx512bf16`` for a moment)."""
    from torch._inductor import cpu_vec_isa

    from compile_cache.torch_compat import cpp_header

    clean = cpp_header._guessed_isa()
    assert clean is not None
    theirs = next(isa for isa in cpu_vec_isa.supported_vec_isa_list if type(isa) is type(clean))
    saved = theirs.__dict__.get("_arch_flags")
    theirs._arch_flags = type(theirs)._arch_flags + " -mprobe-is-editing-this"
    try:
        during = cpp_header._guessed_isa()
    finally:
        if saved is None:
            del theirs._arch_flags
        else:
            theirs._arch_flags = saved
    assert during is not theirs
    assert "-mprobe-is-editing-this" not in during.build_arch_flags()
    assert during.build_arch_flags() == clean.build_arch_flags()


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() != "x86_64",
                    reason="the header guess is made on x86-64 Linux only")
def test_the_guessed_header_is_the_one_the_compile_asks_for(tmp_path: Path) -> None:
    """Made before torch's ISA probe runs, the guessed header has exactly the arguments the
    compile asks for after the probe, whenever the probe picks the guessed ISA; when it picks
    another, the arguments differ, so the compile would not take the guessed header."""
    code = textwrap.dedent("""
        from torch._inductor import cpu_vec_isa
        from compile_cache.torch_compat import cpp_header
        guess = cpp_header._guessed_isa()
        guessed = cpp_header._kernel_header_args(guess)
        assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0  # before the probe
        picked = cpu_vec_isa.pick_vec_isa()
        print(type(guess).__name__, type(picked).__name__, guessed == cpp_header._kernel_header_args())
    """)
    done = subprocess.run([sys.executable, "-c", code], env=fresh_node_env(tmp_path / "node"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    guessed, picked, equal = done.stdout.split()
    assert guessed != "NoneType"  # a guess was made, before the probe
    assert equal == str(guessed == picked), done.stdout
