"""The pack format: one immutable, checksummed, optionally signed file per publish.

Pack format (all integers little-endian)::

    prefix (84 bytes): magic b"CCPACK\\r\\n" | u16 format | u16 flags | u64 body length
                       | SHA-256(body) | HMAC-SHA256(key, prefix[:52]) or 32 zero bytes
    body:              u32 header length | header (UTF-8 JSON) | member bytes, in header order

The header holds the format, creation time, torch version, host, key, caller metadata, the
compile seconds, the member table (name, size, and what the capture recorded of the file,
e.g. ``file_size``) and, from packs of this version on, the entry's record (``entry``: what
``entry.json`` holds beyond the header's own fields, so that a node downloading the pack need not
ask for the entry's ``entry.json``). The SHA-256 detects any flipped byte or truncation; with a signing key
(``COMPILE_CACHE_SIGNING_KEY``), packs are signed and the header names the signer (a key id
that reveals nothing of the key). A pack is named by :func:`content_hash` of its members (and
signer). This module knows bytes, not where packs live.

Reading a whole pack, bounded, is :mod:`.reader`'s job; this module has the pieces it checks
first: :func:`check_prefix` (magic, format, size and :class:`PackLimits`, from the 84-byte
prefix alone) and the header parser.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import config
from .._paths import HOSTNAME, check_key, check_member_name
from ..errors import CorruptPackError
from ._io import json_bytes, parse_json, torch_version

__all__ = [
    "CHUNK",
    "FLAG_SIGNED",
    "FORMAT_VERSION",
    "MAGIC",
    "PREFIX_SIZE",
    "PREFIX_STRUCT",
    "U32",
    "IncompatiblePackError",
    "PackLimitError",
    "PackLimits",
    "SignatureMismatchError",
    "add_member",
    "check_member_bytes",
    "check_prefix",
    "content_digest",
    "content_hash",
    "encode_pack",
    "parse_header",
    "prefix_accepts",
    "read_pack_header",
    "signature_ok",
    "signer_id",
]

FORMAT_VERSION = 1
MAGIC = b"CCPACK\r\n"
#: The prefix's layout: magic, format, flags, body length, body digest, signature (MAC).
PREFIX_STRUCT = struct.Struct("<8sHHQ32s32s")
#: The pack's fixed-size prefix: everything :func:`check_prefix` needs.
PREFIX_SIZE = PREFIX_STRUCT.size
_SIGNED_PART = 8 + 2 + 2 + 8 + 32  # magic, format, flags, length, body digest: what the HMAC covers
FLAG_SIGNED = 0x1
#: A length (of the header, of a member name) in the pack.
U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
#: A header (JSON) longer than this is refused before it is read: a real one is well under 1 MiB.
MAX_HEADER_BYTES = 16 << 20
#: Bytes read at a time: the checksum pass, member copies.
CHUNK = 1 << 20


class IncompatiblePackError(CorruptPackError):
    """A pack written in another format version: a miss here, but left in place for its writer."""


class PackLimitError(CorruptPackError):
    """A pack larger, or with more or longer-named members, than the limits allow (refused unread)."""


class SignatureMismatchError(CorruptPackError):
    """A pack signed with another key, or unsigned, while this reader has a signing key.

    A miss for this reader only: another reader may hold the right key, so it is not quarantined.
    """


@dataclass(frozen=True)
class PackLimits:
    """The bounds a pack must stay within, checked from its prefix and header."""

    max_pack_size: int
    max_members: int
    max_name: int

    @classmethod
    def from_config(cls) -> PackLimits:
        """``COMPILE_CACHE_MAX_PACK_SIZE``, ``_MAX_PACK_MEMBERS``, ``_MAX_MEMBER_NAME`` (or defaults)."""
        return cls(config.MAX_PACK_SIZE.value(), config.MAX_PACK_MEMBERS.value(), config.MAX_MEMBER_NAME.value())

    def problem(self, size: int, count: int, longest: int) -> str | None:
        """Why a pack of ``size`` bytes with ``count`` members, the longest name ``longest``
        characters, breaks the limits, or None."""
        if size > self.max_pack_size:
            return (f"pack of {size} bytes is over the limit of {self.max_pack_size} "
                    "(COMPILE_CACHE_MAX_PACK_SIZE)")
        if count > self.max_members:
            return (f"pack of {count} members is over the limit of {self.max_members} "
                    "(COMPILE_CACHE_MAX_PACK_MEMBERS)")
        if longest > self.max_name:
            return (f"pack has a member name of {longest} characters, over the limit of "
                    f"{self.max_name} (COMPILE_CACHE_MAX_MEMBER_NAME)")
        return None


def check_member_bytes(name: str, value: object) -> bytes | bytearray | memoryview:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"member {name!r} must be bytes, got {type(value).__name__}")
    return value


def signer_id(signing_key: bytes | None) -> str | None:
    """The id a key signs under (16 hex digits of an HMAC of a constant): names the key, hides it."""
    if not signing_key:
        return None
    return hmac.new(signing_key, b"compile_cache-signer-1", hashlib.sha256).hexdigest()[:16]


def content_digest(signer: str | None) -> Any:
    """The running hash of a pack's content name (members added with :func:`add_member`)."""
    digest = hashlib.sha256(b"compile_cache-pack-content-1\0")
    if signer:  # packs of different signers never share a name (nor block each other's publish)
        digest.update(b"signer\0" + signer.encode() + b"\0")
    return digest


