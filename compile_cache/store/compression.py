"""Packs in transit: one zstd frame holding the whole pack file, bounded before it is opened.

A pack sent to object storage or put in an ``export`` archive is compressed
(``COMPILE_CACHE_PACK_COMPRESSION``, default level 3: measured in ``benchmarks/RESULTS.md``) as
one zstd frame whose content is the pack file byte for byte. So the content name, the SHA-256
and the signature are those of the uncompressed pack: keys and dedupe do not change, and a
compressed pack is checked exactly as an uncompressed one once it is expanded.

Expanding is bounded before it starts (:func:`decompress`): the frame header must declare the
content size, and that size must be within the pack size limit (a bomb is refused from its first
18 bytes); while expanding, output past the declared size is refused (a frame that lies about
its size), as are a short frame and bytes after it. The stdlib ``compression.zstd`` is used where
Python has it (3.14+), else ``backports.zstd`` (the same module).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import IO, Any

from .. import config
from ..errors import CorruptPackError
from .pack import CHUNK, PackLimitError

__all__ = [
    "SUFFIX",
    "ZSTD_MAGIC",
    "compress",
    "compress_file",
    "declared_size",
    "decompress",
    "decompress_bytes",
    "decompress_head",
    "expand",
    "is_compressed",
    "level",
    "zstd",
]

#: The first four bytes of a zstd frame.
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: What a compressed pack's name adds to ``<hash>.pack`` (objects and archive members).
SUFFIX = ".zst"
#: A zstd frame header is at most this long: enough to read the declared content size.
FRAME_HEADER_MAX = 18


@functools.cache
def zstd() -> Any:
    """The zstd module: ``compression.zstd`` (Python 3.14+), else ``backports.zstd`` (looked up
    once: a download's worker thread calls this, and must not import)."""
    try:
        from compression import zstd as module  # type: ignore[import-not-found]
    except ImportError:
        from backports import zstd as module  # type: ignore[import-not-found,no-redef]
    return module


def level() -> int:
    """The level packs are compressed at (``COMPILE_CACHE_PACK_COMPRESSION``; 0: not at all)."""
    return int(config.PACK_COMPRESSION.value())


def is_compressed(head: bytes | bytearray | memoryview) -> bool:
    """Whether bytes starting a file are a zstd frame (a pack file starts with ``CCPACK``)."""
    return bytes(head[:4]) == ZSTD_MAGIC


def _compressor(lvl: int, size: int | None) -> Any:
    z = zstd()
    options = {z.CompressionParameter.compression_level: lvl, z.CompressionParameter.checksum_flag: 1}
    comp = z.ZstdCompressor(options=options)
    if size is not None:  # the frame header then declares the content size: what readers bound
        comp.set_pledged_input_size(size)
    return comp


def compress(data: bytes | bytearray | memoryview, lvl: int | None = None) -> bytes:
    """``data`` as one zstd frame that declares its content size (level: :func:`level`)."""
    comp = _compressor(level() if lvl is None else lvl, len(data))
    return comp.compress(data, comp.FLUSH_FRAME)


def compress_file(src: IO[bytes], size: int, out: IO[bytes], lvl: int | None = None) -> int:
    """Stream ``size`` bytes of ``src`` into ``out`` as one frame; returns the bytes written."""
    comp = _compressor(level() if lvl is None else lvl, size)
    written = done = 0
    while done < size:
        data = src.read(min(CHUNK, size - done))
        if not data:
            raise CorruptPackError(f"pack ended at {done} of its {size} bytes while compressing")
        done += len(data)
        chunk = comp.compress(data)
        out.write(chunk)
        written += len(chunk)
    tail = comp.flush(comp.FLUSH_FRAME)
    out.write(tail)
    return written + len(tail)


def declared_size(head: bytes, limit: int) -> int:
    """The content size a frame header declares, checked against ``limit`` before anything is
    expanded: :class:`PackLimitError` over it, :class:`CorruptPackError` when it is not declared."""
    z = zstd()
    try:
        info = z.get_frame_info(head)
    except (z.ZstdError, ValueError) as exc:
        raise CorruptPackError(f"compressed pack has a bad zstd frame header: {exc}") from None
    size = info.decompressed_size
    if size is None:
        raise CorruptPackError("compressed pack's frame does not declare its size: refused unread")
    if info.dictionary_id:
        raise CorruptPackError("compressed pack needs a zstd dictionary: refused")
    if size > limit:
        raise PackLimitError(f"compressed pack expands to {size} bytes, over the limit of {limit} "
                             "(COMPILE_CACHE_MAX_PACK_SIZE): refused before expanding")
    return int(size)


def decompress(read: Callable[[int], bytes], out: IO[bytes], limit: int) -> int:
    """Expand one frame read through ``read(n)`` into ``out``; returns the expanded size.

    Bounded before it starts and while it runs (see the module docstring): never writes more
    than the declared size, itself within ``limit``.
    """
    z = zstd()
    head = b""
    while len(head) < FRAME_HEADER_MAX:
        more = read(FRAME_HEADER_MAX - len(head))
        if not more:
            break
        head += more
    size = declared_size(head, limit)
    dec = z.ZstdDecompressor()
    written, data = 0, head
    try:
        while not dec.eof:
            if not data and dec.needs_input:
                data = read(CHUNK)
                if not data:
                    raise CorruptPackError(f"compressed pack ends early ({written} of {size} bytes expanded)")
            chunk = dec.decompress(data, max_length=min(CHUNK, size - written + 1))
            data = b""
            written += len(chunk)
            if written > size:
                raise CorruptPackError(f"compressed pack expands past the {size} bytes its frame "
                                       "declares: refused")
            out.write(chunk)
    except z.ZstdError as exc:
        raise CorruptPackError(f"compressed pack is damaged: {exc}") from None
    if written != size:
        raise CorruptPackError(f"compressed pack expands to {written} bytes, its frame declares {size}")
    if dec.unused_data or read(1):
        raise CorruptPackError("compressed pack has bytes after its frame")
    return written


def expand(data: bytes | bytearray | memoryview, limit: int, hold: int) -> bytes | None:
    """One frame held in memory, expanded in one call if it declares at most ``hold`` bytes
    (None: it declares more, for :func:`decompress` to stream); bounded as :func:`decompress`
    is: the declared size within ``limit`` before anything is expanded, never more output than
    declared, no short frame, no bytes after it. One call: a download's thread that expands a
    pack releases the GIL once, not once per chunk."""
    size = declared_size(bytes(data[:FRAME_HEADER_MAX]), limit)
    if size > hold:
        return None
    z = zstd()
    dec = z.ZstdDecompressor()
    try:
        out = dec.decompress(data, max_length=size + 1)
    except z.ZstdError as exc:
        raise CorruptPackError(f"compressed pack is damaged: {exc}") from None
    if len(out) > size:
        raise CorruptPackError(f"compressed pack expands past the {size} bytes its frame declares: refused")
    if not dec.eof:
        raise CorruptPackError(f"compressed pack ends early ({len(out)} of {size} bytes expanded)")
    if len(out) != size:
        raise CorruptPackError(f"compressed pack expands to {len(out)} bytes, its frame declares {size}")
    if dec.unused_data:
        raise CorruptPackError("compressed pack has bytes after its frame")
    return out


def decompress_bytes(data: bytes | bytearray | memoryview, limit: int) -> bytes:
    """:func:`decompress` of a frame held in memory (:func:`expand`, whatever it declares
    within ``limit``)."""
    out = expand(data, limit, limit)
    assert out is not None  # a declared size over limit raised
    return out


def decompress_head(data: bytes, n: int) -> bytes:
    """Up to the first ``n`` expanded bytes of a frame's first bytes ``data`` (perhaps only its
    start: a ranged read), for a listing that needs a pack's header only."""
    z = zstd()
    try:
        return z.ZstdDecompressor().decompress(data, max_length=n)
    except z.ZstdError as exc:
        raise CorruptPackError(f"compressed pack is damaged: {exc}") from None
