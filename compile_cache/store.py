"""The on-disk store of compile artifacts: entries of immutable, checksummed, content-addressed packs.

Only this module knows the layout::

    <root>/                                  COMPILE_CACHE_DIR, $XDG_CACHE_HOME/compile_cache, ~/.cache/compile_cache
      v1/entries/<key[:2]>/<key>/
          entry.json                         entry metadata, written once (first publisher wins)
          used                               empty file; its mtime is the last use (LRU)
          packs/<content-hash>.pack          one per publish; name = hash of the members' content
      v1/stats/shard-<n>.json                counters, read-modify-write under a short lock
      v1/quarantine/<key>-<pack>-<time>.pack packs that failed their checks, set aside
      v1/locks/<key>.lock | <key>.lockdir    see locks.py
      v1/tmp/                                entries being evicted (renamed here, then deleted)

Every file is written under a unique temp name beside its target (host-pid-random), fsynced and
``os.replace``\\ d: a reader sees a whole file or none. Packs are never modified, only added or
removed, so concurrent publishers, readers and evicters need no lock for correctness; locks only
avoid duplicate work. A pack that fails a check is a miss (counted, quarantined), never a crash,
and an I/O error while publishing (``ENOSPC``, ``EACCES``, ``EROFS``) is a warning and a counted
error, never an exception in the training job.

Pack format (all integers little-endian)::

    prefix (84 bytes): magic b"CCPACK\\r\\n" | u16 format | u16 flags | u64 body length
                       | SHA-256(body) | HMAC-SHA256(key, prefix[:52]) or 32 zero bytes
    body:              u32 header length | header (UTF-8 JSON) | member bytes, in header order

The header holds the format, creation time, torch version, host, key, caller metadata, the
compile seconds and the member table (name, size). The SHA-256 detects any flipped byte or
truncation; with ``COMPILE_CACHE_SIGNING_KEY`` set, packs are signed and unsigned or altered
packs are rejected (the HMAC covers the body digest, hence every byte).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import io
import json
import logging
import os
import re
import secrets
import shutil
import stat
import struct
import sys
import tarfile
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _warnings, config
from ._paths import (
    HOSTNAME,
    atomic_write,
    check_key,
    check_member_name,
    is_temp_name,
)
from ._sizes import format_size, parse_age, parse_size
from .errors import CorruptPackError, StoreError, UnsafePathError, UnsafeStoreError
from .locks import (
    DEFAULT_STALE_AFTER,
    FileLock,
    break_stale_lock,
    is_stale,
    lock_mode_for,
    optional_lock,
)

__all__ = [
    "DEFAULT_MAX_SIZE",
    "FORMAT_VERSION",
    "EntryInfo",
    "ImportReport",
    "IncompatiblePackError",
    "Pack",
    "PackInfo",
    "Store",
    "StoreWarning",
    "VerifyReport",
    "decode_pack",
    "encode_pack",
    "resolve_location",
]

logger = logging.getLogger("compile_cache")

FORMAT_VERSION = 1
LAYOUT_DIR = "v1"
MAGIC = b"CCPACK\r\n"
_PREFIX = struct.Struct("<8sHHQ32s32s")
_SIGNED_PART = 8 + 2 + 2 + 8 + 32  # magic, format, flags, length, body digest: what the HMAC covers
FLAG_SIGNED = 0x1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
#: Default size cap (``COMPILE_CACHE_MAX_SIZE`` overrides; ``0`` means no cap).
DEFAULT_MAX_SIZE: int = config.MAX_SIZE.default
MAX_HEADER_BYTES = 64 << 20
MAX_JSON_BYTES = 4 << 20
STATS_SHARDS = 8
#: Temp files and empty entries younger than this are someone's publish in progress.
ORPHAN_AGE = 15 * 60.0
#: Quarantined packs are kept this long for inspection, then deleted by evict()/verify(fix=True).
QUARANTINE_KEEP = 7 * 86400.0
_PACK_RE = re.compile(r"([0-9a-f]{32})\.pack")
_COUNTERS: tuple[str, ...] = (
    "hits",
    "misses",
    "errors",
    "corrupt",
    "incompatible",
    "publishes",
    "bytes_published",
    "bytes_restored",
    "seconds_saved",
    "compile_seconds",
    "evictions",
    "evicted_bytes",
    "backend_fallbacks",
)


class StoreWarning(UserWarning):
    """A one-time, user-visible warning from the store (read-only store, disk full, corrupt pack)."""


class IncompatiblePackError(CorruptPackError):
    """A pack written in another format version: a miss here, but left in place for its writer."""


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------
_warned: set[tuple[str, str]] = set()


def _warn_once(root: Path, what: str, message: str) -> None:
    """Warn once per (store, kind of problem) per process; log every time at debug."""
    logger.debug("%s", message)
    if (str(root), what) in _warned:
        return
    _warned.add((str(root), what))
    _warnings.warn(message, StoreWarning)


def _torch_version() -> str:
    """torch's version without importing torch (5 s) when it is not loaded yet."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(getattr(torch, "__version__", "unknown"))
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:
        return "unknown"


def _errno_name(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, type(exc).__name__) if code else type(exc).__name__


