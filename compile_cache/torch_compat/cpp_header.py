"""Inductor's precompiled kernel header: built only when a kernel is really compiled.

``CppCodeCache.load_async`` (torch 2.13, ``_inductor/codecache.py``) calls
``_precompile_header`` before it knows whether the kernel's ``.so`` exists. That runs ``g++ -E``
on the header and ``openssl sha512`` in every process, and on a fresh machine builds a 149 MB
``.gch`` under ``<tmp>/torchinductor_<user>/precompiled_headers`` (about 6 s of g++ on 2 cores),
outside ``TORCHINDUCTOR_CACHE_DIR``, so a restored start whose kernels are all there pays for a
header no build uses.

:func:`install` replaces two module globals of ``codecache``:

* ``_precompile_header``: for calls from ``load_async`` only (checked by the caller's code
  object), it returns a placeholder ``.h`` (a real file that ``#include``\\ s the header, so a build
  that is not intercepted still compiles, just without the PCH) and remembers the arguments. Any
  other caller (AOTInductor) gets torch's function.
* ``_worker_compile_cpp`` (which ``load_async``'s build closure looks up as a global): for every
  builder whose target is missing and that names a placeholder, it first runs torch's own
  ``_precompile_header`` with the remembered arguments (single-flight) and puts the real path back
  into the builder's command line, where torch alone would have put it.

``AsyncCompile.submit`` is wrapped too, so that a build sent to a subprocess pool is patched in
this process first. The kernel keys are computed from a command line without the header, so they
do not change; a hit runs no g++ at all, and a miss runs byte-identical commands (tested).

:func:`start_background_build` (``COMPILE_CACHE_PREFETCH_HEADER``, default on; the policy is in
:mod:`compile_cache.prefetch`) builds the header a cold start will need in a thread, as soon as
its arguments are known: at once, from the ISA torch's probe will most likely pick (the first
candidate the CPU's flags allow, as its probe leaves it when every check passes), so that the
header's g++ runs beside the probe's builds instead of after them (about 2 s of a cold 4 x 2048
Llama ``generate()`` on 2 cores with AVX-512, benchmarks/RESULTS.md), or right after the probe
where the pick is steered by env or config. A wrong guess only wastes CPU: the compile takes the
header only if its arguments are equal (``counts()['background_unused']``).

Capability ``cpp_header.defer`` (verified with torch 2.13; 2.11 has other
``_worker_compile_cpp`` signatures, hence ``*args``): without it torch builds the header as it
always does. ``COMPILE_CACHE_DEFER_HEADER=0`` turns the deferral off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from typing import Any

from . import available, capability, mark_missing

__all__ = ["counts", "install", "installed", "start_background_build"]

log = logging.getLogger("compile_cache")


@capability(
    "cpp_header.defer",
    needs="torch._inductor.codecache._precompile_header, _worker_compile_cpp, _HEADER_DIR, "
    "write_atomic, CppCodeCache.load_async, cpp_builder.CppBuilder._include_dirs_args and "
    "async_compile.AsyncCompile.submit (verified with torch 2.13; 2.11 not verified)",
    breaks="every process with CPU kernels preprocesses Inductor's header, and a fresh machine "
    "builds its 149 MB precompiled header even when every kernel was restored",
)
def _probe() -> str | None:
    from torch._inductor import codecache
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions

    for name in ("_precompile_header", "_worker_compile_cpp", "_HEADER_DIR", "write_atomic"):
        if not hasattr(codecache, name):
            return f"torch._inductor.codecache has no {name}"
    if not callable(getattr(AsyncCompile, "submit", None)):
        return "AsyncCompile has no submit"
    options = CppTorchDeviceOptions(device_type="cpu")
    options.precompiled_header = "/x/PLACEHOLDER.h"
    probe = CppBuilder(name="o", sources="i", BuildOption=options)
    if "-include /x/PLACEHOLDER.h " not in getattr(probe, "_include_dirs_args", ""):
        return "CppBuilder._include_dirs_args does not hold '-include <header> '"
    return None


_lock = threading.RLock()
_originals: dict[str, Any] = {}
_deferred: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}  # placeholder -> arguments
_by_args: dict[Any, str] = {}
_resolved: dict[str, str] = {}  # placeholder -> the real header path
_resolve_locks: dict[str, threading.Lock] = {}
_used: set[str] = set()  # placeholders a real load_async call got
_background: set[str] = set()  # placeholders built by start_background_build
_counts = {"deferred": 0, "built": 0, "patch_failed": 0, "background": 0}


def installed() -> bool:
    """Whether the deferral is active in this process."""
    return "pch" in _originals


def counts() -> dict[str, int]:
    """Headers deferred, built (when a kernel really compiled), background builds, and
    background builds no kernel used."""
    with _lock:
        return {**_counts, "background_unused": len(_background - _used)}


def _placeholder(header: str, cmd_line: str, compile_command: dict[str, Any]) -> str | None:
    """The placeholder for these ``_precompile_header`` arguments (registered once)."""
    from torch._inductor import codecache

    try:
        args_key = (header, cmd_line, tuple(sorted(compile_command.items())))
        hash(args_key)
    except TypeError:
        return None
    with _lock:
        placeholder = _by_args.get(args_key)
        if placeholder is None:
            digest = hashlib.sha256(repr(args_key).encode()).hexdigest()[:24]
            placeholder = os.path.join(codecache._HEADER_DIR, "deferred", f"{digest}.h")
            if not os.path.exists(placeholder):
                codecache.write_atomic(placeholder, f"#include <{header}>\n", make_dirs=True)
            _by_args[args_key] = placeholder
            _deferred[placeholder] = ((header, cmd_line), dict(compile_command))
            _resolve_locks[placeholder] = threading.Lock()
            _counts["deferred"] += 1
    return placeholder


def _resolve(placeholder: str) -> str:
    """Torch's own header for ``placeholder`` (preprocessed, hashed, built if missing), once."""
    real = _resolved.get(placeholder)
    if real is not None:
        return real
    with _resolve_locks[placeholder]:
        real = _resolved.get(placeholder)
        if real is None:
            args, kwargs = _deferred[placeholder]
            real = _originals["pch"](*args, **kwargs)
            with _lock:
                _resolved[placeholder] = real
                _counts["built"] += 1
    return real


