"""Fingerprints of module trees: the identity every cache key in compile_cache is built from.

Two backends give byte-for-byte the same digests: the native one (``compile_cache._C``, C++) and
the pure-Python reference (``compile_cache._reference``). The native one is chosen at import when
it loads; ``COMPILE_CACHE_BACKEND=python|native`` forces one. An unforced native backend that fails
to load falls back to Python with one warning, and the fallback is counted (``backend_fallbacks``).
"""

from __future__ import annotations

import logging
import os
import warnings

from torch import nn

from . import _reference
from .errors import BackendUnavailableError, ConfigError

logger = logging.getLogger("compile_cache")

__all__ = ["Fingerprint", "backend", "backend_fallbacks", "fingerprint", "fingerprint_tree"]


class Fingerprint:
    """An immutable 128-bit digest of a module tree's structure and parameter metadata."""

    __slots__ = ("_digest",)

    def __init__(self, digest: bytes) -> None:
        if type(digest) is not bytes or len(digest) != _reference.DIGEST_SIZE:
            raise ValueError(
                f"a Fingerprint needs {_reference.DIGEST_SIZE} bytes, got {digest!r}"
            )
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
            return self._digest == other._digest
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._digest)

    def __str__(self) -> str:
        return self.hex

    def __repr__(self) -> str:
        return f"Fingerprint('{self.hex}')"

    def __reduce__(self):  # noqa: ANN204 - pickling support
        return (Fingerprint, (self._digest,))


_new = object.__new__
_set_digest = Fingerprint._digest.__set__  # type: ignore[attr-defined]


def _trusted_fingerprint(digest: bytes) -> Fingerprint:
    """A Fingerprint from a backend's 16 bytes, skipping the checks (a tree has ~1000 of them)."""
    value = _new(Fingerprint)
    _set_digest(value, digest)
    return value


def _load_backend() -> tuple[str, object, int]:
    """Chooses the backend once, at import; returns (name, implementation, fallbacks)."""
    requested = os.environ.get("COMPILE_CACHE_BACKEND", "").strip().lower()
    if requested not in ("", "native", "python"):
        raise ConfigError(
            f"COMPILE_CACHE_BACKEND={requested!r} is not a backend; use 'native' or 'python'"
        )
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
        message = (
            f"compile_cache: native fingerprint backend unavailable ({exc}); "
            "using the pure-Python backend (same digests, slower)"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        logger.warning(message)
        return "python", _reference, 1
    return "native", _C, 0


backend, _implementation, backend_fallbacks = _load_backend()


def _check_module(module: object) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fingerprint needs a torch.nn.Module, got {type(module).__module__}."
            f"{type(module).__qualname__}"
        )


def fingerprint_tree(module: nn.Module, *, attributes: bool = True) -> dict[str, Fingerprint]:
    """One fingerprint per submodule, keyed by qualified name (``""`` is the root), in one pass.

    A submodule reachable under several names (shared, or through a cycle) is digested once and
    listed under its first name, as ``named_modules()`` does.
    """
    _check_module(module)
    pairs = _implementation.fingerprint_tree(module, bool(attributes))  # type: ignore[attr-defined]
    return {name: _trusted_fingerprint(digest) for name, digest in pairs}


def fingerprint(module: nn.Module, *, attributes: bool = True) -> Fingerprint:
    """The fingerprint of a whole module tree: structure, forward code, tensor metadata.

    Covers classes, ``forward`` code, child names, parameter and buffer names with shape, stride,
    dtype, device type and ``requires_grad``, and (``attributes=True``) primitive instance
    attributes. Not covered: tensor values and device indices, so a model moved from ``cuda:0``
    to ``cuda:3`` or loaded with other weights keeps its fingerprint.
    """
    return fingerprint_tree(module, attributes=attributes)[""]