def _read_nofollow(path: Path, limit: int | None = None) -> bytes:
    """Read a regular file without following a symlink at ``path`` (a planted link is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symlink") from exc
        raise
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
        return fh.read() if limit is None else fh.read(limit)


def _read_json_file(path: Path) -> tuple[dict[str, Any] | None, bool]:
    """(data, garbage): ``(None, False)`` if absent, ``(None, True)`` if unreadable as a JSON object."""
    try:
        raw = _read_nofollow(path, MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        return None, False
    except (OSError, UnsafePathError):
        return None, True
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, True
    return (data, False) if isinstance(data, dict) else (None, True)


def _key_list(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list of checked keys; a lone string (an easy slip for ``[key]``) is a TypeError."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"keys must be an iterable of cache keys, got {type(keys).__name__}: {keys!r}")
    return [check_key(k) for k in keys]


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}: {value!r}")
    return float(value)


def _json_bytes(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


# ---------------------------------------------------------------------------------------------
# Pack encoding
# ---------------------------------------------------------------------------------------------
def _as_bytes(name: str, value: object) -> bytes | bytearray | memoryview:
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
        _as_bytes(member_name, members[member_name])
    header = {
        "format": FORMAT_VERSION,
        "created": time.time() if created is None else created,
        "torch": _torch_version(),
        "host": HOSTNAME,
        "pid": os.getpid(),
        "key": key,
        "compile_seconds": float(compile_seconds),
        "metadata": dict(metadata or {}),
        "members": [{"name": n, "size": len(members[n])} for n in names],
    }
    header_bytes = _json_bytes(header)
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


# ---------------------------------------------------------------------------------------------
# Public records
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackInfo:
    """One pack on disk: which key, its content hash, size and header facts."""

    key: str
    name: str
    path: Path
    size: int
    created: float
    members: int
    data_bytes: int
    compile_seconds: float
    signed: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    member_names: tuple[str, ...] = ()

    @classmethod
    def _from_header(cls, key: str, name: str, path: Path, size: int, header: dict[str, Any], signed: bool) -> PackInfo:
        table = header.get("members") or []
        return cls(
            key=key,
            name=name,
            path=path,
            size=size,
            created=float(header.get("created") or 0.0),
            members=len(table),
            data_bytes=sum(int(m.get("size", 0)) for m in table if isinstance(m, dict)),
            compile_seconds=float(header.get("compile_seconds") or 0.0),
            signed=signed,
            metadata=dict(header.get("metadata") or {}),
            member_names=tuple(
                m["name"] for m in table if isinstance(m, dict) and isinstance(m.get("name"), str)
            ),
        )


@dataclass(frozen=True)
class Pack:
    """A loaded, verified pack: ``members`` maps safe relative names to bytes."""

    members: dict[str, bytes]
    header: dict[str, Any]
    info: PackInfo


@dataclass(frozen=True)
class EntryInfo:
    """One cache entry (a key): its ``entry.json`` metadata, packs, total size and times."""

    key: str
    metadata: dict[str, Any]
    packs: tuple[PackInfo, ...]
    size: int
    created: float
    last_used: float
    path: Path

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for ``ls --json``)."""
        return {
            "key": self.key,
            "metadata": self.metadata,
            "packs": [
                {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(p).items()}
                for p in self.packs
            ],
            "size": self.size,
            "created": self.created,
            "last_used": self.last_used,
            "path": str(self.path),
        }


