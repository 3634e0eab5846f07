"""The values a precompiled graph was traced under: recorded when it is traced, proven at load.

Torch rebuilds a loaded entry's guards by evaluating each guard's source against the scope it
unpickles (``CompilePackage.install`` -> ``load_guard_manager`` -> ``CheckFunctionManager``), and
it pickles Python modules by name and classes by reference. A value read through a module
(``G['__import_cfg'].MODE``, an attribute of a global module instance) or through a class
(``type(L['self']).kind``, a config class's default, a global enum's ``_value_``) is therefore
taken from the *loading* process: the rebuilt guard compares the live value with itself, and a
graph traced for ``"tanh"`` runs where the code now says ``"sigmoid"``.

So each graph carries its values:

* **At trace** (:class:`ValueRecorder`, fed by the guard filter): for every guard the filter
  keeps whose check is on a value (a constant, an equality, a dict's keys, a length, a global
  tensor's metadata), the guard's source and a portable description of the value it was traced
  with. When Dynamo adds the frame's graph to the package, the record is filed under a digest of
  the graph's saved guards (:func:`graph_digest`), so every graph of an entry has its own.
* **At load** (:func:`check_entry`): before torch reads an entry, each graph's guards are
  unpickled as torch will unpickle them, each recorded source is evaluated against that scope,
  exactly as torch's guard builder will (``Source.get_value``), and the description compared with
  the recorded one. A graph with a differing value, an unevaluable source or no record is not
  installed; that call traces again. In an entry with several graphs only the proven ones stay
  (the entry file is rewritten without the others); when the function's own graphs all go, or a
  graph of a resume function goes (a resume function left with no graph would be skipped by
  torch), the whole entry goes.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import hashlib
import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
from typing import Any

from . import lazy_globals

logger = logging.getLogger("compile_cache")

__all__ = ["EntryCheck", "ValueRecorder", "check_entry", "describe_value", "graph_digest",
           "hasattr_name", "record_key"]

#: Guard types whose check is on the value itself (its equality or identity as a constant).
_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "CONSTANT_SUBCLASS_MATCH", "BOOL_MATCH"})
#: Between a guard's type and its source in a record's key: one source may carry several guards.
_KEY_SEP = "\t"
_HASATTR = re.compile(r"hasattr\(.*, '([^']+)'\)\s*$")
_PRIMITIVES = (bool, int, float, complex, str, bytes, type(None))


def graph_digest(guards_state: bytes) -> str:
    """The name a graph's record is filed under: a digest of its saved guards."""
    return hashlib.sha256(guards_state).hexdigest()[:32]


def _primitive(value: Any, depth: int = 0) -> str | None:
    if isinstance(value, enum.Enum):
        kind = type(value)
        return f"enum:{kind.__module__}.{kind.__qualname__}.{value.name}"
    if isinstance(value, _PRIMITIVES):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list, frozenset, set)) and depth < 4 and len(value) <= 256:
        items = [_primitive(v, depth + 1) for v in value]
        if any(i is None for i in items):
            return None
        if isinstance(value, (frozenset, set)):
            items.sort()
        return f"{type(value).__name__}:[{','.join(items)}]"  # type: ignore[arg-type]
    module = type(value).__module__ or ""
    if module == "torch" and type(value).__name__ in ("dtype", "device", "layout", "memory_format"):
        return f"torch.{type(value).__name__}:{value}"
    return None


def record_key(guard_type: str, source: str) -> str:
    """The key of one guard's value in a graph's record: its type and its source (Dynamo may put
    several guards on one source: ``SEQUENCE_LENGTH`` and ``EMPTY_NN_MODULE_HOOKS_DICT``)."""
    return f"{guard_type}{_KEY_SEP}{source}"


def _split_key(key: str) -> tuple[str | None, str]:
    guard_type, sep, source = key.partition(_KEY_SEP)
    return (guard_type, source) if sep else (None, key)


