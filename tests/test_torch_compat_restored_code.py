"""compile_cache.torch_compat.restored_code: restored Inductor code loads without importing the
code generator, and runs the same kernels.

What must hold: the stand-in ``extern_kernels`` gives, for every name it knows, the very object
torch's own namespace holds (and any other name from torch's); the exchanged header lines import
the same ``_align``; a module is changed only while the module its line imports is not imported,
line for line; torch's ``cache_hit_post_compile`` recompiled keeps its file, line numbers and
behaviour (it still calls ``GraphLowering.save_output_code`` when a test set it); torch's
``CompiledFxGraph.__call__`` recompiled keeps its file and lines, records the graph execution
order as torch's does, and runs where ``torch._inductor.debug`` is not imported. The fresh node
that restores everything and imports none of those modules is in tests/test_precompile.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fresh_node_env

from compile_cache.torch_compat import module_source, restored_code

HEADER = [
    "import torch",
    "from torch._inductor.hooks import run_intermediate_hooks",
    "from torch._inductor.utils import maybe_profile",
    "from torch._inductor.codegen.memory_planning import _align as align",
    "from torch import device, empty_strided",
    "from torch._inductor.async_compile import AsyncCompile",
    "from torch._inductor.select_algorithm import extern_kernels",
    "",
    "def call(a, b, c):",
    "    return extern_kernels.addmm(c, a, b), align(3)",
]


@pytest.fixture
def torchs_own_code() -> Iterator[None]:
    """torch's own functions for the test, whatever an earlier test of the process installed
    (install swaps their ``__code__`` in place); put back as it was after."""
    was = restored_code.installed()
    restored_code.uninstall()
    try:
        yield
    finally:
        if was:
            restored_code.install()


def test_the_stand_in_holds_torchs_own_kernels() -> None:
    from torch._inductor.codegen.memory_planning import _align
    from torch._inductor.select_algorithm import extern_kernels

    stand_in = restored_code._ExternKernels()
    for name in restored_code._KNOWN:
        assert getattr(stand_in, name) is getattr(extern_kernels, name), name
    # a name it does not know comes from torch's namespace
    assert stand_in.mm_dtype is extern_kernels.mm_dtype
    with pytest.raises(AttributeError):
        stand_in.no_such_kernel  # noqa: B018
    from torch._inductor.utils import _align as utils_align

    assert _align is utils_align


def test_lines_are_exchanged_only_while_their_module_is_not_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = "\n".join(HEADER)
    import torch._inductor.codegen.memory_planning  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401

    assert restored_code.lighten(source) == source  # both imported: torch's lines
    monkeypatch.delitem(sys.modules, "torch._inductor.select_algorithm")
    light = restored_code.lighten(source).split("\n")
    assert len(light) == len(HEADER)
    assert [i for i, (a, b) in enumerate(zip(light, HEADER, strict=True)) if a != b] == [6]
    assert light[6] == ("from compile_cache.torch_compat.restored_code import EXTERN_KERNELS "
                        "as extern_kernels")
    monkeypatch.delitem(sys.modules, "torch._inductor.codegen.memory_planning")
    light = restored_code.lighten(source).split("\n")
    assert [i for i, (a, b) in enumerate(zip(light, HEADER, strict=True)) if a != b] == [3, 6]
    assert light[3] == "from torch._inductor.utils import _align as align"
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(light), "<restored>", "exec"), namespace)  # noqa: S102
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    out, aligned = namespace["call"](a, b, c)
    torch.testing.assert_close(out, torch.addmm(c, a, b), rtol=0, atol=0)
    from torch._inductor.utils import _align

    assert aligned == _align(3)
    assert namespace["extern_kernels"] is restored_code.EXTERN_KERNELS


def test_torch_header_still_has_the_lines() -> None:
    """The probe reads torch's sources: the capability is there on this torch, and the header
    torch writes has exactly the lines :func:`lighten` exchanges."""
    from compile_cache import torch_compat

    assert torch_compat.available(restored_code.CAPABILITY)
    from torch._inductor.codegen import wrapper

    text = Path(wrapper.__file__).read_text()
    assert all(line in text for line in restored_code._LINES)


def test_post_compile_keeps_its_file_lines_and_calls_the_test_hook(torchs_own_code: None) -> None:
    from torch._inductor import codecache
    from torch._inductor.graph import GraphLowering

    function = restored_code._post_compile_function()
    torchs = function.__code__
    code = restored_code._post_compile_code()
    assert code.co_filename == torchs.co_filename == codecache.__file__
    assert code.co_firstlineno == torchs.co_firstlineno
    assert code.co_varnames[:3] == torchs.co_varnames[:3] == ("graph", "cache_info", "constants")
    assert len(list(code.co_lines())) > 10 and max(line for *_, line in code.co_lines() if line) \
        == max(line for *_, line in torchs.co_lines() if line)

    class Stop(Exception):
        pass

    seen: list[str] = []

    def save(source: str) -> None:
        seen.append(source)
        raise Stop

    graph = type("G", (), {"_triton_bundle": None, "source_code": "src",
                           "after_deserialization": lambda self, constants: "path"})()
    recompiled = type(function)(code, function.__globals__, function.__name__)
    old = GraphLowering.save_output_code
    GraphLowering.save_output_code = save
    try:
        with pytest.raises(Stop):
            recompiled(graph, {}, None)
    finally:
        GraphLowering.save_output_code = old
    assert seen == ["src"]


def test_the_call_keeps_its_lines_records_as_torch_and_needs_no_debug_module(
    monkeypatch: pytest.MonkeyPatch, torchs_own_code: None
) -> None:
    import torch._inductor
    import torch._inductor.debug as debug
    from torch._inductor import output_code

    function = restored_code._call_function()
    torchs = function.__code__
    code = restored_code._call_code()
    assert code.co_filename == torchs.co_filename == output_code.__file__
    assert code.co_firstlineno == torchs.co_firstlineno
    assert code.co_varnames[:2] == torchs.co_varnames[:2] == ("self", "inputs")
    assert max(line for *_, line in code.co_lines() if line) \
        == max(line for *_, line in torchs.co_lines() if line)
    recompiled = type(function)(code, function.__globals__, function.__name__)
    original = type(function)(torchs, function.__globals__, function.__name__)

    def graph() -> Any:  # what __call__ reads of a CompiledFxGraph
        return type("G", (), {"current_callable": staticmethod(lambda inputs: sum(inputs)),
                              "fx_kwargs": {"graph_id": 7}, "_compile_context": None,
                              "_fx_graph_cache_key": "k"})()

    orders = []
    for call in (original, recompiled):
        with debug.record_and_log_graph_execution_order():
            debug.GRAPH_COMPILE_IDS[7] = "0/0"
            assert call(graph(), [1, 2]) == 3
            orders.append(list(debug.GRAPH_EXECUTION_ORDER))
    assert orders[0] == orders[1] == [{"compile_id": "0/0"}]  # records as torch's does
    assert recompiled(graph(), [1, 2]) == 3  # not recording: nothing appended, nothing read
    # a process that never imported torch._inductor.debug: torch's call needs it, ours not
    monkeypatch.delattr(torch._inductor, "debug")
    with pytest.raises(AttributeError):
        original(graph(), [1, 2])
    assert recompiled(graph(), [1, 2]) == 3


def test_install_is_idempotent_and_uninstall_gives_torch_its_own_back() -> None:
    from torch._inductor import codecache

    was = restored_code.installed()
    function, call = restored_code._post_compile_function(), restored_code._call_function()
    try:
        restored_code.uninstall()
        torchs_loader, torchs_code = codecache._reload_python_module, function.__code__
        torchs_call = call.__code__
        assert torchs_loader.__module__ == "torch._inductor.runtime.compile_tasks"
        assert restored_code.install() and restored_code.install()
        assert codecache._reload_python_module is restored_code._reload_python_module
        assert function.__code__ is not torchs_code and call.__code__ is not torchs_call
        # the probe run after installing (doctor, capabilities() in a process that compiled)
        # still finds torch's loader: the one ours replaced
        assert restored_code._probe() is None
        restored_code.uninstall()
        assert codecache._reload_python_module is torchs_loader
        assert function.__code__ is torchs_code and call.__code__ is torchs_call
    finally:
        if was:
            restored_code.install()


def test_a_module_loads_as_torchs_loader_loads_it(tmp_path: Path) -> None:
    """The same module name, file, key and globals; only the exchanged lines differ."""
    from torch._inductor.runtime.compile_tasks import _reload_python_module as torchs

    path = tmp_path / "cxyz.py"
    path.write_text("\n".join(HEADER) + "\n")
    if not restored_code.installed():
        assert restored_code.install()
    ours = restored_code._reload_python_module("kx", str(path), set_sys_modules=False)
    theirs = torchs("kx", str(path), set_sys_modules=False)
    assert ours.__name__ == theirs.__name__ == "torch._inductor.runtime.compile_tasks.kx"
    assert ours.__file__ == theirs.__file__ and ours.key == theirs.key == "kx"
    assert set(vars(ours)) == set(vars(theirs))
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    for got, want in zip(ours.call(a, b, c), theirs.call(a, b, c), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_cpp_paths_are_cpp_extensions_own() -> None:
    """The include and library dirs computed without cpp_extension are the very values torch's
    functions give (CPU builds; another device is torch's own function), and ``cpp_extension()``
    is torch's module once it is imported."""
    from torch.utils import cpp_extension

    for dirs in (True, False):
        assert restored_code.include_paths("cpu", dirs) == cpp_extension.include_paths("cpu", dirs)
        assert restored_code.library_paths("cpu", dirs) == cpp_extension.library_paths("cpu", dirs)
    assert restored_code.include_paths() == cpp_extension.include_paths()
    assert restored_code.include_paths("mps", False) == cpp_extension.include_paths("mps", False)
    assert restored_code.library_paths("mps") == cpp_extension.library_paths("mps")
    assert restored_code.cpp_extension() is cpp_extension
    assert restored_code.cpp_extension_paths() == (cpp_extension.include_paths, cpp_extension.TORCH_LIB_PATH)
    assert restored_code._probe_cpp_paths() is None


TORCH_213_PATH = ("\n_HERE = os.path.abspath(__file__)\n_TORCH_PATH = os.path.dirname(os.path.dirname(_HERE))\n"
                  "TORCH_LIB_PATH = os.path.join(_TORCH_PATH, 'lib')\n")
TORCH_214_PATH = ("\nfrom torch._utils_internal import get_file_path\n"
                  '\n_TORCH_PATH = get_file_path("torch")\nTORCH_LIB_PATH = os.path.join(_TORCH_PATH, \'lib\')\n')


WINDOWS_CUDA_LIB_213 = "            if IS_WINDOWS:\n                lib_dir = os.path.join('lib', 'x64')\n"
WINDOWS_CUDA_LIB_215 = "            if IS_WINDOWS:\n                lib_dir = _windows_cuda_lib_dir()\n"


@pytest.mark.parametrize("shape", ["torch 2.14", "torch 2.15", "neither"])
def test_the_cpp_paths_follow_torch_2_14s_torch_path(monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    """torch >= 2.14's cpp_extension takes ``_TORCH_PATH`` from ``torch._utils_internal.
    get_file_path("torch")`` instead of its own file's folder: the probe found torch 2.13's
    lines missing, ``inductor.light_cpp_paths`` was missing (warned) and a restored start
    imported setuptools. Here torch 2.13's source gets 2.14's shape: the capability holds and
    the paths are still cpp_extension's; a source with neither rule is refused. torch 2.15 also
    names a CUDA build's Windows library dir by a function in ``library_paths`` (a branch a CPU
    build never reads), which made the capability missing on 2.15."""
    from torch.utils import cpp_extension

    found = module_source("torch.utils.cpp_extension")
    assert found is not None
    text = found[1]  # the running torch's: 2.13's shape is made 2.14's or 2.15's
    get_file_path = TORCH_214_PATH.split("\n\n", 1)[1]
    assert text.count(TORCH_213_PATH) + text.count(get_file_path) == 1
    if shape == "neither":
        text = text.replace(TORCH_213_PATH, "\n").replace(get_file_path, "\n")
    else:
        text = text.replace(TORCH_213_PATH, TORCH_214_PATH)
    if shape == "torch 2.15":
        text = text.replace(WINDOWS_CUDA_LIB_213, WINDOWS_CUDA_LIB_215)
        assert text.count(WINDOWS_CUDA_LIB_215) == 1
    real = restored_code.module_source
    monkeypatch.setattr(restored_code, "module_source",
                        lambda name: (found[0], text) if name == "torch.utils.cpp_extension" else real(name))
    restored_code._torch_path.cache_clear()
    try:
        if shape == "neither":
            assert "_TORCH_PATH" in (restored_code._probe_cpp_paths() or "")
            return
        assert restored_code._probe_cpp_paths() is None
        for dirs in (True, False):
            assert restored_code.include_paths("cpu", dirs) == cpp_extension.include_paths("cpu", dirs)
            assert restored_code.library_paths("cpu", dirs) == cpp_extension.library_paths("cpu", dirs)
    finally:
        restored_code._torch_path.cache_clear()


def test_install_swaps_the_cpp_builders_readers_and_uninstall_gives_them_back() -> None:
    from torch._inductor import cpp_builder

    was = restored_code.installed()
    functions = [cpp_builder._get_torch_related_args, cpp_builder.get_cpp_torch_device_options]
    try:
        restored_code.uninstall()
        torchs = [f.__code__ for f in functions]
        assert restored_code.install() and restored_code.install()
        assert all(f.__code__ is not code for f, code in zip(functions, torchs, strict=True))
        assert [f.__code__.co_firstlineno for f in functions] == [c.co_firstlineno for c in torchs]
        restored_code.uninstall()
        assert [f.__code__ for f in functions] == torchs
    finally:
        if was:
            restored_code.install()


CPP_COMMAND_LINES = """
import json, sys
import torch
from compile_cache.torch_compat import module_source, restored_code
from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions

def command_line():
    options = CppTorchDeviceOptions(device_type="cpu")
    return CppBuilder(name="o", sources="i", BuildOption=options).get_command_line()

assert restored_code.install()
ours = command_line()
imported = [m for m in ("torch.utils.cpp_extension", "setuptools") if m in sys.modules]
restored_code.uninstall()
theirs = command_line()
print(json.dumps({"same": ours == theirs, "ours": imported,
                  "torchs": [m for m in ("torch.utils.cpp_extension", "setuptools") if m in sys.modules]}))
"""


def test_a_kernels_command_line_is_torchs_without_cpp_extension(tmp_path: Path) -> None:
    """A fresh process: the CPU kernel command line (the key of a restored kernel's ``.so``) is
    byte for byte torch's, built without importing cpp_extension and setuptools; torch's own
    function imports both (the check can fail)."""
    done = subprocess.run([sys.executable, "-c", CPP_COMMAND_LINES], env=fresh_node_env(tmp_path / "node"),
                          capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"same": True, "ours": [], "torchs": ["torch.utils.cpp_extension", "setuptools"]}


def test_a_function_is_recompiled_from_its_source_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capability's probe and its install ask for the same recompiled code: torch's source is
    read once (reading and tokenizing it was most of a restored start's probes, issue 38)."""
    import inspect

    reads = []
    read = inspect.getsourcelines
    monkeypatch.setattr(inspect, "getsourcelines", lambda f: reads.append(f) or read(f))
    monkeypatch.setattr(restored_code, "_recompiled", {}, raising=False)  # a fresh process
    lines = (("    if (not skipkeys and", "    if (not  skipkeys and"),)
    first = restored_code.recompile(json.dumps, json, lines, "def dumps(")
    again = restored_code.recompile(json.dumps, json, lines, "def dumps(")
    assert again is first and reads == [json.dumps]
    other = restored_code.recompile(json.dumps, json, (), "def dumps(")  # other lines: its own code
    assert other is not first and reads == [json.dumps, json.dumps]
    assert first.co_firstlineno == json.dumps.__code__.co_firstlineno
