"""Fingerprints of module trees: the identity every cache key in compile_cache is built from.

Two backends give byte-for-byte the same digests: the native one (``compile_cache._C``, C++) and
the pure-Python reference (``compile_cache._reference``). The backend is chosen once, when a
fingerprint is first needed (not at ``import compile_cache``): the native one when it loads;
``COMPILE_CACHE_BACKEND=python|native`` forces one. An unforced native backend that fails to load
falls back to Python with one warning, and the fallback is counted (``backend_fallbacks``).
``backend``, ``backend_fallbacks`` (module attributes) choose it when first read.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from typing import Any

from . import _warnings, config
from .errors import BackendUnavailableError

#: Bytes in a digest (the reference backend's DIGEST_SIZE; checked when a backend loads).
DIGEST_SIZE = 16

__all__ = ["Fingerprint", "fingerprint", "fingerprint_tree"]  # and backend, backend_fallbacks


class Fingerprint:
    """An immutable 128-bit digest of a module tree's structure and parameter metadata."""

    __slots__ = ("_digest",)

    def __init__(self, digest: bytes) -> None:
        if type(digest) is not bytes or len(digest) != DIGEST_SIZE:
            raise ValueError(f"a Fingerprint needs {DIGEST_SIZE} bytes, got {digest!r}")
        object.__setattr__(self, "_digest", digest)

    @classmethod
    def from_hex(cls, text: str) -> Fingerprint:
        """Parses the 32-character form that ``.hex`` and ``str()`` give."""
        try:
            return cls(bytes.fromhex(text))
        except (ValueError, TypeError):
            raise ValueError(f"not a fingerprint (32 hex characters): {text!r}") from None

    @property
    def digest(self) -> bytes:
        return self._digest

    @property
    def hex(self) -> str:
        return self._digest.hex()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Fingerprint is immutable")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Fingerprint):
            return self._digest == other.digest
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._digest)

    def __str__(self) -> str:
        return self.hex

    def __repr__(self) -> str:
        return f"Fingerprint('{self.hex}')"

    def __reduce__(self):  # noqa: ANN204 - pickling support
        return (Fingerprint, (self._digest,))

    @classmethod
    def trusted(cls, digest: bytes) -> Fingerprint:
        """A Fingerprint from a backend's 16 bytes, skipping the checks (a tree has ~1000 of them)."""
        value = _new(cls)
        cls._digest.__set__(value, digest)  # type: ignore[attr-defined]
        return value


_new = object.__new__


def _load_backend() -> tuple[str, object, int]:
    """Chooses the backend: (name, implementation, fallbacks)."""
    from . import _reference

    assert _reference.DIGEST_SIZE == DIGEST_SIZE
    requested = config.BACKEND.value()
    if requested == "python":
        return "python", _reference, 0
    try:
        from . import _C  # type: ignore[attr-defined]

        _C.set_internal_attributes(sorted(_reference.MODULE_INTERNAL_ATTRIBUTES))
    except Exception as exc:  # ImportError, or an ABI mismatch surfacing as another error
        if requested == "native":
            raise BackendUnavailableError(
                f"COMPILE_CACHE_BACKEND=native but compile_cache._C cannot load: {exc}. "
                "Rebuild with `pip install --no-build-isolation -e .` against this torch."
            ) from exc
        _warnings.warn(
            f"compile_cache: native fingerprint backend unavailable ({exc}); "
            "using the pure-Python backend (same digests, slower)",
            RuntimeWarning,
        )
        return "python", _reference, 1
    return "native", _C, 0


_chosen: tuple[str, object, int] | None = None
_choose_lock = threading.Lock()


def _backend() -> tuple[str, object, int]:
    global _chosen
    if _chosen is None:
        with _choose_lock:
            if _chosen is None:
                _chosen = _load_backend()
    return _chosen


def __getattr__(name: str) -> Any:
    """``backend``, ``backend_fallbacks`` and ``_implementation``: chosen on first read."""
    if name == "backend":
        return _backend()[0]
    if name == "_implementation":
        return _backend()[1]
    if name == "backend_fallbacks":
        return _backend()[2]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_module(module: object) -> None:
    from torch import nn

    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fingerprint needs a torch.nn.Module, got {type(module).__module__}."
            f"{type(module).__qualname__}"
        )


def fingerprint_tree(module: Any, *, attributes: bool = True) -> dict[str, Fingerprint]:
    """One fingerprint per submodule, keyed by qualified name (``""`` is the root), in one pass.

    A submodule reachable under several names (shared, or through a cycle) is digested once and
    listed under its first name, as ``named_modules()`` does.
    """
    _check_module(module)
    pairs = _backend()[1].fingerprint_tree(module, bool(attributes))  # type: ignore[attr-defined]
    return {name: Fingerprint.trusted(digest) for name, digest in pairs}


def fingerprint(module: Any, *, attributes: bool = True) -> Fingerprint:
    """The fingerprint of a whole module tree: structure, forward code, tensor metadata.

    Covers classes, ``forward`` code, child names, parameter and buffer names with shape, stride,
    dtype, device type and ``requires_grad``, and (``attributes=True``) primitive instance
    attributes. Not covered: tensor values and device indices, so a model moved from ``cuda:0``
    to ``cuda:3`` or loaded with other weights keeps its fingerprint.
    """
    return fingerprint_tree(module, attributes=attributes)[""]


def class_lineage(module: Any) -> str:
    """A digest of every class a module tree's code comes from, beyond what the fingerprint has.

    The fingerprint names each module's class and ``forward``'s code; a precompiled entry also
    relies on the rest of each class and its bases, since a loaded entry matches classes by name
    only. This covers, for each class in the MRO of each module's class (torch's own and Python's
    are pinned by the environment key): its qualified name, the code of every function its body
    defines (methods, static and class methods, properties) and its primitive class attributes.
    So another base class, an override added below ``forward``, a class function rebound or a
    class attribute set at run time give another digest.
    """
    from ._reference import encode_code

    _check_module(module)
    h = hashlib.sha256()
    seen: set[type] = set()
    for sub in module.modules():
        for cls in type(sub).__mro__:
            if cls in seen or (cls.__module__ or "").split(".", 1)[0] in ("torch", "builtins"):
                continue
            seen.add(cls)
            h.update(f"\0class {cls.__module__}.{cls.__qualname__}".encode())
            for name, attr in sorted(vars(cls).items()):
                if name in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"):
                    continue
                h.update(f"\0{name}=".encode())
                for part in _class_attribute_parts(attr):
                    h.update(encode_code(part) if inspect.iscode(part) else repr(part).encode())
    return h.hexdigest()[:32]


def _class_attribute_parts(attr: Any) -> list[Any]:
    """What of one class attribute goes into :func:`class_lineage`: code objects, primitive
    values, else the attribute's type name."""
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    if isinstance(attr, property):
        return [f.__code__ if f is not None else None for f in (attr.fget, attr.fset, attr.fdel)]
    if inspect.isfunction(attr):
        defaults = attr.__defaults__ or ()
        return [attr.__code__, *(d if _primitive(d) else type(d).__qualname__ for d in defaults)]
    if _primitive(attr):
        return [type(attr).__name__, attr]
    kind = type(attr)
    return [f"{kind.__module__}.{kind.__qualname__}"]


def _primitive(value: Any) -> bool:
    if value is None or type(value) in (bool, int, float, str, bytes):
        return True
    return type(value) is tuple and all(_primitive(v) for v in value)
