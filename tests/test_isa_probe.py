"""compile_cache.isa_probe: one hook into Inductor's ISA probe, on either torch's form of it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from torch._inductor import cpu_vec_isa

from compile_cache import isa_probe


@pytest.fixture
def fresh_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isa_probe, "_answerers", [])
    monkeypatch.setattr(isa_probe, "_observed", {})
    monkeypatch.setattr(isa_probe, "_counts", {"answered": 0, "asked_torch": 0})


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
