"""Restored Inductor code that runs without importing Inductor's code generator.

Every Python module Inductor writes for a compiled graph (its ``call``) starts with the same
imports (torch 2.13, ``codegen/wrapper.py``). Two of them import, on a start that restores its
code and compiles nothing, modules only a compile needs (imported after the rest of what a
restore needs: ~490 modules, 3-3.5 s on a loaded 2-core machine; 97 of them are not imported
otherwise, most of the rest come with ``torch._inductor.debug`` and torch.compile's minifier
wrapper, see below and torch_compat.inductor_backend; benchmarks/RESULTS.md):

* ``from torch._inductor.codegen.memory_planning import _align as align``: memory_planning
  imports the code generator (``codegen.wrapper``, the scheduler, autotuning, AOTAutograd's
  partitioners and networkx) to re-export ``torch._inductor.utils._align``;
* ``from torch._inductor.select_algorithm import extern_kernels``: select_algorithm imports
  ``lowering`` and every GEMM kernel module, which fill the ``extern_kernels`` namespace with the
  callables the code calls (``extern_kernels.addmm(...)`` is ``torch.addmm``).

:func:`install` replaces ``torch._inductor.codecache``'s ``_reload_python_module`` (how
``PyCodeCache`` loads such a module: read, compile, exec) by the same function that compiles the
source with those two lines exchanged, each only while its module is not imported yet, line for
line (tracebacks keep their line numbers): ``_align`` straight from ``torch._inductor.utils``
(the same object), and ``extern_kernels`` from :data:`EXTERN_KERNELS`, a namespace whose
``mm``, ``addmm``, ``bmm`` and ``baddbmm`` are the torch functions torch's kernel modules
register under those names (checked in torch's sources when installing) and whose any other
attribute is read from torch's own namespace, importing it then. The file on disk, its key and
every kernel are torch's; a module loaded while a compile has imported those modules is
compiled from its source unchanged.

A third import comes before the module's: ``FxGraphCache.cache_hit_post_compile`` imports
``torch._inductor.graph`` (which imports ``lowering`` and every kernel module) only to call
``GraphLowering.save_output_code`` when a test has set it. A class attribute set only by code
that imported ``graph``: :func:`install` recompiles torch's function from torch's source with
that import reading ``torch._inductor.graph`` from ``sys.modules`` (None when not imported, and
then nothing is called) and puts the code into torch's own function object (its wrappers keep
calling it), the same lines at the same line numbers.

A fourth comes with every call: ``CompiledFxGraph.__call__`` reads
``torch._inductor.debug.RECORD_GRAPH_EXECUTION`` as an attribute, which needs that module
imported (it imports the scheduler, the IR, after_aot and AOTAutograd's compile stack). Its flag
is False until a function of that module sets it, so :func:`install` recompiles the call the same
way with that first read as ``getattr(getattr(torch._inductor, "debug", None), ...,
False)``: the same value whenever the module is imported, and no import needed when it is not.

Capability ``inductor.light_restored_code``: without it restored code imports the code
generator, as torch does.

**The CPU kernels' build keys.** ``CppCodeCache.load_async`` finds a restored kernel's ``.so`` by
a key over its build command line, and ``cpp_builder._get_torch_related_args`` gets that command
line's torch include dirs and library dir with ``from torch.utils.cpp_extension import
include_paths, TORCH_LIB_PATH``: cpp_extension imports setuptools (with distutils, packaging and
jaraco, ~75 modules) for building extensions, which loading a kernel never does. :func:`install`
recompiles that function from torch's source with the import line reading
:func:`cpp_extension_paths` instead: torch's own two names whenever cpp_extension is imported,
else :func:`include_paths` and the library dir computed as cpp_extension computes them (its
``_TORCH_PATH``: torch 2.13 from its file's folder, torch >= 2.14 from ``torch._utils_internal``,
:data:`_TORCH_PATH_RULES`; the lines repeated are checked in torch's source, :data:`_CPP_EXTENSION_LINES`),
so the command lines and keys are torch's. Capability ``inductor.light_cpp_paths``: without it
the first kernel key imports cpp_extension, as torch does.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import re
import sys
import threading
import types
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import available, capability, mark_missing, module_source

__all__ = ["CAPABILITY", "CPP_PATHS_CAPABILITY", "EXTERN_KERNELS", "install", "install_for", "UnknownSource",
           "cpp_extension", "cpp_extension_paths", "include_paths", "installed", "library_paths", "lighten",
           "recompile", "uninstall"]

CAPABILITY = "inductor.light_restored_code"
CPP_PATHS_CAPABILITY = "inductor.light_cpp_paths"

_TASKS = "torch._inductor.runtime.compile_tasks"
_MEMORY_PLANNING = "torch._inductor.codegen.memory_planning"
_SELECT_ALGORITHM = "torch._inductor.select_algorithm"
#: Each line of torch's wrapper header -> (the module it imports, the line that replaces it).
_LINES = {
    f"from {_MEMORY_PLANNING} import _align as align": (
        _MEMORY_PLANNING, "from torch._inductor.utils import _align as align"),
    f"from {_SELECT_ALGORITHM} import extern_kernels": (
        _SELECT_ALGORITHM, f"from {__name__} import EXTERN_KERNELS as extern_kernels"),
}
#: extern kernel name -> (torch function, the registration that names it, the source file under
#: torch/_inductor that holds it). ``ExternKernelChoice`` registers ``kernel`` under
#: ``name or kernel.__name__`` and refuses a second registration of a name.
_KNOWN = {
    "mm": ("mm", 'aten_mm = ExternKernelChoice(torch.mm, "at::mm_out", op_overload=aten.mm.out)',
           ("kernel", "mm.py")),
    "addmm": ("addmm", 'aten_addmm = ExternKernelChoice(\n    torch.addmm, "at::addmm_out", '
              "op_overload=aten.addmm.out\n)", ("kernel", "mm.py")),
    "bmm": ("bmm", 'aten_bmm = ExternKernelChoice(torch.bmm, "at::bmm_out", op_overload=aten.bmm.out)',
            ("kernel", "bmm.py")),
    "baddbmm": ("baddbmm", 'aten_baddbmm = ExternKernelChoice(\n    torch.baddbmm, "at::baddbmm_out", '
                "op_overload=aten.baddbmm.out\n)", ("kernel", "bmm.py")),
}
_REGISTERS = ("name = name or kernel.__name__", "setattr(extern_kernels, name, kernel)")
#: In ``FxGraphCache.cache_hit_post_compile``: torch's lines -> the same lines reading the
#: module only if it is imported.
_POST_COMPILE = (
    ("            from .graph import GraphLowering\n",
     '            GraphLowering = getattr(sys.modules.get(__name__.rpartition(".")[0] + ".graph"), '
     '"GraphLowering", None)\n'),
    ("            if GraphLowering.save_output_code is not None:\n",
     "            if GraphLowering is not None and GraphLowering.save_output_code is not None:\n"),
)
#: In ``CompiledFxGraph.__call__``: torch's first read of ``torch._inductor.debug`` -> the same
#: read, False when that module is not imported (its flag is False until a function of that
#: module sets it; the rest of the condition is read only when it is True).
_CALL = (
    ("            torch._inductor.debug.RECORD_GRAPH_EXECUTION\n",
     '            getattr(getattr(torch._inductor, "debug", None), "RECORD_GRAPH_EXECUTION", False)\n'),
)


_CPP_EXTENSION = "torch.utils.cpp_extension"
#: In ``cpp_builder._get_torch_related_args``: torch's import -> the same two names from here.
_TORCH_ARGS = (
    ("    from torch.utils.cpp_extension import include_paths, TORCH_LIB_PATH\n",
     f'    include_paths, TORCH_LIB_PATH = sys.modules["{__name__}"].cpp_extension_paths()\n'),
)
#: In ``cpp_builder.get_cpp_torch_device_options`` (for every device, CPU included): the same.
_DEVICE_OPTIONS = (
    ("    from torch.utils import cpp_extension\n",
     f'    cpp_extension = sys.modules["{__name__}"].cpp_extension()\n'),
)
#: Where torch/utils/cpp_extension.py takes its ``_TORCH_PATH`` from, each rule's lines as in
#: that file: torch 2.13 the folder above its own file's folder; torch >= 2.14 torch's
#: ``_utils_internal.get_file_path("torch")`` (the folder of the installed package, which an
#: editable install may put elsewhere). Exactly one is in torch's source (:func:`_path_rule`).
_TORCH_PATH_RULES = {
    "file": "\n_HERE = os.path.abspath(__file__)\n_TORCH_PATH = os.path.dirname(os.path.dirname(_HERE))\n"
            "TORCH_LIB_PATH = os.path.join(_TORCH_PATH, 'lib')\n",
    "get_file_path": "\nfrom torch._utils_internal import get_file_path\n",
}
_GET_FILE_PATH_LINES = ('\n_TORCH_PATH = get_file_path("torch")\n'
                        "TORCH_LIB_PATH = os.path.join(_TORCH_PATH, 'lib')\n")
#: The attributes of cpp_extension that ``get_cpp_torch_device_options`` may read (torch 2.13:
#: the first two; torch >= 2.14 also CUDA_HOME): :func:`cpp_extension`'s namespace has them.
_DEVICE_OPTIONS_READS = frozenset({"include_paths", "library_paths", "CUDA_HOME"})
#: What :func:`include_paths` and :func:`cpp_extension_paths` repeat of torch/utils/cpp_extension.py
#: (torch 2.13 to 2.15), each once in that file: the whole of ``include_paths`` and
#: ``library_paths`` (a CPU build reads only their first branch).
_CPP_EXTENSION_LINES = (
    r'''
def include_paths(device_type: str = "cpu", torch_include_dirs=True) -> list[str]:
    """
    Get the include paths required to build a C++ or CUDA or SYCL extension.

    Args:
        device_type: Defaults to "cpu".
    Returns:
        A list of include path strings.
    """
    paths = []
    lib_include = os.path.join(_TORCH_PATH, 'include')
    if torch_include_dirs:
        paths.extend([
            lib_include,
            # Remove this once torch/torch.h is officially no longer supported for C++ extensions.
            os.path.join(lib_include, 'torch', 'csrc', 'api', 'include'),
        ])
    if device_type == "cuda" and IS_HIP_EXTENSION:
        paths.append(os.path.join(lib_include, 'THH'))
        paths.append(_join_rocm_home('include'))
    elif device_type == "cuda":
        cuda_home_include = _join_cuda_home('include')
        # if we have the Debian/Ubuntu packages for cuda, we get /usr as cuda home.
        # but gcc doesn't like having /usr/include passed explicitly
        if cuda_home_include != '/usr/include':
            paths.append(cuda_home_include)

        # Support CUDA_INC_PATH env variable supported by CMake files
        if (cuda_inc_path := os.environ.get("CUDA_INC_PATH", None)) and \
                cuda_inc_path != '/usr/include':

            paths.append(cuda_inc_path)
        if CUDNN_HOME is not None:
            paths.append(os.path.join(CUDNN_HOME, 'include'))
    elif device_type == "xpu":
        paths.append(_join_sycl_home('include'))
        paths.append(_join_sycl_home('include', 'sycl'))
    return paths


def library_paths(''',
    r'''
def library_paths(device_type: str = "cpu", torch_include_dirs: bool = True, cross_target_platform: str | None = None) -> list[str]:
    """
    Get the library paths required to build a C++ or CUDA extension.

    Args:
        device_type: Defaults to "cpu".

    Returns:
        A list of library path strings.
    """

    paths = []

    if torch_include_dirs:
        # We need to link against libtorch.so
        paths.extend([TORCH_LIB_PATH])

    if device_type == "cuda" and IS_HIP_EXTENSION:
        lib_dir = 'lib'
        paths.append(_join_rocm_home(lib_dir))
        if HIP_HOME is not None:
            paths.append(os.path.join(HIP_HOME, 'lib'))
    elif device_type == "cuda":
        if cross_target_platform == "windows":
            lib_dir = os.path.join('lib', 'x64')
            if WINDOWS_CUDA_HOME is None:
                raise RuntimeError("Need to set WINDOWS_CUDA_HOME for windows cross-compilation")
            paths.append(os.path.join(WINDOWS_CUDA_HOME, lib_dir))
        else:
            if IS_WINDOWS:
                lib_dir = os.path.join('lib', 'x64')
            else:
                lib_dir = 'lib64'
                if (not os.path.exists(_join_cuda_home(lib_dir)) and
                        os.path.exists(_join_cuda_home('lib'))):
                    # 64-bit CUDA may be installed in 'lib' (see e.g. gh-16955)
                    # Note that it's also possible both don't exist (see
                    # _find_cuda_home) - in that case we stay with 'lib64'.
                    lib_dir = 'lib'

            paths.append(_join_cuda_home(lib_dir))
            if CUDNN_HOME is not None:
                paths.append(os.path.join(CUDNN_HOME, lib_dir))
    elif device_type == "xpu":
        if IS_WINDOWS:
            lib_dir = os.path.join('lib', 'x64')
        else:
            lib_dir = 'lib64'
            if (not os.path.exists(_join_sycl_home(lib_dir)) and
                    os.path.exists(_join_sycl_home('lib'))):
                lib_dir = 'lib'

        paths.append(_join_sycl_home(lib_dir))

    return paths


def load(''',
)


def _source(*parts: str) -> str:
    import torch._inductor

    with open(os.path.join(os.path.dirname(torch._inductor.__file__), *parts), encoding="utf-8") as f:
        return f.read()


@capability(
    CAPABILITY,
    needs="torch._inductor.codecache._reload_python_module (torch._inductor.runtime."
    "compile_tasks's: read, compile, exec), the wrapper header's imports of memory_planning's "
    "_align (torch._inductor.utils._align) and select_algorithm's extern_kernels "
    "(ExternKernelChoice's registrations of torch.mm, addmm, bmm and baddbmm)",
    breaks="a start that restores every graph imports Inductor's code generator, lowering and "
    "the GEMM kernel modules (~490 modules) for the two names its restored code imports",
)
def _probe() -> str | None:
    from torch._inductor import codecache, utils
    from torch._inductor.runtime import compile_tasks

    reload = getattr(compile_tasks, "_reload_python_module", None)
    current = codecache._reload_python_module
    if current is _reload_python_module:  # installed here already: torch's is the one it replaced
        current = _original
    if getattr(reload, "__module__", None) != _TASKS or current is not reload:
        return "torch._inductor.codecache no longer loads modules by compile_tasks._reload_python_module"
    names = set(reload.__code__.co_names)
    if not {"open", "compile", "ModuleType", "exec", "modules"} <= names:
        return "compile_tasks._reload_python_module no longer reads, compiles and execs the file"
    if reload.__code__.co_varnames[:3] != ("key", "path", "set_sys_modules"):
        return "compile_tasks._reload_python_module has another signature"
    wrapper = _source("codegen", "wrapper.py")
    for line in _LINES:
        if line not in wrapper:
            return f"Inductor's wrapper header no longer has {line!r}"
    if not callable(getattr(utils, "_align", None)):
        return "torch._inductor.utils has no _align"
    if "from ..utils import _align" not in _source("codegen", "memory_planning.py"):
        return "memory_planning's _align is no longer torch._inductor.utils._align"
    select_algorithm = _source("select_algorithm.py")
    if not all(text in select_algorithm for text in _REGISTERS):
        return "ExternKernelChoice no longer registers kernels under name or kernel.__name__"
    try:
        _post_compile_code()
        _call_code()
    except UnknownSource as exc:
        return str(exc)
    sources: dict[tuple[str, ...], str] = {}
    for name, (_, registration, where) in _KNOWN.items():
        text = sources.setdefault(where, _source(*where))
        if registration not in text:
            return f"torch no longer registers extern kernel {name!r} as {registration.split(chr(10))[0]!r}"
    return None


@capability(
    CPP_PATHS_CAPABILITY,
    needs="torch._inductor.cpp_builder._get_torch_related_args (its import of torch.utils."
    "cpp_extension's include_paths and TORCH_LIB_PATH), and those two as torch/utils/"
    "cpp_extension.py computes them",
    breaks="the first CPU kernel key of a start that restores its kernels imports torch.utils."
    "cpp_extension, and with it setuptools (~75 modules)",
)
def _probe_cpp_paths() -> str | None:
    found = module_source(_CPP_EXTENSION)
    if found is None:
        return f"{_CPP_EXTENSION} has no source file"
    text = found[1]
    try:
        _path_rule(text)
    except UnknownSource as exc:
        return str(exc)
    for lines in _CPP_EXTENSION_LINES:
        if sum(text.count(known) for known in _variants(lines)) != 1:
            return f"{_CPP_EXTENSION} no longer has {lines.strip().splitlines()[0]!r} as known"
    for name in ("\n_HERE ", "\n_TORCH_PATH ", "\nTORCH_LIB_PATH ", "\ndef include_paths(", "\ninclude_paths ",
                 "\ndef library_paths(", "\nlibrary_paths "):
        if text.count(name) > 1 or "global " + name.split()[-1].rstrip("(") in text:
            return f"{_CPP_EXTENSION} sets {name.strip()} more than once"
    try:
        _cpp_paths_codes()
    except UnknownSource as exc:
        return str(exc)
    return None


def _cpp_paths_codes() -> list[tuple[Any, Any]]:
    """(torch's function, its code recompiled from torch's source with the lines exchanged) for
    ``cpp_builder._get_torch_related_args`` (:data:`_TORCH_ARGS`) and
    ``get_cpp_torch_device_options`` (:data:`_DEVICE_OPTIONS`): same file and line numbers."""
    from torch._inductor import cpp_builder

    if vars(cpp_builder).get("sys") is not sys:
        raise UnknownSource("torch._inductor.cpp_builder does not import sys")
    codes = []
    for name, lines in (("_get_torch_related_args", _TORCH_ARGS),
                        ("get_cpp_torch_device_options", _DEVICE_OPTIONS)):
        function = vars(cpp_builder).get(name)
        if getattr(function, "__module__", None) != cpp_builder.__name__:
            raise UnknownSource(f"cpp_builder.{name} is not torch's function")
        if lines is _DEVICE_OPTIONS:
            reads = set(re.findall(r"\bcpp_extension\.(\w+)", inspect.getsource(function)))
            if not reads <= _DEVICE_OPTIONS_READS:
                raise UnknownSource(f"cpp_builder.{name} reads cpp_extension's "
                                    f"{', '.join(sorted(reads - _DEVICE_OPTIONS_READS))}")
        codes.append((function, recompile(function, cpp_builder, lines, f"def {name}(")))
    return codes


#: torch 2.15's ``library_paths`` names a CUDA build's Windows library dir by a function of
#: its own; a CPU build (all the functions here compute) reads only the first branch.
_WINDOWS_CUDA_LIB = ("            if IS_WINDOWS:\n                lib_dir = os.path.join('lib', 'x64')\n",
                     "            if IS_WINDOWS:\n                lib_dir = _windows_cuda_lib_dir()\n")


def _variants(lines: str) -> tuple[str, ...]:
    """The forms of :data:`_CPP_EXTENSION_LINES`' ``lines`` known in torch 2.13 to 2.15."""
    old, new = _WINDOWS_CUDA_LIB
    if lines.count(old) == 1:
        return (lines, lines.replace(old, new))
    return (lines,)