@dataclass
class VerifyReport:
    """What :meth:`Store.verify` found (and, with ``fixed``, removed or quarantined)."""

    checked_entries: int = 0
    checked_packs: int = 0
    corrupt_packs: list[tuple[Path, str]] = field(default_factory=list)
    incompatible_packs: list[Path] = field(default_factory=list)
    orphaned_temp: list[Path] = field(default_factory=list)
    stale_locks: list[Path] = field(default_factory=list)
    bad_entries: list[Path] = field(default_factory=list)
    bad_stats: list[Path] = field(default_factory=list)
    empty_entries: list[Path] = field(default_factory=list)
    old_quarantine: list[Path] = field(default_factory=list)
    fixed: bool = False

    @property
    def ok(self) -> bool:
        """No problem found (incompatible packs of another version are not a problem)."""
        return not (
            self.corrupt_packs or self.orphaned_temp or self.stale_locks or self.bad_entries
            or self.bad_stats or self.empty_entries
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for ``verify --json``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                value = [[str(v[0]), v[1]] if isinstance(v, tuple) else str(v) for v in value]
            out[f.name] = value
        out["ok"] = self.ok
        return out


@dataclass
class ImportReport:
    """What :meth:`Store.import_archive` did: keys seen, packs written, packs already present."""

    keys: list[str] = field(default_factory=list)
    packs_added: int = 0
    packs_present: int = 0


# ---------------------------------------------------------------------------------------------
# Location and permissions
# ---------------------------------------------------------------------------------------------
def resolve_location(path: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """Where the store lives and why: ``(directory, source)``.

    Precedence: the ``path`` argument, ``COMPILE_CACHE_DIR``, ``$XDG_CACHE_HOME/compile_cache``
    (only if absolute, per the XDG spec), ``~/.cache/compile_cache``. ``source`` is one of
    ``"argument"``, ``"COMPILE_CACHE_DIR"``, ``"XDG_CACHE_HOME"``, ``"default"``.
    """
    if path is not None:
        return Path(path).expanduser().absolute(), "argument"
    env = (config.DIR.value() or "").strip()
    if env:
        return Path(env).expanduser().absolute(), "COMPILE_CACHE_DIR"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "compile_cache", "XDG_CACHE_HOME"
    return Path.home() / ".cache" / "compile_cache", "default"


def _check_safe_dir(path: Path, group_mode: bool) -> None:
    """Refuse a directory other users could write into: their packs would run code here."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, PermissionError):
        return  # absent, or not even searchable by us: nothing in it can be loaded here either
    mode = stat.S_IMODE(st.st_mode)
    euid = os.geteuid()
    fix = (
        f"Fix it with `chmod go-w {path}`, or, to share the cache with your group on purpose, "
        f"set COMPILE_CACHE_SHARED=group and `chmod o-w {path}`."
    )
    if mode & stat.S_IWOTH:
        raise UnsafeStoreError(
            f"refusing to use compile cache directory {path}: it is world-writable (mode "
            f"{mode:04o}), so any user could plant artifacts this process would load and run. {fix}"
        )
    our_groups = set(os.getgroups()) | {os.getegid()}
    if mode & stat.S_IWGRP:
        if not group_mode:
            raise UnsafeStoreError(
                f"refusing to use compile cache directory {path}: it is group-writable (mode "
                f"{mode:04o}) but COMPILE_CACHE_SHARED=group is not set. {fix}"
            )
        if st.st_gid not in our_groups:
            raise UnsafeStoreError(
                f"refusing to use compile cache directory {path}: it is writable by group "
                f"{st.st_gid}, which is not one of this process's groups. Fix it with "
                f"`chgrp <your-group> {path}` or `chmod g-w {path}`."
            )
    if st.st_uid not in (euid, 0):
        shared_ok = group_mode and st.st_gid in our_groups
        if not shared_ok and os.access(path, os.W_OK):
            raise UnsafeStoreError(
                f"refusing to use compile cache directory {path}: it belongs to user {st.st_uid} "
                f"and is writable here. Use your own directory (COMPILE_CACHE_DIR), or set "
                f"COMPILE_CACHE_SHARED=group to share one with your group on purpose."
            )


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------
class Store:
    """The artifact store at ``path`` (see :func:`resolve_location` for the default).

    ``max_size``: size cap (int bytes or ``"20G"``); default ``COMPILE_CACHE_MAX_SIZE`` or 20 GiB;
    ``0`` means no cap. ``read_only``: default ``COMPILE_CACHE_READ_ONLY``; a store that exists
    but cannot be written, or cannot be created, is read-only too (``read_only_reason`` says why).
    ``signing_key``: default ``COMPILE_CACHE_SIGNING_KEY``.

    Raises :class:`StoreError` if ``path`` is an existing non-directory, :class:`UnsafeStoreError`
    if it is writable by other users, :class:`ConfigError` for a bad environment value.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        max_size: int | str | None = None,
        read_only: bool | None = None,
        signing_key: bytes | str | None = None,
    ) -> None:
        if read_only is not None and not isinstance(read_only, bool):
            raise TypeError(f"read_only must be a bool or None, got {type(read_only).__name__}: {read_only!r}")
        if signing_key is not None and not isinstance(signing_key, (bytes, str)):
            raise TypeError(
                f"signing_key must be bytes, str or None, got {type(signing_key).__name__}"
            )
        self.root, self.location_source = resolve_location(path)
        self.shared_group: bool = config.SHARED.value()
        self.dir_mode, self.file_mode = (0o2775, 0o664) if self.shared_group else (0o700, 0o600)
        if max_size is None:
            self.max_size = config.MAX_SIZE.value()
        else:
            self.max_size = parse_size(max_size, name="max_size")
        if signing_key is None:
            signing_key = config.SIGNING_KEY.value()
        self.signing_key: bytes | None = (
            signing_key.encode() if isinstance(signing_key, str) else signing_key
        ) or None
        self.lock_mode, self.lock_reason = lock_mode_for(self.root)
        self.base = self.root / LAYOUT_DIR
        self.entries_dir = self.base / "entries"
        self.stats_dir = self.base / "stats"
        self.tmp_dir = self.base / "tmp"
        self.quarantine_dir = self.base / "quarantine"
        self.locks_dir = self.base / "locks"
        self._pending: dict[str, Any] = {}
        self.read_only_reason: str | None = None
        if read_only is None:
            read_only = config.READ_ONLY.value()
            if read_only:
                self.read_only_reason = "COMPILE_CACHE_READ_ONLY is set"
        elif read_only:
            self.read_only_reason = "read_only=True"
        self.read_only: bool = bool(read_only)

        # os.path's checks, not Path's: an unsearchable parent must not raise PermissionError here.
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise StoreError(f"compile cache location {self.root} exists and is not a directory")
        if not os.path.exists(self.root) and not self.read_only:
            try:
                self._mkdirs(self.root, anchor=None)
            except OSError as exc:
                self._go_read_only(f"cannot create {self.root}: {exc.strerror or exc}")
        for directory in (self.root, self.base):
            _check_safe_dir(directory, self.shared_group)
        if os.path.isdir(self.root) and not os.access(self.root, os.R_OK | os.X_OK):
            self._go_read_only(f"{self.root} is not readable by this user")
        if not self.read_only:
            if not os.access(self.root, os.W_OK | os.X_OK) or (
                self.base.exists() and not os.access(self.base, os.W_OK | os.X_OK)
            ):
                self._go_read_only(f"{self.root} is not writable by this user")
            else:
                try:
                    for directory in (self.entries_dir, self.stats_dir, self.tmp_dir, self.quarantine_dir, self.locks_dir):
                        self._mkdirs(directory)
                except OSError as exc:
                    self._go_read_only(f"cannot write in {self.root}: {exc.strerror or exc}")

    # -- plumbing --------------------------------------------------------------------------------
    def __repr__(self) -> str:
        ro = ", read_only" if self.read_only else ""
        return f"Store({str(self.root)!r}, source={self.location_source}{ro})"

    def _go_read_only(self, reason: str) -> None:
        # Logged only: the one user-visible warning comes with the first skipped publish.
        self.read_only = True
        self.read_only_reason = reason
        logger.info("compile cache %s is read-only: %s", self.root, reason)

    def _mkdirs(self, path: Path, anchor: Path | None = ...) -> None:  # type: ignore[assignment]
        """Create ``path`` and missing parents below ``anchor`` (default: the store root) with our mode."""
        if anchor is ...:
            anchor = self.root
        missing = []
        probe = path
        while not probe.is_dir():
            if probe == anchor:
                # The store itself is gone (removed, or an unmounted network path): do not
                # re-create it under the mount point; the caller counts an error instead.
                raise FileNotFoundError(errno.ENOENT, "compile cache directory vanished", str(anchor))
            missing.append(probe)
            if probe.parent == probe:
                break
            probe = probe.parent
        for directory in reversed(missing):
            ours = anchor is not None or directory == path  # parents outside the store: umask
            try:
                os.mkdir(directory, self.dir_mode if ours else 0o777)
            except FileExistsError:
                continue
            if ours:
                os.chmod(directory, self.dir_mode)  # exact, whatever the umask

    def _entry_dir(self, key: str) -> Path:
        return self.entries_dir / key[:2] / key

    def _io_error(self, what: str, exc: BaseException, path: Path | None = None) -> None:
        kind = _errno_name(exc)
        where = f" ({path})" if path else ""
        _warn_once(
            self.root,
            f"io-{what}-{kind}",
            f"compile cache: could not {what}{where}: {kind}: {exc}; going on without caching it",
        )
        self._bump(errors=1, errors_by_kind={kind: 1})

    def _write(self, target: Path, data: Any, *, exclusive: bool = False, fsync: bool = True) -> bool:
        return atomic_write(target, data, mode=self.file_mode, exclusive=exclusive, fsync=fsync)

    def _touch_used(self, key: str) -> None:
        if self.read_only:
            return
        used = self._entry_dir(key) / "used"
        try:
            os.utime(used)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.close(os.open(used, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), self.file_mode))
        except OSError:
            pass

    def _pack_paths(self, key: str, *, strict: bool = False) -> list[Path]:
        """The pack files of ``key``; an unreadable directory raises with ``strict``, else is empty."""
        packs_dir = self._entry_dir(key) / "packs"
        try:
            names = os.listdir(packs_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError:
            if strict:
                raise
            return []
        return [packs_dir / n for n in sorted(names) if _PACK_RE.fullmatch(n)]

    # -- stats ---------------------------------------------------------------------------------
    def _shard(self) -> int:
        return zlib.crc32(f"{HOSTNAME}:{os.getpid()}".encode()) % STATS_SHARDS

    @staticmethod
    def _add_counts(into: dict[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
        for name, value in delta.items():
            if name == "errors_by_kind":
                kinds = into.setdefault("errors_by_kind", {})
                if isinstance(value, dict):
                    for kind, n in value.items():
                        if isinstance(n, (int, float)) and not isinstance(n, bool):
                            kinds[str(kind)] = kinds.get(str(kind), 0) + n
            elif name in _COUNTERS and isinstance(value, (int, float)) and not isinstance(value, bool):
                into[name] = into.get(name, 0) + value
        return into

    def _bump(self, **delta: Any) -> None:
        """Add ``delta`` to the persisted counters; kept in memory and retried if the write fails."""
        self._add_counts(self._pending, delta)
        if self.read_only or not self.base.is_dir():
            return  # kept in memory: a vanished store is not re-created just for counters
        n = self._shard()
        shard = self.stats_dir / f"shard-{n}.json"
        lock = FileLock(self.locks_dir / f"stats-{n}", mode=self.lock_mode, timeout=2.0,
                        dir_mode=self.dir_mode, file_mode=self.file_mode)
        try:
            with optional_lock(lock) as held:
                if not held:
                    return  # pending deltas go out with the next update
                current, garbage = _read_json_file(shard)
                merged = self._add_counts({}, current or {})
                if garbage:
                    logger.warning("compile cache stats file %s was unreadable; counting from zero", shard)
                    self._add_counts(merged, {"errors": 1, "errors_by_kind": {"stats_file": 1}})
                self._add_counts(merged, self._pending)
                self._write(shard, _json_bytes(merged), fsync=False)
                self._pending = {}
        except OSError as exc:
            logger.debug("could not update stats %s: %s", shard, exc)

    def record_hit(self, key: str, seconds_saved: float | None = None, nbytes: int = 0) -> None:
        """Count a hit (the caller restored ``key`` and it worked) and mark ``key`` used.

        ``seconds_saved`` defaults to the compile seconds recorded in the key's packs.
        """
        check_key(key)
        if seconds_saved is None:
            seconds_saved = 0.0
            for path in self._pack_paths(key):
                with contextlib.suppress(OSError, CorruptPackError):
                    seconds_saved += float(read_pack_header(path)[0].get("compile_seconds") or 0.0)
        self._touch_used(key)
        self._bump(hits=1, seconds_saved=float(seconds_saved), bytes_restored=int(nbytes))

    def record_miss(self, key: str) -> None:
        """Count a miss for ``key`` (nothing usable was in the store)."""
        check_key(key)
        self._bump(misses=1)

    def record_error(self, kind: str) -> None:
        """Count an error of ``kind`` (e.g. ``"restore"``, ``"ENOSPC"``)."""
        self._bump(errors=1, errors_by_kind={str(kind): 1})

    def record_backend_fallback(self) -> None:
        """Count a fallback from the native fingerprint backend to the reference one."""
        self._bump(backend_fallbacks=1)

    def stats(self) -> dict[str, Any]:
        """Counters summed over all processes, plus the store's size, cap and location.

        Keys: every counter (``hits``, ``misses``, ``errors``, ``corrupt``, ``incompatible``,
        ``publishes``, ``bytes_published``, ``bytes_restored``, ``seconds_saved``,
        ``compile_seconds``, ``evictions``, ``evicted_bytes``, ``backend_fallbacks``),
        ``errors_by_kind``, ``hit_rate``, ``entries``, ``packs``, ``size``, ``max_size``,
        ``size_human``, ``max_size_human``, ``quarantined``, ``location``, ``location_source``,
        ``read_only``, ``read_only_reason``, ``lock_mode``.
        """
        totals: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)
        totals["errors_by_kind"] = {}
        try:
            shard_names = sorted(os.listdir(self.stats_dir))
        except OSError:
            shard_names = []
        for name in shard_names:
            if not re.fullmatch(r"shard-\d+\.json", name):
                continue
            data, garbage = _read_json_file(self.stats_dir / name)
            if garbage:
                self._add_counts(totals, {"errors": 1, "errors_by_kind": {"stats_file": 1}})
            elif data:
                self._add_counts(totals, data)
        self._add_counts(totals, self._pending)
        entries = self.entries()
        size = sum(e.size for e in entries)
        lookups = totals["hits"] + totals["misses"]
        try:
            quarantined = len(os.listdir(self.quarantine_dir))
        except OSError:
            quarantined = 0
        totals.update(
            hit_rate=(totals["hits"] / lookups) if lookups else None,
            entries=len(entries),
            packs=sum(len(e.packs) for e in entries),
            size=size,
            size_human=format_size(size),
            max_size=self.max_size,
            max_size_human=format_size(self.max_size) if self.max_size else "unlimited",
            quarantined=quarantined,
            location=str(self.root),
            location_source=self.location_source,
            read_only=self.read_only,
            read_only_reason=self.read_only_reason,
            lock_mode=self.lock_mode,
        )
        return totals

    def zero_stats(self) -> None:
        """Reset every counter to zero (entries are kept)."""
        self._require_writable("zero the stats")
        self._pending = {}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.stats_dir):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.stats_dir / name)

    def _require_writable(self, what: str) -> None:
        if self.read_only:
            raise StoreError(f"cannot {what}: compile cache {self.root} is read-only ({self.read_only_reason})")

    # -- publish / load --------------------------------------------------------------------------
    def publish(
        self,
        key: str,
        members: Mapping[str, bytes | bytearray | memoryview],
        metadata: Mapping[str, Any] | None = None,
        entry_info: Mapping[str, Any] | None = None,
        compile_seconds: float = 0.0,
    ) -> PackInfo | None:
        """Add a pack of ``members`` to ``key``; return its :class:`PackInfo`, or ``None``.

        ``None`` means nothing was written: the same content is already there (packs are
        content-addressed), the store is read-only (one warning), or an I/O error happened
        (``ENOSPC``, ``EACCES``, ``EROFS``, a directory removed under us: one warning per kind,
        a counted error, never an exception). ``metadata`` goes into the pack header;
        ``entry_info`` into ``entry.json`` when this publish creates the entry. Programming
        errors still raise: a bad key (``ValueError``), an unsafe member name
        (:class:`UnsafePathError`), non-bytes members or non-JSON metadata (``TypeError``).
        May evict least-recently-used entries afterwards to stay under ``max_size``.
        """
        check_key(key)
        if not isinstance(members, Mapping):
            raise TypeError(f"members must be a mapping of name -> bytes, got {type(members).__name__}")
        for member_name, data in members.items():
            check_member_name(member_name)
            _as_bytes(member_name, data)
        entry_json = _json_bytes(self._entry_record(key, entry_info))
        _json_bytes(dict(metadata or {}))  # TypeError/ValueError now, not after the hashing
        if self.read_only:
            _warn_once(self.root, "read-only-publish",
                       f"compile cache {self.root} is read-only ({self.read_only_reason}): "
                       "new compile artifacts are not saved")
            return None
        name = content_hash(members)
        entry = self._entry_dir(key)
        target = entry / "packs" / f"{name}.pack"
        try:
            if target.exists():
                self._touch_used(key)
                return None
            name, chunks, size = encode_pack(
                key, members, metadata, compile_seconds=compile_seconds,
                signing_key=self.signing_key, name=name,
            )
            for attempt in range(2):
                try:
                    self._mkdirs(target.parent)
                    self._write_entry_json(entry, entry_json)
                    self._write(target, chunks)
                    break
                except FileNotFoundError:
                    if attempt:  # the entry was evicted twice under us: give up quietly
                        raise
            self._touch_used(key)
        except OSError as exc:
            self._io_error("publish", exc, target)
            return None
        header = {"created": time.time(), "members": [{"size": len(members[m])} for m in members],
                  "compile_seconds": compile_seconds, "metadata": dict(metadata or {})}
        info = PackInfo._from_header(key, name, target, size, header, self.signing_key is not None)
        self._bump(publishes=1, bytes_published=size, compile_seconds=float(compile_seconds))
        if self.max_size:
            try:
                self._enforce_cap(protect={key})
            except OSError as exc:
                logger.debug("eviction after publish failed: %s", exc)
        return info

    def _entry_record(self, key: str, entry_info: Mapping[str, Any] | None) -> dict[str, Any]:
        record: dict[str, Any] = {"created": time.time(), "torch": _torch_version(), "host": HOSTNAME}
        record.update(entry_info or {})
        record.update(key=key, format=FORMAT_VERSION)
        return record

    def _write_entry_json(self, entry: Path, data: bytes) -> None:
        path = entry / "entry.json"
        current, garbage = _read_json_file(path)
        if current is not None:
            return
        self._write(path, data, exclusive=not garbage)

    def load(self, key: str) -> list[Pack]:
        """Every valid pack of ``key``, oldest first; ``[]`` when there is none.

        A pack that fails its checks (truncated, altered, unsigned while a signing key is set,
        unsafe member names) is counted as ``corrupt``, moved to quarantine and skipped; a pack of
        another format version is counted as ``incompatible`` and left alone. Loading does not
        count a hit or a miss (the caller knows whether the restore worked: :meth:`record_hit`,
        :meth:`record_miss`); it marks the entry used.
        """
        check_key(key)
        packs: list[Pack] = []
        try:
            paths = self._pack_paths(key, strict=True)
        except OSError as exc:  # EACCES, EIO, ESTALE: a miss for this job, counted
            self._io_error("read", exc, self._entry_dir(key) / "packs")
            return []
        ours = _torch_version()
        for path in paths:
            try:
                data = _read_nofollow(path)
                header, members = decode_pack(data, signing_key=self.signing_key, key=key)
            except FileNotFoundError:
                continue  # evicted or quarantined by another process meanwhile
            except IncompatiblePackError as exc:
                logger.info("skipping pack %s: %s", path, exc)
                self._bump(incompatible=1)
                continue
            except CorruptPackError as exc:
                self._corrupt(path, key, exc)
                continue
            except OSError as exc:
                self._io_error("read", exc, path)
                continue
            theirs = header.get("torch")
            if isinstance(theirs, str) and "unknown" not in (theirs, ours) and theirs != ours:
                # Keys include the environment, so this pack was put here by hand or by a bug;
                # its artifacts were built for another torch. Set it aside so that a republish
                # of the same content (same pack name) is not blocked by it.
                moved = self._quarantine(path, key)
                _warn_once(self.root, "foreign-torch",
                           f"compile cache: pack {path} was written by torch {theirs}, this is "
                           f"torch {ours}; treated as a miss and "
                           + (f"moved to {moved}" if moved else "left in place (read-only store)"))
                self._bump(incompatible=1)
                continue
            info = PackInfo._from_header(key, path.stem, path, len(data), header,
                                         bool(_PREFIX.unpack_from(data)[2] & FLAG_SIGNED))
            packs.append(Pack(members=members, header=header, info=info))
        if packs:
            self._touch_used(key)
        packs.sort(key=lambda p: (p.info.created, p.info.name))
        return packs

    def _corrupt(self, path: Path, key: str, exc: BaseException) -> None:
        moved = self._quarantine(path, key)
        where = f"moved to {moved}" if moved else "left in place (read-only store)"
        _warn_once(self.root, "corrupt", f"compile cache: pack {path} is unusable ({exc}); "
                   f"treated as a miss and {where}")
        self._bump(corrupt=1)

    def _quarantine(self, path: Path, key: str) -> Path | None:
        if self.read_only:
            return None
        target = self.quarantine_dir / f"{key}-{path.stem}-{int(time.time())}-{secrets.token_hex(2)}.pack"
        try:
            self._mkdirs(self.quarantine_dir)
            os.replace(path, target)
        except OSError:
            return None
        return target

    def has(self, key: str) -> bool:
        """Whether ``key`` has at least one pack (unverified: :meth:`load` checks them)."""
        return bool(self._pack_paths(check_key(key)))

    def lock(self, key: str, timeout: float | None = 60.0) -> FileLock:
        """A lock for ``key`` (``with store.lock(key): ...``): only avoids duplicate compiles.

        Raises :class:`LockTimeoutError` on timeout, after which callers go on without it. On a
        read-only store this is a no-op lock.
        """
        check_key(key)
        if self.read_only:
            return FileLock(self.locks_dir / key, mode="none", timeout=timeout)
        return FileLock(self.locks_dir / key, mode=self.lock_mode, timeout=timeout,
                        dir_mode=self.dir_mode, file_mode=self.file_mode)

    # -- listing -------------------------------------------------------------------------------
    def _keys(self) -> Iterator[str]:
        try:
            prefixes = sorted(os.listdir(self.entries_dir))
        except OSError:
            return
        for prefix in prefixes:
            if not re.fullmatch(r"[0-9a-f]{2}", prefix):
                continue
            try:
                keys = sorted(os.listdir(self.entries_dir / prefix))
            except OSError:
                continue
            for key in keys:
                if key.startswith(prefix) and re.fullmatch(r"[0-9a-f]{8,128}", key):
                    yield key

    def entry(self, key: str) -> EntryInfo | None:
        """The :class:`EntryInfo` of ``key``, or ``None`` if it has no entry directory."""
        entry = self._entry_dir(check_key(key))
        try:
            names = os.listdir(entry)
        except (FileNotFoundError, NotADirectoryError):
            return None
        metadata, _garbage = _read_json_file(entry / "entry.json")
        size = 0
        mtimes: list[float] = []
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(entry / name)
                if stat.S_ISREG(st.st_mode):
                    size += st.st_size
        packs: list[PackInfo] = []
        for path in self._pack_paths(key):
            try:
                st = os.lstat(path)
                size += st.st_size
                mtimes.append(st.st_mtime)
                header, signed, _ = read_pack_header(path)
                packs.append(PackInfo._from_header(key, path.stem, path, st.st_size, header, signed))
            except (OSError, CorruptPackError):
                continue
        try:
            last_used = os.stat(entry / "used").st_mtime
        except OSError:
            last_used = max(mtimes, default=0.0)
        created = float((metadata or {}).get("created") or 0.0) or min(
            [p.created for p in packs] or [last_used]
        )
        return EntryInfo(key=key, metadata=metadata or {}, packs=tuple(packs), size=size,
                         created=created, last_used=last_used, path=entry)

    def entries(self) -> list[EntryInfo]:
        """Every entry, sorted by key."""
        out = []
        for key in self._keys():
            info = self.entry(key)
            if info is not None:
                out.append(info)
        return out

    # -- eviction ------------------------------------------------------------------------------
    def evict(
        self,
        max_size: int | str | None = None,
        older_than: float | str | None = None,
        keys: Iterable[str] | None = None,
        dry_run: bool = False,
    ) -> list[EntryInfo]:
        """Remove entries; return those removed (or, with ``dry_run``, those that would be).

        Selects the union of: the ``keys`` given; entries not used for ``older_than`` (seconds
        or ``"30d"``); least-recently-used entries until the store fits ``max_size`` (bytes or
        ``"20G"``). With no criterion, enforces the store's own cap. Also deletes quarantined
        packs older than a week. Raises :class:`StoreError` on a read-only store (unless dry run).
        """
        if not dry_run:
            self._require_writable("evict")
        if max_size is None and older_than is None and keys is None:
            if not self.max_size:
                return []
            max_size = self.max_size
        return self._evict(
            None if max_size is None else parse_size(max_size, name="max_size"),
            None if older_than is None else parse_age(older_than, name="older_than"),
            None if keys is None else set(_key_list(keys)),
            dry_run,
            protect=set(),
        )

    def _total_size(self) -> int:
        """Bytes in all entries, from stat calls only (cheap enough to run after every publish)."""
        total = 0
        for key in self._keys():
            for directory in (self._entry_dir(key), self._entry_dir(key) / "packs"):
                with contextlib.suppress(OSError), os.scandir(directory) as it:
                    for item in it:
                        with contextlib.suppress(OSError):
                            if item.is_file(follow_symlinks=False):
                                total += item.stat(follow_symlinks=False).st_size
        return total

    def _enforce_cap(self, protect: set[str]) -> None:
        if self._total_size() <= self.max_size:
            return
        lock = FileLock(self.locks_dir / "evict", mode=self.lock_mode, timeout=0,
                        dir_mode=self.dir_mode, file_mode=self.file_mode)
        with optional_lock(lock) as held:
            if held:  # another process evicting now does the job for us
                self._evict(self.max_size, None, None, False, protect=protect)

    def _evict(
        self, max_size: int | None, older_than: float | None, keys: set[str] | None,
        dry_run: bool, protect: set[str],
    ) -> list[EntryInfo]:
        entries = sorted(self.entries(), key=lambda e: (e.last_used, e.key))
        chosen: dict[str, EntryInfo] = {}
        if keys:
            chosen.update((e.key, e) for e in entries if e.key in keys)
        if older_than is not None:
            cutoff = time.time() - older_than
            chosen.update((e.key, e) for e in entries if e.last_used < cutoff)
        if max_size is not None:
            total = sum(e.size for e in entries if e.key not in chosen)
            for e in entries:
                if total <= max_size:
                    break
                if e.key in chosen or e.key in protect:
                    continue
                chosen[e.key] = e
                total -= e.size
        removed = sorted(chosen.values(), key=lambda e: (e.last_used, e.key))
        if dry_run:
            return removed
        done = []
        for e in removed:
            if self._remove_entry_dir(e.path):
                done.append(e)
        if done:
            self._bump(evictions=len(done), evicted_bytes=sum(e.size for e in done))
            logger.info("evicted %d entries (%s)", len(done), format_size(sum(e.size for e in done)))
        self._prune_quarantine(QUARANTINE_KEEP)
        return done

    def _remove_entry_dir(self, path: Path) -> bool:
        """Rename an entry out of sight (atomic), then delete it: readers see all of it or none."""
        aside = self.tmp_dir / f"{path.name}.evict-{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self._mkdirs(self.tmp_dir)
            os.rename(path, aside)
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.debug("could not move %s aside (%s); deleting in place", path, exc)
            shutil.rmtree(path, ignore_errors=True)
            return not path.exists()
        shutil.rmtree(aside, ignore_errors=True)
        return True

    def _prune_quarantine(self, keep: float) -> list[Path]:
        old = []
        cutoff = time.time() - keep
        with contextlib.suppress(OSError):
            for name in os.listdir(self.quarantine_dir):
                path = self.quarantine_dir / name
                with contextlib.suppress(OSError):
                    if os.lstat(path).st_mtime < cutoff:
                        os.unlink(path)
                        old.append(path)
        return old

    def clear(self) -> int:
        """Remove every entry and quarantined pack (counters are kept); return entries removed."""
        self._require_writable("clear")
        count = 0
        for key in list(self._keys()):
            count += self._remove_entry_dir(self._entry_dir(key))
        self._prune_quarantine(-1.0)
        return count

    # -- verify ----------------------------------------------------------------------------------
    def verify(
        self, fix: bool = False, *, temp_age: float = ORPHAN_AGE, lock_stale_after: float = DEFAULT_STALE_AFTER
    ) -> VerifyReport:
        """Check every pack (header, checksum, signature), entry.json, stats file, temp file and lock.

        Reports corrupt packs, orphaned temp files older than ``temp_age`` seconds (a crashed
        publisher's), stale locks (dead holder or older than ``lock_stale_after``), garbage
        ``entry.json`` and stats files, and empty entries. With ``fix=True`` corrupt packs are
        quarantined and the rest removed (``fix`` raises :class:`StoreError` on a read-only store).
        Packs of another format version are listed but never touched.
        """
        temp_age = _seconds("temp_age", temp_age)
        lock_stale_after = _seconds("lock_stale_after", lock_stale_after)
        if fix:
            self._require_writable("fix the store")
        report = VerifyReport(fixed=bool(fix))
        now = time.time()

        def old(path: Path) -> bool:
            try:
                return now - os.lstat(path).st_mtime > temp_age
            except OSError:
                return False

        for key in list(self._keys()):
            report.checked_entries += 1
            entry = self._entry_dir(key)
            _data, garbage = _read_json_file(entry / "entry.json")
            if garbage:
                report.bad_entries.append(entry / "entry.json")
                if fix:
                    with contextlib.suppress(OSError):
                        os.unlink(entry / "entry.json")
            for directory in (entry, entry / "packs"):
                with contextlib.suppress(OSError):
                    for name in os.listdir(directory):
                        if is_temp_name(name) and old(directory / name):
                            report.orphaned_temp.append(directory / name)
                            if fix:
                                with contextlib.suppress(OSError):
                                    os.unlink(directory / name)
            packs = self._pack_paths(key)
            for path in packs:
                report.checked_packs += 1
                try:
                    decode_pack(_read_nofollow(path), signing_key=self.signing_key, key=key)
                except FileNotFoundError:
                    continue
                except IncompatiblePackError:
                    report.incompatible_packs.append(path)
                except (CorruptPackError, OSError) as exc:
                    report.corrupt_packs.append((path, str(exc)))
                    if fix:
                        self._quarantine(path, key)
                        self._bump(corrupt=1)
            anchor = entry / "packs" if (entry / "packs").is_dir() else entry
            if not packs and old(anchor):
                report.empty_entries.append(entry)
                if fix:
                    self._remove_entry_dir(entry)

        with contextlib.suppress(OSError):
            for name in os.listdir(self.tmp_dir):
                if old(self.tmp_dir / name):
                    report.orphaned_temp.append(self.tmp_dir / name)
                    if fix:
                        _remove_path(self.tmp_dir / name)
        with contextlib.suppress(OSError):
            for name in os.listdir(self.locks_dir):
                path = self.locks_dir / name
                if ".stale-" in name or ".release-" in name or is_temp_name(name):
                    if old(path):
                        report.orphaned_temp.append(path)
                        if fix:
                            _remove_path(path)
                elif name.endswith((".lock", ".lockdir")) and is_stale(path, stale_after=lock_stale_after):
                    report.stale_locks.append(path)
                    if fix:
                        break_stale_lock(path, stale_after=lock_stale_after)
        with contextlib.suppress(OSError):
            for name in os.listdir(self.stats_dir):
                path = self.stats_dir / name
                if is_temp_name(name):
                    if old(path):
                        report.orphaned_temp.append(path)
                        if fix:
                            path.unlink(missing_ok=True)
                    continue
                if _read_json_file(path)[1]:
                    report.bad_stats.append(path)
                    if fix:
                        path.unlink(missing_ok=True)
        if fix:
            report.old_quarantine = self._prune_quarantine(QUARANTINE_KEEP)
        return report

    # -- export / import -------------------------------------------------------------------------
    def export(self, path: str | os.PathLike[str], keys: Iterable[str] | None = None) -> int:
        """Write entries (all, or ``keys``) with their valid packs into one tar archive at ``path``.

        ``.tar.gz``/``.tgz`` names are gzip-compressed. Corrupt packs are skipped (and
        quarantined). Returns the number of packs exported. Unknown ``keys`` raise StoreError.
        """
        wanted = None if keys is None else _key_list(keys)
        if wanted is not None:
            missing = [k for k in wanted if not self._entry_dir(k).is_dir()]
            if missing:
                raise StoreError(f"no such cache entries: {', '.join(missing)}")
        target = Path(path)
        compress = target.name.endswith((".gz", ".tgz"))
        tmp = target.with_name(f".{target.name}.tmp-{HOSTNAME}-{os.getpid()}-{secrets.token_hex(4)}")
        count = 0
        selected = wanted if wanted is not None else list(self._keys())
        try:
            with tarfile.open(tmp, "w:gz" if compress else "w", format=tarfile.PAX_FORMAT) as tar:
                manifest = {"format": "compile_cache-export", "version": FORMAT_VERSION,
                            "created": time.time(), "host": HOSTNAME, "keys": selected}
                _tar_add(tar, "manifest.json", _json_bytes(manifest))
                for key in selected:
                    meta, _garbage = _read_json_file(self._entry_dir(key) / "entry.json")
                    if meta is not None:
                        _tar_add(tar, f"entries/{key}/entry.json", _json_bytes(meta))
                    for pack_path in self._pack_paths(key):
                        try:
                            data = _read_nofollow(pack_path)
                            decode_pack(data, signing_key=self.signing_key, key=key)
                        except FileNotFoundError:
                            continue
                        except IncompatiblePackError:
                            continue
                        except CorruptPackError as exc:
                            self._corrupt(pack_path, key, exc)
                            continue
                        _tar_add(tar, f"entries/{key}/packs/{pack_path.name}", data)
                        count += 1
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return count

    def import_archive(self, path: str | os.PathLike[str]) -> ImportReport:
        """Add the entries of an archive made by :meth:`export`; importing twice is harmless.

        Every member is validated before anything is written: only regular files and
        directories (no symlinks, hard links, devices, FIFOs), safe relative names, the expected
        layout, and every pack's checksum (and signature, with a signing key), key and content
        hash. A bad archive raises :class:`UnsafePathError` / :class:`CorruptPackError` and
        leaves the store untouched. Raises :class:`StoreError` on a read-only store.
        """
        self._require_writable("import")
        path = Path(path)
        validated: dict[str, tuple[str, bytes]] = {}  # member name -> (sha256 of data, kind)
        keys: list[str] = []
        try:
            with tarfile.open(path, "r:*") as tar:
                for member in tar:
                    _check_tar_member(member)
                    if member.isdir():
                        continue
                    fh = tar.extractfile(member)
                    data = fh.read() if fh is not None else b""
                    kind = self._validate_import_member(member.name, data)
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
                    self._import_member(member.name, kind, data, report)
        except tarfile.TarError as exc:
            raise CorruptPackError(f"{path} is not a readable tar archive: {exc}") from exc
        return report

    def _validate_import_member(self, name: str, data: bytes) -> str:
        try:
            return self._classify_import_member(name, data)
        except ValueError as exc:  # a bad key in a member name
            if isinstance(exc, CorruptPackError):
                raise
            raise CorruptPackError(f"archive member {name!r}: {exc}") from exc

    def _classify_import_member(self, name: str, data: bytes) -> str:
        if name == "manifest.json":
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
        if len(parts) == 4 and parts[0] == "entries" and parts[2] == "packs" and _PACK_RE.fullmatch(parts[3]):
            key = check_key(parts[1])
            _header, members = decode_pack(data, signing_key=self.signing_key, key=key)
            if content_hash(members) != parts[3][:-5]:
                raise CorruptPackError(f"archive member {name!r}: name does not match its content")
            return f"pack:{key}"
        raise CorruptPackError(f"unexpected archive member {name!r}: not made by compile_cache export")

    def _import_member(self, name: str, kind: str, data: bytes, report: ImportReport) -> None:
        key = kind.split(":", 1)[1]
        entry = self._entry_dir(key)
        self._mkdirs(entry / "packs")
        if kind.startswith("entry:"):
            self._write_entry_json(entry, data)
            return
        target = entry / "packs" / name.rsplit("/", 1)[1]
        if target.exists():
            report.packs_present += 1
            return
        self._write(target, data)
        self._touch_used(key)
        report.packs_added += 1


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


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


def _reset() -> None:
    """Forget which one-time warnings were shown (tests)."""
    _warned.clear()
