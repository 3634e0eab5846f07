"""The pure-Python fingerprint backend: the reference encoding the native backend must match byte for byte.

Encoding (all integers little-endian; ``S(x)`` is ``u32(len) + utf-8 bytes``, surrogates passed):

module record::

    b"ccfp1"  S(type.__module__ + "." + type.__qualname__)  forward_digest(16 bytes)
    b"C" u32(n)  n x [ S(name)  (b"D" digest16 | b"R" u32(distance up the walk stack) | b"N") ]
    b"P" u32(n)  n x [ S(name)  tensor ]            parameters, registration order
    b"B" u32(n)  n x [ S(name)  tensor ]            buffers, registration order
    b"A" u32(n)  n x [ S(name)  value ]  | b"-"     primitive attributes sorted by utf-8 name, or none

tensor: ``b"N"`` for a None slot, else ``b"T" S(dtype) S(device type) u8(layout code)
u8(requires_grad) u32(ndim) ndim x i64 size [ndim x i64 stride, strided layout only]``.
value: ``b"n"`` None, ``b"b" u8``, ``b"i" S(str(int))``, ``b"f" S(repr(float))``, ``b"s" S(str)``,
``b"t" u32(n) values``.

forward_digest is the XXH3-128 digest of ``b"K" code`` for a Python function (the instance's
own ``forward`` if it has one, else the class's; a function with ``__compile_cache_fingerprint_as__``
is hashed as the function that attribute holds), or of ``b"X" S(qualified type name)`` for a
callable without ``__code__``. code: ``S(co_code bytes) u32(n) consts u32(n) S(names)``, constants
encoded as values plus ``b"c" S(repr(complex))``, ``b"y" u32(len) bytes``, ``b"z" u32(n)
sorted(encoded elements)`` for frozensets, ``b"e"`` for Ellipsis, ``b"k" code`` for nested code
and ``b"o" S(qualified type name)`` for anything else.

A digest is XXH3-128 of the record, in xxHash's canonical (big-endian) byte order: the ``xxhash``
package here, the same library's ``xxhash.h`` (vendored in ``csrc/third_party``) natively. It is a
fast, stable content hash, not a security boundary: signing packs is a separate, keyed mechanism.
"""

from __future__ import annotations

import struct

import torch
import xxhash
from torch import nn

from .torch_compat.tensors import OTHER_LAYOUT as _OTHER_LAYOUT
from .torch_compat.tensors import layout_codes

MAGIC = b"ccfp1"
DIGEST_SIZE = 16

#: Instance attributes every nn.Module has for its own bookkeeping: never part of a digest.
MODULE_INTERNAL_ATTRIBUTES: frozenset[str] = frozenset(nn.Module().__dict__) | {
    "_compiled_call_impl",
    "forward",
}

LAYOUT_CODES: dict[torch.layout, int] = layout_codes()  # torch_compat: torch may drop a layout
OTHER_LAYOUT = _OTHER_LAYOUT

_u32 = struct.Struct("<I").pack
_i64 = struct.Struct("<q").pack


