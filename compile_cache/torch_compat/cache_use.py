"""Capture by use: which of torch's cache entries each region group's compiles used, hit or written.

A pack must hold what the model *uses*, not what a directory gained: a warm local dir gains
nothing, and a diff also sees other models' files and ``.so`` files the linker is still writing.
These hooks (torch 2.13) record every entry torch's caches hand out or store:
``AOTAutogradCache`` and ``FxGraphCache`` (``find_guarded_entry`` + ``try_load`` /
``load_with_key`` for a hit that produced a usable result, ``_write_to_local_cache`` for an entry
written; the exact bytes either way, at torch's own ``_get_tmp_dir_for_key`` + ``sha256_hash``
path), ``CppCodeCache._load_library`` (a kernel's path and key, after torch built and loaded it;
remembered per FX key too, since torch never loads a library twice in a process), and
``torch._dynamo.callback.callback_handler`` (a frame or lazy-backward compile ended). The ISA
probe's test libraries are recorded by :mod:`.isa`.

**Units and attribution.** What one Dynamo graph needs (its AOT entry, forward and backward FX
entries, kernels) forms a *unit*, keyed by the compile id (``CompileContext``). The owner on top
of the thread's :func:`owner_stack` (a region group's code name) claims the compile id at its
first event; the lazy backward runs under the forward's saved compile context, so it lands in the
same unit although ``loss.backward()`` runs outside any region call. A unit's *slot* says what
the graph is for (input shapes, strides, dtypes, devices, ``requires_grad``, grad mode): a newer
unit in a slot supersedes an older one (:mod:`compile_cache.store.generations`).
``torch._dynamo.reset()`` clears Dynamo's callbacks and restarts compile ids: that starts a new
epoch (claims forgotten, callback put back, an owner's next compile starts a fresh record).

Known torch versions: :data:`VERIFIED_TORCH` by experiment, :data:`UNVERIFIED_TORCH` by reading
the source only; elsewhere the probe decides. Without the capability the capture is a directory
diff (warned once, counted as ``capture_fallbacks`` in the store's stats).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import autotune, available, capability, mark_missing
from .inductor_cache import KernelFile, member_name
from .tensors import input_signature

__all__ = ["UNVERIFIED_TORCH", "VERIFIED_TORCH", "Unit", "compile_seconds", "counts", "fx_lookups",
           "install", "note_file", "on_compiled", "owner_stack", "record_file",
           "record_graph_fields", "snapshot"]

log = logging.getLogger("compile_cache")

#: torch versions these hooks were verified against by experiment (fresh-node hits, tests).
VERIFIED_TORCH = ("2.13",)
#: torch versions whose source was read but that were not run.
UNVERIFIED_TORCH = ("2.11",)

_NEEDS = (
    "torch._inductor.codecache.FxGraphCache (find_guarded_entry, load_with_key, "
    "_write_to_local_cache, _get_tmp_dir_for_key), sha256_hash, get_lock_dir, "
    "CppCodeCache._load_library, torch._functorch._aot_autograd.autograd_cache.AOTAutogradCache "
    "(find_guarded_entry, try_load, _write_to_local_cache), torch._dynamo.callback."
    "callback_handler, torch._guards.CompileContext (verified with torch "
    f"{', '.join(VERIFIED_TORCH)}; {', '.join(UNVERIFIED_TORCH)} read, not run)"
)


@capability(
    "cache_use.capture",
    needs=_NEEDS,
    breaks="packs are captured by diffing the local cache dirs instead: a node whose local dir "
    "is already warm publishes nothing and a pack can carry other models' files",
)
def _probe() -> str | None:
    from torch._dynamo.callback import callback_handler
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._guards import CompileContext
    from torch._inductor import codecache

    wanted = (
        (codecache.FxGraphCache, ("find_guarded_entry", "load_with_key", "_write_to_local_cache",
                                  "_get_tmp_dir_for_key")),
        (AOTAutogradCache, ("find_guarded_entry", "try_load", "_write_to_local_cache",
                            "_get_tmp_dir_for_key")),
        (codecache.CppCodeCache, ("_load_library",)),
        (callback_handler, ("register_start_callback", "register_end_callback", "clear",
                            "start_callbacks", "end_callbacks")),
        (CompileContext, ("current_compile_id",)),
        (codecache, ("sha256_hash", "get_lock_dir")),
    )
    for owner, names in wanted:
        missing = [name for name in names if not hasattr(owner, name)]
        if missing:
            return f"{getattr(owner, '__name__', type(owner).__name__)} has no {missing[0]}"
    return None


@dataclasses.dataclass
class Unit:
    """What one Dynamo graph of an owner used: entries (member -> exact bytes) and kernels."""

    slot: str
    entries: dict[str, bytes] = dataclasses.field(default_factory=dict)
    kernels: dict[str, KernelFile] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Usage:
    epoch: int
    units: list[Unit] = dataclasses.field(default_factory=list)
    generation: int = 0
    seconds: float = 0.0  # wall time of the compiles attributed to the owner


_lock = threading.RLock()
_tls = threading.local()
_epoch = 0
_usage: dict[str, _Usage] = {}
_claims: dict[str, str] = {}  # compile id -> owner
_current: dict[str, Unit] = {}  # compile id -> the unit its events go to
_fx_kernels: dict[str, dict[str, KernelFile]] = {}  # FX key -> kernels loaded while it was current
_file_units: dict[str, tuple[str, Unit, int]] = {}  # path -> (owner, unit, epoch) it belongs to
_listeners: list[Callable[[set[str]], None]] = []
_notified: dict[str, int] = {}
_seconds: dict[str, float] = {}  # owner -> compile seconds (kept across Dynamo resets)
_counts = {"fx_hit": 0, "fx_write": 0, "aot_hit": 0, "aot_write": 0, "kernel_load": 0,
           "file": 0, "unowned": 0, "resets": 0}
_installed = False
#: FX-graph lookups per owner, when :func:`record_graph_fields` is on: fx key -> ``{"hit": bool,
#: "fields": {field: [hash, value]}}`` (torch's own key details, ``FxGraphHashDetails``).
_fx_lookups: dict[str, dict[str, dict[str, Any]]] = {}
_graph_fields = False
_FIELD_VALUE_CHARS = 120


def owner_stack() -> list[str]:
    """This thread's owner stack: push a region group's code name around its compiled call."""
    stack = getattr(_tls, "owners", None)
    if stack is None:
        stack = _tls.owners = []
    return stack


def on_compiled(listener: Callable[[set[str]], None]) -> None:
    """``listener(owners)`` after each compile (frame or lazy backward) that added to their usage.

    Runs on the compiling thread, inside torch's compile: it must only enqueue work.
    """
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def counts() -> dict[str, int]:
    """Events seen in this process (hits and writes recorded, kernels loaded, Dynamo resets)."""
    with _lock:
        return dict(_counts)


def snapshot(owners: Iterable[str]) -> tuple[list[tuple[str, Unit]], int]:
    """``([(owner, unit copy)...], generation sum)`` of the owners' current usage, in order."""
    out: list[tuple[str, Unit]] = []
    generation = 0
    with _lock:
        for owner in owners:
            usage = _usage.get(owner)
            if usage is None:
                continue
            generation += usage.generation + (usage.epoch << 32)
            for unit in usage.units:
                out.append((owner, Unit(unit.slot, dict(unit.entries), dict(unit.kernels))))
    return out, generation


