"""Export and import: entries in one tar archive, for air-gapped clusters.

Archive layout (``.tar``, or gzip-compressed for ``.tar.gz``/``.tgz`` names)::

    manifest.json                          format, version, creation time, host, keys
    entries/<key>/entry.json               the entry's metadata
    entries/<key>/packs/<hash>.pack.zst    every valid pack, one zstd frame of its bytes
                                           (``<hash>.pack``, as it is, at
                                           ``COMPILE_CACHE_PACK_COMPRESSION=0`` and from older
                                           versions: both are imported)

A compressed pack is expanded on import bounded by its frame header (:mod:`.compression`):
over ``COMPILE_CACHE_MAX_PACK_SIZE`` is refused before anything is expanded.

An import validates every member before moving anything into the store: only regular files and
directories, safe names, this layout, declared sizes within the limits, and every pack's
checksum (and signature), key, members and content hash. It reads the archive once and holds at
most one chunk of it in memory.
"""

from __future__ import annotations

import bz2  # noqa: F401  (bz2 and lzma: what tarfile raises for those archives)
import contextlib
import gzip
import lzma
import os
import secrets
import tarfile
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from .._paths import HOSTNAME, check_key, check_member_name
from .._sizes import format_size
from ..errors import CorruptPackError, StoreError, UnsafePathError, UnsafeStorePathError
from . import compression
from ._io import MAX_JSON_BYTES, json_bytes, key_list, parse_json
from .layout import REMOTE_PACK_RE
from .maintenance import recount_size
from .pack import (
    CHUNK,
    FORMAT_VERSION,
    PREFIX_SIZE,
    IncompatiblePackError,
    PackLimits,
    SignatureMismatchError,
    check_prefix,
)
from .parts import StoreParts
from .records import ImportReport

__all__ = ["export", "import_archive"]

MANIFEST = "manifest.json"
#: An archive with more members than this (directories included) is refused: an export holds
#: an entry.json and a few packs per entry.
MAX_ARCHIVE_MEMBERS = 100_000


def export(parts: StoreParts, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> int:
    """See :meth:`Store.export`."""
    fs, layout, keeper = parts.fs, parts.layout, parts.keeper
    wanted = None if keys is None else key_list(keys)
    if wanted is not None:
        missing = [k for k in wanted if not fs.is_dir(layout.entry_dir(k))]
        if missing:
            raise StoreError(f"no such cache entries: {', '.join(missing)}")
    target = Path(path)
    compress = target.name.endswith((".gz", ".tgz"))
    tmp = target.with_name(f".{target.name}.tmp-{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}")
    count = 0
    selected = wanted if wanted is not None else list(layout.keys())
    try:
        with tarfile.open(tmp, "w:gz" if compress else "w", format=tarfile.PAX_FORMAT) as tar:
            manifest = {"format": "compile_cache-export", "version": FORMAT_VERSION,
                        "created": time.time(), "host": HOSTNAME, "keys": selected}
            _tar_add(tar, MANIFEST, json_bytes(manifest))
            for key in selected:
                meta, _garbage = fs.read_json(layout.entry_json(key))
                if meta is not None:
                    _tar_add(tar, f"entries/{key}/entry.json", json_bytes(meta))
                for pack_path in layout.pack_paths(key):
                    try:
                        fh = fs.open_read(pack_path)
                    except FileNotFoundError:
                        continue
                    except UnsafeStorePathError as exc:  # a link or a FIFO planted there
                        if exc.reason == "type" or exc.reason == "link":
                            keeper.corrupt(pack_path, key, exc)
                        continue
                    except OSError as exc:
                        keeper.io_error("read", exc, pack_path)
                        continue
                    with fh:  # checked, then streamed from the same open file: never read whole
                        try:
                            checked = parts.checker.check(fh, key, close=False)
                        except (IncompatiblePackError, SignatureMismatchError):
                            continue  # another version's, or another key's: not ours to carry
                        except CorruptPackError as exc:
                            keeper.corrupt(pack_path, key, exc)
                            continue
                        fh.seek(0)
                        _add_pack(tar, f"entries/{key}/packs/{pack_path.name}", fh, checked.size)
                    count += 1
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return count


#: What reading a damaged archive raises, by compression: a truncated gzip stream EOFError, bad
#: gzip data zlib.error or BadGzipFile, xz LZMAError, bz2 an OSError without errno.
_UNREADABLE = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError)


