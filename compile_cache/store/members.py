"""What a pack member must be before torch may see it: the checks restore, verify and import share.

A pack member is a file torch will ``pickle.loads`` or ``dlopen``. The checksum only says the
bytes are the ones the publisher wrote; it says nothing about whether the publisher read a file
torch had finished. Torch's linker writes each ``.so`` in place, so a capture that raced it packs
a 0-byte or truncated library, and every node restoring that pack dies in ``dlopen``. So every
member is checked on its own, by one function (:func:`member_problem`):

* its name fits the limits (``COMPILE_CACHE_MAX_MEMBER_NAME`` characters, 255 bytes per path
  part: what a filesystem can hold) and, where the caller knows them, starts with a known label;
* a shared library (``.so``, ``.dylib``, ``.pyd``, ``.dll``) is a *complete* ELF, Mach-O or PE
  file: magic, and every table and segment its headers describe lies inside the file;
* its size equals the ``file_size`` the capture recorded from the finished file (when recorded).

Members are read through ``read_at(offset, n)``, never whole: a library check reads its headers
and tables only. This module knows bytes, not the disk layout and not torch.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import config
from ..errors import CorruptPackError

__all__ = [
    "LIBRARY_SUFFIXES",
    "PACK_LABELS",
    "MAX_PART_BYTES",
    "BadMemberError",
    "check_member",
    "is_complete_library",
    "is_library_name",
    "library_problem",
    "member_problem",
    "name_problem",
]

#: The first part of every member name compile_cache writes: the local cache dir it restores
#: into (``compile_cache.artifacts``). ``verify`` checks them; the store itself takes any name.
PACK_LABELS = frozenset({"inductor", "triton"})
#: Files torch loads as native code: each must be a complete executable file.
LIBRARY_SUFFIXES = (".so", ".dylib", ".pyd", ".dll")
#: The longest file name (one path part) common filesystems hold (NAME_MAX).
MAX_PART_BYTES = 255
#: Tables longer than this in a library's headers are not believed (a real one has a few KB).
_MAX_TABLE_BYTES = 64 << 20

ReadAt = Callable[[int, int], bytes]


class BadMemberError(CorruptPackError):
    """A pack member that must not reach torch: a partial library, a size that differs from the
    capture's, a name no filesystem (or no restore target) takes."""


def is_library_name(name: str) -> bool:
    """Whether ``name`` is a file torch loads as native code (``.so``, ``.dylib``, ``.pyd``, ``.dll``)."""
    return name.endswith(LIBRARY_SUFFIXES)


