"""The globals a precompiled region relies on without a guard: pinned, and checked.

To save an entry, the guard filter drops the identity guards on globals that no guard can carry
across processes: module-level functions and classes, torch and standard-library functions
(``G['__import_transformers_dot_models_dot_llama_dot_modeling_llama'].apply_rotary_pos_emb``,
``G['torch'].tanh``). The key pins their *names* (and Dynamo the source of inlined functions),
not what a name is bound to: a monkeypatch after compiling, or another binding on another node,
would go unnoticed. So each such dropped guard becomes a *pin*, its source expression and the
object it named when traced:

* in process, every pin of a group is compared by identity at every call of the group's
  function (one evaluation of one compiled expression: a direct call of a block after a
  monkeypatch is checked as a model forward is): a changed binding declines precompile for that
  group, which compiles again with every guard (:class:`Pins`);
* across processes, the publisher records every pin as a portable description (module,
  qualified name and, for Python functions, a digest of the code) with the pack, and a node
  that restores the entry checks them before loading it (:func:`verify`); where one differs,
  the group declines precompile on that node.

A pin may also start from the block (``self._modules['mlp'].act``: a function, builtin or
module object stored on it, as transformers' activations are): it is evaluated with ``self``
bound to the block being called, at every call, and to the group's first block before an entry
loads. An object found at a call that is not the pinned one but has the same description (a
lambda made per block) is accepted and remembered.
"""

from __future__ import annotations

import builtins
import enum
import hashlib
import importlib
import inspect
import re
import sys
import types
from typing import Any

__all__ = ["Pins", "builtin_shadow_source", "class_pins", "code_digest", "describe", "on_block",
           "on_call", "verify"]

def describe(value: Any) -> str:
    """A description of what a global names that is the same in every process that binds the
    same object: module, qualified name, and a digest of a Python function's code; an enum
    member by its class and name (``Mode.A`` is not ``Mode.B``)."""
    if isinstance(value, enum.Enum):
        kind = type(value)
        return f"{kind.__module__}.{kind.__qualname__}.{value.name}"
    if inspect.ismodule(value):
        return f"module {value.__name__}{_module_names(value)}"
    module = getattr(value, "__module__", None) or type(value).__module__
    name = (getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
            or type(value).__qualname__)
    code = getattr(value, "__code__", None)
    if isinstance(code, types.CodeType):
        return f"{module}.{name}:{code_digest(code)}"
    if inspect.isclass(value) and "<locals>" in name:
        return f"{module}.{name}:{_local_class_digest(value)}"
    return f"{module}.{name}"


def _local_class_digest(cls: type, seen: frozenset[type] = frozenset()) -> str:
    """A class defined in a function (``_create_func_module.<locals>.Func``, one per function
    kernels wraps) has no name of its own: a digest of what it defines (names, the code of its
    functions and what their closures hold, described) and of its bases tells such classes
    apart (another wrapped function closes over another function)."""
    parts = [describe(base) for base in cls.__bases__]
    for name, item in sorted(vars(cls).items()):
        if name.startswith("__") and name not in ("__init__", "__call__"):
            continue
        parts.append(name)
        function = getattr(item, "__func__", item)
        code = getattr(function, "__code__", None)
        if not isinstance(code, types.CodeType):
            parts.append(_ADDRESS.sub("", repr(item)) if isinstance(item, (str, int, float, bool)) else type(item).__qualname__)
            continue
        parts.append(code_digest(code))
        for cell in getattr(function, "__closure__", None) or ():
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if held is cls or any(held is other for other in seen):  # (mutual closures)
                continue
            if inspect.isclass(held) and "<locals>" in held.__qualname__:
                parts.append(f"{held.__module__}.{held.__qualname__}:"
                             f"{_local_class_digest(held, seen | {cls})}")
            elif isinstance(held, (str, bytes, int, float, bool, type(None))):
                parts.append(repr(held))  # a constant the code reads: its value, not its type
            else:
                parts.append(describe(held) if callable(held) else type(held).__qualname__)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _module_names(module: types.ModuleType) -> str:
    """For a module outside torch and Python's standard library, a digest of the names it holds
    (dunder names aside: Dynamo's aliases, the module's own attributes): code traced with a name
    absent (``getattr(settings, "EXTRA", 0.0)``, ``hasattr``) is guarded by the module's
    identity only, so the names are what proves the absence on another node."""
    top = module.__name__.split(".", 1)[0]
    if top in ("torch", "builtins") or top in sys.stdlib_module_names:
        return ""
    try:
        # (nor the resume functions Dynamo installs where a frame of the module graph-breaks)
        names = sorted(n for n in list(vars(module))
                       if not n.startswith(("__", "torch_dynamo_resume")))
    except TypeError:
        return " names:?"
    return f" names:{hashlib.sha256(chr(0).join(names).encode()).hexdigest()[:16]}"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_ROOT = re.compile(r"G\['([^']+)'\]")