def hasattr_name(entry: Any) -> str | None:
    """The attribute a ``HASATTR`` guard checks (its code: ``hasattr(G['Reg'], 'extra')``)."""
    if getattr(entry, "guard_type", None) != "HASATTR":
        return None
    for line in getattr(getattr(entry, "orig_guard", None), "code_list", None) or ():
        found = _HASATTR.search(line)
        if found:
            return found.group(1)
    return None


def describe_value(guard_type: str, value: Any, source: str, *, attr: str | None = None) -> str | None:
    """A description of what a guard of ``guard_type`` checks of ``value``, the same in every
    process that holds an equal value; None for a guard whose check is not on a value.
    ``attr``: the attribute a ``HASATTR`` guard checks; its presence is the description."""
    if guard_type in _VALUE_GUARDS:
        return _primitive(value)
    if guard_type == "HASATTR":
        return None if attr is None else f"hasattr:{attr!r}:{hasattr(value, attr)}"
    if guard_type == "TYPE_MATCH" and ("G[" in source or "type(" in source or "__class__" in source):
        kind = type(value)  # a live source: the class the value has there, by name
        return f"type:{kind.__module__}.{kind.__qualname__}"
    if guard_type in ("DICT_KEYS_MATCH", "DICT_KEYS", "MAPPING_KEYS_CHECK"):
        keys = getattr(value, "keys", None)
        return None if keys is None else _prefixed("keys", _primitive(tuple(keys())))
    if guard_type in ("SEQUENCE_LENGTH", "LENGTH_CHECK"):
        try:
            return f"len:{len(value)}"
        except TypeError:
            return None
    if guard_type == "TENSOR_MATCH" and "G[" in source:  # a global tensor: its metadata is live
        meta = (getattr(value, "dtype", None), getattr(value, "device", None),
                tuple(getattr(value, "shape", ())), getattr(value, "requires_grad", None))
        return f"tensor:{meta}"
    return None


def _prefixed(prefix: str, text: str | None) -> str | None:
    return None if text is None else f"{prefix}:{text}"


class ValueRecorder:
    """Collects the values of the frame being traced (the guard filter's kept value guards) and
    files them under the graph Dynamo adds next, per thread."""

    def __init__(self) -> None:
        self._pending = threading.local()
        #: graph digest -> {guard source: description of the value it was traced with}
        self.graphs: dict[str, dict[str, str]] = {}

    def frame(self, values: dict[str, str]) -> None:
        """The guard filter ran for a frame: these are its values (replacing a frame whose
        compile failed before its graph was added)."""
        self._pending.values = values

    def graph_added(self, guards_state: bytes) -> None:
        """Dynamo added the frame's graph to the package: file the frame's values under it. A
        graph added without a guard-filter run gets no record, so it never loads elsewhere."""
        values = getattr(self._pending, "values", None)
        self._pending.values = None
        if values is not None:
            self.graphs[graph_digest(guards_state)] = values

    def adopt(self, graphs: dict[str, dict[str, str]]) -> None:
        """The records of graphs loaded from an entry (proven at load)."""
        self.graphs.update(graphs)

    def records_for(self, digests: list[str]) -> dict[str, dict[str, str]]:
        """The records of these graphs (the package's now), for the entry's record in the store."""
        return {d: self.graphs[d] for d in digests if d in self.graphs}


@dataclasses.dataclass
class EntryCheck:
    """What :func:`check_entry` found: the graphs that stay (digest -> record) and the reasons
    the others went."""

    kept: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    dropped: list[str] = dataclasses.field(default_factory=list)


