"""Reading a pack without reading it whole: every check, in order, then members on demand.

:func:`open_pack` checks a pack through ``read_at(offset, n)`` (an open file's ``pread``, or a
buffer): the prefix and the limits first (:func:`~compile_cache.store.pack.check_prefix`: size,
from the first 84 bytes), the signature, the header with its member table (count, names, sizes
adding up), then the checksum over the body, one chunk at a time. A :class:`CheckedPack` reads
its members on demand (:class:`PackMembers`, the ``members`` of a loaded pack), so memory never
holds more than one chunk of a large member, and a pack another process removes meanwhile is
still read whole from the open file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from .._paths import check_member_name
from ..errors import CorruptPackError
from . import compression
from .pack import (
    CHUNK,
    FLAG_SIGNED,
    MAX_HEADER_BYTES,
    PREFIX_STRUCT,
    U32,
    PackLimitError,
    PackLimits,
    SignatureMismatchError,
    add_member,
    check_prefix,
    content_digest,
    parse_header,
    signature_ok,
    signer_id,
)

__all__ = ["CheckedPack", "PackMembers", "decode_pack", "open_pack", "open_pack_file"]

ReadAt = Callable[[int, int], bytes]


def _read_exactly(read_at: ReadAt, offset: int, n: int) -> bytes:
    data = read_at(offset, n)
    if len(data) != n:
        raise CorruptPackError(f"truncated pack: {n} bytes expected at offset {offset}, got {len(data)}")
    return data


@dataclass(frozen=True)
class _Entry:
    name: str
    offset: int  # from the start of the pack file
    size: int
    info: dict[str, Any]


class CheckedPack:
    """A pack whose prefix, limits, header, checksum and signature were checked (by :func:`open_pack`).

    Members are read on demand through ``read_at`` (an open file's ``pread``, or a buffer), so a
    pack that another process evicts or quarantines meanwhile is still read whole.
    """

    def __init__(self, read_at: ReadAt, size: int, flags: int, header: dict[str, Any],
                 entries: list[_Entry], closer: Callable[[], None] | None) -> None:
        self.read_at = read_at
        self.size = size
        self.flags = flags
        self.header = header
        self.entries = {e.name: e for e in entries}
        self._closer = closer

    @property
    def signed(self) -> bool:
        return bool(self.flags & FLAG_SIGNED)

    def member_size(self, name: str) -> int:
        return self.entries[name].size

    def member_info(self, name: str) -> dict[str, Any]:
        """The member's entry of the member table (name, size, and what capture recorded)."""
        return self.entries[name].info

    def read_member_at(self, name: str, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes of member ``name`` from ``offset`` within it."""
        entry = self.entries[name]
        if offset >= entry.size or n <= 0:
            return b""
        return self.read_at(entry.offset + offset, min(n, entry.size - offset))

    def chunks(self, name: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """The bytes of member ``name``, ``chunk`` bytes at a time."""
        entry = self.entries[name]
        done = 0
        while done < entry.size:
            data = _read_exactly(self.read_at, entry.offset + done, min(chunk, entry.size - done))
            done += len(data)
            yield data

    def read(self, name: str) -> bytes:
        """The whole member ``name`` (for small members; large ones: :meth:`chunks`)."""
        entry = self.entries[name]
        return _read_exactly(self.read_at, entry.offset, entry.size) if entry.size else b""

    def content_hash(self) -> str:
        """The pack's name by its content, computed in chunks."""
        digest = content_digest(self.header.get("signer") if self.signed else None)
        for name in sorted(self.entries):
            add_member(digest, name, self.entries[name].size)
            for data in self.chunks(name):
                digest.update(data)
        return digest.hexdigest()[:32]

    def close(self) -> None:
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()

    def reopen_on_demand(self, read_at: ReadAt, closer: Callable[[], None]) -> None:
        """Close the file now; read later through ``read_at`` (a reader that opens the same
        file again when asked, :class:`~compile_cache.store.loading.Reopener`), closed by
        ``closer``. A load of an entry with a thousand packs so holds a few descriptors."""
        old, self._closer = self._closer, closer
        self.read_at = read_at
        if old is not None:
            old()


def open_pack(
    read_at: ReadAt,
    size: int,
    *,
    signing_key: bytes | None = None,
    key: str | None = None,
    limits: PackLimits | None = None,
    closer: Callable[[], None] | None = None,
    checksum: bool = True,
) -> CheckedPack:
    """Check a pack of ``size`` bytes read through ``read_at(offset, n)``; never reads it whole.

    In order: the prefix (magic, format), the size and the limits (from the prefix alone), the
    signature, the header (bounded) with its member table (count, names, sizes adding up), and
    the checksum over the body, in chunks. Raises :class:`IncompatiblePackError` (another
    format), :class:`PackLimitError`, :class:`SignatureMismatchError` (a miss for this reader
    only), :class:`UnsafePathError` (a member name that could escape) or
    :class:`CorruptPackError` (anything else, incl. a key other than ``key``). ``checksum``
    False: everything but the checksum over the body (a file this process checked whole a
    moment ago: :meth:`~.checker.PackChecker.vouch`).
    """
    limits = limits or PackLimits.from_config()
    prefix = read_at(0, PREFIX_STRUCT.size)
    flags, body_len, digest, mac = check_prefix(prefix, size, limits)
    total = size
    signature = signature_ok(prefix, flags, mac, signing_key) if signing_key else None
    if body_len < 4:
        raise CorruptPackError("truncated pack header")
    (header_len,) = U32.unpack(_read_exactly(read_at, PREFIX_STRUCT.size, 4))
    if header_len > min(body_len - 4, MAX_HEADER_BYTES):
        raise CorruptPackError(f"truncated or oversized pack header ({header_len} bytes)")
    header_raw = _read_exactly(read_at, PREFIX_STRUCT.size + 4, header_len)
    header = parse_header(header_raw)
    if signature is not None:
        if header.get("signer") == signer_id(signing_key):
            # It names our key, but the MAC is wrong: altered, or forged by someone without it.
            raise CorruptPackError(f"{signature}, though the pack claims to be signed with it")
        raise SignatureMismatchError(signature)
    if key is not None and header.get("key") != key:
        raise CorruptPackError(f"pack belongs to key {header.get('key')!r}, found under {key!r}")
    table = header["members"]
    problem = limits.problem(total, len(table), 0)
    if problem:
        raise PackLimitError(problem)
    entries = _member_table(table, PREFIX_STRUCT.size + 4 + header_len, total)
    problem = limits.problem(total, len(table), max((len(e.name) for e in entries), default=0))
    if problem:
        raise PackLimitError(problem)
    if not checksum:  # read and checked whole by this process a moment ago (PackChecker.vouch)
        return CheckedPack(read_at, total, flags, header, entries, closer)
    body = hashlib.sha256(U32.pack(header_len))
    body.update(header_raw)
    position = PREFIX_STRUCT.size + 4 + header_len
    while position < total:
        data = _read_exactly(read_at, position, min(CHUNK, total - position))
        body.update(data)
        position += len(data)
    if body.digest() != digest:
        raise CorruptPackError("pack checksum mismatch: its bytes were altered or damaged")
    return CheckedPack(read_at, total, flags, header, entries, closer)


def _member_table(table: list[Any], offset: int, total: int) -> list[_Entry]:
    """The members of a header's member table, the first at ``offset``: safe names, sizes
    that fit and add up to the pack's ``total`` bytes, no name twice (CorruptPackError)."""
    entries: list[_Entry] = []
    seen: set[str] = set()
    for item in table:
        if not isinstance(item, dict):
            raise CorruptPackError("bad member table entry")
        name, member_size = item.get("name"), item.get("size")
        check_member_name(name)
        assert isinstance(name, str)
        if (not isinstance(member_size, int) or isinstance(member_size, bool) or member_size < 0
                or offset + member_size > total):
            raise CorruptPackError(f"member {name!r} has a bad size {member_size!r}")
        if name in seen:
            raise CorruptPackError(f"duplicate member {name!r}")
        seen.add(name)
        entries.append(_Entry(name, offset, member_size, dict(item)))
        offset += member_size
    if offset != total:
        raise CorruptPackError("pack has bytes its member table does not account for")
    return entries


def open_pack_file(
    fh: BinaryIO, *, signing_key: bytes | None = None, key: str | None = None,
    limits: PackLimits | None = None, close: bool = True, checksum: bool = True,
) -> CheckedPack:
    """:func:`open_pack` on an open binary file (read with ``pread``); the pack keeps it open
    (``close``: closed with the pack, and when checking fails).

    A compressed pack (one zstd frame, :mod:`.compression`) is expanded first, bounded by the
    pack size limit from its frame header, into an unlinked temp file the pack reads instead.
    """
    fd = fh.fileno()
    try:
        if compression.is_compressed(os.pread(fd, 4, 0)):
            fh = _expanded(fh, limits or PackLimits.from_config(), close)
            fd, close = fh.fileno(), True
        size = os.fstat(fd).st_size
        return open_pack(lambda offset, n: os.pread(fd, n, offset), size, signing_key=signing_key,
                         key=key, limits=limits, closer=fh.close if close else None, checksum=checksum)
    except BaseException:
        if close:
            fh.close()
        raise


def _expanded(fh: BinaryIO, limits: PackLimits, close: bool) -> BinaryIO:
    """A compressed pack file ``fh`` expanded into an unlinked temp file (``fh`` closed with
    ``close``), bounded by ``limits`` before anything is expanded."""
    out = tempfile.TemporaryFile()
    try:
        fh.seek(0)
        compression.decompress(fh.read, out, limits.max_pack_size)
        out.flush()
    except BaseException:
        out.close()
        raise
    finally:
        if close:
            fh.close()
    return out  # type: ignore[return-value]


class PackMembers(Mapping[str, bytes]):
    """A checked pack's members by name, read from the pack on demand (name order).

    ``pack.members[name]`` reads one member whole; :meth:`chunks` streams it, :meth:`size` and
    :meth:`info` answer from the member table without reading it.
    """

    def __init__(self, checked: CheckedPack, *, names: Iterable[str] | None = None,
                 finalizer: weakref.finalize | None = None) -> None:
        """``names``/``finalizer``: a view of some members sharing another's file (:meth:`only`)."""
        self._pack = checked
        self._names = sorted(checked.entries if names is None else names)
        self._only: frozenset[str] | None = None if names is None else frozenset(self._names)
        # The file closes with us (with the first of a view and the members it came from).
        self._finalizer = finalizer if finalizer is not None else weakref.finalize(self, checked.close)

    def __getitem__(self, name: str) -> bytes:
        if name not in self:
            raise KeyError(name)
        return self._pack.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._pack.entries and (self._only is None or name in self._only)

    def size(self, name: str) -> int:
        return self._pack.member_size(name)

    def info(self, name: str) -> dict[str, Any]:
        return self._pack.member_info(name)

    def chunks(self, name: str, chunk: int = CHUNK) -> Iterator[bytes]:
        return self._pack.chunks(name, chunk)

    def read_at(self, name: str, offset: int, n: int) -> bytes:
        return self._pack.read_member_at(name, offset, n)

    def close(self) -> None:
        """Close the pack file (reading a member afterwards fails)."""
        self._finalizer()

    def only(self, names: Iterable[str]) -> PackMembers:
        """The members among ``names``, read from the same pack file (closed with it)."""
        return type(self)(self._pack, names={n for n in names if n in self._pack.entries},
                          finalizer=self._finalizer)

    def __repr__(self) -> str:
        return f"PackMembers({len(self._names)} members)"


def decode_pack(
    data: bytes, *, signing_key: bytes | None = None, key: str | None = None,
    limits: PackLimits | None = None,
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Check and decode a whole pack held in memory (compressed or not): ``(header, members)``.

    The same checks as :func:`open_pack` (and its exceptions).
    """
    if compression.is_compressed(data):
        data = compression.decompress_bytes(data, (limits or PackLimits.from_config()).max_pack_size)
    view = memoryview(data)
    checked = open_pack(lambda offset, n: bytes(view[offset : offset + n]), len(view),
                        signing_key=signing_key, key=key, limits=limits)
    return checked.header, {name: checked.read(name) for name in checked.entries}

