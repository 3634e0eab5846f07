"""Dynamo's automatic-dynamic decisions of a model's regions, carried by the store.

Dynamo records, per code object (``torch._dynamo.pgo.CodeId``), the sizes and ints each input
had at every compile (``CodeState.automatic_dynamic``): a dimension seen with two values is
*dynamic*, and the next compile of that code makes it symbolic. A fresh process starts empty,
so its first call at any length compiles a static graph, whatever other nodes learned. This
module reads that record for the region groups' code objects (each group has its own, named
after it: :func:`compile_cache.regions._region_function`) and for the resume functions after
their graph breaks, encodes it as JSON (no pickle from a shared store), and merges a restored
record into the process's before its first compile, with torch's own merge (``|=``: a value
seen to differ anywhere is dynamic). Torch consults the record only where automatic dynamic
shapes are on: a group compiled with ``dynamic=False`` keeps its static graphs.

Torch's static-to-dynamic *exclusions* (``excluded_sizes``: the sizes a process had a static
graph for) are not carried: a fresh node has no static graph to fall back to.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from . import available, capability, inductor_cache
from .precompile import names

__all__ = ["MEMBER_DIR", "decisions", "encode_state", "install", "is_region_code", "merge", "restored_file",
           "snapshot", "source_files", "summary"]

log = logging.getLogger("compile_cache")

#: Where a restored record lies, under torch's Inductor cache dir (pack member ``inductor/...``).
MEMBER_DIR = "compile_cache_dynamic"
#: The code objects Dynamo makes for the rest of a frame after a graph break.
RESUME_PREFIX = "torch_dynamo_resume_in_"
_VERSION = 1


@capability(
    "pgo.automatic_dynamic",
    needs="torch._dynamo.pgo (CodeId, CodeState, FrameStateSizeEntry, get_code_state, auto_dynamic)",
    breaks="the automatic-dynamic decisions of the regions are not carried: a fresh node compiles "
    "a static graph for each input length it has not seen",
)
def _probe() -> str | None:
    from torch._dynamo import pgo

    for name in ("CodeId", "CodeState", "FrameStateSizeEntry", "get_code_state", "auto_dynamic",
                 "auto_unset", "InferStride"):
        if not hasattr(pgo, name):
            return f"torch._dynamo.pgo has no {name}"
    if not hasattr(pgo.FrameStateSizeEntry, "__ior__"):
        return "FrameStateSizeEntry cannot be merged (|=)"
    return None


def _atom(value: Any) -> Any:
    from torch._dynamo import pgo

    if value is pgo.auto_dynamic:
        return "dyn"
    if value is pgo.auto_unset:
        return None
    if isinstance(value, pgo.InferStride):
        return {"infer": value.dim}
    if type(value) in (int, float):  # a float where specialize_float keeps floats static
        return value
    raise TypeError(f"unknown frame state atom {value!r}")


def _unatom(value: Any) -> Any:
    from torch._dynamo import pgo

    if value == "dyn":
        return pgo.auto_dynamic
    if value is None:
        return pgo.auto_unset
    if isinstance(value, dict) and type(value.get("infer")) is int:
        return pgo.InferStride(value["infer"])
    if type(value) in (int, float):
        return value
    raise ValueError(f"bad frame state atom {value!r}")


def _tup(value: Any, conv: Any) -> Any:
    return [conv(v) for v in value] if isinstance(value, (tuple, list)) else conv(value)


def _untup(value: Any) -> Any:
    return tuple(_unatom(v) for v in value) if isinstance(value, list) else _unatom(value)


def _encode_entry(entry: Any) -> dict[str, Any]:
    return {"scalar": _atom(entry.scalar), "size": _tup(entry.size, _atom),
            "stride": _tup(entry.stride, _atom)}


def _decode_entry(data: dict[str, Any]) -> Any:
    from torch._dynamo import pgo

    return pgo.FrameStateSizeEntry(scalar=_unatom(data.get("scalar")), size=_untup(data.get("size")),
                                   stride=_untup(data.get("stride")))


def _key(code_id: Any) -> str:
    return f"{code_id.file_hash}:{code_id.firstlineno}:{code_id.name}:{code_id.closure_hash}"


def is_region_code(name: str, owners: Iterable[str]) -> bool:
    """Whether the code named ``name`` is one of the groups ``owners`` or a resume function."""
    return _wanted(name, set(owners))


def _wanted(name: str, owners: Iterable[str], filename: str | None = None,
            files: Iterable[str] | None = None) -> bool:
    """A group's code (its function, or its precompiled function: named after the group and
    the key, the same on every node) or a resume function after a graph break; with ``files``
    (base names), only a resume function of code in one of those files."""
    if names.owner_of(name) in owners:
        return True
    if not name.startswith(RESUME_PREFIX):
        return False
    if files is None or filename is None or os.path.basename(filename) in files:
        return True
    return any(owner in name for owner in owners)  # resumes a group's function itself


def source_files(model: Any) -> frozenset[str] | None:
    """Base names of the files that define the classes of ``model``'s modules: where the resume
    functions of its graph breaks lie (a break in a group's own function resumes in a function
    named after it). Another model's in the same process (another file) stay out of this one's
    record. None (every resume function) for what is not a module."""
    import inspect

    modules = getattr(model, "modules", None)
    if not callable(modules):
        return None
    out = set()
    for cls in {type(m) for m in modules()}:
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:  # a class without a source file (built in)
            continue
        if path:
            out.add(os.path.basename(path))
    return frozenset(out)


def snapshot(owners: Iterable[str], files: Iterable[str] | None = None) -> dict[str, Any] | None:
    """The process's record for the groups ``owners`` (code names) and the resume functions
    (with ``files``, those of code in these files: :func:`source_files`), JSON-ready; None when
    there is none (nothing compiled, or torch lacks the record)."""
    if not available("pgo.automatic_dynamic"):
        return None
    from torch._dynamo import pgo

    states = getattr(pgo, "_CODE_STATE", None)
    if not states:
        return None
    owners = set(owners)
    files = None if files is None else set(files)
    codes: dict[str, Any] = {}
    for code_id, state in list(states.items()):
        if not _wanted(code_id.name, owners, code_id.filename, files) or not state.automatic_dynamic:
            continue
        try:
            entries = {name: _encode_entry(e) for name, e in state.automatic_dynamic.items()}
        except TypeError as exc:  # a torch with other atoms: this code's record is left out
            log.debug("compile_cache: frame state of %s not carried: %s", code_id.name, exc)
            continue
        codes[_key(code_id)] = {"name": code_id.name, "firstlineno": code_id.firstlineno,
                                "file_hash": code_id.file_hash, "closure_hash": code_id.closure_hash,
                                "filename": os.path.basename(code_id.filename), "inputs": entries}
    return {"version": _VERSION, "codes": codes} if codes else None


def encode_state(state: dict[str, Any]) -> bytes:
    """Stable bytes of a record (sorted keys: the same record, the same digest)."""
    return json.dumps(state, sort_keys=True, separators=(",", ":")).encode()


def merge(*states: dict[str, Any] | None) -> dict[str, Any] | None:
    """One record from several (torch's merge: a value that differs between them is dynamic)."""
    merged: dict[str, Any] = {}
    for state in states:
        for key, code in ((state or {}).get("codes") or {}).items():
            into = merged.setdefault(key, dict(code, inputs={}))
            for name, entry in code.get("inputs", {}).items():
                have = into["inputs"].get(name)
                new = _decode_entry(entry)
                if have is not None:
                    base = _decode_entry(have)
                    base |= new
                    new = base
                into["inputs"][name] = _encode_entry(new)
    return {"version": _VERSION, "codes": merged} if merged else None


def install(state: dict[str, Any]) -> int:
    """Merges a restored record into this process's, before its compiles; the number of inputs
    now dynamic that were not (0 when torch lacks the record)."""
    if not available("pgo.automatic_dynamic") or state.get("version") != _VERSION:
        return 0
    from torch._dynamo import pgo

    states = pgo.get_code_state()
    turned = 0
    for code in (state.get("codes") or {}).values():
        try:
            code_id = pgo.CodeId(code["filename"], int(code["firstlineno"]), str(code["name"]),
                                 str(code["file_hash"]), code.get("closure_hash"))
            inputs = {name: _decode_entry(e) for name, e in code["inputs"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("compile_cache: a restored automatic-dynamic record is malformed (%s); "
                        "left out", exc)
            continue
        local = states[code_id].automatic_dynamic
        for name, entry in inputs.items():
            before = _dynamic_dims(local[name]) if name in local else 0
            local[name] |= entry
            local[name].excluded_sizes = None
            local[name].excluded_scalar = None
            turned += max(0, _dynamic_dims(local[name]) - before)
    return turned


def _dynamic_dims(entry: Any) -> int:
    from torch._dynamo import pgo

    if isinstance(entry.size, tuple):  # a tensor: its sizes (its scalar is "dyn" by torch's rule)
        return sum(d is pgo.auto_dynamic for d in entry.size)
    return int(entry.scalar is pgo.auto_dynamic)


def decisions(state: dict[str, Any] | None) -> set[tuple[str, str, str, int]]:
    """The record's dynamic decisions: (code, input, "size"/"stride"/"scalar", dimension) for
    each value recorded as varying. A record that gained none has nothing new for another node
    (its other changes are sizes seen once, which a fresh node learns by running)."""
    out: set[tuple[str, str, str, int]] = set()
    for key, code in ((state or {}).get("codes") or {}).items():
        for name, entry in (code.get("inputs") or {}).items():
            size = entry.get("size")
            if isinstance(size, list):  # a tensor: its dimensions (its scalar is "dyn" by rule)
                out.update((key, name, "size", i) for i, v in enumerate(size) if v == "dyn")
            elif entry.get("scalar") is not None and entry.get("scalar") != "dyn":
                continue  # an int or float seen at one value (its size and stride are "dyn" by rule)
            elif size == "dyn" and entry.get("scalar") == "dyn" and entry.get("stride") == "dyn":
                # a tensor whose rank changed, or a scalar that varied: either is a decision
                out.add((key, name, "any", -1))
    return out


def summary(state: dict[str, Any] | None) -> dict[str, list[str]]:
    """Per code name, the inputs with a dynamic dimension, readably (``explain``, reports)."""
    out: dict[str, list[str]] = {}
    for code in ((state or {}).get("codes") or {}).values():
        dyn = []
        for name, entry in sorted(code.get("inputs", {}).items()):
            size = entry.get("size")
            if isinstance(size, list):  # a tensor: its dynamic dimensions
                if "dyn" in size:
                    dims = ", ".join(str(i) for i, v in enumerate(size) if v == "dyn")
                    dyn.append(f"{name} (dim {dims})")
            elif entry.get("scalar") == "dyn":  # an int (a scalar's size is "dyn" by torch's rule)
                dyn.append(name)
        if dyn:
            out.setdefault(code.get("name", "?"), []).extend(dyn)
    return out


def member(scope: str) -> str:
    """The pack member of a model's record (its first region group's code name)."""
    safe = hashlib.sha256(scope.encode()).hexdigest()[:16] if len(scope) > 100 else scope
    return f"inductor/{MEMBER_DIR}/{safe}.json"


def restored_file(scope: str) -> str:
    """Where :func:`member` lies on this node once restored."""
    return os.path.join(inductor_cache.cache_dir(), *member(scope).split("/")[1:])


def read_restored(scope: str) -> dict[str, Any] | None:
    """The restored record of ``scope``, or None (none restored, or not ours: warned)."""
    try:
        with open(restored_file(scope), "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("compile_cache: restored automatic-dynamic record unreadable (%s); ignored", exc)
        return None
    return data if isinstance(data, dict) else None