def _patch(builders: Any) -> None:
    """Puts the real header into each builder that is about to build and names a placeholder."""
    if not isinstance(builders, (list, tuple)):
        builders = (builders,)
    for builder in builders:
        option = getattr(builder, "_build_option", None)
        placeholder = getattr(option, "precompiled_header", None)
        if placeholder not in _deferred or os.path.exists(builder.get_target_file_path()):
            continue
        real = _resolve(placeholder)
        before = builder._include_dirs_args
        after = before.replace(f"-include {placeholder} ", f"-include {real} ", 1)
        if after == before:  # still correct: the placeholder includes the header
            with _lock:
                _counts["patch_failed"] += 1
            continue
        builder._include_dirs_args = after
        option.precompiled_header = real


def install() -> bool:
    """Defers the header in this process (idempotent); False where torch lacks what it needs."""
    with _lock:
        if installed():
            return True
        if not available("cpp_header.defer"):
            return False
        try:
            _install()
        except Exception as exc:
            mark_missing("cpp_header.defer", f"{type(exc).__name__}: {exc}")
            return False
        return True


def _install() -> None:
    from torch._inductor import codecache
    from torch._inductor.async_compile import AsyncCompile

    original_pch = codecache._precompile_header
    original_worker = codecache._worker_compile_cpp
    load_async = codecache.CppCodeCache.load_async.__func__
    while getattr(load_async, "__wrapped__", None) is not None:  # under a wrapper (the load
        load_async = load_async.__wrapped__  # guard): torch's own function calls the header build
    load_async_code = load_async.__code__

    def _precompile_header(header: str, hashable_cmd_line: str, **compile_command: Any) -> str:
        if sys._getframe(1).f_code is not load_async_code:  # AOTInductor and others: torch's
            return original_pch(header, hashable_cmd_line, **compile_command)
        placeholder = _placeholder(header, hashable_cmd_line, compile_command)
        if placeholder is None:
            return original_pch(header, hashable_cmd_line, **compile_command)
        with _lock:
            _used.add(placeholder)
        return placeholder

    def _worker_compile_cpp(lock_path: str, cpp_builders: Any, *rest: Any, **kwargs: Any) -> None:
        _patch(cpp_builders)
        return original_worker(lock_path, cpp_builders, *rest, **kwargs)

    for function, original in ((_precompile_header, original_pch),
                               (_worker_compile_cpp, original_worker)):
        function._compile_cache_original = original  # type: ignore[attr-defined]
        # The same qualified name: a build closure pickled to a subprocess pool resolves to the
        # child's own (unhooked) function, and the submit hook has patched its builders already.
        function.__module__ = original.__module__
        function.__qualname__ = original.__qualname__
        function.__name__ = original.__name__

    original_submit = AsyncCompile.__dict__["submit"].__func__

    def submit(cls: Any, task: Any) -> Any:
        if getattr(task, "func", None) is _worker_compile_cpp and len(task.args) > 1:
            _patch(task.args[1])
        return original_submit(cls, task)

    submit._compile_cache_original = original_submit  # type: ignore[attr-defined]
    _originals.update(pch=original_pch, worker=original_worker, submit=original_submit)
    AsyncCompile.submit = classmethod(submit)  # type: ignore[method-assign, assignment]
    codecache._precompile_header = _precompile_header
    codecache._worker_compile_cpp = _worker_compile_cpp