def _path_rule(text: str) -> str:
    """The name of the :data:`_TORCH_PATH_RULES` rule cpp_extension's source ``text`` follows;
    :class:`UnknownSource` unless exactly one of them is there, once, as known."""
    found = [name for name, lines in _TORCH_PATH_RULES.items() if text.count(lines) == 1]
    if found == ["get_file_path"] and (
            text.count(_GET_FILE_PATH_LINES) != 1 or "\n_HERE " in text):
        found = []
    if len(found) != 1:
        raise UnknownSource(f"{_CPP_EXTENSION} no longer sets _TORCH_PATH and TORCH_LIB_PATH as known")
    return found[0]


@functools.cache
def _torch_path() -> str:
    """cpp_extension's ``_TORCH_PATH``, by the rule its source follows (:func:`_path_rule`;
    found and read, not imported): torch 2.13 the folder above the folder of its file, as the
    import system would load it; torch >= 2.14 ``torch._utils_internal.get_file_path("torch")``
    (torch's own function, imported with torch)."""
    found = module_source(_CPP_EXTENSION)
    rule = _path_rule(found[1]) if found is not None else "file"
    if rule == "get_file_path":
        from torch._utils_internal import get_file_path

        return get_file_path("torch")
    spec = importlib.util.find_spec(_CPP_EXTENSION)
    return os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))  # type: ignore[union-attr, arg-type]


