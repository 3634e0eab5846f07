"""What a pack holds: the cache entries a model's region groups used, hit or written.

:mod:`compile_cache.torch_compat.cache_use` records, per region group (its code name), every
AOTAutograd and FX-graph entry torch's caches handed out or stored and every kernel library
torch loaded for them, in *units* (one per Dynamo graph, with a slot saying what the graph is
for). :func:`usage` turns the records of a model's groups into candidate members; the ISA
probe's test libraries (with the answers torch's probe gave) are added to every model's pack,
since every process needs them before its first CPU kernel. :func:`resolve` then reads what the
store lacks (by content: member name and SHA-256) and describes the whole usage in a manifest
(:mod:`compile_cache.store.generations`), so that a newer pack supersedes what it replaces.

Libraries are read under torch's own lock for their key (torch holds it while it links the file
in place) and kept only when whole (:func:`compile_cache.artifacts.is_complete_library`); a file
this process restored and that is unchanged since is not read again to learn its digest.

Where torch lacks a hook, :class:`compile_cache.artifacts.Capture` (a diff of the local cache
dirs) takes over: the session warns once and counts a ``capture_fallbacks`` in the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from . import artifacts
from .store import generations
from .torch_compat import cache_use, dynamic_shapes, inductor_cache, isa, pgo

__all__ = ["Candidate", "Known", "Usage", "counts", "install", "resolve", "usage"]

log = logging.getLogger("compile_cache")

#: member -> (real path, size, mtime_ns, sha256) of a file restored from the store
Known = Mapping[str, tuple[str, int, int, str]]

_lock = threading.Lock()
_counts = {"incomplete_skipped": 0, "unreadable": 0, "read": 0}


def install() -> bool:
    """Capture by use is possible in this process (hooks attached); False: use the diff."""
    return cache_use.install()


def counts() -> dict[str, int]:
    """Libraries skipped because incomplete, members that could not be read, files read."""
    with _lock:
        return dict(_counts)


def _count(name: str) -> None:
    with _lock:
        _counts[name] += 1


@dataclasses.dataclass
class Candidate:
    """A member a model used: its digest when known without reading it, and how to read it."""

    member: str
    digest: str | None
    read: Callable[[], bytes | None]


@dataclasses.dataclass
class Usage:
    """What a model's groups used: candidates, the units (scope, slot, members) and the members
    every pack carries (``always``); ``generation`` changes whenever any of it changes."""

    candidates: dict[str, Candidate]
    units: list[dict[str, Any]]
    always: list[str]
    generation: int
    #: The member of the groups' automatic-dynamic record and the record (JSON-ready), or None.
    #: It is in no unit: the manifest names it with ``always`` (each pack's newest wins), so it
    #: adds no unit to supersede; whether it may travel alone is the publisher's call.
    dynamic: tuple[str, dict[str, Any]] | None = None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_library(kernel: inductor_cache.KernelFile) -> bytes | None:
    data = inductor_cache.read_locked(kernel)
    _count("read")
    if data is None:
        _count("unreadable")
        return None
    if not artifacts.is_complete_library(data):
        _count("incomplete_skipped")
        log.info("compile_cache: %s is not a whole library (still being written?); left out",
                 kernel.path)
        return None
    return data


def _known_digest(member: str, path: str, known: Known) -> str | None:
    """The digest of ``path`` if this process restored it and it has not changed since."""
    entry = known.get(member)
    if entry is None or entry[0] != os.path.realpath(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return entry[3] if (st.st_size, st.st_mtime_ns) == (entry[1], entry[2]) else None


#: A group's second precompile entry, its decode steps through the layer view, is published
#: under the group's code name with this suffix; its unit keeps the group's scope, so a restore
#: of the group's units brings it.
VIEWS_SUFFIX = "__views"
#: A group's third entry, its calls that pass a KV cache when Dynamo traces the cache update
#: into the graph (no eager update between two graphs: a block compiled on its own), likewise
#: under the group's scope.
CACHE_SUFFIX = "__cache"


def group_codes(owners: Sequence[str]) -> list[str]:
    """The code names of the groups ``owners``: each group's own function and its decode-step
    (``__views``) and KV-cache-call (``__cache``: the prefill, with the traced update) functions,
    precompiled or not. Their automatic-dynamic records travel with the group's."""
    return [*owners, *(owner + suffix for suffix in (VIEWS_SUFFIX, CACHE_SUFFIX) for owner in owners)]


def precompile_unit(group: str) -> tuple[str, str]:
    """(scope, slot) of the unit that holds ``group``'s saved Dynamo precompile entry."""
    if group.endswith(VIEWS_SUFFIX):
        return group[: -len(VIEWS_SUFFIX)], "dynamo-precompile-views#0"
    if group.endswith(CACHE_SUFFIX):
        return group[: -len(CACHE_SUFFIX)], "dynamo-precompile-cache#0"
    return group, "dynamo-precompile#0"