# --------------------------------------------------------------------------------------------
# The background build (switch: COMPILE_CACHE_PREFETCH_HEADER; measured in benchmarks/)


def _kernel_header_args(isa: Any = None) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments ``load_async`` passes to ``_precompile_header`` for a CPU kernel
    (``async_compile.cpp_pybinding``), computed as codecache.py does; None until this process's
    ISA probe ran, since the picked ISA is one of them."""
    from torch._inductor import codecache, config, cpu_vec_isa
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions

    if isa is None:
        if not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
            return None
        isa = cpu_vec_isa.pick_vec_isa()
    cls = codecache.CppPythonBindingsCodeCache
    header = cls._get_uncompiled_header("cpu")
    if header is None:
        return None
    command = {**cls.cpp_compile_command_flags, "device_type": "cpu", "extra_flags": (),
               "use_relative_path": config.is_fbcode(), "vec_isa": isa}
    option = CppTorchDeviceOptions(compile_only=False, min_optimize=False, **command)
    cmd_line = CppBuilder(name="o", sources="i", BuildOption=option).get_command_line()
    return (header, cmd_line), {"min_optimize": False, **command}


def _guessed_isa() -> Any:
    """The ISA torch's probe will most likely pick, without probing: a private instance of the
    first candidate the CPU's flags allow, as its probe leaves it when every check passes (the
    extra flags its ``__bool__`` records, such as AVX512-BF16, predicted from ``torch.cpu``'s own
    CPU queries); None where the pick is steered by env or config. Private, because the probe
    edits its own instance's ``_arch_flags`` while it runs. A wrong guess (a check that fails on
    this compiler) only wastes one build: the compile takes the header only if its arguments are
    equal."""
    import platform

    from torch._inductor import config, cpu_vec_isa

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    if os.environ.get("ATEN_CPU_CAPABILITY") or config.cpp.simdlen is not None:
        return None
    if config.cpp.vec_isa_ok is not None:
        return None
    flags = cpu_vec_isa.x86_isa_checker()
    for isa in cpu_vec_isa.supported_vec_isa_list:
        if all(flag in flags for flag in str(isa).split()):
            return _as_probed(isa)
    return None


#: What an ISA's ``__bool__`` sets when an extra check passes, each named as ``torch.cpu``'s
#: query of the same CPU feature.
_PROBED_EXTRAS = ("_is_avx512_bf16_supported", "_is_amx_fp16_supported")


def _as_probed(isa: Any) -> Any:
    import torch

    guess = type(isa)()  # class-level flags, never an instance's mid-probe edit
    for name in _PROBED_EXTRAS:
        if hasattr(guess, name):
            setattr(guess, name, bool(getattr(torch.cpu, name, lambda: False)()))
    return guess


def start_background_build(give_up_s: float = 600.0) -> threading.Thread | None:
    """Builds the kernel header in a thread as soon as its arguments are known; None if the
    deferral is not installed. The real ``load_async`` call gets the same placeholder only if
    its arguments are equal (``counts()['background_unused']`` counts wasted builds)."""
    if not installed():
        return None
    try:
        guess = _guessed_isa()
    except Exception as exc:
        log.debug("compile_cache: no ISA guess for the header: %s", exc)
        guess = None

    def run() -> None:
        deadline = time.monotonic() + give_up_s
        predicted = None
        try:
            if guess is not None:
                predicted = _kernel_header_args(guess)
            while predicted is None and time.monotonic() < deadline:
                predicted = _kernel_header_args()
                if predicted is None:
                    time.sleep(0.05)
            if predicted is None:
                return
            (header, cmd_line), kwargs = predicted
            placeholder = _placeholder(header, cmd_line, kwargs)
            if placeholder is not None:
                with _lock:
                    _background.add(placeholder)
                    _counts["background"] += 1
                _resolve(placeholder)
        except Exception as exc:  # the compile builds it when it needs it, as torch would
            log.debug("compile_cache: background header build failed: %s", exc)

    thread = threading.Thread(target=run, name="compile_cache-pch", daemon=True)
    thread.start()
    return thread


def _reset() -> None:
    """Forget the counts (tests): the deferral stays installed, with what it deferred."""
    with _lock:
        for name in _counts:
            _counts[name] = 0
        _used.clear()
        _background.clear()
