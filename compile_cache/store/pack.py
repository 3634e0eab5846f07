"""The pack format: one immutable, checksummed, optionally signed file per publish.

Pack format (all integers little-endian)::

    prefix (84 bytes): magic b"CCPACK\\r\\n" | u16 format | u16 flags | u64 body length
                       | SHA-256(body) | HMAC-SHA256(key, prefix[:52]) or 32 zero bytes
    body:              u32 header length | header (UTF-8 JSON) | member bytes, in header order

The header holds the format, creation time, torch version, host, key, caller metadata, the
compile seconds and the member table (name, size). The SHA-256 detects any flipped byte or
truncation; with a signing key (``COMPILE_CACHE_SIGNING_KEY``), packs are signed and unsigned or
altered packs are rejected (the HMAC covers the body digest, hence every byte). A pack is named
by :func:`content_hash` of its members. This module knows bytes, not where packs live.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._paths import HOSTNAME, check_key, check_member_name
from ..errors import CorruptPackError
from ._io import json_bytes, torch_version

__all__ = [
    "FLAG_SIGNED",
    "FORMAT_VERSION",
    "MAGIC",
    "IncompatiblePackError",
    "check_member_bytes",
    "content_hash",
    "decode_pack",
    "encode_pack",
    "is_signed",
    "read_pack_header",
]

FORMAT_VERSION = 1
MAGIC = b"CCPACK\r\n"
_PREFIX = struct.Struct("<8sHHQ32s32s")
_SIGNED_PART = 8 + 2 + 2 + 8 + 32  # magic, format, flags, length, body digest: what the HMAC covers
FLAG_SIGNED = 0x1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
MAX_HEADER_BYTES = 64 << 20


class IncompatiblePackError(CorruptPackError):
    """A pack written in another format version: a miss here, but left in place for its writer."""


def check_member_bytes(name: str, value: object) -> bytes | bytearray | memoryview:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"member {name!r} must be bytes, got {type(value).__name__}")
    return value


def content_hash(members: Mapping[str, bytes | bytearray | memoryview]) -> str:
    """The pack name: 32 hex digits of SHA-256 over the members' names and bytes, in name order."""
    digest = hashlib.sha256(b"compile_cache-pack-content-1\0")
    for name in sorted(members):
        data = members[name]
        encoded = name.encode("utf-8", "surrogatepass")
        digest.update(_U32.pack(len(encoded)) + encoded + _U64.pack(len(data)))
        digest.update(data)
    return digest.hexdigest()[:32]


def encode_pack(
    key: str,
    members: Mapping[str, bytes | bytearray | memoryview],
    metadata: Mapping[str, Any] | None = None,
    *,
    compile_seconds: float = 0.0,
    signing_key: bytes | None = None,
    created: float | None = None,
    name: str | None = None,
) -> tuple[str, list[bytes | bytearray | memoryview], int]:
    """Encode a pack: ``(content hash, chunks to write in order, total size)``.

    Validates ``key``, every member name (:class:`UnsafePathError`), that members are bytes
    (``TypeError``) and that ``metadata`` is JSON-serialisable (``TypeError``/``ValueError``).
    Member bytes are not copied: the chunks reference them. ``name``: the content hash if the
    caller already computed it.
    """
    check_key(key)
    names = sorted(members)
    for member_name in names:
        check_member_name(member_name)
        check_member_bytes(member_name, members[member_name])
    header = {
        "format": FORMAT_VERSION,
        "created": time.time() if created is None else created,
        "torch": torch_version(),
        "host": HOSTNAME,
        "pid": os.getpid(),
        "key": key,
        "compile_seconds": float(compile_seconds),
        "metadata": dict(metadata or {}),
        "members": [{"name": n, "size": len(members[n])} for n in names],
    }
    header_bytes = json_bytes(header)
    body_head = _U32.pack(len(header_bytes)) + header_bytes
    digest = hashlib.sha256(body_head)
    body_len = len(body_head)
    for n in names:
        digest.update(members[n])
        body_len += len(members[n])
    flags = FLAG_SIGNED if signing_key else 0
    signed_part = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, body_len, digest.digest(), b"")[:_SIGNED_PART]
    mac = hmac.new(signing_key, signed_part, hashlib.sha256).digest() if signing_key else bytes(32)
    prefix = signed_part + mac
    chunks: list[bytes | bytearray | memoryview] = [prefix, body_head]
    chunks.extend(members[n] for n in names)
    return name or content_hash(members), chunks, len(prefix) + body_len