def include_paths(device_type: str = "cpu", torch_include_dirs: bool = True) -> list[str]:
    """``torch.utils.cpp_extension.include_paths`` (torch 2.13-2.15, :data:`_CPP_EXTENSION_LINES`):
    computed here for a CPU build, torch's own function for any other device."""
    if device_type != "cpu":
        from torch.utils.cpp_extension import include_paths as torchs

        return torchs(device_type, torch_include_dirs)
    lib_include = os.path.join(_torch_path(), "include")
    if not torch_include_dirs:
        return []
    return [lib_include, os.path.join(lib_include, "torch", "csrc", "api", "include")]


def library_paths(device_type: str = "cpu", torch_include_dirs: bool = True,
                  cross_target_platform: str | None = None) -> list[str]:
    """``torch.utils.cpp_extension.library_paths`` (torch 2.13-2.15, :data:`_CPP_EXTENSION_LINES`):
    computed here for a CPU build, torch's own function for any other device."""
    if device_type != "cpu":
        from torch.utils.cpp_extension import library_paths as torchs

        return torchs(device_type, torch_include_dirs, cross_target_platform)
    return [os.path.join(_torch_path(), "lib")] if torch_include_dirs else []


def cpp_extension() -> Any:
    """``torch.utils.cpp_extension`` when it is imported, else a namespace of the
    :func:`include_paths` and :func:`library_paths` here and ``CUDA_HOME`` (all
    ``get_cpp_torch_device_options`` reads of it: :data:`_DEVICE_OPTIONS_READS`)."""
    module = sys.modules.get(_CPP_EXTENSION)
    if module is not None:
        return module
    # CUDA_HOME: torch >= 2.14 reads it first (and sets it from the environment when None);
    # only a CUDA build uses it, and that calls torch's own functions, not these
    return types.SimpleNamespace(include_paths=include_paths, library_paths=library_paths,
                                 CUDA_HOME=None)


