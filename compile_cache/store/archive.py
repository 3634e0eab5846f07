"""Export and import: entries in one tar archive, for air-gapped clusters.

Archive layout (``.tar``, or gzip-compressed for ``.tar.gz``/``.tgz`` names)::

    manifest.json                          format, version, creation time, host, keys
    entries/<key>/entry.json               the entry's metadata
    entries/<key>/packs/<hash>.pack        every valid pack, byte for byte

An import validates every member before writing anything: only regular files and directories,
safe names, this layout, and every pack's checksum (and signature), key and content hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .._paths import HOSTNAME, check_key, check_member_name
from ..errors import CorruptPackError, StoreError, UnsafePathError
from ._io import json_bytes, key_list, read_json_file, read_nofollow
from .layout import PACK_RE
from .maintenance import recount_size
from .pack import FORMAT_VERSION, IncompatiblePackError, content_hash, decode_pack
from .records import ImportReport

if TYPE_CHECKING:
    from .core import Store

__all__ = ["export", "import_archive"]

MANIFEST = "manifest.json"


def export(store: Store, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> int:
    """See :meth:`Store.export`."""
    layout = store.layout
    wanted = None if keys is None else key_list(keys)
    if wanted is not None:
        missing = [k for k in wanted if not layout.entry_dir(k).is_dir()]
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
                meta, _garbage = read_json_file(layout.entry_json(key))
                if meta is not None:
                    _tar_add(tar, f"entries/{key}/entry.json", json_bytes(meta))
                for pack_path in layout.pack_paths(key):
                    try:
                        data = read_nofollow(pack_path)
                        decode_pack(data, signing_key=store.signing_key, key=key)
                    except FileNotFoundError:
                        continue
                    except IncompatiblePackError:
                        continue
                    except CorruptPackError as exc:
                        store._corrupt(pack_path, key, exc)
                        continue
                    _tar_add(tar, f"entries/{key}/packs/{pack_path.name}", data)
                    count += 1
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return count


def import_archive(store: Store, path: str | os.PathLike[str]) -> ImportReport:
    """See :meth:`Store.import_archive`."""
    path = Path(path)
    validated: dict[str, tuple[str, str]] = {}  # member name -> (sha256 of data, kind)
    keys: list[str] = []
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                _check_tar_member(member)
                if member.isdir():
                    continue
                fh = tar.extractfile(member)
                data = fh.read() if fh is not None else b""
                kind = _validate_member(store, member.name, data)
                if kind.startswith("pack:") or kind.startswith("entry:"):
                    key = kind.split(":", 1)[1]
                    if key not in keys:
                        keys.append(key)
                validated[member.name] = (hashlib.sha256(data).hexdigest(), kind)
            # Everything checked: now write, re-checking each member is the one validated.
            report = ImportReport(keys=keys)
            for member in tar:
                if member.name not in validated or member.isdir():
                    continue
                digest, kind = validated[member.name]
                if kind == "manifest":
                    continue
                fh = tar.extractfile(member)
                data = fh.read() if fh is not None else b""
                if hashlib.sha256(data).hexdigest() != digest:
                    raise CorruptPackError(f"archive member {member.name!r} changed while importing")
                _import_member(store, member.name, kind, data, report)
    except tarfile.TarError as exc:
        raise CorruptPackError(f"{path} is not a readable tar archive: {exc}") from exc
    if report.packs_added:
        recount_size(store)  # what an import adds is counted by one walk
    return report


def _validate_member(store: Store, name: str, data: bytes) -> str:
    try:
        return _classify_member(store, name, data)
    except ValueError as exc:  # a bad key in a member name
        if isinstance(exc, CorruptPackError):
            raise
        raise CorruptPackError(f"archive member {name!r}: {exc}") from exc


def _classify_member(store: Store, name: str, data: bytes) -> str:
    if name == MANIFEST:
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            if isinstance(json.loads(data.decode()), dict):
                return "manifest"
        raise CorruptPackError("archive manifest.json is not a JSON object")
    parts = name.split("/")
    if len(parts) == 3 and parts[0] == "entries" and parts[2] == "entry.json":
        key = check_key(parts[1])
        try:
            ok = isinstance(json.loads(data.decode()), dict)
        except (ValueError, UnicodeDecodeError):
            ok = False
        if not ok:
            raise CorruptPackError(f"archive member {name!r} is not a JSON object")
        return f"entry:{key}"
    if len(parts) == 4 and parts[0] == "entries" and parts[2] == "packs" and PACK_RE.fullmatch(parts[3]):
        key = check_key(parts[1])
        _header, members = decode_pack(data, signing_key=store.signing_key, key=key)
        if content_hash(members) != parts[3][:-5]:
            raise CorruptPackError(f"archive member {name!r}: name does not match its content")
        return f"pack:{key}"
    raise CorruptPackError(f"unexpected archive member {name!r}: not made by compile_cache export")


def _import_member(store: Store, name: str, kind: str, data: bytes, report: ImportReport) -> None:
    key = kind.split(":", 1)[1]
    store._mkdirs(store.layout.packs_dir(key))
    if kind.startswith("entry:"):
        store._write_entry_json(store.layout.entry_dir(key), data)
        return
    target = store.layout.packs_dir(key) / name.rsplit("/", 1)[1]
    if target.exists():
        report.packs_present += 1
        return
    store._write(target, data)
    store._touch_used(key)
    report.packs_added += 1


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _check_tar_member(member: tarfile.TarInfo) -> None:
    """Refuse links, devices and unsafe names in an archive, before anything is written."""
    name = member.name
    if member.issym() or member.islnk():
        raise UnsafePathError(f"archive member {name!r} is a link (to {member.linkname!r}): refused")
    if not (member.isreg() or member.isdir()):
        raise UnsafePathError(f"archive member {name!r} is a device, FIFO or other special file: refused")
    check_member_name(name.rstrip("/") if member.isdir() else name)
