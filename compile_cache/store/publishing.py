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
from typing import TYPE_CHECKING, Any

from .._paths import check_key, check_member_name
from . import maintenance
from ._io import json_bytes, warn_once
from .members import name_problem
from .pack import (
    PREFIX_SIZE,
    PackLimits,
    check_member_bytes,
    content_hash,
    encode_pack,
    prefix_accepts,
)
from .records import PackInfo

if TYPE_CHECKING:
    from .core import Store

__all__ = ["limit_problem", "publish"]

logger = logging.getLogger("compile_cache")


def publish(
    store: Store,
    key: str,
    members: Mapping[str, bytes | bytearray | memoryview],
    metadata: Mapping[str, Any] | None,
    entry_info: Mapping[str, Any] | None,
    compile_seconds: float,
    member_info: Mapping[str, Mapping[str, Any]] | None,
) -> PackInfo | None:
    """See :meth:`Store.publish`."""
    check_key(key)
    if not isinstance(members, Mapping):
        raise TypeError(f"members must be a mapping of name -> bytes, got {type(members).__name__}")
    for member_name, data in members.items():
        check_member_name(member_name)
        check_member_bytes(member_name, data)
    entry_json = json_bytes(store._entry_record(key, entry_info))
    json_bytes(dict(metadata or {}))  # TypeError/ValueError now, not after the hashing
    json_bytes(dict(member_info or {}))
    if store.read_only:
        warn_once(store.root, "read-only-publish",
                  f"compile cache {store.root} is read-only ({store.read_only_reason}): "
                  "new compile artifacts are not saved")
        return None
    problem = limit_problem(store.limits, members)
    if problem is not None:
        warn_once(store.root, "publish-limit",
                  f"compile cache: not publishing a pack for {key[:12]}: {problem}; readers "
                  "would refuse it")
        store._bump(errors=1, errors_by_kind={"pack_limit": 1})
        return None
    name = content_hash(members, store.signer)
    entry = store.layout.entry_dir(key)
    target = store.layout.pack_path(key, name)
    try:
        if store.fs.exists(target):
            if _usable_on_disk(store, target):
                store._touch_used(key)
                return None
            # Our name, but not signed with our key: damaged or planted. Ours replaces it.
            store._quarantine(target, key)
        name, chunks, size = encode_pack(
            key, members, metadata, compile_seconds=compile_seconds,
            signing_key=store.signing_key, name=name, member_info=member_info,
        )
        for attempt in range(2):
            try:
                store._mkdirs(target.parent)
                added = store._write_entry_json(entry, entry_json)
                store._write(target, chunks)
                break
            except FileNotFoundError:
                if attempt:  # the entry was evicted twice under us: give up quietly
                    raise
        store._touch_used(key)
    except OSError as exc:
        store._io_error("publish", exc, target)
        return None
    header = {"created": time.time(), "members": [{"size": len(members[m])} for m in members],
              "compile_seconds": compile_seconds, "metadata": dict(metadata or {}),
              "signer": store.signer}
    info = PackInfo._from_header(key, name, target, size, header, store.signing_key is not None)
    store._bump(publishes=1, bytes_published=size, compile_seconds=float(compile_seconds),
                stored_bytes=size + added)
    if store.max_size:
        try:
            maintenance.enforce_cap(store, protect={key})
        except OSError as exc:
            logger.debug("eviction after publish failed: %s", exc)
    return info


def _usable_on_disk(store: Store, target: Path) -> bool:
    """Whether the pack at ``target`` is a regular, trusted file signed as this store reads."""
    try:
        with store.fs.open_read(target, trust=True) as fh:
            prefix = fh.read(PREFIX_SIZE)
    except OSError:
        return False
    return prefix_accepts(prefix, store.signing_key)


def limit_problem(limits: PackLimits, members: Mapping[str, bytes | bytearray | memoryview]) -> str | None:
    """Why a pack of ``members`` would break the limits readers check, or None."""
    size = sum(len(data) for data in members.values()) + 64 * len(members) + 4096  # + header
    longest = max((len(name) for name in members), default=0)
    problem = limits.problem(size, len(members), longest)
    if problem is not None:
        return problem
    for name in members:
        problem = name_problem(name, max_name=limits.max_name)
        if problem is not None:
            return problem
    return None