def _parse_prefix(data: bytes, *, signing_key: bytes | None) -> tuple[int, int, int]:
    """Check magic, format and (if a key is set) the signature; return (format, flags, body_len)."""
    if len(data) < _PREFIX.size:
        raise CorruptPackError(f"truncated pack: {len(data)} bytes, shorter than its {_PREFIX.size}-byte prefix")
    magic, fmt, flags, body_len, _digest, mac = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptPackError("not a compile_cache pack (bad magic)")
    if fmt != FORMAT_VERSION:
        raise IncompatiblePackError(f"pack format {fmt}, this compile_cache reads format {FORMAT_VERSION}")
    if signing_key:
        if not flags & FLAG_SIGNED:
            raise CorruptPackError("unsigned pack rejected: COMPILE_CACHE_SIGNING_KEY is set")
        expected = hmac.new(signing_key, data[:_SIGNED_PART], hashlib.sha256).digest()
        if not hmac.compare_digest(mac, expected):
            raise CorruptPackError("pack signature does not match COMPILE_CACHE_SIGNING_KEY")
    return fmt, flags, body_len


def _parse_header(body_head: bytes, body_len: int) -> tuple[dict[str, Any], int]:
    if len(body_head) < 4:
        raise CorruptPackError("truncated pack header")
    (header_len,) = _U32.unpack_from(body_head)
    if header_len > min(body_len - 4, MAX_HEADER_BYTES) or len(body_head) < 4 + header_len:
        raise CorruptPackError("truncated or oversized pack header")
    try:
        header = json.loads(bytes(body_head[4 : 4 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptPackError(f"pack header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        raise CorruptPackError("pack header is not a format-1 header object")
    table = header.get("members")
    if not isinstance(table, list):
        raise CorruptPackError("pack header has no member table")
    return header, 4 + header_len


def decode_pack(
    data: bytes, *, signing_key: bytes | None = None, key: str | None = None
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Check and decode a whole pack: ``(header, members)``.

    Raises :class:`IncompatiblePackError` for another format version, :class:`UnsafePathError`
    for an unsafe member name, and :class:`CorruptPackError` for anything else wrong: bad magic,
    truncation, checksum or signature mismatch, a header that lies about sizes, a ``key`` other
    than the expected one.
    """
    _fmt, _flags, body_len = _parse_prefix(data, signing_key=signing_key)
    if len(data) != _PREFIX.size + body_len:
        raise CorruptPackError(
            f"truncated pack: {len(data)} bytes on disk, its prefix says {_PREFIX.size + body_len}"
        )
    view = memoryview(data)[_PREFIX.size :]
    if hashlib.sha256(view).digest() != _PREFIX.unpack_from(data)[4]:
        raise CorruptPackError("pack checksum mismatch: its bytes were altered or damaged")
    header, offset = _parse_header(view, body_len)
    if key is not None and header.get("key") != key:
        raise CorruptPackError(f"pack belongs to key {header.get('key')!r}, found under {key!r}")
    members: dict[str, bytes] = {}
    for item in header["members"]:
        if not isinstance(item, dict):
            raise CorruptPackError("bad member table entry")
        name, size = item.get("name"), item.get("size")
        check_member_name(name)
        assert isinstance(name, str)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > body_len:
            raise CorruptPackError(f"member {name!r} has a bad size {size!r}")
        if name in members:
            raise CorruptPackError(f"duplicate member {name!r}")
        members[name] = bytes(view[offset : offset + size])
        offset += size
    if offset != body_len:
        raise CorruptPackError("pack has bytes its member table does not account for")
    return header, members


def read_pack_header(path: Path) -> tuple[dict[str, Any], int, bool]:
    """Read only a pack's header (no checksum): ``(header, flags-signed, body_len)``. For listings."""
    with open(path, "rb") as fh:
        prefix = fh.read(_PREFIX.size + 4)
        if len(prefix) < _PREFIX.size + 4:
            raise CorruptPackError("truncated pack")
        magic, fmt, flags, body_len, _d, _m = _PREFIX.unpack_from(prefix)
        if magic != MAGIC:
            raise CorruptPackError("not a compile_cache pack (bad magic)")
        if fmt != FORMAT_VERSION:
            raise IncompatiblePackError(f"pack format {fmt}")
        (header_len,) = _U32.unpack_from(prefix, _PREFIX.size)
        if header_len > min(body_len - 4, MAX_HEADER_BYTES):
            raise CorruptPackError("oversized pack header")
        head = prefix[_PREFIX.size :] + fh.read(header_len)
    header, _ = _parse_header(head, body_len)
    return header, bool(flags & FLAG_SIGNED), body_len




def is_signed(data: bytes) -> bool:
    """Whether the pack ``data`` (already decoded once) carries a signature."""
    return bool(_PREFIX.unpack_from(data)[2] & FLAG_SIGNED)
