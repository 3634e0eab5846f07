"""compile_cache.torch_compat.isa: one hook into Inductor's ISA probe, on either torch's form of
it, and the builds done ahead of torch's probe (the prefetch's mechanism)."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from torch._inductor import cpu_vec_isa
from torch.utils._filelock import FileLock

from compile_cache.torch_compat import isa as isa_probe


@pytest.fixture
def fresh_hook(fresh_state: None) -> None:
    """No answerer, nothing observed, counts at zero."""


def test_torch_2_13_form_answers_known_libraries_and_asks_torch_for_the_rest(
    monkeypatch: pytest.MonkeyPatch, fresh_hook: None, tmp_path: Path
) -> None:
    torch_loads: list[str] = []

    def torch_probe_load(self: Any, output_path: str) -> bool:
        torch_loads.append(output_path)
        return True

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", torch_probe_load, raising=False)
    known = os.path.realpath(tmp_path / "known.so")
    assert isa_probe.add_answerer(lambda isa, path: False if path == known else None)
    assert isa_probe.watch()  # installed once: a second install does not wrap the hook again

    isa = cpu_vec_isa.VecAVX2()
    other = str(tmp_path / "other.so")
    assert isa._probe_load(str(tmp_path / "known.so")) is False
    assert isa._probe_load(other) is True
    assert torch_loads == [other]
    assert isa_probe.counts() == {"answered": 1, "asked_torch": 1}
    assert isa_probe.observed() == {known: False, os.path.realpath(other): True}
    assert isa_probe.torch_load_probe() is torch_probe_load  # torch's own, not the hook


def test_torch_2_11_form_hooks_check_build(
    monkeypatch: pytest.MonkeyPatch, fresh_hook: None, tmp_path: Path
) -> None:
    """torch 2.11 has no _probe_load: it builds and loads inside check_build."""
    checked: list[str] = []

    def torch_check_build(self: Any, code: str) -> bool:
        checked.append(code)
        return True

    monkeypatch.delattr(cpu_vec_isa.VecISA, "_probe_load", raising=False)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", torch_check_build)
    libraries = {"known code": str(tmp_path / "known.so"), "other code": str(tmp_path / "o.so")}
    monkeypatch.setattr(isa_probe, "library_path", lambda isa, code: ("k", None, libraries[code]))
    known = os.path.realpath(libraries["known code"])
    assert isa_probe.add_answerer(lambda isa, path: True if path == known else None)

    isa = cpu_vec_isa.VecAVX2()
    assert isa.check_build("known code") is True
    assert checked == []  # answered: torch neither built nor loaded it
    assert isa.check_build("other code") is True
    assert checked == ["other code"]
    assert isa_probe.counts() == {"answered": 1, "asked_torch": 1}


def test_torch_2_14_form_observes_a_library_answered_from_its_load_ok_marker(
    monkeypatch: pytest.MonkeyPatch, fresh_hook: None, tmp_path: Path
) -> None:
    """torch >= 2.14: check_build answers from ``<library>.load_ok`` without calling _probe_load
    (a machine that probed before): the library is observed all the same, so a warm publisher's
    pack carries it and a fresh node does not build, probe and publish it again."""
    library = tmp_path / "isa.so"
    library.write_bytes(b"\x7fELF")
    loads: list[str] = []

    def torch_probe_load(self: Any, output_path: str) -> bool:
        loads.append(output_path)
        return True

    def torch_check_build(self: Any, code: str) -> bool:  # torch 2.14's shape, build done
        marker = str(library) + ".load_ok"
        if os.path.isfile(marker):
            return True
        ok = self._probe_load(str(library))
        if ok:
            Path(marker).write_text("")
        return ok

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", torch_probe_load, raising=False)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", torch_check_build)
    monkeypatch.setattr(isa_probe, "library_path", lambda isa, code: ("k", None, str(library)))
    assert isa_probe.watch()
    isa = cpu_vec_isa.VecAVX2()
    assert isa.check_build("code") is True  # a new machine: torch's probe, through the hook
    assert loads == [str(library)]
    isa_probe._reset()  # a later process on the same machine
    assert isa.check_build("code") is True
    assert loads == [str(library)]  # the marker answered: no probe
    assert isa_probe.observed() == {os.path.realpath(library): True}
    assert isa_probe.counts() == {"answered": 0, "asked_torch": 0}


def test_torch_2_11_load_check_runs_torchs_child_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Torch's own child-process command, with the library path put in as torch puts it."""
    child = "import os, sys\nsys.exit(os.path.basename('__lib_path__') != 'loads.so')"
    monkeypatch.delattr(cpu_vec_isa.VecISA, "_probe_load", raising=False)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "_avx_py_load", child, raising=False)
    load = isa_probe.torch_load_probe()
    assert load is not None
    assert load(None, str(tmp_path / "loads.so")) is True
    assert load(None, str(tmp_path / "fails.so")) is False


# ---------------------------------------------------------------- builds ahead of torch's probe


class _FakeBuilder:
    """Stands in for torch's CppBuilder: 'builds' by writing the target, or fails."""

    def __init__(self, target: Path, fail: bool = False) -> None:
        self.target, self.fail, self.builds = target, fail, 0

    def get_target_file_path(self) -> str:
        return str(self.target)

    def build(self) -> None:
        self.builds += 1
        if self.fail:
            raise RuntimeError("g++: error: unrecognized command-line option '-mavx9000'")
        self.target.write_bytes(b"\x7fELF")


@pytest.fixture
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from torch._inductor.codecache import get_lock_dir

    return Path(get_lock_dir())


def test_a_library_torch_is_already_building_is_left_to_torch(tmp_path: Path, lock_dir: Path) -> None:
    builder = _FakeBuilder(tmp_path / "probe.so")
    answer: Future[bool | None] = Future()
    with FileLock(str(lock_dir / "k1.lock")):  # torch's check_build holds its lock
        outcome = isa_probe.build_and_load("k1", builder, None, lambda isa, path: True, answer)
    assert outcome == "busy"
    assert builder.builds == 0
    assert answer.result(timeout=1) is None  # torch probes it itself: no deadlock, no guess


def test_a_failed_build_leaves_the_decision_to_torch(tmp_path: Path, lock_dir: Path) -> None:
    builder = _FakeBuilder(tmp_path / "probe.so", fail=True)
    answer: Future[bool | None] = Future()
    outcome = isa_probe.build_and_load("k2", builder, None, lambda isa, path: True, answer)
    assert outcome == "failed"
    assert answer.result(timeout=1) is None
    assert not (tmp_path / "probe.so").exists()


def test_the_answer_is_torchs_own_load_of_the_built_library(tmp_path: Path, lock_dir: Path) -> None:
    loads: list[str] = []

    def torch_load(isa: object, path: str) -> bool:
        loads.append(path)
        return False  # e.g. the library built but does not load on this CPU

    builder = _FakeBuilder(tmp_path / "probe.so")
    answer: Future[bool | None] = Future()
    assert isa_probe.build_and_load("k3", builder, None, torch_load, answer) == "built"
    assert answer.result(timeout=1) is False
    assert loads == [str(tmp_path / "probe.so")]
    # Present already (an earlier process built it): not rebuilt, still loaded once more.
    again: Future[bool | None] = Future()
    assert isa_probe.build_and_load("k3", builder, None, torch_load, again) == "present"
    assert builder.builds == 1