def add_member(digest: Any, name: str, size: int) -> None:
    """Add one member's name and size to a :func:`content_digest` (its bytes follow)."""
    encoded = name.encode("utf-8", "surrogatepass")
    digest.update(U32.pack(len(encoded)) + encoded + _U64.pack(size))


def content_hash(members: Mapping[str, bytes | bytearray | memoryview], signer: str | None = None) -> str:
    """The pack name: 32 hex digits of SHA-256 over the members' names and bytes, in name order
    (and the signer's id, for signed packs)."""
    digest = content_digest(signer)
    for name in sorted(members):
        data = members[name]
        add_member(digest, name, len(data))
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
    member_info: Mapping[str, Mapping[str, Any]] | None = None,
    entry: Mapping[str, Any] | None = None,
) -> tuple[str, list[bytes | bytearray | memoryview], int]:
    """Encode a pack: ``(content hash, chunks to write in order, total size)``.

    Validates ``key``, every member name (:class:`UnsafePathError`), that members are bytes
    (``TypeError``) and that ``metadata`` is JSON-serialisable (``TypeError``/``ValueError``).
    ``member_info``: per member, what the capture recorded of its file (``{"file_size": n}``),
    kept in the member table and checked on restore. Member bytes are not copied: the chunks
    reference them. ``name``: the content hash if the caller already computed it. ``entry``:
    what the entry's ``entry.json`` records beyond the header's own fields (the publisher's
    ``entry_info``): a node that downloads the pack writes its local ``entry.json`` from it,
    without a request for the URL's (:meth:`~.keeper.Keeper.entry_record_of`).
    """
    check_key(key)
    names = sorted(members)
    for member_name in names:
        check_member_name(member_name)
        check_member_bytes(member_name, members[member_name])
    signer = signer_id(signing_key)
    table = []
    for n in names:
        row = {k: v for k, v in (member_info or {}).get(n, {}).items() if k not in ("name", "size")}
        row.update(name=n, size=len(members[n]))
        table.append(row)
    header = {
        "format": FORMAT_VERSION,
        "created": time.time() if created is None else created,
        "torch": torch_version(),
        "host": HOSTNAME,
        "pid": os.getpid(),
        "key": key,
        "compile_seconds": float(compile_seconds),
        "metadata": dict(metadata or {}),
        "members": table,
    }
    if entry:
        header["entry"] = dict(entry)
    if signer:
        header["signer"] = signer
    header_bytes = json_bytes(header)
    body_head = U32.pack(len(header_bytes)) + header_bytes
    digest = hashlib.sha256(body_head)
    body_len = len(body_head)
    for n in names:
        digest.update(members[n])
        body_len += len(members[n])
    flags = FLAG_SIGNED if signing_key else 0
    signed_part = PREFIX_STRUCT.pack(MAGIC, FORMAT_VERSION, flags, body_len, digest.digest(), b"")[:_SIGNED_PART]
    mac = hmac.new(signing_key, signed_part, hashlib.sha256).digest() if signing_key else bytes(32)
    prefix = signed_part + mac
    chunks: list[bytes | bytearray | memoryview] = [prefix, body_head]
    chunks.extend(members[n] for n in names)
    return name or content_hash(members, signer), chunks, len(prefix) + body_len


