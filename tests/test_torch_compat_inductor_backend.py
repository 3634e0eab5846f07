"""compile_cache.torch_compat.inductor_backend: ``torch.compile``'s Inductor backend without
importing Inductor's compile stack before a graph compiles, and with nothing else changed.

What must hold: the subclass is torch's wrapper but for how ``get_compiler_config()`` reads the
same dict; inside the context ``torch.compile`` builds it and imports no ``compile_fx`` (a fresh
process, checked against a plain ``torch.compile`` that does); torch's global comes back; and a
graph compiled through it has the FX-graph and AOTAutograd keys, and the precompile entry, of
torch's own wrapper (one real Inductor compile). The fresh node that restores everything and
imports none of it is in tests/test_precompile.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from compile_cache import torch_compat
from compile_cache.torch_compat import TorchCompatWarning, inductor_backend
from compile_cache.torch_compat import precompile as pc
from compile_cache.torch_compat.inductor_backend import config_without_compile_stack

pytestmark = pytest.mark.usefixtures("fresh_state", "dynamo_reset")

REPO = Path(__file__).resolve().parents[1]
BASE = torch._TorchCompileInductorWrapper
SETTINGS: list[tuple[str | None, dict[str, Any] | None, bool | None, str | None]] = [
    (None, None, None, None),
    ("default", None, False, None),
    ("max-autotune-no-cudagraphs", None, None, "region"),
    (None, {"max_autotune": True}, True, None),  # (no cudagraphs: torch would set env vars)
    (None, {"freezing": True, "epilogue_fusion": False}, None, "r"),
]


def _double_plus_one(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 2 + 1


@pytest.mark.parametrize(("mode", "options", "dynamic", "name"), SETTINGS)
def test_the_wrapper_is_torchs_but_for_how_it_reads_its_config(
    mode: str | None, options: dict[str, Any] | None, dynamic: bool | None, name: str | None,
) -> None:
    ours_cls = inductor_backend.InductorWrapper
    ours = ours_cls(mode, dict(options or {}) or None, dynamic, name)
    theirs = BASE(mode, dict(options or {}) or None, dynamic, name)
    assert ours_cls.__bases__ == (BASE,) and isinstance(ours, BASE)
    assert ours.config == theirs.config and ours.dynamic == theirs.dynamic
    assert ours.name == theirs.name and ours.compiler_name == "inductor"
    assert ours == theirs and theirs == ours
    # compiling is torch's own method: compile_fx with the same patches, so the same keys
    assert ours_cls.__call__ is BASE.__call__ and ours_cls.reset is BASE.reset
    assert [n for n in vars(ours_cls) if not n.startswith("__")] == ["get_compiler_config"]
    assert ours.get_compiler_config() == theirs.get_compiler_config()  # imports compile_fx here
    config = ours.get_compiler_config()
    assert all(config[k] == v for k, v in (options or {}).items())  # the patches are applied


def test_torch_compile_builds_it_inside_and_gets_its_own_back_after() -> None:
    assert torch._TorchCompileInductorWrapper is BASE
    with config_without_compile_stack():
        assert torch._TorchCompileInductorWrapper is inductor_backend.InductorWrapper
        with config_without_compile_stack():  # reentrant
            compiled = torch.compile(_double_plus_one)
        assert torch._TorchCompileInductorWrapper is inductor_backend.InductorWrapper
    assert torch._TorchCompileInductorWrapper is BASE
    assert compiled.get_compiler_config() == torch.compile(_double_plus_one).get_compiler_config()

    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with config_without_compile_stack():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert inside.wait(30)
    with config_without_compile_stack():
        pass  # ends first: the other thread still uses it
    assert torch._TorchCompileInductorWrapper is inductor_backend.InductorWrapper
    release.set()
    thread.join(30)
    assert torch._TorchCompileInductorWrapper is BASE


def test_someone_elses_wrapper_is_left_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    class Theirs(BASE):  # type: ignore[misc, valid-type]
        pass

    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", Theirs)
    with config_without_compile_stack():
        assert torch._TorchCompileInductorWrapper is Theirs
    assert torch._TorchCompileInductorWrapper is Theirs


def test_missing_it_leaves_torch_compile_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BASE, "get_compiler_config", lambda self: {})  # no longer what we copy
    torch_compat._reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with config_without_compile_stack():
            assert torch._TorchCompileInductorWrapper is BASE
    messages = [str(w.message) for w in record if issubclass(w.category, TorchCompatWarning)]
    assert len(messages) == 1 and repr(inductor_backend.CAPABILITY) in messages[0]
    assert inductor_backend.CAPABILITY in torch_compat.degraded()


def test_the_stand_in_is_torchs_minifier_wrapper_until_a_graph_compiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside the context ``get_compiler_fn`` is torch's (same file and lines) but for where
    ``wrap_backend_debug`` comes from: torch's wrapper while after_dynamo is imported, else the
    stand-in, with the attributes torch's wrapper has; a call builds torch's wrapper and goes
    through it; torch's function comes back after."""
    from torch._dynamo import eval_frame
    from torch._dynamo.repro.after_dynamo import WrapBackendDebug

    torchs = eval_frame.get_compiler_fn
    calls: list[int] = []

    def record(gm: Any, example_inputs: list[Any]) -> Any:
        calls.append(len(example_inputs))
        return gm.forward

    with config_without_compile_stack():
        light = eval_frame.get_compiler_fn
        assert light is not torchs and light.__code__.co_filename == torchs.__code__.co_filename
        assert light.__code__.co_firstlineno == torchs.__code__.co_firstlineno
        assert max(line for *_, line in light.__code__.co_lines() if line) \
            == max(line for *_, line in torchs.__code__.co_lines() if line)
        assert type(light(record)) is WrapBackendDebug  # after_dynamo imported: torch's
        monkeypatch.delitem(sys.modules, "torch._dynamo.repro.after_dynamo")
        # (a backend named by a string other than "inductor" is looked up in torch's registry,
        # whose first lookup imports after_dynamo itself)
        for backend in (record, torch._TorchCompileInductorWrapper("default", {}, False)):
            ours = light(backend)
            monkeypatch.undo()
            theirs = torchs(backend)
            assert type(ours) is inductor_backend.BackendDebug
            assert set(vars(ours)) - set(vars(theirs)) == {"_torch_wrapper"}
            for name, value in vars(theirs).items():
                assert getattr(ours, name) == value, name
            monkeypatch.delitem(sys.modules, "torch._dynamo.repro.after_dynamo")
        ours = light(record)
        monkeypatch.undo()
    assert eval_frame.get_compiler_fn is torchs
    assert type(ours) is inductor_backend.BackendDebug and ours._torch_wrapper is None
    gm = torch.fx.symbolic_trace(_double_plus_one)
    out = ours(gm, [torch.ones(2)])
    assert calls == [1] and type(ours._torch_wrapper) is WrapBackendDebug
    assert ours._torch_wrapper._torchdynamo_orig_backend is record
    torch.testing.assert_close(out(torch.ones(2)), _double_plus_one(torch.ones(2)))


