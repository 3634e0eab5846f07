"""Publishing a pack: checked before it is written, written so that no reader sees a part of it.

The function behind :meth:`Store.publish` (see there for the rules): the members' names and
types, the limits every reader checks (a pack readers would refuse is not written), the content
name (signer included), then a unique temp file, fsync and ``os.replace``; eviction after.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._paths import check_key, check_member_name
from . import maintenance
from ._io import json_bytes, warn_once
from .keeper import Keeper
from .pack import PREFIX_SIZE, check_member_bytes, content_hash, encode_pack
from .parts import StoreParts
from .records import PackInfo

__all__ = ["publish"]

logger = logging.getLogger("compile_cache")


def publish(
    parts: StoreParts,
    max_size: int,
    key: str,
    members: Mapping[str, bytes | bytearray | memoryview],
    metadata: Mapping[str, Any] | None,
    entry_info: Mapping[str, Any] | None,
    compile_seconds: float,
    member_info: Mapping[str, Mapping[str, Any]] | None,
) -> PackInfo | None:
    """See :meth:`Store.publish`."""
    fs, layout, keeper, checker = parts.fs, parts.layout, parts.keeper, parts.checker
    entry_json = _entry_json(keeper, key, members, metadata, entry_info, member_info)
    if fs.read_only:
        warn_once(fs.root, "read-only-publish",
                  f"compile cache {fs.root} is read-only ({fs.read_only_reason}): "
                  "new compile artifacts are not saved")
        return None
    problem = checker.limit_problem(members)
    if problem is not None:
        warn_once(fs.root, "publish-limit",
                  f"compile cache: not publishing a pack for {key[:12]}: {problem}; readers "
                  "would refuse it")
        parts.counters.bump(errors=1, errors_by_kind={"pack_limit": 1})
        return None
    name = content_hash(members, checker.signer)
    target = layout.pack_path(key, name)
    try:
        if fs.exists(target):
            if _usable_on_disk(parts, target):
                keeper.touch_used(key)
                return None
            # Our name, but not signed with our key: damaged or planted. Ours replaces it.
            keeper.quarantine(target, key)
        name, chunks, size = encode_pack(
            key, members, metadata, compile_seconds=compile_seconds,
            signing_key=checker.signing_key, name=name, member_info=member_info, entry=entry_info,
        )
        added = _write_pack(parts, key, target, entry_json, chunks)
        keeper.touch_used(key)
    except OSError as exc:
        keeper.io_error("publish", exc, target)
        return None
    header = {"created": time.time(), "members": [{"size": len(members[m])} for m in members],
              "compile_seconds": compile_seconds, "metadata": dict(metadata or {}),
              "signer": checker.signer}
    info = PackInfo.from_header(key, name, target, size, header, checker.signing_key is not None)
    parts.counters.bump(publishes=1, bytes_published=size, compile_seconds=float(compile_seconds),
                        stored_bytes=size + added)
    if max_size:
        try:
            maintenance.enforce_cap(parts, max_size, protect={key})
        except OSError as exc:
            logger.debug("eviction after publish failed: %s", exc)
    return info


def _entry_json(
    keeper: Keeper, key: str, members: Mapping[str, bytes | bytearray | memoryview],
    metadata: Mapping[str, Any] | None, entry_info: Mapping[str, Any] | None,
    member_info: Mapping[str, Mapping[str, Any]] | None,
) -> bytes:
    """The arguments' programming errors, raised before anything is hashed or written (a bad
    key, an unsafe member name, non-bytes members, non-JSON metadata); the entry.json bytes."""
    check_key(key)
    if not isinstance(members, Mapping):
        raise TypeError(f"members must be a mapping of name -> bytes, got {type(members).__name__}")
    for member_name, data in members.items():
        check_member_name(member_name)
        check_member_bytes(member_name, data)
    entry_json = json_bytes(keeper.entry_record(key, entry_info))
    json_bytes(dict(metadata or {}))  # TypeError/ValueError now, not after the hashing
    json_bytes(dict(member_info or {}))
    return entry_json


def _write_pack(parts: StoreParts, key: str, target: Path, entry_json: bytes, chunks: Any) -> int:
    """Write the entry's ``entry.json`` (if new) and the pack; the bytes entry.json added. An
    entry evicted under us once is made again."""
    for attempt in range(2):
        try:
            parts.fs.mkdirs(target.parent)
            added = parts.keeper.write_entry_json(parts.layout.entry_dir(key), entry_json)
            parts.fs.write(target, chunks)
            return added
        except FileNotFoundError:
            if attempt:  # the entry was evicted twice under us: give up quietly
                raise
    raise AssertionError("not reached")


def _usable_on_disk(parts: StoreParts, target: Path) -> bool:
    """Whether the pack at ``target`` is a regular, trusted file signed as this store reads."""
    try:
        with parts.fs.open_read(target, trust=True) as fh:
            prefix = fh.read(PREFIX_SIZE)
    except OSError:
        return False
    return parts.checker.accepts_prefix(prefix)