def name_problem(name: str, labels: Iterable[str] | None = None, max_name: int | None = None) -> str | None:
    """Why ``name`` (already a safe relative POSIX path) cannot be restored, or None.

    ``max_name``: default ``COMPILE_CACHE_MAX_MEMBER_NAME``. ``labels``: the first parts a member
    may have (``inductor``, ``triton``); None accepts any.
    """
    limit = config.MAX_MEMBER_NAME.value() if max_name is None else max_name
    if len(name) > limit:
        return f"member name of {len(name)} characters, over the limit of {limit} (COMPILE_CACHE_MAX_MEMBER_NAME)"
    for part in name.split("/"):
        if len(part.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES:
            return f"member name part {part[:40]!r}... is over {MAX_PART_BYTES} bytes: no filesystem holds it"
    if labels is not None:
        label = name.split("/", 1)[0]
        if label not in labels or "/" not in name:
            return f"member {name!r} has unknown label {label!r} (expected one of {', '.join(sorted(labels))})"
    return None


def member_problem(
    name: str,
    size: int,
    read_at: ReadAt,
    recorded: Mapping[str, Any] | None = None,
    *,
    labels: Iterable[str] | None = None,
    max_name: int | None = None,
) -> str | None:
    """Why the member ``name`` of ``size`` bytes must not reach torch, or None when it may.

    ``recorded``: the member's entry in the pack's member table (``file_size``: the size of the
    finished file at capture). ``read_at(offset, n)`` reads the member's bytes.
    """
    problem = name_problem(name, labels, max_name)
    if problem is not None:
        return problem
    file_size = (recorded or {}).get("file_size")
    if isinstance(file_size, int) and not isinstance(file_size, bool) and file_size != size:
        return f"member {name!r} holds {size} bytes, but the captured file had {file_size}"
    if is_library_name(name):
        problem = library_problem(size, read_at)
        if problem is not None:
            return f"member {name!r} is not a complete shared library: {problem}"
    return None


def check_member(
    name: str,
    data: bytes | bytearray | memoryview,
    recorded: Mapping[str, Any] | None = None,
    *,
    labels: Iterable[str] | None = None,
) -> None:
    """Raise :class:`BadMemberError` if the member ``name`` with bytes ``data`` must not reach torch."""
    view = memoryview(data)
    problem = member_problem(name, len(view), lambda off, n: bytes(view[off : off + n]), recorded, labels=labels)
    if problem is not None:
        raise BadMemberError(problem)


def is_complete_library(data: bytes | bytearray | memoryview | str | os.PathLike[str]) -> bool:
    """Whether ``data`` (bytes, or a file's path) is a complete ELF, Mach-O or PE file.

    A 0-byte file, a file the linker is still writing (headers that point past its end), or a file
    of some other kind is not. The capture side calls it on a finished ``.so`` before packing it.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        return library_problem(len(view), lambda off, n: bytes(view[off : off + n])) is None
    try:  # non-blocking: a FIFO is no library, and must not hang the capture
        fd = os.open(data, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        size = st.st_size
        return library_problem(size, lambda off, n: os.pread(fd, n, off)) is None
    finally:
        os.close(fd)


def library_problem(size: int, read_at: ReadAt) -> str | None:
    """Why a file of ``size`` bytes read through ``read_at`` is not a complete library, or None."""
    if size == 0:
        return "it is empty (0 bytes)"
    head = read_at(0, 64)
    if head[:4] == b"\x7fELF":
        return _elf_problem(size, head, read_at)
    if head[:4] in _MACHO_MAGICS:
        return _macho_problem(size, read_at, 0, size, nested=False)
    if head[:2] == b"MZ":
        return _pe_problem(size, read_at)
    return f"no ELF, Mach-O or PE magic (starts with {bytes(head[:4])!r})"


def _span_ok(offset: int, length: int, size: int) -> bool:
    return offset >= 0 and length >= 0 and offset + length <= size


def _table(read_at: ReadAt, size: int, offset: int, count: int, entsize: int, what: str) -> tuple[bytes | None, str | None]:
    length = count * entsize
    if length > _MAX_TABLE_BYTES:
        return None, f"its {what} table claims {length} bytes"
    if not _span_ok(offset, length, size):
        return None, f"its {what} table ends at byte {offset + length}, past the file's end ({size} bytes): truncated"
    data = read_at(offset, length)
    if len(data) != length:
        return None, f"its {what} table could not be read whole: truncated"
    return data, None


# -- ELF -----------------------------------------------------------------------------------------
_PT_LOAD, _SHT_NULL, _SHT_NOBITS = 1, 0, 8


def _elf_problem(size: int, head: bytes, read_at: ReadAt) -> str | None:
    if len(head) < 6:
        return f"ELF header needs 64 bytes, the file has {size}: truncated"
    cls, data_enc = head[4], head[5]
    if cls not in (1, 2) or data_enc not in (1, 2):
        return f"bad ELF class/encoding ({cls}, {data_enc})"
    end = "<" if data_enc == 1 else ">"
    if cls == 2:
        if size < 64 or len(head) < 64:
            return f"ELF header needs 64 bytes, the file has {size}: truncated"
        (_t, _m, _v, _e, phoff, shoff, _f, _eh, phentsize, phnum, shentsize, shnum, _x) = struct.unpack_from(
            end + "HHIQQQIHHHHHH", head, 16
        )
        ph_fmt, ph_size, sh_fmt, sh_size = end + "IIQQQQQQ", 56, end + "IIQQQQIIQQ", 64
    else:
        if size < 52 or len(head) < 52:
            return f"ELF header needs 52 bytes, the file has {size}: truncated"
        (_t, _m, _v, _e, phoff, shoff, _f, _eh, phentsize, phnum, shentsize, shnum, _x) = struct.unpack_from(
            end + "HHIIIIIHHHHHH", head, 16
        )
        ph_fmt, ph_size, sh_fmt, sh_size = end + "IIIIIIII", 32, end + "IIIIIIIIII", 40
    loads = 0
    if phnum:
        if phentsize != ph_size:
            return f"program header entries of {phentsize} bytes, expected {ph_size}"
        table, problem = _table(read_at, size, phoff, phnum, phentsize, "program header")
        if problem:
            return problem
        assert table is not None
        for i in range(phnum):
            fields = struct.unpack_from(ph_fmt, table, i * ph_size)
            if cls == 2:
                p_type, p_offset, p_filesz = fields[0], fields[2], fields[5]
            else:
                p_type, p_offset, p_filesz = fields[0], fields[1], fields[4]
            if not _span_ok(p_offset, p_filesz, size):
                return f"segment {i} ends at byte {p_offset + p_filesz}, past the file's end ({size} bytes): truncated"
            loads += p_type == _PT_LOAD
    if shnum:
        if shentsize != sh_size:
            return f"section header entries of {shentsize} bytes, expected {sh_size}"
        table, problem = _table(read_at, size, shoff, shnum, shentsize, "section header")
        if problem:
            return problem
        assert table is not None
        for i in range(shnum):
            fields = struct.unpack_from(sh_fmt, table, i * sh_size)
            sh_type, sh_offset, sh_len = fields[1], fields[4], fields[5]
            if sh_type not in (_SHT_NULL, _SHT_NOBITS) and not _span_ok(sh_offset, sh_len, size):
                return f"section {i} ends at byte {sh_offset + sh_len}, past the file's end ({size} bytes): truncated"
    elif shoff > size:
        return f"its section header table starts at byte {shoff}, past the file's end ({size} bytes)"
    if not loads:
        return "no loadable segment"
    return None


# -- Mach-O --------------------------------------------------------------------------------------
_MACHO_THIN = {
    b"\xce\xfa\xed\xfe": ("<", 28), b"\xfe\xed\xfa\xce": (">", 28),  # 32-bit
    b"\xcf\xfa\xed\xfe": ("<", 32), b"\xfe\xed\xfa\xcf": (">", 32),  # 64-bit
}
_MACHO_FAT = {b"\xca\xfe\xba\xbe": (20, ">IIIII"), b"\xca\xfe\xba\xbf": (32, ">IIQQII")}
_MACHO_MAGICS = frozenset(_MACHO_THIN) | frozenset(_MACHO_FAT)
_LC_SEGMENT, _LC_SEGMENT_64 = 0x1, 0x19


def _macho_problem(size: int, read_at: ReadAt, start: int, length: int, *, nested: bool) -> str | None:
    magic = read_at(start, 4)
    if magic in _MACHO_FAT and not nested:
        entsize, fmt = _MACHO_FAT[magic]
        head = read_at(start, 8)
        if len(head) < 8:
            return "fat Mach-O header truncated"
        (nfat,) = struct.unpack_from(">I", head, 4)
        if not 0 < nfat <= 64:
            return f"fat Mach-O with {nfat} architectures"
        table, problem = _table(read_at, size, start + 8, nfat, entsize, "fat architecture")
        if problem:
            return problem
        assert table is not None
        for i in range(nfat):
            fields = struct.unpack_from(fmt, table, i * entsize)
            offset, arch_size = fields[2], fields[3]
            if not _span_ok(offset, arch_size, size):
                return f"architecture {i} ends at byte {offset + arch_size}, past the file's end: truncated"
            problem = _macho_problem(size, read_at, offset, arch_size, nested=True)
            if problem:
                return f"architecture {i}: {problem}"
        return None
    if magic not in _MACHO_THIN:
        return f"no Mach-O magic at byte {start}"
    end, header_size = _MACHO_THIN[magic]
    head = read_at(start, header_size)
    if len(head) < header_size or length < header_size:
        return "Mach-O header truncated"
    _magic, _cpu, _sub, _ftype, ncmds, sizeofcmds, _flags = struct.unpack_from(end + "IiiIIII", head, 0)
    commands, problem = _table(read_at, start + length, start + header_size, 1, sizeofcmds, "load command")
    if problem:
        return problem
    assert commands is not None
    offset = 0
    for i in range(ncmds):
        if offset + 8 > sizeofcmds:
            return f"load command {i} lies past the commands' end"
        cmd, cmdsize = struct.unpack_from(end + "II", commands, offset)
        if cmdsize < 8 or offset + cmdsize > sizeofcmds:
            return f"load command {i} has a bad size {cmdsize}"
        if cmd == _LC_SEGMENT_64 and cmdsize >= 72:
            fileoff, filesize = struct.unpack_from(end + "QQ", commands, offset + 40)
        elif cmd == _LC_SEGMENT and cmdsize >= 56:
            fileoff, filesize = struct.unpack_from(end + "II", commands, offset + 32)
        else:
            offset += cmdsize
            continue
        if not _span_ok(fileoff, filesize, length):
            return f"segment {i} ends at byte {fileoff + filesize}, past the file's end ({length} bytes): truncated"
        offset += cmdsize
    return None


# -- PE (Windows) ----------------------------------------------------------------------------------
def _pe_problem(size: int, read_at: ReadAt) -> str | None:
    dos = read_at(0, 64)
    if len(dos) < 64:
        return "DOS header truncated"
    (pe_offset,) = struct.unpack_from("<I", dos, 0x3C)
    coff = read_at(pe_offset, 24)
    if len(coff) < 24 or coff[:4] != b"PE\0\0":
        return "no PE signature where the DOS header points: truncated or not a DLL"
    nsections, opt_size = struct.unpack_from("<H", coff, 6)[0], struct.unpack_from("<H", coff, 20)[0]
    table, problem = _table(read_at, size, pe_offset + 24 + opt_size, nsections, 40, "section")
    if problem:
        return problem
    assert table is not None
    for i in range(nsections):
        raw_size, raw_ptr = struct.unpack_from("<II", table, i * 40 + 16)
        if raw_size and not _span_ok(raw_ptr, raw_size, size):
            return f"section {i} ends at byte {raw_ptr + raw_size}, past the file's end: truncated"
    return None