def code_digest(code: types.CodeType) -> str:
    """A digest of a code object that is the same in every process (no addresses)."""
    consts = _ADDRESS.sub("", repr(code.co_consts))
    blob = b"\0".join([code.co_code, consts.encode(), repr(code.co_names).encode()])
    return hashlib.sha256(blob).hexdigest()[:16]


class _Globals:
    """``G`` of Dynamo's guard sources: the compiled function's globals; the module aliases
    Dynamo installs there (``__import_<module with _dot_>``) resolve before it has."""

    __slots__ = ("scope",)

    def __init__(self, scope: dict[str, Any]) -> None:
        self.scope = scope

    def __getitem__(self, key: str) -> Any:
        try:
            return self.scope[key]
        except KeyError:
            if key.startswith("__import_"):
                return importlib.import_module(key[len("__import_"):].replace("_dot_", "."))
            raise


_CODES: dict[str, types.CodeType] = {}
_MISSING = object()


_NO_BLOCK = object()


_FREE_NAME = re.compile(r"(?<![\w.'\"])[A-Za-z_]\w*")


_CALL_LOCALS = frozenset({"self", "args", "kwargs"})


def _locals_of(source: str) -> set[str]:
    return {n for n in _FREE_NAME.findall(source) if not hasattr(builtins, n)}


def on_block(source: str) -> bool:
    """Whether a pin's source starts from the region's call (the block ``self...``, ``dict(type(
    self).__dict__)['scale'].fget``, or its ``args`` / ``kwargs``: only those and builtins), not
    from a global."""
    names = _locals_of(source)
    return bool(names) and names <= _CALL_LOCALS


def on_call(source: str) -> bool:
    """Whether a pin's source starts from the call's arguments (``type(kwargs['past_key_values'])
    ...``): checked at each call, and against the publisher's description at the first call after
    a load (no call exists before it)."""
    return on_block(source) and bool(_locals_of(source) & {"args", "kwargs"})


def class_pins(block: Any) -> dict[str, Any]:
    """Pins on what the block's own classes define as code (methods, properties, static and
    class methods; torch's and Python's classes aside): Dynamo guards none of a module's
    methods, so a method swapped on the class after compiling (``Block.pick = ...``) would
    leave a precompiled entry stale where a plain compile traces again. Checked at every call
    (``type(self).__mro__[i].__dict__['pick']``) and, described, before an entry loads."""
    found: dict[str, Any] = {}
    for index, cls in enumerate(type(block).__mro__):
        if (cls.__module__ or "").split(".", 1)[0] in ("torch", "builtins"):
            continue
        for name, value in vars(cls).items():
            if inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod)):
                found[f"type(self).__mro__[{index}].__dict__[{name!r}]"] = value
    return found


def builtin_shadow_source(name: str) -> str:
    """A pin's source for "``name`` is not bound in the block's module": a builtin the traced code
    called (``max``), which a module global of that name would shadow (``max = min``)."""
    return f"self.forward.__globals__.get({name!r})"