def _s(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return _u32(len(data)) + data


def _qualified_type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _digest(record: bytes) -> bytes:
    return xxhash.xxh3_128_digest(record)


def _is_primitive(value: object) -> bool:
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return True
    return kind is tuple and all(_is_primitive(item) for item in value)  # type: ignore[union-attr]


def _encode_value(value: object) -> bytes:
    kind = type(value)
    if value is None:
        return b"n"
    if kind is bool:
        return b"b" + (b"\x01" if value else b"\x00")
    if kind is int:
        return b"i" + _s(str(value))
    if kind is float:
        return b"f" + _s(repr(value))
    if kind is str:
        return b"s" + _s(value)  # type: ignore[arg-type]
    if kind is tuple:
        return b"t" + _u32(len(value)) + b"".join(_encode_value(v) for v in value)  # type: ignore[arg-type]
    raise TypeError(f"not a primitive attribute value: {value!r}")


def _encode_constant(value: object) -> bytes:
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return _encode_value(value)
    if kind is tuple:
        return b"t" + _u32(len(value)) + b"".join(_encode_constant(v) for v in value)  # type: ignore[arg-type]
    if kind is complex:
        return b"c" + _s(repr(value))
    if kind is bytes:
        return b"y" + _u32(len(value)) + value  # type: ignore[operator]
    if kind is frozenset:
        items = sorted(_encode_constant(v) for v in value)  # type: ignore[union-attr]
        return b"z" + _u32(len(items)) + b"".join(items)
    if value is Ellipsis:
        return b"e"
    if kind is type(encode_code.__code__):
        return b"k" + encode_code(value)
    return b"o" + _s(_qualified_type_name(value))


def encode_code(code) -> bytes:  # noqa: ANN001 - a CodeType
    """The portable encoding of a code object (nested code included, frozensets sorted)."""
    raw = code.co_code
    parts = [_u32(len(raw)), raw, _u32(len(code.co_consts))]
    parts.extend(_encode_constant(c) for c in code.co_consts)
    parts.append(_u32(len(code.co_names)))
    parts.extend(_s(name) for name in code.co_names)
    return b"".join(parts)


def _forward_callable(module: nn.Module) -> object:
    own = module.__dict__.get("forward")
    if own is not None:
        return own
    return getattr(type(module), "forward", None)


#: A forward that compile_cache puts in place of another (a class's ``forward`` as installed,
#: ``compile_cache.torch_compat.kv.wrapped_forward``) names it here: it is hashed as that one, so
#: a key does not depend on whether the stand-in is installed yet.
FINGERPRINT_AS = "__compile_cache_fingerprint_as__"


def _forward_digest(function: object, cache: dict[int, tuple[object, bytes]]) -> bytes:
    function = getattr(function, "__func__", function)
    function = getattr(function, FINGERPRINT_AS, function)
    hit = cache.get(id(function))
    if hit is not None and hit[0] is function:
        return hit[1]
    code = getattr(function, "__code__", None)
    if code is not None and type(code) is type(encode_code.__code__):
        digest = _digest(b"K" + encode_code(code))
    else:
        digest = _digest(b"X" + _s(_qualified_type_name(function)))
    cache[id(function)] = (function, digest)
    return digest


def _encode_tensor(tensor: torch.Tensor | None) -> bytes:
    if tensor is None:
        return b"N"
    layout = LAYOUT_CODES.get(tensor.layout, OTHER_LAYOUT)
    shape = tuple(tensor.shape)
    parts = [
        b"T",
        _s(str(tensor.dtype).removeprefix("torch.")),
        _s(tensor.device.type),
        bytes((layout, 1 if tensor.requires_grad else 0)),
        _u32(len(shape)),
    ]
    parts.extend(_i64(size) for size in shape)
    if layout == 0:
        parts.extend(_i64(step) for step in tensor.stride())
    return b"".join(parts)


class _Walker:
    """One walk over a module tree: each module encoded and hashed once, shared modules reused."""

    def __init__(self, attributes: bool) -> None:
        self.attributes = attributes
        self.done: dict[int, bytes] = {}
        self.stack: list[int] = []
        self.names: list[tuple[str, int]] = []
        self.forward_cache: dict[int, tuple[object, bytes]] = {}
        self.class_names: dict[type, bytes] = {}
        self.keepalive: list[nn.Module] = []

    def walk(self, module: nn.Module, name: str) -> bytes:
        key = id(module)
        self.keepalive.append(module)
        self.names.append((name, key))
        self.stack.append(key)
        cls = type(module)
        class_name = self.class_names.get(cls)
        if class_name is None:
            class_name = self.class_names[cls] = _s(f"{cls.__module__}.{cls.__qualname__}")
        state = module.__dict__
        parts = [MAGIC, class_name, _forward_digest(_forward_callable(module), self.forward_cache)]

        children = state["_modules"]
        parts.append(b"C" + _u32(len(children)))
        for child_name, child in children.items():
            parts.append(_s(child_name))
            if child is None:
                parts.append(b"N")
                continue
            child_key = id(child)
            if child_key in self.stack:
                distance = len(self.stack) - self.stack.index(child_key)
                parts.append(b"R" + _u32(distance))
                continue
            child_digest = self.done.get(child_key)
            if child_digest is None:
                prefix = f"{name}.{child_name}" if name else child_name
                child_digest = self.walk(child, prefix)
            parts.append(b"D" + child_digest)

        for tag, tensors in ((b"P", state["_parameters"]), (b"B", state["_buffers"])):
            parts.append(tag + _u32(len(tensors)))
            for tensor_name, tensor in tensors.items():
                parts.append(_s(tensor_name))
                parts.append(_encode_tensor(tensor))

        if self.attributes:
            found = sorted(
                (attr.encode("utf-8", "surrogatepass"), value)
                for attr, value in state.items()
                if type(attr) is str
                and attr not in MODULE_INTERNAL_ATTRIBUTES
                and _is_primitive(value)
            )
            parts.append(b"A" + _u32(len(found)))
            for encoded_name, value in found:
                parts.append(_u32(len(encoded_name)) + encoded_name + _encode_value(value))
        else:
            parts.append(b"-")

        self.stack.pop()
        digest = _digest(b"".join(parts))
        self.done[key] = digest
        return digest


def fingerprint_tree(module: nn.Module, attributes: bool) -> list[tuple[str, bytes]]:
    """Digests of every submodule, in the order of ``named_modules()``, as (qualified name, 16 bytes)."""
    walker = _Walker(attributes)
    walker.walk(module, "")
    return [(name, walker.done[key]) for name, key in walker.names]