def import_archive(parts: StoreParts, max_size: int, path: str | os.PathLike[str]) -> ImportReport:
    """See :meth:`Store.import_archive` (``max_size``: the store's cap, 0 for none).

    One pass over the archive (a ``.tar.gz`` is never decompressed twice): each member's type,
    name and declared size are checked first (a pack over ``COMPILE_CACHE_MAX_PACK_SIZE``, or an
    archive whose members add up to more than the store's size cap, stops the import before its
    bytes are read: a gzip bomb costs nothing), then it is copied in chunks to a private temp
    file under ``v1/tmp`` and checked there like any pack a job loads. Only when every member
    passed are the packs moved into place.
    """
    path = Path(path)
    staging = parts.layout.tmp_dir / f"import-{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}"
    parts.fs.mkdirs(staging)
    try:
        try:
            staged, keys = _stage(parts, path, staging, max_size or None)
        except _UNREADABLE as exc:
            if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, gzip.BadGzipFile):
                raise  # a real I/O error (the disk, the store), not the archive's content
            why = str(exc) or type(exc).__name__
            raise CorruptPackError(f"{path} is not a readable tar archive (truncated or "
                                   f"corrupt?): {why}") from exc
        # Everything checked: now move the staged files into place.
        report = ImportReport(keys=keys)
        for kind, name, staged_file in staged:
            if kind != "manifest":
                _import_member(parts, name, kind, staged_file, report)
    finally:
        with contextlib.suppress(OSError):
            parts.fs.rmtree(staging)
    if report.packs_added:
        recount_size(parts)  # what an import adds is counted by one walk
    return report


def _stage(parts: StoreParts, path: Path, staging: Path,
           total_limit: int | None) -> tuple[list[tuple[str, str, Path]], list[str]]:
    """Copy every member of the archive at ``path`` into ``staging``, each checked (type, name,
    declared size, then its content): ``(staged (kind, member name, file), keys)``."""
    limits = parts.checker.limits
    staged: list[tuple[str, str, Path]] = []
    keys: list[str] = []
    declared = 0
    with tarfile.open(path, "r:*") as tar:
        seen = 0
        for member in tar:
            tar.members = []  # streamed: tarfile would keep every member's info
            seen += 1
            if seen > MAX_ARCHIVE_MEMBERS:
                raise CorruptPackError(f"archive {path} has more than {MAX_ARCHIVE_MEMBERS} "
                                       "members; refused")
            _check_tar_member(member)
            declared += max(member.size, tarfile.BLOCKSIZE)  # a directory costs a block too
            if total_limit is not None and declared > total_limit:
                raise CorruptPackError(
                    f"archive {path} holds more than the store's size cap of "
                    f"{format_size(total_limit)} (COMPILE_CACHE_MAX_SIZE); stopped at "
                    f"{member.name!r}"
                )
            if member.isdir():
                continue
            kind, limit = _classify(member.name, limits.max_pack_size)
            if member.size > limit:
                raise CorruptPackError(
                    f"archive member {member.name!r} declares {format_size(member.size)}, over "
                    f"the limit of {format_size(limit)}"
                    + (" (COMPILE_CACHE_MAX_PACK_SIZE)" if kind.startswith("pack:") else "")
                )
            target = staging / f"{len(staged):06d}"
            fh = tar.extractfile(member)
            if member.name.endswith(compression.SUFFIX):  # expanded, bounded by its frame header
                with parts.fs.create(target) as out:
                    assert fh is not None
                    expanded = compression.decompress(fh.read, out, limits.max_pack_size)
                declared += expanded - member.size
                if total_limit is not None and declared > total_limit:
                    raise CorruptPackError(
                        f"archive {path} expands to more than the store's size cap of "
                        f"{format_size(total_limit)} (COMPILE_CACHE_MAX_SIZE); stopped at "
                        f"{member.name!r}")
            else:
                _copy_bounded(fh, parts.fs.create(target), member.size,
                              limits if kind.startswith("pack:") else None)
            _validate_staged(parts, member.name, kind, target)
            key = kind.split(":", 1)[1] if ":" in kind else None
            if key is not None and key not in keys:
                keys.append(key)
            staged.append((kind, member.name, target))
    return staged, keys


def _classify(name: str, max_pack_size: int) -> tuple[str, int]:
    """(kind, size limit) of an archive member, from its name alone (checked again in full later)."""
    parts = name.split("/")
    if name == MANIFEST:
        return "manifest", MAX_JSON_BYTES
    if len(parts) == 3 and parts[0] == "entries" and parts[2] == "entry.json":
        return f"entry:{_key(name, parts[1])}", MAX_JSON_BYTES
    if len(parts) == 4 and parts[0] == "entries" and parts[2] == "packs" and REMOTE_PACK_RE.fullmatch(parts[3]):
        return f"pack:{_key(name, parts[1])}", max_pack_size
    raise CorruptPackError(f"unexpected archive member {name!r}: not made by compile_cache export")