def check_entry(path: str, records: dict[str, dict[str, str]]) -> EntryCheck:
    """Prove each graph of the entry at ``path`` against its record; rewrite the entry without
    the graphs that fail, or remove it (see the module docstring)."""
    result = EntryCheck()
    with open(path, "rb") as f:
        data = f.read()
    # As torch reads it next (.lazy_globals: without importing what only a compile calls).
    entry = lazy_globals.loads(data)
    main, *resumes = entry.dynamo.codes
    for code in resumes:
        for guarded in code.guarded_codes:
            reason = _prove(guarded.guards_state, records, result)
            if reason is not None:
                result.dropped.append(f"a resume function's graph: {reason}")
                return _remove(path, result)
    kept = []
    for index, guarded in enumerate(main.guarded_codes):
        reason = _prove(guarded.guards_state, records, result)
        if reason is None:
            kept.append(index)
        else:
            result.dropped.append(reason)
    if not kept:
        return _remove(path, result)
    if len(kept) != len(main.guarded_codes):
        # Rewritten from torch's own objects (plain pickle: no stand-in in what torch reads).
        entry = pickle.loads(data)  # noqa: S301 - the file read above, torch's format
        main = entry.dynamo.codes[0]
        main.guarded_codes = [main.guarded_codes[i] for i in kept]
        _write_atomic(path, pickle.dumps(entry))
    return result


def _prove(guards_state: bytes, records: dict[str, dict[str, str]], result: EntryCheck) -> str | None:
    digest = graph_digest(guards_state)
    record = records.get(digest)
    if record is None:
        return "a graph with no record of the values it was traced under"
    if record:
        reason = _differs(guards_state, record)
        if reason is not None:
            return reason
    result.kept[digest] = record
    return None


def _differs(guards_state: bytes, record: dict[str, str]) -> str | None:
    """None when every recorded source evaluates, in the scope torch will rebuild the guards
    in, to what it was traced with; else the first that does not."""
    from torch._dynamo.guards import _get_closure_vars
    from torch._dynamo.package import load_guards_state
    from torch._guards import TracingContext, tracing

    # Some sources install a guard as they are unpickled (ImportSource: __import__('torch')),
    # which needs a tracing context: torch loads an entry inside one (_compile_frame_context).
    with tracing(TracingContext(None)):
        state = load_guards_state(guards_state)
    graph = state.output_graph
    # by (source, type): one source may carry several guards (torch >= 2.14: an empty hook dict
    # has both SEQUENCE_LENGTH and EMPTY_NN_MODULE_HOOKS_DICT); a record without a type is proven
    # by any guard of its source whose description matches
    guards = {(guard.name, guard.create_fn_name()): guard for guard in graph.guards}
    by_name: dict[str, list[Any]] = {}
    for guard in graph.guards:
        by_name.setdefault(guard.name, []).append(guard)
    scope = {"L": graph.local_scope, "G": graph.global_scope,
             "__builtins__": builtins.__dict__.copy()}
    closure_vars = _get_closure_vars()
    cache: dict[Any, Any] = {}
    for key, expected in record.items():
        guard_type, source = _split_key(key)
        if guard_type is None:
            on_source = by_name.get(source, [])
        else:
            on_source = [g for g in (guards.get((source, guard_type)),) if g is not None]
        if not on_source:
            return f"{source}: not among the graph's guards"
        try:
            value = on_source[0].originating_source.get_value(scope, closure_vars, cache)
        except Exception as exc:  # noqa: BLE001 - a source that no longer resolves has changed
            return f"{source} cannot be evaluated here ({type(exc).__name__})"
        attr = expected.split(":", 2)[1][1:-1] if expected.startswith("hasattr:") else None
        found = [d for d in (describe_value(g.create_fn_name(), value, source, attr=attr)
                             for g in on_source) if d is not None]
        if expected not in found:
            here = " / ".join(found) if found else None
            return f"{source} is {here} here but the graph was traced with {expected}"
    return None


def _remove(path: str, result: EntryCheck) -> EntryCheck:
    """Remove the entry (its folder: torch takes a folder without an entry for a broken one)."""
    result.kept.clear()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return result


def _write_atomic(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".entry-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