def cpp_extension_paths() -> tuple[Callable[..., list[str]], str]:
    """``(include_paths, TORCH_LIB_PATH)`` of ``torch.utils.cpp_extension``: that module's own
    when it is imported, else :func:`include_paths` and the same library dir, without importing
    it."""
    module = sys.modules.get(_CPP_EXTENSION)
    if module is not None:
        return module.include_paths, module.TORCH_LIB_PATH
    return include_paths, library_paths()[0]


class UnknownSource(Exception):
    """torch's function is not the one the recompiling code knows (its source changed)."""


def _post_compile_code() -> Any:
    """The code of ``FxGraphCache.cache_hit_post_compile`` compiled from torch's source with
    :data:`_POST_COMPILE`'s lines exchanged (same file name and line numbers)."""
    from torch._inductor import codecache

    if "sys" not in vars(codecache) or vars(codecache)["sys"] is not sys:
        raise UnknownSource("torch._inductor.codecache does not import sys")
    return recompile(_post_compile_function(), codecache, _POST_COMPILE, "@staticmethod\n")


def _call_code() -> Any:
    """The code of ``CompiledFxGraph.__call__`` compiled from torch's source with
    :data:`_CALL`'s line exchanged (same file name and line numbers)."""
    from torch._inductor import output_code

    if vars(output_code).get("torch") is not sys.modules["torch"]:
        raise UnknownSource("torch._inductor.output_code does not import torch")
    return recompile(_call_function(), output_code, _CALL, "def __call__(")