def _evaluate(source: str, scope: dict[str, Any], block: Any = _NO_BLOCK,
              call: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> Any:
    """What ``source`` names now (``self``: ``block``; ``args``, ``kwargs``: ``call``'s);
    ``_MISSING`` when it cannot be evaluated."""
    code = _CODES.get(source)
    try:
        if code is None:
            code = _CODES[source] = compile(source, "<compile_cache pin>", "eval")
        local = {} if block is _NO_BLOCK else {"self": block}
        if call is not None:
            local["args"], local["kwargs"] = call
        return eval(code, {"__builtins__": builtins, "G": _Globals(scope)}, local)  # noqa: S307
    except Exception:  # noqa: BLE001 - a source that no longer resolves has changed
        return _MISSING


def verify(described: dict[str, str], scope: dict[str, Any], block: Any = _NO_BLOCK) -> str | None:
    """None when every pin a publisher recorded names the same thing here (a pin on the block
    evaluated on ``block``), else what differs."""
    for source, expected in described.items():
        if on_call(source):
            continue  # checked at the first call (Pins.add_current)
        if on_block(source) and block is _NO_BLOCK:
            return f"{source}: no block to check it on"
        value = _evaluate(source, scope, block)
        found = "nothing" if value is _MISSING else describe(value)
        if found != expected:
            where = "the block holds another object" if on_block(source) else "a global bound differently"
            return (f"{source} is {found} here but was {expected} where the entry was "
                    f"published ({where})")
    return None


class Pins:
    """The pins of one precompiled function, checked by identity in this process.

    All sources are compiled into one expression, evaluated once per check: a check costs one
    ``eval`` and an attribute walk and identity comparison per pin."""

    def __init__(self, scope: dict[str, Any]) -> None:
        self.scope = scope
        self._objects: dict[str, Any] = {}
        #: Per pin on the block: objects seen at a call that describe as the pinned one does.
        self._alike: dict[str, list[Any]] = {}
        self._code: types.CodeType | None = None
        self._namespace = {"__builtins__": builtins, "G": _Globals(scope)}
        #: Per pin on a user module: how many names it held when pinned (and their digest: a
        #: name Dynamo installs there, a resume function, changes the count, not the digest).
        self._sizes: dict[str, int] = {}
        self._names: dict[str, str] = {}
        #: Pins on the call's arguments restored with an entry: source -> the publisher's
        #: description, compared at the next call (then pinned by identity).
        self._deferred: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._objects)

    @property
    def watching(self) -> bool:
        """Whether there is anything to check."""
        return self._code is not None or bool(self._deferred)

    def add(self, pins: dict[str, Any]) -> None:
        """Pins seen while tracing (source -> object); the first object per source is kept."""
        for source, value in pins.items():
            self._objects.setdefault(source, value)
        self._compile()

    def add_current(self, sources: Any, block: Any = _NO_BLOCK) -> None:
        """Pins restored with an entry (verified; a pin on the block on ``block``): what they
        name now."""
        for source in sources:
            if on_call(source) and isinstance(sources, dict):
                self._deferred[source] = sources[source]  # described: checked at the next call
                continue
            value = _evaluate(source, self.scope, block if on_block(source) else _NO_BLOCK)
            if value is not _MISSING:
                self._objects.setdefault(source, value)
        self._compile()

    def _compile(self) -> None:
        if not self._objects:
            return
        sources = list(self._objects)
        # One expression, ``(<pin 0>) is _0 and (<pin 1>) is _1 and ...``: no tuple, no loop.
        # A user module also keeps its number of names (``len(vars(...)) == n``): code traced
        # with a name absent (``hasattr(settings, "FLAG")``) is guarded by the module's identity
        # only, and a name bound after compiling must not leave the entry stale.
        terms = []
        for i, source in enumerate(sources):
            value = self._namespace[f"_{i}"] = self._objects[source]
            terms.append(f"({source}) is _{i}")
            if inspect.ismodule(value) and _module_names(value):
                self._sizes.setdefault(source, len(vars(value)))  # as when first pinned
                self._names.setdefault(source, _module_names(value))
                terms.append(f"len(vars(_{i})) == {self._sizes[source]}")
        self._code = compile(" and ".join(terms), "<compile_cache pins>", "eval")
        # The roots (``G['torch']``, ``G['__import_<module>']``) are Python modules: objects that
        # stay what they are, so they are looked up once; what a pin checks is reached from them
        # by attribute, at every check. A root that is not a module is looked up every time.
        roots: dict[str, Any] | None = {}
        for source in sources:
            for key in _ROOT.findall(source):
                value = _evaluate(f"G[{key!r}]", self.scope)
                if not inspect.ismodule(value):
                    roots = None
                    break
                roots[key] = value  # type: ignore[index]
            if roots is None:
                break
        self._namespace["G"] = roots if roots is not None else _Globals(self.scope)

    def changed(self, block: Any = None, args: tuple[Any, ...] = (),
                kwargs: dict[str, Any] | None = None) -> str | None:
        """None while every pin names the object it named when traced (a pin on the block: on
        ``block``, the block being called; on the call's ``args`` / ``kwargs``: this call's),
        else which one moved. A pin on an argument the call does not pass is not checked: the
        entry's own guards on the arguments rule that entry out."""
        call = (args, kwargs or {})
        if self._deferred and (moved := self._check_deferred(block, call)) is not None:
            return moved
        if self._code is None:
            return None
        try:
            if eval(self._code, self._namespace, {"self": block, "args": call[0], "kwargs": call[1]}):  # noqa: S307
                return None
        except Exception:  # noqa: BLE001 - one source no longer resolves: find which below
            pass
        resized = False
        for source, value in self._objects.items():
            mine = on_block(source)
            found = _evaluate(source, self.scope, block if mine else _NO_BLOCK, call)
            if found is _MISSING and on_call(source):
                continue
            if found is value and source in self._sizes and len(vars(value)) != self._sizes[source]:
                if _module_names(value) != self._names[source]:
                    return (f"{source} ({describe(value)}) gained or lost a name after compiling "
                            f"(code traced with a name absent, getattr's default or hasattr, "
                            f"would be stale)")
                self._sizes[source] = len(vars(value))  # only names Dynamo installs
                resized = True
            if found is value:
                continue
            if mine and found is not _MISSING and self._alike_of(source, value, found):
                continue
            text = "nothing" if found is _MISSING else describe(found)
            if mine:
                return (f"{source} of {type(block).__name__} is {text}, not the {describe(value)} "
                        f"the group's compiled code was traced with (set after compiling, or "
                        f"different between the group's blocks)")
            return f"{source} was rebound after compiling (now {text}, was {describe(value)})"
        if resized:
            self._compile()
        return None

    def _check_deferred(self, block: Any, call: tuple[tuple[Any, ...], dict[str, Any]]) -> str | None:
        """The first call after a load: pins on the arguments, against the publisher's."""
        resolved = False
        for source, expected in list(self._deferred.items()):
            found = _evaluate(source, self.scope, block, call)
            if found is _MISSING:
                continue  # not passed in this call
            text = describe(found)
            if text != expected:
                return (f"{source} is {text} at this call but was {expected} where the entry was "
                        f"published")
            del self._deferred[source]
            self._objects.setdefault(source, found)
            resolved = True
        if resolved:
            self._compile()
        return None

    def _alike_of(self, source: str, pinned: Any, found: Any) -> bool:
        """``found`` on a block describes as ``pinned`` does (a function made per block)."""
        alike = self._alike.setdefault(source, [])
        if any(found is seen for seen in alike):
            return True
        if describe(found) != describe(pinned):
            return False
        alike.append(found)
        return True

    def described(self) -> dict[str, str]:
        """The portable descriptions a publisher records with the entry."""
        return {source: describe(value) for source, value in self._objects.items()}
