"""Inductor's CPU vector-ISA probe: one hook that answers it, and the builds done ahead of it.

For each candidate instruction set, Inductor builds a small test library (in the local cache dir)
and loads it in a child Python (``torch/_inductor/cpu_vec_isa.py``), in every new process:

* torch 2.13: ``VecISA.check_build`` builds, then ``VecISA._probe_load`` loads, without importing
  torch in the child (about 0.2 s per library);
* torch 2.11: ``check_build`` builds and loads inline, and the child imports torch (about 1.5 s
  per library on 2 cores: 6 libraries cost 9 s of *every* CPU start, warm or not).

The two forms are told apart by ``hasattr(VecISA, "_probe_load")``.

**The hook.** Two parts of compile_cache know the answer for some libraries before torch asks:
``artifacts`` (a restored library of an ISA the pack's publisher accepted) and ``prefetch`` (a
library it built and loaded in the background). They register an *answerer* here:
``(isa, library path) -> True/False``, or None for "ask torch". The hook sits on ``_probe_load``
where torch has it, else on ``check_build``, and asks torch whenever no answerer knows. It also
remembers every answer it saw (:func:`observed`): a publisher puts them in its pack, so that a
process restoring the pack answers each restored library exactly as the publisher's torch did.

**The builds ahead** (the mechanism of :mod:`compile_cache.prefetch`, which decides when):
:func:`plan_probe_builds` runs torch's own ``__bool__`` chain on private copies of its ISA objects
whose ``check_build`` records instead of building; :func:`build_and_load` builds one library with
torch's ``CppBuilder`` and the arguments torch's ``check_build`` computes, into the path torch
will look at, under torch's own per-library lock, then loads it with torch's own check.

Capabilities: ``isa.probe_hook`` (``VecISA._probe_load`` or ``check_build``), ``isa.prefetch``
(``cpu_vec_isa`` lists and checker, ``codecache.write``/``get_lock_dir``, ``cpp_builder``,
``torch.utils._filelock``). A missing ``get_lock_dir`` turns the prefetch off with one warning;
it never leaves torch's probe waiting for an answer that does not come.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from . import available, capability

__all__ = [
    "add_answerer",
    "build_and_load",
    "counts",
    "library_path",
    "observed",
    "plan_probe_builds",
    "torch_load_probe",
    "watch",
]

log = logging.getLogger("compile_cache")


@capability(
    "isa.probe_hook",
    needs="torch._inductor.cpu_vec_isa.VecISA._probe_load (torch 2.13) or .check_build (2.11)",
    breaks="restored ISA test libraries are probed again by torch (one child process each) and "
    "packs carry no probe answers",
)
def _probe_hook() -> str | None:
    from torch._inductor import cpu_vec_isa

    cls = getattr(cpu_vec_isa, "VecISA", None)
    if cls is None:
        return "torch._inductor.cpu_vec_isa has no VecISA"
    if not callable(getattr(cls, "_probe_load", None)) and not callable(getattr(cls, "check_build", None)):
        return "VecISA has neither _probe_load nor check_build"
    return None


@capability(
    "isa.prefetch",
    needs="torch._inductor.cpu_vec_isa's ISA lists, codecache.get_lock_dir and .write, "
    "cpp_builder.CppBuilder and torch.utils._filelock",
    breaks="Inductor's CPU ISA-probe libraries are not built in the background, so a cold CPU "
    "compile waits for torch's probe (about 7 s on 2 cores)",
)
def _probe_prefetch() -> str | None:
    from torch._inductor import codecache, config, cpp_builder, cpu_vec_isa

    wanted = {
        cpu_vec_isa: ("x86_isa_checker", "supported_vec_isa_list", "valid_vec_isa_list",
                      "_get_isa_dry_compile_fingerprint", "VecAMX"),
        codecache: ("write", "get_lock_dir"),
        cpp_builder: ("CppBuilder", "CppTorchOptions", "normalize_path_separator"),
    }
    for module, names in wanted.items():
        for name in names:
            if not hasattr(module, name):
                return f"{module.__name__} has no {name}"
    if not hasattr(getattr(config, "cpp", None), "vec_isa_ok"):
        return "torch._inductor.config.cpp has no vec_isa_ok"
    try:
        from torch.utils._filelock import FileLock  # noqa: F401
    except ImportError as exc:
        return f"torch.utils._filelock: {exc}"
    return None


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
    if not available("isa.probe_hook"):
        return False
    from torch._inductor import cpu_vec_isa

    cls = cpu_vec_isa.VecISA
    probe = getattr(cls, "_probe_load", None)
    if probe is not None:
        _observe_check_build(cls)
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


def _observe_check_build(cls: Any) -> None:
    """Where the load is a separate step (``_probe_load``), torch >= 2.14's ``check_build`` also
    leaves a marker beside a library that loaded (``<library>.load_ok``) and, in a later process
    on the same machine, answers from it without calling ``_probe_load``: the hook would not see
    the library, and a warm publisher's pack would lack the libraries every fresh node then
    builds and probes again (and publishes). An observer on ``check_build`` records the library
    torch used with torch's answer, where the hook did not see it already."""
    check_build = getattr(cls, "check_build", None)
    if check_build is None or _is_hook(check_build):
        return

    def _check_build(self: Any, code: str) -> bool:
        answer = check_build(self, code)
        try:
            path = os.path.realpath(library_path(self, code)[2])
        except Exception:  # noqa: BLE001 - another torch: its own probe, unobserved
            return answer
        if isinstance(answer, bool) and os.path.isfile(path):
            with _lock:
                _observed.setdefault(path, answer)
        return answer

    _check_build._compile_cache_original = check_build  # type: ignore[attr-defined]
    cls.check_build = _check_build


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

    Two forms are known, told apart by what ``VecISA`` has (not by reading torch's source):

    * torch 2.13 (``VecISA._probe_load`` exists, the load is a separate step): the key holds
      ``isa.build_arch_flags()``;
    * torch 2.11 (no ``_probe_load``; ``check_build`` builds and loads inline): the key holds the
      ``isa._arch_flags`` attribute.

    They differ once a bf16 check has passed (``VecAVX512.build_arch_flags`` adds
    ``-mavx512bf16``).
    """
    from torch._inductor import cpu_vec_isa

    if hasattr(cpu_vec_isa.VecISA, "_probe_load"):
        return isa.build_arch_flags()
    return isa._arch_flags


def torch_load_probe() -> Callable[[Any, str], bool] | None:
    """Torch's own check that a built test library loads, callable ahead of torch.

    torch 2.13: its ``VecISA._probe_load`` (unhooked). Older torch: the same child process its
    ``check_build`` runs inline. None if this torch has neither.
    """
    if not available("isa.probe_hook"):
        return None
    from torch._inductor import cpu_vec_isa

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


# --------------------------------------------------------------------------------------------
# The builds ahead of torch's probe (compile_cache.prefetch decides when)


def plan_probe_builds() -> list[tuple[str, Any, Any, str]]:
    """(lock key, CppBuilder, ISA object, path) per test library torch's probe would build and
    not find."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return []
    if not available("isa.prefetch"):
        return []
    # Imported here, on the caller's thread: two threads importing the compile stack at once can
    # hand one of them a half-initialised module.
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None or config.is_fbcode():
        return []  # torch does not probe
    cache_info = getattr(cpu_vec_isa.valid_vec_isa_list, "cache_info", None)
    if cache_info is not None and cache_info().currsize:
        return []  # already probed in this process
    cpu_isas = cpu_vec_isa.x86_isa_checker()
    planned: dict[str, tuple[str, Any, Any, str]] = {}

    def record(isa: Any, code: str) -> None:
        key, builder, target = library_path(isa, code)
        if not os.path.isfile(target):
            planned.setdefault(target, (key, builder, isa, target))

    amx_code = getattr(cpu_vec_isa.VecAMX, "_amx_code", None)
    for isa in cpu_vec_isa.supported_vec_isa_list:
        if not all(flag in cpu_isas for flag in str(isa).split()):
            continue  # valid_vec_isa_list skips it without probing
        cls = type(isa)

        class _Recording(cls):  # type: ignore[valid-type, misc]
            def check_build(self, code: str) -> bool:
                record(self, code)
                # Answer "yes" to reach the checks torch makes after a success, except AMX's,
                # whose success calls torch.cpu._init_amx(): a process-wide side effect.
                return code != amx_code

        _Recording.__name__ = _Recording.__qualname__ = f"_Recording{cls.__name__}"
        bool(_Recording())
    return list(planned.values())


def build_and_load(
    key: str,
    builder: Any,
    isa: Any,
    original_load: Any,
    answer: Future[bool | None],
    stop: threading.Event | None = None,
) -> str:
    """Build one test library under torch's lock for ``key``, then load it with torch's check.

    Returns ``"built"``, ``"present"``, ``"failed"``, ``"busy"`` (someone held the lock) or
    ``"cancelled"`` (``stop`` was set). ``answer`` always gets a result, whatever happens (the
    load's answer, or None for "ask torch"), so torch's probe never waits for it in vain.
    """
    outcome = "failed"
    loaded: bool | None = None
    target = "?"
    try:
        if stop is not None and stop.is_set():
            return (outcome := "cancelled")
        from torch._inductor.codecache import get_lock_dir
        from torch.utils._filelock import FileLock

        target = builder.get_target_file_path()  # Linux only (see plan_probe_builds)
        lock = FileLock(os.path.join(get_lock_dir(), key + ".lock"), timeout=0)
        try:
            lock.acquire()
        except Exception:  # torch (or another process) got there first: it builds and probes
            return (outcome := "busy")
        try:
            if os.path.isfile(target):
                outcome = "present"
            else:
                builder.build()
                outcome = "built" if os.path.isfile(target) else "failed"
        finally:
            lock.release()
        if outcome != "failed" and original_load is not None:
            loaded = bool(original_load(isa, target))  # torch's own child-process load
    except Exception as exc:  # torch builds it again and draws its own conclusion
        log.debug("compile_cache: prefetch build of %s failed: %s", target, exc)
        outcome = "failed"
    finally:
        answer.set_result(loaded if outcome in ("built", "present") else None)
    return outcome


def cpu_isa_flags() -> list[str]:
    """The instruction-set flags torch's CPU checks report (``torch.cpu._is_<flag>_supported``).

    Best effort, no capability: torch's public ``get_cpu_capability()`` already names the
    vector ISA in the environment key; these add the finer flags where this torch has them.
    """
    import torch

    flags = []
    for flag in ("avx2", "avx512", "vnni", "amx_tile", "arm_sve"):
        probe = getattr(torch.cpu, f"_is_{flag}_supported", None)
        if probe is not None:
            try:
                if probe():
                    flags.append(flag)
            except Exception:
                pass
    return flags


def _reset() -> None:
    """Forget answerers, observed answers and counts (the hook on torch stays installed)."""
    with _lock:
        _answerers.clear()
        _observed.clear()
        _counts.update(answered=0, asked_torch=0)
