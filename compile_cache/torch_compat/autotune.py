"""Autotune results a region's kernels used: Triton's ``.best_config`` files and max-autotune's
selection cache, recorded for capture by use and put back before the first run.

Without them every fresh node benchmarks each Triton kernel's configs at its first run (0.1 to
0.5 s a node in the default mode, seconds with ``max-autotune``), although the kernels themselves
ride inside the FX-graph entries.

* **``.best_config``** (torch 2.13, ``torch/_inductor/runtime/autotune_cache.py``): the local
  autotune cache of a kernel whose source is ``<inductor dir>/<xx>/<name>.py`` is the JSON file
  ``AutotuneCache._make_local_cache_key(dirname, AutotuneCache._prepare_key(filename))``,
  next to the kernel. ``AutotuneCache.save`` writes it after benchmarking (at the kernel's first
  run), ``AutotuneCache._read`` reads it (when the kernel is loaded). Both are wrapped: the
  file's exact bytes are recorded (:func:`compile_cache.torch_compat.cache_use.record_file`) in
  the unit of the compile that created the kernel's ``AutotuneCache`` (``AutotuneCache.create``,
  wrapped too), else the current compile's, else the last unit of the region group whose call
  ran the kernel. Its member name is its path under the Inductor dir, so a restore writes it
  where torch's autotuner looks (:func:`best_config_path` derives that path with torch's code).
* **max-autotune's selection cache** (``torch._inductor.codecache.PersistentCache``): one JSON
  file per node, ``<inductor dir>/cache/<system hash>``, that every model adds to. A pack cannot
  carry the whole file (other models' entries, bytes that change with every write), so what a
  lookup used (``cache[op][inputs][precision][choice]`` for its choices) is recorded as a *part*,
  ``cache/<system hash>.compile_cache/<digest>.json``, and :func:`merge_restored_parts` folds
  restored parts into torch's file (torch's entries win) before the first compile reads it.

Torch checks what it reads: a ``.best_config`` whose ``configs_hash`` differs from the kernel's
configs is ignored (torch benchmarks again), so a stale file costs time, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

from . import available, capability, mark_missing

__all__ = ["PART_DIR_SUFFIX", "best_config_path", "counts", "install", "merge_restored_parts",
           "install_possible", "selection_cache_path", "triton_bundling"]

log = logging.getLogger("compile_cache")

#: Parts of the selection cache ``<inductor dir>/cache/<hash>`` live in ``<hash><suffix>/``.
PART_DIR_SUFFIX = ".compile_cache"

_NEEDS = (
    "torch._inductor.runtime.autotune_cache.AutotuneCache (create, save, _read, local_cache, "
    "_prepare_key), torch._inductor.codecache.PersistentCache (lookup, get_local_cache, "
    "get_local_cache_path, system)"
)

_counts = {"best_config_saved": 0, "best_config_read": 0, "selection_parts": 0,
           "parts_merged": 0}
_installed = False
#: Set by :func:`install`: where noted and recorded files go (capture by use's bookkeeping).
_callbacks: dict[str, Any] = {"note": None, "record": None}


@capability(
    "autotune.capture",
    needs=_NEEDS,
    breaks="autotune results (.best_config, max-autotune's selection cache) are not carried: "
    "every fresh node benchmarks each Triton kernel's configs again at its first run",
)
def _probe() -> str | None:
    from torch._inductor.codecache import PersistentCache
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    for owner, names in ((AutotuneCache, ("create", "save", "_read", "_prepare_key")),
                         (PersistentCache, ("lookup", "get_local_cache", "get_local_cache_path"))):
        missing = [name for name in names if not hasattr(owner, name)]
        if missing:
            return f"{owner.__name__} has no {missing[0]}"
    return None


def counts() -> dict[str, int]:
    """Autotune files recorded (saved, read), selection-cache parts recorded and merged."""
    return dict(_counts)


def best_config_path(kernel_path: str) -> str:
    """Where torch's autotuner keeps the ``.best_config`` of the kernel at ``kernel_path``
    (torch's own ``AutotuneCache`` key functions: the same path its local cache reads)."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    dirname, key = os.path.dirname(kernel_path), AutotuneCache._prepare_key(kernel_path)
    make = getattr(AutotuneCache, "_make_local_cache_key", None)
    if make is not None:  # torch 2.13
        return make(dirname, key)
    # torch 2.11 and earlier inline it in _setup_local_cache: sha256 of the key and torch_key()
    import hashlib

    from torch._inductor.codecache import torch_key

    hasher = hashlib.sha256(key.encode("utf-8"))
    hasher.update(torch_key())
    return os.path.join(dirname, f"{hasher.hexdigest()}.best_config")


def selection_cache_path() -> str:
    """max-autotune's selection cache file on this node (torch's ``PersistentCache``)."""
    from torch._inductor.codecache import PersistentCache

    return str(PersistentCache.get_local_cache_path())


def triton_bundling() -> bool | None:
    """Whether Inductor bundles Triton kernels into its FX-graph entries (torch's
    ``TritonBundler.is_enabled``: ``bundle_triton_into_fx_graph_cache``, off when caches are
    force-disabled); None when torch cannot say. Without it a pack carries no Triton kernels."""
    try:
        from torch._inductor.triton_bundler import TritonBundler

        return bool(TritonBundler.is_enabled())
    except Exception:
        return None


def _read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _record(path: str) -> None:
    data = _read_file(path)
    if data is not None:
        _callbacks["record"](path, data)


def _local_key(cache: Any) -> str | None:
    local = getattr(cache, "local_cache", None)
    if not local:
        return None
    key = local[1]
    return key if isinstance(key, str) and key.endswith(".best_config") else None


def _install_best_config() -> None:
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    create, save, read = AutotuneCache.create, AutotuneCache.save, AutotuneCache._read
    if getattr(save, "_compile_cache_original", None) is not None:
        return

    def create_noting(inductor_meta: Any, filename: str, configs_hash: str) -> Any:
        cache = create(inductor_meta, filename, configs_hash)
        try:
            key = _local_key(cache)
            if key is not None:
                _callbacks["note"](key)  # the compile that made the kernel owns its result
        except Exception as exc:  # never break torch's kernel load
            log.debug("compile_cache: autotune cache of %s not noted: %s", filename, exc)
        return cache

    def save_recording(self: Any, *args: Any, **kwargs: Any) -> None:
        save(self, *args, **kwargs)
        try:
            key = _local_key(self)
            if key is not None:
                _counts["best_config_saved"] += 1
                _record(key)
        except Exception as exc:
            log.debug("compile_cache: autotune result not recorded: %s", exc)

    def read_recording(self: Any) -> Any:
        found = read(self)
        try:
            key = _local_key(self)
            if found and key is not None and os.path.isfile(key):
                _counts["best_config_read"] += 1
                _record(key)
        except Exception as exc:
            log.debug("compile_cache: autotune result read not recorded: %s", exc)
        return found

    for wrapper, original in ((create_noting, create), (save_recording, save),
                              (read_recording, read)):
        wrapper._compile_cache_original = original  # type: ignore[attr-defined]
        wrapper.__name__ = original.__name__
        wrapper.__qualname__ = original.__qualname__
    AutotuneCache.create = staticmethod(create_noting)  # type: ignore[method-assign]
    AutotuneCache.save = save_recording  # type: ignore[method-assign]
    AutotuneCache._read = read_recording  # type: ignore[method-assign]


def _part(cache: dict[str, Any], op: str, inputs: str, precision: str,
          choices: Iterable[str]) -> dict[str, Any] | None:
    """``{op: {inputs: {precision: {choice: timing}}}}`` for ``choices``, or None if one lacks."""
    wanted = set(choices)
    found = cache.get(op, {}).get(inputs, {}).get(precision, {})
    picked = {c: found[c] for c in wanted if c in found}
    if not picked or len(picked) != len(wanted):
        return None
    return {op: {inputs: {precision: picked}}}


def _install_selection() -> None:
    import torch
    from torch._inductor.codecache import PersistentCache

    lookup = PersistentCache.lookup
    if getattr(lookup, "_compile_cache_original", None) is not None:
        return

    def lookup_recording(self: Any, choices: Any, op: str, inputs: str, benchmark: Any,
                         hint_override: int | None = None) -> Any:
        timings = lookup(self, choices, op, inputs, benchmark, hint_override)
        try:
            if timings:
                key = f"{inputs}_{hint_override}" if hint_override is not None else inputs
                part = _part(self.get_local_cache(), op, key,
                             torch.get_float32_matmul_precision(),
                             [choice.hash_key() for choice in choices])
                if part is not None:
                    data = json.dumps({"system": self.system, "cache": part},
                                      sort_keys=True).encode()
                    base = str(self.get_local_cache_path())
                    name = hashlib.sha256(data).hexdigest()[:32] + ".json"
                    _counts["selection_parts"] += 1
                    _callbacks["record"](os.path.join(base + PART_DIR_SUFFIX, name), data)
        except Exception as exc:
            log.debug("compile_cache: selection-cache use not recorded: %s", exc)
        return timings

    lookup_recording._compile_cache_original = lookup  # type: ignore[attr-defined]
    lookup_recording.__name__ = lookup.__name__
    lookup_recording.__qualname__ = lookup.__qualname__
    PersistentCache.lookup = lookup_recording  # type: ignore[method-assign]


def install_possible() -> bool:
    """The hooks can be attached in this process (the capability is available)."""
    return available("autotune.capture")


def install(note: Callable[[str], None], record: Callable[[str, bytes], None]) -> bool:
    """Attaches the autotune hooks (once per process); False, warned once, where torch lacks
    one (capture by use goes on without autotune results). ``note(path)``: a kernel's result
    file belongs to the compile running now; ``record(path, bytes)``: a result file was used."""
    global _installed
    _callbacks.update(note=note, record=record)
    if _installed:
        return available("autotune.capture")
    if not available("autotune.capture"):
        return False
    try:
        _install_best_config()
        _install_selection()
    except Exception as exc:
        mark_missing("autotune.capture", f"{type(exc).__name__}: {exc}")
        return False
    _installed = True
    return True


def _merge(into: dict[str, Any], part: dict[str, Any]) -> bool:
    """Adds ``part``'s leaves missing from ``into`` (torch's own entries win); True if any."""
    changed = False
    for name, value in part.items():
        if isinstance(value, dict):
            child = into.setdefault(name, {})
            if not isinstance(child, dict):
                continue
            changed = _merge(child, value) or changed
        elif name not in into:
            into[name] = value
            changed = True
    return changed


def merge_restored_parts(paths: Iterable[str]) -> int:
    """Folds restored selection-cache parts into torch's selection cache file next to them
    (``<dir>/<hash>``, from ``<dir>/<hash>.compile_cache/<part>.json``); the number merged.

    Torch's entries win over a part's; a part whose system differs from the file's is skipped
    (that file belongs to another GPU or Triton). Written atomically, as torch writes it.
    """
    merged = 0
    by_file: dict[str, list[str]] = {}
    for path in paths:
        parent = os.path.dirname(path)
        if parent.endswith(PART_DIR_SUFFIX) and path.endswith(".json"):
            by_file.setdefault(parent[: -len(PART_DIR_SUFFIX)], []).append(path)
    for target, parts in by_file.items():
        if os.path.islink(target):  # never write through a link planted in the local dir
            continue
        try:
            with open(target) as f:
                current = json.load(f)
        except FileNotFoundError:
            current = None
        except (OSError, ValueError) as exc:
            log.info("compile_cache: selection cache %s unreadable (%s); parts left out",
                     target, exc)
            continue
        changed = False
        for path in sorted(parts):
            try:
                with open(path) as f:
                    part = json.load(f)
            except (OSError, ValueError):
                continue
            if not isinstance(part, dict) or not isinstance(part.get("cache"), dict):
                continue
            if current is None:
                current = {"system": part.get("system"), "cache": {}}
            if current.get("system") != part.get("system"):
                continue
            if _merge(current.setdefault("cache", {}), part["cache"]):
                changed = True
                merged += 1
        if changed and current is not None:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(current, f, indent=4)
                os.replace(tmp, target)
            except OSError as exc:
                log.info("compile_cache: selection cache %s not written: %s", target, exc)
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    _counts["parts_merged"] += merged
    return merged


def _reset() -> None:
    """Forget the counts (tests; the hooks stay)."""
    for name in _counts:
        _counts[name] = 0