def _key(name: str, text: str) -> str:
    try:
        return check_key(text)
    except ValueError as exc:  # a bad key in a member name
        raise CorruptPackError(f"archive member {name!r}: {exc}") from exc


def _copy_bounded(
    fh: IO[bytes] | None, out: IO[bytes], size: int, limits: PackLimits | None,
) -> None:
    """Copy at most ``size`` bytes (the declared size) from ``fh`` to ``out`` (a new file,
    closed here), in chunks; a pack's prefix (``limits`` given) is checked against its declared
    size first."""
    with out:
        remaining = size
        if limits is not None and fh is not None:
            prefix = fh.read(min(PREFIX_SIZE, size))
            check_prefix(prefix, size, limits)  # magic, format, size, limits: before the body
            out.write(prefix)
            remaining -= len(prefix)
        while fh is not None and remaining > 0:
            data = fh.read(min(CHUNK, remaining))
            if not data:
                raise CorruptPackError(f"archive member ends before its declared {size} bytes")
            out.write(data)
            remaining -= len(data)


def _validate_staged(parts: StoreParts, name: str, kind: str, staged: Path) -> None:
    if kind in ("manifest",) or kind.startswith("entry:"):
        try:
            ok = isinstance(parse_json(parts.fs.read(staged, MAX_JSON_BYTES + 1)), dict)
        except (ValueError, OSError):
            ok = False
        if not ok:
            what = "archive manifest.json" if kind == "manifest" else f"archive member {name!r}"
            raise CorruptPackError(f"{what} is not a JSON object")
        return
    key = kind.split(":", 1)[1]
    checked = parts.checker.check(parts.fs.open_read(staged), key)  # limits, checksum, signature, members
    try:
        if checked.content_hash() != name.rsplit("/", 1)[1].split(".", 1)[0]:
            raise CorruptPackError(f"archive member {name!r}: name does not match its content")
    finally:
        checked.close()


def _import_member(parts: StoreParts, name: str, kind: str, staged: Path, report: ImportReport) -> None:
    fs, layout = parts.fs, parts.layout
    key = kind.split(":", 1)[1]
    fs.mkdirs(layout.packs_dir(key))
    if kind.startswith("entry:"):
        parts.keeper.write_entry_json(layout.entry_dir(key), fs.read(staged, MAX_JSON_BYTES))
        return
    target = layout.packs_dir(key) / name.rsplit("/", 1)[1].removesuffix(compression.SUFFIX)
    if fs.exists(target):
        report.packs_present += 1
        return
    fs.rename(staged, target)  # same filesystem (v1/tmp): atomic, a reader sees all or nothing
    parts.keeper.touch_used(key)
    report.packs_added += 1


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    import io

    _tar_add_file(tar, name, io.BytesIO(data), len(data))


def _add_pack(tar: tarfile.TarFile, name: str, fh: IO[bytes], size: int) -> None:
    """Add the pack of ``size`` bytes read from ``fh`` as ``name``, compressed as
    ``name.zst`` (``COMPILE_CACHE_PACK_COMPRESSION``; at level 0 as it is)."""
    import tempfile

    lvl = compression.level()
    if not lvl:
        _tar_add_file(tar, name, fh, size)
        return
    with tempfile.TemporaryFile() as tmp:  # a tar header needs the size before the bytes
        sent = compression.compress_file(fh, size, tmp, lvl)
        tmp.seek(0)
        _tar_add_file(tar, name + compression.SUFFIX, tmp, sent)


def _tar_add_file(tar: tarfile.TarFile, name: str, fh: IO[bytes], size: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = int(time.time())
    tar.addfile(info, fh)


def _check_tar_member(member: tarfile.TarInfo) -> None:
    """Refuse links, devices and unsafe names in an archive, before anything is written."""
    name = member.name
    if member.issym() or member.islnk():
        raise UnsafePathError(f"archive member {name!r} is a link (to {member.linkname!r}): refused")
    if not (member.isreg() or member.isdir()):
        raise UnsafePathError(f"archive member {name!r} is a device, FIFO or other special file: refused")
    check_member_name(name.rstrip("/") if member.isdir() else name)