def test_a_fresh_process_imports_no_compile_stack_until_a_graph_compiles(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import sys
        import torch
        from compile_cache.torch_compat.inductor_backend import config_without_compile_stack

        def f(x):
            return x + 1

        calls = []

        def record(gm, example_inputs):
            calls.append(len(example_inputs))
            return gm.forward

        with config_without_compile_stack():
            wrapped = torch.compile(f)
            recorded = torch.compile(f, backend=record)
            print("inside", "torch._inductor.compile_fx" in sys.modules,
                  "torch._dynamo.repro.after_dynamo" in sys.modules, "networkx" in sys.modules)
            # a graph compiles: torch's minifier wrapper is built, and calls the backend
            print("called", int(recorded(torch.ones(1))), calls,
                  "torch._dynamo.repro.after_dynamo" in sys.modules)
            import torch._inductor.select_algorithm  # what restored kernels' code imports
        from torch._inductor.kernel.bmm import bmm_template
        print("lazy", type(bmm_template.template).__name__, bmm_template.template._template is None)
        config = wrapped.get_compiler_config()
        torch.compile(f)
        print("plain", "torch._inductor.compile_fx" in sys.modules)
        from torch._inductor.compile_fx import get_patched_config_dict
        print("same", config == get_patched_config_dict())
        from torch._inductor.codegen.common import KernelTemplate
        print("after", type(KernelTemplate._template_from_string("x")).__name__)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    # a plain torch.compile does import compile_fx, and templates are torch's again after: the
    # checks can fail
    assert done.stdout.split() == ["inside", "False", "False", "False", "called", "2", "[1]", "True",
                                   "lazy", "_LazyTemplate", "True",
                                   "plain", "True", "same", "True", "after", "Template"]


def test_a_lazy_template_renders_what_torchs_renders() -> None:
    from torch._inductor.codegen.common import KernelTemplate, jinja2_env

    source = "def {{ name }}(x):\n{{ body | indent_except_first(1) }}\n    return {{ out }}"
    values = {"name": "kernel", "body": "y = x + 1\ny = y * 2", "out": "y"}
    theirs = KernelTemplate._template_from_string(source)
    with config_without_compile_stack():
        ours = KernelTemplate._template_from_string(source)
        jinja2_env().filters.pop("indent_except_first")  # as a fresh process has it
        later = KernelTemplate._template_from_string(source)
    assert type(ours).__name__ == "_LazyTemplate" and ours._template is None
    assert ours.render(**values) == theirs.render(**values) and ours._template is not None
    assert later.render(**values) == theirs.render(**values)  # the filter was put back at once
    assert "indent_except_first" in jinja2_env().filters
    import jinja2

    with pytest.raises(jinja2.UndefinedError):  # StrictUndefined, as torch's
        ours.render(name="k")
    assert type(KernelTemplate._template_from_string(source)) is type(theirs)  # torch's again


def _spy_keys(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The FX-graph and AOTAutograd cache keys torch computes from now on, in order."""
    import torch._functorch._aot_autograd.autograd_cache as aot_cache
    import torch._inductor.codecache as codecache

    keys: list[tuple[str, str]] = []

    def spy(kind: str, module: Any, name: str) -> None:
        original = getattr(module, name)

        def computed(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            keys.append((kind, result[0]))
            return result

        monkeypatch.setattr(module, name, computed)

    spy("fx", codecache, "compiled_fx_graph_hash")
    spy("aot", aot_cache, "autograd_cache_key")
    return keys


def test_keys_and_entries_are_those_of_torchs_own_wrapper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One real Inductor compile with torch's wrapper; the same function compiled through ours
    computes the same FX-graph and AOTAutograd keys (and hits both); a precompile entry that ours
    saved loads through torch's wrapper and traces nothing."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    keys = _spy_keys(monkeypatch)
    x = torch.randn(4, 8)
    torch.testing.assert_close(torch.compile(_double_plus_one)(x), _double_plus_one(x))
    assert counters["inductor"]["fxgraph_cache_miss"] == 1  # it compiled
    theirs = list(keys)
    assert [kind for kind, _ in theirs] == ["aot", "fx"]

    torch._dynamo.reset()
    counters.clear()
    keys.clear()
    with config_without_compile_stack():
        compiled = torch.compile(_double_plus_one)
    torch.testing.assert_close(compiled(x), _double_plus_one(x))
    assert counters["frames"]["ok"] == 1  # traced again, ...
    assert keys == theirs[:1]  # ... the same AOTAutograd key: a hit, so no FX lookup at all
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert counters["inductor"]["fxgraph_cache_miss"] == 0

    # with precompile (whose AOTAutograd keys change from call to call in torch 2.13, with
    # either wrapper): the same FX key, and an entry saved through ours loads through torch's
    torch._dynamo.reset()
    counters.clear()
    keys.clear()
    with config_without_compile_stack():
        ours = pc.PrecompiledFunction(_double_plus_one, {})
    torch.testing.assert_close(ours(x), _double_plus_one(x))
    assert ("fx", theirs[1][1]) in keys and counters["inductor"]["fxgraph_cache_miss"] == 0
    assert Path(ours.entry_path()).exists()  # saved at the end of the call that traced it

    torch._dynamo.reset()
    counters.clear()
    record = {"pins": ours.pins.described(), "values": ours.graph_records()}
    loaded = pc.PrecompiledFunction(_double_plus_one, {}, record=record)
    assert loaded.status == "loaded"
    torch.testing.assert_close(loaded(x), _double_plus_one(x))
    assert counters["frames"]["ok"] == 0