# -- the first checks of a reader (compile_cache.store.reader) ---------------------------------------
def _parse_prefix(prefix: bytes) -> tuple[int, int, bytes, bytes]:
    """Magic and format of a prefix; return (flags, body_len, body digest, mac)."""
    if len(prefix) < PREFIX_STRUCT.size:
        raise CorruptPackError(f"truncated pack: {len(prefix)} bytes, shorter than its {PREFIX_STRUCT.size}-byte prefix")
    magic, fmt, flags, body_len, digest, mac = PREFIX_STRUCT.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptPackError("not a compile_cache pack (bad magic)")
    if fmt != FORMAT_VERSION:
        raise IncompatiblePackError(f"pack format {fmt}, this compile_cache reads format {FORMAT_VERSION}")
    return flags, body_len, digest, mac


def check_prefix(prefix: bytes, size: int, limits: PackLimits) -> tuple[int, int, bytes, bytes]:
    """Check a pack's first bytes against the file's ``size`` and the limits, before anything
    else is read; return (flags, body_len, body digest, mac)."""
    flags, body_len, digest, mac = _parse_prefix(prefix)
    total = PREFIX_STRUCT.size + body_len
    problem = limits.problem(total, 0, 0)
    if problem:
        raise PackLimitError(problem)
    if size != total:
        raise CorruptPackError(f"truncated pack: {size} bytes on disk, its prefix says {total}")
    return flags, body_len, digest, mac


def signature_ok(prefix: bytes, flags: int, mac: bytes, signing_key: bytes) -> str | None:
    """None when the prefix carries a valid signature by ``signing_key``, else why not."""
    if not flags & FLAG_SIGNED:
        return "unsigned pack: COMPILE_CACHE_SIGNING_KEY is set"
    expected = hmac.new(signing_key, prefix[:_SIGNED_PART], hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        return "pack signature does not match COMPILE_CACHE_SIGNING_KEY"
    return None


def parse_header(raw: bytes) -> dict[str, Any]:
    """The pack header from its JSON bytes, bounded and checked field by field (CorruptPackError)."""
    try:
        header = parse_json(raw, max_bytes=MAX_HEADER_BYTES, what="pack header")
    except ValueError as exc:
        raise CorruptPackError(f"pack header is not usable JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        raise CorruptPackError("pack header is not a format-1 header object")
    if not isinstance(header.get("members"), list):
        raise CorruptPackError("pack header has no member table")
    for field, kinds in _HEADER_FIELDS:
        value = header.get(field)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise CorruptPackError(f"pack header field {field!r} is a {type(value).__name__}")
    return header


#: The header fields every reader uses, and the types they must have when present.
_HEADER_FIELDS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("created", (int, float)), ("compile_seconds", (int, float)), ("metadata", dict),
    ("signer", str), ("torch", str), ("key", str), ("host", str), ("entry", dict),
)


def read_pack_header(path: Path) -> tuple[dict[str, Any], bool, int]:
    """Read only a pack's header (no checksum): ``(header, flags-signed, body_len)``. For listings."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb", buffering=0) as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptPackError(f"{path} is not a regular file")
        return read_pack_header_from(fh)


def read_pack_header_from(fh: Any) -> tuple[dict[str, Any], bool, int]:
    """:func:`read_pack_header` of an open file (a local one, or an object store's ranged reads)."""
    prefix = fh.read(PREFIX_STRUCT.size + 4)
    if len(prefix) < PREFIX_STRUCT.size + 4:
        raise CorruptPackError("truncated pack")
    flags, body_len, _d, _m = _parse_prefix(prefix)
    (header_len,) = U32.unpack_from(prefix, PREFIX_STRUCT.size)
    if header_len > min(body_len - 4, MAX_HEADER_BYTES):
        raise CorruptPackError("oversized pack header")
    raw = fh.read(header_len)
    if len(raw) != header_len:
        raise CorruptPackError("truncated pack header")
    return parse_header(raw), bool(flags & FLAG_SIGNED), body_len


def prefix_accepts(prefix: bytes, signing_key: bytes | None) -> bool:
    """Whether a pack's first bytes ``prefix`` carry a signature ``signing_key`` accepts."""
    try:
        flags, _len, _digest, mac = _parse_prefix(prefix)
    except CorruptPackError:
        return False
    return signing_key is None or signature_ok(prefix, flags, mac, signing_key) is None