def record_graph_fields(on: bool = True) -> None:
    """Keep, for each FX-graph lookup from now on, torch's key details by field (the process
    store's ``explain``: which field of a missed graph differs from the published ones)."""
    global _graph_fields
    _graph_fields = on


def fx_lookups(owners: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The owners' FX-graph lookups: fx key -> ``{"hit": bool, "fields": {field: [hash, value]}}``
    (empty unless :func:`record_graph_fields` was on)."""
    out: dict[str, dict[str, Any]] = {}
    with _lock:
        for owner in owners:
            out.update({k: {"hit": v["hit"], "fields": dict(v["fields"])}
                        for k, v in _fx_lookups.get(owner, {}).items()})
    return out


def _key_fields(debug_lines: Any) -> dict[str, list[str]]:
    """``{field: [hash, value]}`` from torch's ``debug_lines`` (``[hash] field: value``)."""
    fields: dict[str, list[str]] = {}
    for line in debug_lines if isinstance(debug_lines, (list, tuple)) else ():
        if not isinstance(line, str) or not line.startswith("["):
            continue
        digest, _, rest = line[1:].partition("] ")
        name, _, value = rest.partition(": ")
        if name:
            fields[name] = [digest, value if len(value) <= _FIELD_VALUE_CHARS
                            else value[:_FIELD_VALUE_CHARS] + "..."]
    return fields


def compile_seconds(owners: Iterable[str]) -> float:
    """Seconds the owners' compiles took in this process (start to end of each compile)."""
    with _lock:
        return sum(_seconds.get(owner, 0.0) for owner in owners)


def _compile_id() -> str | None:
    from torch._guards import CompileContext

    try:
        cid = CompileContext.current_compile_id()
    except Exception:
        return None
    return None if cid is None else str(cid)


def _usage_of(owner: str) -> _Usage:
    usage = _usage.get(owner)
    if usage is None or usage.epoch != _epoch:  # Dynamo was reset: the old compiled code is gone
        usage = _usage[owner] = _Usage(epoch=_epoch)
    return usage


def _unit(slot: str | None, *, unless_aot: bool = False) -> tuple[Unit, str | None] | None:
    """The unit this event belongs to, and its owner. ``slot`` starts a new unit (a new graph),
    unless ``unless_aot`` and the current one is an AOT graph's (its FX graphs join it).

    Called with ``_lock`` held.
    """
    cid = _compile_id()
    stack = getattr(_tls, "owners", None)
    owner = stack[-1] if stack else None
    key = cid if cid is not None else f"thread-{threading.get_ident()}"
    if owner is not None and _claims.get(key) != owner:
        if key in _claims:  # claimed by another owner before: its unit is not this one's
            _current.pop(key, None)
        _claims[key] = owner
    owner = _claims.get(key)
    if owner is None:  # a compile no region call started (the user's own): not ours, not kept
        _counts["unowned"] += 1
        return None
    unit = _current.get(key)
    if unless_aot and unit is not None and unit.slot.startswith("aot:"):
        slot = None
    if unit is None or slot is not None:
        unit = _current[key] = Unit(slot=slot or "graph")
        _usage_of(owner).units.append(unit)
    return unit, owner


def _changed(owner: str | None) -> None:
    if owner is not None:
        _usage_of(owner).generation += 1


def _record_entry(kind: str, cls: Any, key: str, content: bytes | None, hit: bool) -> None:
    if content is None:
        return
    from torch._inductor.codecache import sha256_hash

    member = member_name(os.path.join(cls._get_tmp_dir_for_key(key), sha256_hash(content)))
    if member is None:
        return
    with _lock:
        _counts[f"{kind}_{'hit' if hit else 'write'}"] += 1
        found = _unit(None)
        if found is None:
            return
        unit, owner = found
        unit.entries[member] = bytes(content)
        if kind == "fx":
            unit.kernels.update(_fx_kernels.get(key, {}))
        _changed(owner)


def _record_kernel(path: str, key: str) -> None:
    member = member_name(path)
    if member is None:
        return
    st = os.stat(path)
    kernel = KernelFile(os.path.realpath(path), key, st.st_size, st.st_mtime_ns)
    with _lock:
        _counts["kernel_load"] += 1
        fx_key = getattr(_tls, "fx_key", None)
        if fx_key is not None:
            _fx_kernels.setdefault(fx_key, {})[member] = kernel
        found = _unit(None)
        if found is not None:
            unit, owner = found
            unit.kernels[member] = kernel
            _changed(owner)


def note_file(path: str) -> None:
    """``path`` (a kernel's autotune result, written later) belongs to the unit being compiled
    now: a later :func:`record_file` of it lands there, whoever runs the kernel."""
    if _compile_id() is None:
        return
    with _lock:
        found = _unit(None)
        if found is not None:
            _file_units[os.path.realpath(path)] = (found[1], found[0], _epoch)  # type: ignore[assignment]


def record_file(path: str, data: bytes) -> None:
    """Records a file a region group's kernels used (an autotune result: written after a kernel's
    first run, or read when it was loaded) with its exact bytes, in the unit :func:`note_file`
    named, else the compile's current unit, else the last unit of the group on top of this
    thread's owner stack (whose call ran the kernel); then queues a publish."""
    member = member_name(path)
    if member is None:
        return
    with _lock:
        _counts["file"] += 1
        noted = _file_units.get(os.path.realpath(path))
        if noted is not None and noted[2] == _epoch:
            owner, unit = noted[0], noted[1]
        elif _compile_id() is not None:
            found = _unit(None)
            if found is None:
                return
            unit, owner = found  # type: ignore[assignment]
        else:
            stack = getattr(_tls, "owners", None)
            if not stack:  # a kernel no region call ran (the user's own compile): not ours
                _counts["unowned"] += 1
                return
            owner = stack[-1]
            usage = _usage_of(owner)
            if not usage.units:
                usage.units.append(Unit(slot="autotune"))
            unit = usage.units[-1]
        if unit.entries.get(member) == data:
            return
        unit.entries[member] = bytes(data)
        _changed(owner)
        usage = _usage[owner]
        mark = usage.generation + (usage.epoch << 32)
        if _compile_id() is not None or _notified.get(owner) == mark:
            return  # inside a compile: the compile's end notifies
        _notified[owner] = mark
        listeners = list(_listeners)
    for listener in listeners:  # after a kernel's first run, outside any compile
        try:
            listener({owner})
        except Exception as exc:
            log.warning("compile_cache: listener failed after an autotune result: %s", exc)


# --------------------------------------------------------------------------------------------
# Hooks


def _wrap(cls: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replaces the static or class method ``cls.name`` (own or inherited) by ``make(function)``."""
    import inspect

    original = inspect.getattr_static(cls, name)
    function = original.__func__ if isinstance(original, (classmethod, staticmethod)) else original
    if getattr(function, "_compile_cache_original", None) is not None:
        return  # already ours
    wrapper = make(function)
    wrapper._compile_cache_original = function  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(function, "__name__", name)
    wrapper.__qualname__ = getattr(function, "__qualname__", name)
    kind = staticmethod if isinstance(original, staticmethod) else classmethod
    setattr(cls, name, kind(wrapper))


def _find(tag: str) -> Callable[[Any], Any]:
    """``find_guarded_entry`` that remembers what it found (recorded only once it was usable)."""

    def make(function: Any) -> Any:
        def find_guarded_entry(cls: Any, key: str, *args: Any, **kwargs: Any) -> Any:
            result = function(cls, key, *args, **kwargs)
            if result[0] is not None:
                setattr(_tls, tag, (key, result[1]))
            return result

        return find_guarded_entry

    return make


def _write(kind: str, cls: Any) -> Callable[[Any], Any]:
    """``_write_to_local_cache`` that records the entry written (and ends an FX scope)."""

    def make(function: Any) -> Any:
        def _write_to_local_cache(key: str, content: bytes) -> None:
            function(key, content)
            _record_entry(kind, cls, key, content, hit=False)
            if getattr(_tls, "fx_key", None) == key:
                _tls.fx_key = None

        return _write_to_local_cache

    return make


def _install_fx() -> None:
    from torch._inductor.codecache import FxGraphCache

    def make_load(function: Any) -> Any:
        def load_with_key(key: str, debug_lines: Any, example_inputs: Any, *args: Any,
                          **kwargs: Any) -> Any:
            is_backward = kwargs.get("is_backward", args[2] if len(args) > 2 else None)
            with _lock:  # part of the AOT graph being compiled, else (AOT cache off) its own
                claimed = _unit(f"fx:{input_signature(example_inputs, is_backward)}", unless_aot=True)
            _tls.fx_key, _tls.fx_found = key, None  # kernels loaded from now on belong to it
            result = function(key, debug_lines, example_inputs, *args, **kwargs)
            if _graph_fields and claimed is not None and claimed[1] is not None:
                fields = _key_fields(debug_lines)
                with _lock:
                    _fx_lookups.setdefault(claimed[1], {})[key] = {
                        "hit": result[0] is not None, "fields": fields}
            found, _tls.fx_found = getattr(_tls, "fx_found", None), None
            if result[0] is not None:  # a hit that loaded (its kernels were loaded inside)
                if found is not None and found[0] == key:
                    _record_entry("fx", FxGraphCache, key, found[1], hit=True)
                if getattr(_tls, "fx_key", None) == key:
                    _tls.fx_key = None
            return result  # a miss: the scope lasts until the compiled graph is written

        return load_with_key

    _wrap(FxGraphCache, "find_guarded_entry", _find("fx_found"))
    _wrap(FxGraphCache, "load_with_key", make_load)
    _wrap(FxGraphCache, "_write_to_local_cache", _write("fx", FxGraphCache))


def _loaded_function(result: Any) -> Any:
    """The compiled function ``AOTAutogradCache.try_load`` returned, or None on a miss: torch
    2.13 returns ``(function or None, aot_config)``, torch 2.11 the function or None.
    Any other shape is an internal that moved: the capability is marked missing (warned once)
    and the hit goes unrecorded, while the user's compile goes on with what torch returned."""
    if isinstance(result, tuple) and result:
        return result[0]
    if result is None or callable(result):
        return result
    mark_missing("cache_use.capture", f"AOTAutogradCache.try_load returned a "
                 f"{type(result).__name__}, not a function, None or a (function, config) pair")
    return None


def _install_aot() -> None:
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    def make_try_load(function: Any) -> Any:
        def try_load(mod: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
            import torch

            with _lock:  # a new graph: a new unit, in the slot its inputs describe
                _unit(f"aot:{input_signature(args, torch.is_grad_enabled())}")
            _tls.aot_found = None
            result = function(mod, args, *rest, **kwargs)
            found, _tls.aot_found = getattr(_tls, "aot_found", None), None
            # An entry whose FX graphs are gone raises FXGraphCacheMiss inside try_load and is
            # compiled again: only a hit that produced a function is recorded.
            if _loaded_function(result) is not None and found is not None:
                _record_entry("aot", AOTAutogradCache, found[0], found[1], hit=True)
            return result

        return try_load

    _wrap(AOTAutogradCache, "find_guarded_entry", _find("aot_found"))
    _wrap(AOTAutogradCache, "try_load", make_try_load)
    _wrap(AOTAutogradCache, "_write_to_local_cache", _write("aot", AOTAutogradCache))


def _install_kernels() -> None:
    from torch._inductor.codecache import CppCodeCache

    def make(function: Any) -> Any:
        def _load_library(cls: Any, path: str, key: str) -> Any:
            library = function(cls, path, key)  # loaded: torch built it under its lock
            try:
                _record_kernel(path, key)
            except Exception as exc:  # never break torch's load
                log.debug("compile_cache: kernel %s not recorded: %s", path, exc)
            return library

        return _load_library

    _wrap(CppCodeCache, "_load_library", make)


def _on_compile_start(args: Any) -> None:
    _tls.compile_start = time.perf_counter()


def _on_compile_end(args: Any) -> None:
    cid = str(getattr(args, "compile_id", ""))
    started, _tls.compile_start = getattr(_tls, "compile_start", None), None
    with _lock:
        stack = getattr(_tls, "owners", None)
        first = stack[-1] if stack else _claims.get(cid)
        if first is not None and started is not None:
            _seconds[first] = _seconds.get(first, 0.0) + time.perf_counter() - started
        candidates = {_claims.get(cid), first}
        due = set()
        for owner in candidates - {None}:
            usage = _usage.get(owner)  # type: ignore[arg-type]
            mark = None if usage is None else usage.generation + (usage.epoch << 32)
            if mark is not None and _notified.get(owner) != mark:  # type: ignore[arg-type]
                _notified[owner] = mark  # type: ignore[index]
                due.add(owner)
        listeners = list(_listeners)
    if due:
        for listener in listeners:
            try:
                listener(due)  # type: ignore[arg-type]
            except Exception as exc:  # a listener must never break torch's compile
                log.warning("compile_cache: compile-end listener failed: %s", exc)


def _install_compile_end() -> None:
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(_on_compile_start)
    callback_handler.register_end_callback(_on_compile_end)
    clear = callback_handler.clear
    if getattr(clear, "_compile_cache_original", None) is not None:
        return

    def clear_and_restart() -> None:
        try:
            clear()
        finally:
            _new_epoch(callback_handler)

    clear_and_restart._compile_cache_original = clear  # type: ignore[attr-defined]
    callback_handler.clear = clear_and_restart  # type: ignore[method-assign]


def _new_epoch(handler: Any) -> None:
    """``torch._dynamo.reset()`` cleared the callbacks and restarts compile ids at 0."""
    global _epoch
    with _lock:
        _epoch += 1
        _counts["resets"] += 1
        _claims.clear()
        _current.clear()
    try:
        if _on_compile_start not in handler.start_callbacks:
            handler.register_start_callback(_on_compile_start)
        if _on_compile_end not in handler.end_callbacks:
            handler.register_end_callback(_on_compile_end)
    except Exception as exc:  # torch's reset must never fail because of us: no publish at compile end
        mark_missing("cache_use.capture", f"after torch._dynamo.reset(): {type(exc).__name__}: {exc}")


def install() -> bool:
    """Attaches every hook (once per process); False, with one warning, where torch lacks one."""
    global _installed
    with _lock:
        if _installed:
            return available("cache_use.capture")
        if not available("cache_use.capture"):
            return False
        try:
            _install_fx()
            _install_aot()
            _install_kernels()
            _install_compile_end()
            # Optional: without it (warned), autotune results are not carried.
            autotune.install(note_file, record_file)
        except Exception as exc:  # a signature torch changed: the diff takes over, loudly
            mark_missing("cache_use.capture", f"{type(exc).__name__}: {exc}")
            return False
        _installed = True
        return True


def _reset() -> None:
    """Forget usage, claims and events (tests; the hooks on torch stay installed)."""
    global _epoch
    with _lock:
        _epoch += 1
        _usage.clear()
        _claims.clear()
        _current.clear()
        _fx_kernels.clear()
        _file_units.clear()
        _notified.clear()
        _seconds.clear()
        _listeners.clear()
        _fx_lookups.clear()
        for name in _counts:
            _counts[name] = 0