def usage(owners: Sequence[str], known: Known | None = None,
          extra: Mapping[str, Mapping[str, bytes]] | None = None,
          files: Iterable[str] | None = None) -> Usage:
    """The candidate members of the region groups ``owners`` (code names), plus the ISA probe's
    libraries and ``extra`` (group -> member -> bytes: a group's saved Dynamo precompile entry,
    one unit per group, so a newer entry of the group supersedes the older one). ``files``: the
    model's source files, which scope the resume functions of its automatic-dynamic record."""
    known = known or {}
    snapshot, generation = cache_use.snapshot(owners)
    candidates: dict[str, Candidate] = {}
    units: list[dict[str, Any]] = []
    ordinal: dict[tuple[str, str], int] = {}
    for owner, unit in snapshot:
        n = ordinal.get((owner, unit.slot), 0)
        ordinal[(owner, unit.slot)] = n + 1
        members = []
        for member, data in unit.entries.items():
            candidates[member] = Candidate(member, _sha256(data), lambda data=data: data)
            members.append(member)
        for member, kernel in unit.kernels.items():
            digest = _known_digest(member, kernel.path, known)
            candidates.setdefault(member, Candidate(
                member, digest, lambda kernel=kernel: _read_library(kernel)))
            members.append(member)
        units.append({"scope": owner, "slot": f"{unit.slot}#{n}", "members": members})
    always = []
    for path in isa.observed():
        member = inductor_cache.member_name(path)
        if member is None or not os.path.isfile(path):
            continue
        name = os.path.basename(path)
        kernel = inductor_cache.KernelFile(path, name[:-3] if name.endswith(".so") else name, 0, 0)
        candidates.setdefault(member, Candidate(
            member, _known_digest(member, path, known), lambda kernel=kernel: _read_library(kernel)))
        always.append(member)
    extra_digests = []
    for group, entry in (extra or {}).items():
        for member, data in entry.items():
            digest = _sha256(data)
            candidates[member] = Candidate(member, digest, lambda data=data: data)
            extra_digests.append(digest)
        scope, slot = precompile_unit(group)
        units.append({"scope": scope, "slot": slot, "members": sorted(entry)})
    profile = _job_profile(owners)
    if profile is not None:  # Dynamo's profile of this job: a unit of the first group
        member, data = profile
        digest = _sha256(data)
        candidates[member] = Candidate(member, digest, lambda data=data: data)
        units.append({"scope": owners[0], "slot": "dynamo-pgo#0", "members": [member]})
        extra_digests.append(digest)
    dynamic = _dynamic_record(owners, files)
    if dynamic is not None:  # the groups' automatic-dynamic decisions (named in no unit)
        member, state = dynamic
        data = dynamic_shapes.encode_state(state)
        digest = _sha256(data)
        candidates[member] = Candidate(member, digest, lambda data=data: data)
        extra_digests.append(digest)
    # Changes whenever anything to publish does (a replaced entry keeps its name, not its bytes).
    marker = hash((generation, len(always), tuple(extra_digests)))
    return Usage(candidates, units, always, marker, dynamic)


def _job_profile(owners: Sequence[str]) -> tuple[str, bytes] | None:
    """(member, bytes) of Dynamo's ``code_state_*`` profile when a job id is set and the model's
    groups compiled something (it is written after each frame compile), else None."""
    if not owners or not cache_use.snapshot(owners)[0]:
        return None
    path = pgo.code_state_file()
    if path is None:
        return None
    member = inductor_cache.member_name(path)
    if member is None:
        return None
    try:
        with open(path, "rb") as f:
            return member, f.read()
    except OSError:
        return None


def _dynamic_record(owners: Sequence[str], files: Iterable[str] | None = None
                    ) -> tuple[str, dict[str, Any]] | None:
    """(member, record) of the automatic-dynamic record of the groups ``owners`` (what this
    process learned, merged with what it restored), or None when there is none."""
    if not owners:
        return None
    state = dynamic_shapes.snapshot(group_codes(owners), files)
    if state is None:
        return None
    return dynamic_shapes.member(owners[0]), state


def resolve(found: Usage, held: Mapping[str, set[str | None]]
            ) -> tuple[dict[str, bytes], dict[str, Any]]:
    """``(members the store lacks, manifest of the whole usage)``; unreadable members and
    incomplete libraries are left out of both (the restoring process compiles them again)."""
    digests: dict[str, str] = {}
    members: dict[str, bytes] = {}
    always = set(found.always)
    for member, candidate in found.candidates.items():
        data = None
        digest = candidate.digest
        if digest is None:
            data = candidate.read()
            if data is None:
                continue
            digest = _sha256(data)
        if generations.holds(held, member, digest):
            digests[member] = digest
            continue
        # An ISA probe library is named by torch's hash of its source and flags; its bytes
        # differ between nodes only by the paths the compiler embeds: the store's copy serves.
        same_name = sorted(d for d in held.get(member, ()) if d is not None) if member in always else []
        if same_name:
            digests[member] = same_name[0]
            continue
        if data is None:
            data = candidate.read()
            if data is None:
                continue
            digest = _sha256(data)
        digests[member] = digest
        members[member] = data
    # The record is named with the members every pack carries (the newest pack's record wins),
    # but unlike the ISA libraries its bytes matter: it was never given the same-name shortcut.
    always_named = [*found.always, *([found.dynamic[0]] if found.dynamic else [])]
    return members, generations.make_manifest(found.units, always_named, digests)


def _reset() -> None:
    """Forget the counts (tests)."""
    with _lock:
        for name in _counts:
            _counts[name] = 0
