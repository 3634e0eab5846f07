"""One hook into Inductor's CPU vector-ISA probe, answering it from what compile_cache knows.

For each candidate instruction set, Inductor builds a small test library (in the local cache dir)
and loads it in a child Python (``torch/_inductor/cpu_vec_isa.py``), in every new process:

* torch 2.13: ``VecISA.check_build`` builds, then ``VecISA._probe_load`` loads, without importing
  torch in the child (about 0.2 s per library);
* older torch (2.11 here): ``check_build`` builds and loads inline, and the child imports torch
  (about 1.5 s per library on 2 cores: 6 libraries cost 9 s of *every* CPU start, warm or not).

Two parts of compile_cache know the answer for some libraries before torch asks:
``artifacts`` (a restored library of an ISA the pack's publisher accepted) and ``prefetch`` (a
library it built and loaded in the background). They register an *answerer* here:
``(isa, library path) -> True/False``, or None for "ask torch". The hook sits on ``_probe_load``
where torch has it, else on ``check_build``, and asks torch whenever no answerer knows. It also
remembers every answer it saw (:func:`observed`): a publisher puts them in its pack, so that a
process restoring the pack answers each restored library exactly as the publisher's torch did.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

Answerer = Callable[[Any, str], "bool | None"]

_answerers: list[Answerer] = []
_observed: dict[str, bool] = {}  # realpath of a test library -> the answer this process used
_counts = {"answered": 0, "asked_torch": 0}  # by an answerer / left to torch's own probe
_lock = threading.Lock()


def watch() -> bool:
    """Hooks into torch's probe (once per process), so that :func:`observed` sees its answers.

    False where this torch has no probe we know how to hook.
    """
    with _lock:
        return _install()


def add_answerer(answerer: Answerer) -> bool:
    """Lets ``answerer`` answer torch's load probe before torch runs it; True once hooked in.

    Installs the hook once per process; False where this torch has no such probe.
    """
    with _lock:
        if not _install():
            return False
        if answerer not in _answerers:
            _answerers.append(answerer)
    return True


def counts() -> dict[str, int]:
    """How many probe questions an answerer answered, and how many went to torch's own probe."""
    with _lock:
        return dict(_counts)


def observed() -> dict[str, bool]:
    """Every test library the probe checked through the hook: realpath -> the answer used."""
    with _lock:
        return dict(_observed)


def _ask(isa: Any, path: str) -> bool | None:
    for answerer in list(_answerers):
        answer = answerer(isa, path)
        if answer is not None:
            return bool(answer)
    return None


def _answer(isa: Any, path: str | None, torch_answer: Callable[[], bool]) -> bool:
    """An answerer's answer for ``path``, else torch's; remembered either way."""
    answer = None if path is None else _ask(isa, path)
    asked_torch = answer is None
    if asked_torch:
        answer = bool(torch_answer())
    with _lock:
        _counts["asked_torch" if asked_torch else "answered"] += 1
        if path is not None:
            _observed[path] = answer
    return answer


def _install() -> bool:
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return False
    cls = cpu_vec_isa.VecISA
    probe = getattr(cls, "_probe_load", None)
    if probe is not None:
        if _is_hook(probe):
            return True

        def _probe_load(self: Any, output_path: str) -> bool:
            path = os.path.realpath(output_path)
            return _answer(self, path, lambda: probe(self, output_path))

        _probe_load._compile_cache_original = probe  # type: ignore[attr-defined]
        cls._probe_load = _probe_load
        return True
    check_build = getattr(cls, "check_build", None)
    if check_build is None:
        return False
    if _is_hook(check_build):
        return True

    def _check_build(self: Any, code: str) -> bool:
        try:
            path: str | None = os.path.realpath(library_path(self, code)[2])
        except Exception:  # another torch: its own probe, unobserved
            path = None
        return _answer(self, path, lambda: check_build(self, code))

    _check_build._compile_cache_original = check_build  # type: ignore[attr-defined]
    cls.check_build = _check_build
    return True


def library_path(isa: Any, code: str) -> tuple[str, Any, str]:
    """(lock key, CppBuilder, library path) of the test library ``check_build(isa, code)`` uses.

    The first half of torch's ``VecISA.check_build``: same source file, key, options and path.
    """
    from torch._inductor import codecache, cpu_vec_isa
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions, normalize_path_separator

    key, input_path = codecache.write(
        code, "cpp", extra=cpu_vec_isa._get_isa_dry_compile_fingerprint(_key_flags(isa))
    )
    builder = CppBuilder(
        key,
        [input_path],
        CppTorchOptions(vec_isa=isa, warning_all=False),
        os.path.dirname(input_path),
    )
    return key, builder, normalize_path_separator(builder.get_target_file_path())


def _key_flags(isa: Any) -> str:
    """The flags torch's ``check_build`` puts in a test library's key.

    torch 2.13 keys on ``build_arch_flags()``, torch 2.11 on the ``_arch_flags`` attribute; they
    differ once a bf16 check has passed. Read off torch's own source.
    """
    return isa._arch_flags if _keys_on_arch_attribute() else isa.build_arch_flags()


_keys_on_attribute: bool | None = None


def _keys_on_arch_attribute() -> bool:
    global _keys_on_attribute
    if _keys_on_attribute is None:
        from torch._inductor import cpu_vec_isa

        original = _original(cpu_vec_isa.VecISA.check_build)
        try:
            source = inspect.getsource(original)
        except (OSError, TypeError):
            source = ""
        _keys_on_attribute = "_get_isa_dry_compile_fingerprint(self._arch_flags)" in source
    return _keys_on_attribute


def torch_load_probe() -> Callable[[Any, str], bool] | None:
    """Torch's own check that a built test library loads, callable ahead of torch.

    torch 2.13: its ``VecISA._probe_load`` (unhooked). Older torch: the same child process its
    ``check_build`` runs inline. None if this torch has neither.
    """
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return None
    probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if probe is not None:
        return _original(probe)
    code = getattr(cpu_vec_isa.VecISA, "_avx_py_load", None)
    if not isinstance(code, str) or "__lib_path__" not in code:
        return None
    try:
        from torch._inductor.utils import python_subprocess_env
    except ImportError:
        return None

    def load(isa: Any, path: str) -> bool:
        try:
            subprocess.check_call(
                [sys.executable, "-c", code.replace("__lib_path__", path)],
                cwd=os.path.dirname(path),
                stderr=subprocess.DEVNULL,
                env=python_subprocess_env(),
            )
        except Exception:
            return False
        return True

    return load


def _original(function: Any) -> Any:
    """torch's ``function`` without our hook."""
    return getattr(function, "_compile_cache_original", function)


def _is_hook(function: Any) -> bool:
    return hasattr(function, "_compile_cache_original")