def recompile(function: Any, module: ModuleType, lines: tuple[tuple[str, str], ...], start: str) -> Any:
    """The code of torch's ``function`` (defined in ``module``) compiled from its source with
    each of ``lines`` (old, new) exchanged once, in the module's namespace, with the same file
    name and line numbers. Once per process for each function and lines: a capability's probe
    and its install ask for the same code (reading torch's source is most of a start's probes)."""
    memo_key = (function, module.__name__, lines, start)
    with _recompile_lock:
        code = _recompiled.get(memo_key)
    if code is None:
        code = _recompile(function, module, lines, start)
        with _recompile_lock:
            code = _recompiled.setdefault(memo_key, code)
    return code


_recompile_lock = threading.Lock()
_recompiled: dict[tuple[Any, ...], types.CodeType] = {}


def _recompile(function: Any, module: ModuleType, lines: tuple[tuple[str, str], ...], start: str) -> Any:
    import __future__

    import inspect
    import textwrap

    name = function.__qualname__
    if function.__code__.co_freevars or function.__closure__:
        raise UnknownSource(f"{name} is a closure")
    source_lines, first = inspect.getsourcelines(function)
    source = "".join(source_lines)
    for old, new in lines:
        if source.count(old) != 1:
            raise UnknownSource(f"{name} has no line {old.strip()!r}")
        source = source.replace(old, new)
    source = textwrap.dedent(source)
    if not source.startswith(start):
        raise UnknownSource(f"{name} does not start with {start.strip()!r}")
    flags = 0
    if getattr(module, "annotations", None) is __future__.annotations:
        flags |= __future__.annotations.compiler_flag
    code = compile("\n" * (first - 1) + source, function.__code__.co_filename, "exec", flags=flags,
                   dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(code, vars(module), namespace)  # noqa: S102 - torch's own source, lines changed
    new_function = namespace.get(function.__name__)
    new_function = getattr(new_function, "__func__", new_function)
    new_code = getattr(new_function, "__code__", None)
    if new_code is None or new_code.co_freevars or new_code.co_firstlineno != function.__code__.co_firstlineno:
        raise UnknownSource(f"{name} did not recompile as itself")
    return new_code


def _call_function() -> Any:
    """torch's own ``CompiledFxGraph.__call__`` function (unwrapped)."""
    from torch._inductor import output_code

    function = vars(output_code.CompiledFxGraph)["__call__"]
    while getattr(function, "__wrapped__", None) is not None:
        function = function.__wrapped__
    if getattr(function, "__module__", None) != output_code.__name__:
        raise UnknownSource("CompiledFxGraph.__call__ is not torch's function")
    return function


def _post_compile_function() -> Any:
    """torch's own ``FxGraphCache.cache_hit_post_compile`` function (under any wrapper of
    ours: the guard of :mod:`.inductor_cache` keeps it as ``__wrapped__``)."""
    from torch._inductor import codecache

    function = vars(codecache.FxGraphCache)["cache_hit_post_compile"]
    function = getattr(function, "__func__", function)
    while getattr(function, "__wrapped__", None) is not None:
        function = function.__wrapped__
    if getattr(function, "__module__", None) != codecache.__name__:
        raise UnknownSource("FxGraphCache.cache_hit_post_compile is not torch's function")
    return function


class _ExternKernels:
    """Stands for ``select_algorithm.extern_kernels`` in restored code: the known GEMMs are the
    torch functions torch registers under their names; any other name is read from torch's
    namespace (importing select_algorithm, once)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        known = _KNOWN.get(name)
        if known is not None:
            import torch

            fn = getattr(torch, known[0])
        else:
            from torch._inductor.select_algorithm import extern_kernels

            fn = getattr(extern_kernels, name)
        setattr(self, name, fn)  # read once
        return fn

    def __repr__(self) -> str:
        return "<compile_cache's stand-in for torch._inductor.select_algorithm.extern_kernels>"


#: What restored code loaded before select_algorithm is imported gets as ``extern_kernels``.
EXTERN_KERNELS = _ExternKernels()

_lock = threading.Lock()
_original: Any = None
#: (torch's function, its own code) for each function whose code :func:`install` exchanged.
_swapped: list[tuple[Any, Any]] = []
#: The same for the functions of ``cpp_builder`` that read cpp_extension.
_cpp_swapped: list[tuple[Any, Any]] = []
#: Lines exchanged, by the module they did not import (for tests and the report).
COUNTS: dict[str, int] = {}


def lighten(source: str) -> str:
    """``source`` with each header import of a module not imported yet exchanged for its light
    line (the same number of lines)."""
    if not any(line in source for line in _LINES):
        return source
    lines = source.split("\n")
    for i, line in enumerate(lines[:200]):  # the header: the imports come first
        swap = _LINES.get(line)
        if swap is not None and swap[0] not in sys.modules:
            lines[i] = swap[1]
            COUNTS[swap[0]] = COUNTS.get(swap[0], 0) + 1
    return "\n".join(lines)


def _reload_python_module(key: str, path: str, set_sys_modules: bool = True) -> ModuleType:
    """torch's ``compile_tasks._reload_python_module`` (torch 2.13), compiling the source
    through :func:`lighten`."""
    with open(path) as f:
        try:
            code = compile(lighten(f.read()), path, "exec", dont_inherit=True)
        except Exception as e:
            raise RuntimeError(f"Failed to import {path}\n{type(e).__name__}: {e}") from None
        mod = ModuleType(f"{_TASKS}.{key}")
        mod.__file__ = path
        mod.key = key  # type: ignore[attr-defined]
        exec(code, mod.__dict__, mod.__dict__)  # noqa: S102 - torch's own loading of its code
        if set_sys_modules:
            sys.modules[mod.__name__] = mod
        return mod


def installed() -> bool:
    """Whether restored code loads through :func:`lighten` in this process."""
    return _original is not None


def install() -> bool:
    """Loads restored code without the code generator's imports from now on (idempotent);
    False where torch lacks what it needs."""
    global _original
    with _lock:
        _install_cpp_paths()
        if _original is not None:
            return True
        if not available(CAPABILITY):
            return False
        try:
            from torch._inductor import codecache

            codes = [(_post_compile_function(), _post_compile_code()), (_call_function(), _call_code())]
            _original = codecache._reload_python_module
            codecache._reload_python_module = _reload_python_module
            for function, code in codes:
                _swapped.append((function, function.__code__))
                function.__code__ = code
        except Exception as exc:  # noqa: BLE001 - a torch that moved it: torch's loading
            mark_missing(CAPABILITY, f"{type(exc).__name__}: {exc}")
            return False
        return True


def _install_cpp_paths() -> None:
    """``cpp_builder``'s two readers of cpp_extension read :func:`cpp_extension_paths` and
    :func:`cpp_extension` from now on (idempotent; under ``_lock``)."""
    if _cpp_swapped or not available(CPP_PATHS_CAPABILITY):
        return
    try:
        codes = _cpp_paths_codes()
    except Exception as exc:  # noqa: BLE001 - a torch that moved it: torch's import
        mark_missing(CPP_PATHS_CAPABILITY, f"{type(exc).__name__}: {exc}")
        return
    for function, code in codes:
        _cpp_swapped.append((function, function.__code__))
        function.__code__ = code


def install_for(compile_kwargs: dict[str, Any]) -> bool:
    """:func:`install` when ``compile_kwargs`` compile with Inductor (the default backend)."""
    if compile_kwargs.get("backend", "inductor") != "inductor":
        return False
    if _may_use_cudagraphs(compile_kwargs):
        # a restored graph's backward reads torch._inductor.cudagraph_trees as an attribute
        # (output_code.maybe_handle_backward_generation), which the code generator's imports
        # would have imported
        import torch._inductor.cudagraph_trees  # noqa: F401
    return install()


def _may_use_cudagraphs(compile_kwargs: dict[str, Any]) -> bool:
    """Whether a compile with ``compile_kwargs`` can wrap its graphs in CUDA graphs."""
    import torch

    if not torch.cuda.is_available():
        return False
    options = compile_kwargs.get("options") or {}
    if compile_kwargs.get("mode") in ("reduce-overhead", "max-autotune") or options.get(
        "triton.cudagraphs"
    ):
        return True
    from torch._inductor import config

    return bool(config.triton.cudagraphs)


def uninstall() -> None:
    """Puts torch's loader back (tests)."""
    global _original
    with _lock:
        if _original is not None:
            from torch._inductor import codecache

            codecache._reload_python_module = _original
            _original = None
        while _swapped:
            function, code = _swapped.pop()
            function.__code__ = code
        while _cpp_swapped:
            function, code = _cpp_swapped.pop()
            function.__code__ = code
