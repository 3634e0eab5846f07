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

A decision travels only when it came from a size change on the same path. Dynamo decides at
every compile of a code object, whatever made it compile: a group whose members are called with
other arguments (CLIP's encoder: text with a causal mask, then vision without, at another length)
recompiles because a guard on the *path* failed (``len(kwargs) == 1``), and that compile also
finds the length changed and compiles it dynamic. Carried, that decision made a fresh node's
*first* call (text) compile a dynamic graph the store never had, where the publisher had a
static one. So :func:`snapshot` leaves out the decisions of a code object whose recompiles in
this process all failed on other guards than shapes (:func:`shape_reason`): a fresh node then
repeats the publisher's compiles and hits. A code that recompiled because a size changed (a
failing size or stride guard, a symbolic shape guard, an int input's value) keeps its
decisions, and so do the decisions a code had after its *first* compile in the process (a
dimension dynamic from its first compile comes from a restored record: another node's size;
what its later recompiles for other paths add is left out, as above: a precompiled group's
``__cache`` function, whose store entries fail silently on a new prompt length and whose next
block recompiles on the cache's ``is_initialized``); decisions restored by :func:`install` are
always kept. Dynamo names one failing guard per compiled entry, the first it checks: where a
size guard fails before the one on the arguments (a positional tensor of another length *and*
another keyword), the recompile counts as a size change and the decision travels; the cost is
one compile on a later node, never a wrong result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from . import available, capability, dynamo, inductor_cache
from .precompile import names

__all__ = ["MEMBER_DIR", "decisions", "encode_state", "install", "is_region_code", "merge", "restored_file",
           "shape_reason", "snapshot", "source_files", "summary"]

log = logging.getLogger("compile_cache")

#: Where a restored record lies, under torch's Inductor cache dir (pack member ``inductor/...``).
MEMBER_DIR = "compile_cache_dynamic"
#: The code objects Dynamo makes for the rest of a frame after a graph break.
RESUME_PREFIX = "torch_dynamo_resume_in_"
_VERSION = 1
#: What :func:`install` put in place (code key -> input -> encoded entry), and the code-state
#: dict of torch it went into (``torch._dynamo.reset()`` makes a new one: then nothing is).
_installed: dict[str, dict[str, dict[str, Any]]] = {}
_installed_into: list[Any] = [None]
#: Code key -> its inputs' entries (encoded) right after its first compile in this process, for
#: the codes :func:`install` put a record in place for (seen by Dynamo's compile callbacks,
#: which ``torch._dynamo.reset()`` clears: :func:`install` registers them again).
_first: dict[str, dict[str, dict[str, Any]]] = {}
#: The installed codes' entries when a first compile started (compile id -> key -> entries).
_at_start: dict[str, dict[str, dict[str, Any]]] = {}
#: A failing guard on a size: Dynamo's tensor check, a symbolic shape guard of a dynamic graph.
_SHAPE_GUARD = re.compile(r"size mismatch|stride mismatch|expected size|\.size\(\)\[|\.stride\(\)\[")
_INT_GUARD = re.compile(r"(?P<name>\S+) == -?\d+")


@capability(
    "pgo.automatic_dynamic",
    needs="torch._dynamo.pgo (CodeId, CodeState, FrameStateSizeEntry, get_code_state, auto_dynamic), "
    "torch._dynamo.callback.callback_handler (start/end callbacks)",
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
    from torch._dynamo import callback

    handler = getattr(callback, "callback_handler", None)
    if not all(hasattr(handler, n) for n in ("register_start_callback", "register_end_callback",
                                              "end_callbacks")):
        return "torch._dynamo.callback has no callback_handler with start/end callbacks"
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


def _closure_hash(code_id: Any) -> int | None:
    """The hash that tells apart closures of one code (torch 2.13); None on torch 2.11 and
    earlier, whose ``CodeId`` has no such field (one record per code, as that torch keeps it)."""
    return getattr(code_id, "closure_hash", None)


def _code_id(pgo: Any, filename: str, firstlineno: int, name: str, file_hash: str,
             closure_hash: int | None) -> Any:
    """``pgo.CodeId`` as the installed torch spells it (a ``closure_hash`` field in 2.13, none in 2.11)."""
    import dataclasses

    if any(field.name == "closure_hash" for field in dataclasses.fields(pgo.CodeId)):
        return pgo.CodeId(filename, firstlineno, name, file_hash, closure_hash)
    return pgo.CodeId(filename, firstlineno, name, file_hash)


def _key(code_id: Any) -> str:
    return f"{code_id.file_hash}:{code_id.firstlineno}:{code_id.name}:{_closure_hash(code_id)}"


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
    recompiles = _recompile_reasons()
    installed = _installed if _installed_into[0] is states else {}
    first = _first if _installed_into[0] is states else {}
    codes: dict[str, Any] = {}
    for code_id, state in list(states.items()):
        if not _wanted(code_id.name, owners, code_id.filename, files) or not state.automatic_dynamic:
            continue
        try:
            entries = {name: _encode_entry(e) for name, e in state.automatic_dynamic.items()}
        except TypeError as exc:  # a torch with other atoms: this code's record is left out
            log.debug("compile_cache: frame state of %s not carried: %s", code_id.name, exc)
            continue
        reasons = recompiles.get((code_id.name, code_id.firstlineno, os.path.basename(code_id.filename)))
        if reasons and not any(shape_reason(r, entries) for r in reasons):
            entries = _path_only(code_id.name, entries,
                                 first.get(_key(code_id)) or installed.get(_key(code_id), {}))
            if not entries:
                continue
        codes[_key(code_id)] = {"name": code_id.name, "firstlineno": code_id.firstlineno,
                                "file_hash": code_id.file_hash, "closure_hash": _closure_hash(code_id),
                                "filename": os.path.basename(code_id.filename), "inputs": entries}
    return {"version": _VERSION, "codes": codes} if codes else None


def shape_reason(reason: str, inputs: Iterable[str] = ()) -> bool:
    """Whether Dynamo's recompile reason ``reason`` (one entry of ``guard_failures``) is a size
    change: a failing size or stride guard, a symbolic shape guard, or ``NAME == N`` on an int
    input among ``inputs`` (the code's recorded inputs, Dynamo's ``L['...']`` names)."""
    text = re.sub(r"^\S+: ", "", reason.split("\nUser stack", 1)[0].strip())
    if "dtype" in text.lower():
        return False
    if _SHAPE_GUARD.search(text):
        return True
    ints = {_strip_local(name) for name in inputs}
    return any(m.group("name") in ints for part in text.split("; ")
               if (m := _INT_GUARD.fullmatch(part.split("#", 1)[0].strip())))


def _strip_local(name: str) -> str:
    """``L['x']`` as Dynamo's reasons write it (``x``)."""
    return re.sub(r"L\[\s*['\"](.*?)['\"]\s*\]", r"\1", name)


def _recompile_reasons() -> dict[tuple[str, int, str], list[str]]:
    """(name, first line, file base name) of each code object that recompiled in this process
    -> its recompile reasons (one per cache entry tried)."""
    out: dict[tuple[str, int, str], list[str]] = {}
    for code, reasons in list(dynamo.guard_failures().items()):
        name, line, file = (getattr(code, a, None) for a in ("co_name", "co_firstlineno", "co_filename"))
        if isinstance(name, str) and isinstance(line, int) and isinstance(file, str) and reasons:
            out.setdefault((name, line, os.path.basename(file)), []).extend(str(r) for r in reasons)
    return out


def _path_only(code: str, entries: dict[str, Any], installed: dict[str, Any]) -> dict[str, Any]:
    """``entries`` of a code whose recompiles all changed path, not shape: each value seen to vary
    here is unset again (as if never seen), unless ``installed`` had it varying (the restored
    record, or what the code had after its first compile here); an input left with nothing (a
    scalar that varied) is left out."""
    out: dict[str, Any] = {}
    dropped = []
    for name, entry in entries.items():
        had = installed.get(name) or {}
        if isinstance(entry.get("size"), list):
            new = dict(entry, size=_unset_dyn(entry["size"], had.get("size")),
                       stride=_unset_dyn(entry.get("stride"), had.get("stride")))
        elif entry.get("scalar") == "dyn" and had.get("scalar") != "dyn":
            new = None  # an int that varied (or a tensor whose rank changed): as if never seen
        else:
            new = entry
        if new != entry:
            dropped.append(name)
        if new is not None:
            out[name] = new
    if dropped:
        log.debug("compile_cache: automatic-dynamic decisions of %s on %s not carried: it recompiled "
                  "in this process only for other arguments or paths, not for a new size",
                  code, ", ".join(dropped))
    return out


def _unset_dyn(value: Any, had: Any) -> Any:
    """``value`` (a size or stride, encoded) with each "dyn" not in ``had`` unset (None)."""
    if value == "dyn":
        return "dyn" if had == "dyn" else None
    if not isinstance(value, list):
        return value
    return [v if v != "dyn" or had == "dyn" or (isinstance(had, list) and i < len(had) and had[i] == "dyn")
            else None for i, v in enumerate(value)]


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
    if _installed_into[0] is not states:  # a new code state (torch._dynamo.reset())
        _installed.clear()
        _first.clear()
        _installed_into[0] = states
    _watch_first_compiles()
    turned = 0
    for code in (state.get("codes") or {}).values():
        try:
            code_id = _code_id(pgo, code["filename"], int(code["firstlineno"]), str(code["name"]),
                               str(code["file_hash"]), code.get("closure_hash"))
            inputs = {name: _decode_entry(e) for name, e in code["inputs"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("compile_cache: a restored automatic-dynamic record is malformed (%s); "
                        "left out", exc)
            continue
        local = states[code_id].automatic_dynamic
        mine = _installed.setdefault(_key(code_id), {})
        for name, entry in inputs.items():
            if name in mine:
                was = _decode_entry(mine[name])
                was |= entry
                mine[name] = _encode_entry(was)
            else:
                mine[name] = _encode_entry(entry)
            before = _dynamic_dims(local[name]) if name in local else 0
            local[name] |= entry
            local[name].excluded_sizes = None
            local[name].excluded_scalar = None
            turned += max(0, _dynamic_dims(local[name]) - before)
    return turned


def _first_compile(compile_id: str) -> bool:
    """Whether Dynamo's compile ``compile_id`` (``frame/n``) is its frame's first."""
    return re.fullmatch(r"\d+/0", compile_id) is not None


def _installed_entries() -> dict[str, dict[str, dict[str, Any]]]:
    """Code key -> encoded entries now, of the codes :func:`install` put a record in place for."""
    from torch._dynamo import pgo

    states = getattr(pgo, "_CODE_STATE", None)
    if not states or _installed_into[0] is not states:
        return {}
    out = {}
    for code_id, state in list(states.items()):
        key = _key(code_id)
        if key in _installed and key not in _first:
            try:
                out[key] = {n: _encode_entry(e) for n, e in state.automatic_dynamic.items()}
            except TypeError:  # a torch with other atoms: nothing to keep for this code
                continue
    return out


def _on_start(args: Any) -> None:
    if _first_compile(str(args.compile_id)):
        _at_start[str(args.compile_id)] = _installed_entries()


def _on_end(args: Any) -> None:
    """After a frame's first compile: each installed code whose entries it changed keeps what
    it has now (its first-compile decisions, see the module's doc)."""
    before = _at_start.pop(str(args.compile_id), None)
    if before is None:
        return
    for key, entries in _installed_entries().items():
        if key in before and entries != before[key]:
            _first[key] = entries


def _watch_first_compiles() -> None:
    """Registers :func:`_on_start` / :func:`_on_end` with Dynamo (once per reset)."""
    from torch._dynamo.callback import callback_handler

    if _on_end not in callback_handler.end_callbacks:
        callback_handler.register_start_callback(_on_start)
        callback_handler.register_end_callback(_on_end)


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
