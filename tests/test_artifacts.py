"""Tests of compile_cache.artifacts: fast unit tests, plus one real Inductor end-to-end test.

The end-to-end test compiles a tiny MLP in process A (fresh, empty cache dirs), captures the
files the compile added, restores them in process B (other fresh, empty dirs) and checks that B's
compile is a full local-cache hit with no new ``.so`` built.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
from _store_helpers import tiny_elf
from conftest import run_mlp_child

from compile_cache import UnsafePathError, artifacts

REPO = Path(__file__).resolve().parents[1]


def _dirs(tmp_path: Path) -> dict[str, Path]:
    d = {"inductor": tmp_path / "ind", "triton": tmp_path / "tri"}
    for p in d.values():
        p.mkdir(parents=True, exist_ok=True)
    return d


# ---------------------------------------------------------------------------- restore safety


@pytest.mark.parametrize(
    "name",
    [
        "inductor/../x",
        "../x",
        "/abs/path",
        "inductor//x",
        "inductor/./x",
        "inductor/",
        "inductor",
        "",
        "inductor/a\\..\\b",
        "inductor/a\x00b",
        "nolabel/x",
        "megacache/artifacts.bin",  # the Mega-Cache member of old: an unknown label now
    ],
)
def test_restore_rejects_unsafe_names(tmp_path: Path, name: str) -> None:
    dirs = _dirs(tmp_path)
    members = {"inductor/ok/first": b"x", name: b"bad"}
    with pytest.raises(UnsafePathError) as exc:
        artifacts.restore(members, dirs=dirs)
    assert repr(name)[1:-1][:8] in str(exc.value) or name == ""
    # nothing written, not even the good member that came first
    assert not any(p.is_file() for d in dirs.values() for p in d.rglob("*"))


def test_restore_rejects_symlinked_parent(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (dirs["inductor"] / "ln").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="ln/x"):
        artifacts.restore({"inductor/ok": b"1", "inductor/ln/x": b"evil"}, dirs=dirs)
    assert not (outside / "x").exists()
    assert not (dirs["inductor"] / "ok").exists()


def test_restore_rejects_symlinked_file(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (dirs["inductor"] / "f").symlink_to(victim)
    with pytest.raises(UnsafePathError):
        artifacts.restore({"inductor/f": b"evil"}, dirs=dirs)
    assert victim.read_bytes() == b"keep"


def test_restore_writes_idempotent_and_modes(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path)
    members = {
        "inductor/ab/cab.main.so": b"\x7fELF...",
        "inductor/fxgraph/x/fkey/entry": b"entry",
        "triton/0/kern/k.json": b"{}",
    }
    r1 = artifacts.restore(members, dirs=dirs)
    assert sorted(r1.written) == sorted(members)
    so = dirs["inductor"] / "ab" / "cab.main.so"
    assert so.read_bytes() == b"\x7fELF..."
    assert so.stat().st_mode & 0o100, "shared libraries are restored executable"
    assert not (dirs["inductor"] / "fxgraph/x/fkey/entry").stat().st_mode & 0o111
    assert (dirs["triton"] / "0/kern/k.json").read_bytes() == b"{}"
    mtime = so.stat().st_mtime_ns
    r2 = artifacts.restore(members, dirs=dirs)
    assert r2.written == [] and len(r2.present) == 3 and r2.bytes_written == 0
    assert so.stat().st_mtime_ns == mtime
    # a changed file is replaced; no temporaries are left behind
    r3 = artifacts.restore({"inductor/fxgraph/x/fkey/entry": b"new"}, dirs=dirs)
    assert r3.written == ["inductor/fxgraph/x/fkey/entry"]
    assert not [p for p in dirs["inductor"].rglob("*.tmp")]
    # explicit modes override the rule
    artifacts.restore({"inductor/tool": b"#!"}, modes={"inductor/tool": 0o4755}, dirs=dirs)
    mode = (dirs["inductor"] / "tool").stat().st_mode
    assert mode & 0o100 and not mode & 0o4000, "setuid bits are never restored"


def test_validate_member() -> None:
    assert artifacts.validate_member("inductor/a/b.so") == (
        "inductor",
        artifacts.PurePosixPath("a/b.so"),
    )


# ---------------------------------------------------------------------------- capture


def test_capture_collects_only_new_or_changed(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path)
    ind = dirs["inductor"]
    (ind / "old").write_bytes(b"old")
    (ind / "same").write_bytes(b"same")
    cap = artifacts.Capture(dirs)
    (ind / "old").write_bytes(b"changed, longer")
    (ind / "ab").mkdir()
    (ind / "ab" / "cab.so").write_bytes(tiny_elf(b"so"))
    (ind / "ab" / "linking.so").write_bytes(b"")  # torch's linker at work: left out
    (ind / "ab" / "half.so").write_bytes(tiny_elf(b"so", sections=2)[:-10])  # truncated: left out
    (ind / "ab" / "cab.cpp").write_bytes(b"src")  # build input: not carried
    (ind / "ab" / "cab.o").write_bytes(b"obj")
    (ind / "locks").mkdir()
    (ind / "locks" / "k.lock").write_bytes(b"")
    (ind / "x.lock").write_bytes(b"")
    (ind / ".123.456.tmp").write_bytes(b"partial")
    (ind / "tmpabc").write_bytes(b"tmp")
    (ind / "link").symlink_to(ind / "same")
    (dirs["triton"] / "0").mkdir()
    (dirs["triton"] / "0" / "k.cubin").write_bytes(b"cubin")
    members = cap.collect()
    assert members == {
        "inductor/old": b"changed, longer",
        "inductor/ab/cab.so": tiny_elf(b"so"),
        "triton/0/k.cubin": b"cubin",
    }
    assert cap.recorded == {"inductor/ab/cab.so": {"file_size": len(tiny_elf(b"so"))}}


def test_capture_nested_triton_dir_counted_once(tmp_path: Path) -> None:
    ind = tmp_path / "ind"
    dirs = {"inductor": ind, "triton": ind / "triton"}
    (ind / "triton" / "0").mkdir(parents=True)
    cap = artifacts.Capture(dirs)
    (ind / "triton" / "0" / "k.json").write_bytes(b"{}")
    assert cap.collect() == {"inductor/triton/0/k.json": b"{}"}


def test_local_cache_dirs_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "i"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "t"))
    d = artifacts.local_cache_dirs()
    assert d == {"inductor": tmp_path / "i", "triton": tmp_path / "t"}
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert artifacts.local_cache_dirs()["triton"] == tmp_path / "i" / "triton"



# ---------------------------------------------------------------------------- end to end

@pytest.fixture(scope="session")
def round_trip(
    mlp_capture: tuple[dict, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict, dict, dict]:
    a, pack = mlp_capture
    b = run_mlp_child(tmp_path_factory.mktemp("e2e_restore"), "restore", str(pack))
    with open(pack, "rb") as f:
        members = pickle.load(f)
    return a, b, members


@pytest.mark.inductor
def test_restore_gives_full_hit_on_fresh_dir(round_trip: tuple[dict, dict, dict]) -> None:
    a, b, members = round_trip
    assert a["counters"]["fxgraph_miss"] >= 1
    assert any(k.startswith("inductor/fxgraph/") for k in members)
    assert any(k.endswith(".so") for k in members)
    assert not any(k.endswith((".lock", ".cpp", ".o", ".tmp")) for k in members)
    assert b["written"] == len(members)
    assert b["counters"]["fxgraph_miss"] == 0
    assert b["counters"]["fxgraph_hit"] >= 1
    # nothing rebuilt: process B added no shared library (g++ never ran)
    assert not [k for k in b["added"] if k.endswith(".so")], b["added"]


# ---------------------------------------------------------------------------- ISA probe


def test_restored_libraries_get_the_publishers_probe_answers_and_nothing_else(
    tmp_path, monkeypatch, fresh_state
):
    from torch._inductor import cpu_vec_isa

    probed: list[str] = []

    def torch_probe(self, output_path):  # stands in for torch's child-process load check
        probed.append(output_path)
        return True

    # raising=False: torch 2.11 has no _probe_load (it loads inline in check_build, where the
    # hook then sits; tests/test_torch_compat_isa.py covers that form).
    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", torch_probe, raising=False)
    dirs = _dirs(tmp_path)
    artifacts.restore(
        {"inductor/ab/ok.so": b"\x7fELF ok", "inductor/cd/no.so": b"\x7fELF no"}, dirs=dirs
    )
    published = {"inductor/ab/ok.so": True, "inductor/cd/no.so": False, "inductor/ef/gone.so": True}
    assert artifacts.trust_restored_isa_answers(published) == 2  # gone.so was not restored

    isa = cpu_vec_isa.VecAVX2()
    assert isa._probe_load(str(dirs["inductor"] / "ab" / "ok.so")) is True
    assert isa._probe_load(str(dirs["inductor"] / "cd" / "no.so")) is False  # the publisher's "no"
    assert probed == []  # neither loaded again in a child process
    other = str(tmp_path / "built-here.so")
    assert isa._probe_load(other) is True  # not restored: torch's own probe
    assert probed == [other]


def test_published_probe_answers_are_named_as_pack_members(tmp_path, monkeypatch, fresh_state):
    from compile_cache.torch_compat import isa

    dirs = _dirs(tmp_path)
    assert artifacts.isa_probe_answers(dirs) is None  # nothing observed in a fresh process
    inside = os.path.realpath(dirs["inductor"] / "ab" / "probe.so")
    outside = os.path.realpath(tmp_path / "elsewhere.so")
    monkeypatch.setattr(isa, "observed", lambda: {inside: True, outside: False})
    assert artifacts.isa_probe_answers(dirs) == {"inductor/ab/probe.so": True}


# ---------------------------------------------------------------------------- whole libraries


def test_is_complete_library_rejects_every_truncation_of_a_real_library() -> None:
    import compile_cache._C as native

    data = Path(native.__file__).read_bytes()
    assert artifacts.is_complete_library(data)
    step = max(1, len(data) // 400)
    cuts = [n for n in range(0, len(data), step)] + [len(data) - 1]
    assert not [n for n in cuts if artifacts.is_complete_library(data[:n])]
    assert not artifacts.is_complete_library(b"not a library at all")
