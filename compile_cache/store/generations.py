"""Which members of an entry's packs are current: packs that say what they cover, newest wins.

A pack published by use carries a *manifest* in its header metadata (``metadata["manifest"]``)::

    {"format": 1,
     "units":   [{"scope": "<region group>", "slot": "<what the graph is for>#<n>",
                  "members": ["inductor/aotautograd/...", "inductor/fxgraph/...", "...so"]}],
     "always":  ["inductor/.../isa-test-library.so"],
     "digests": {"<member>": "<sha256 of its bytes>", ...}}

It describes the publisher's whole usage, while the pack itself holds only the members the store
lacked (by content: name and SHA-256), so a unit may name members that older packs hold. For
every ``(scope, slot)`` the newest pack's unit wins; the members of the winning units and of
``always`` (each name at its newest digest) are the entry's current generation, and restore
applies only those, from the newest pack that holds each. A pack without a manifest (published
by the directory-diff fallback, or by an older compile_cache) is applied whole, as before.

Pure functions over :class:`~compile_cache.store.records.PackInfo` (header data only): they know
neither the disk layout nor torch. :func:`compaction` plans the rewrite that ``prune`` and
``verify --fix`` do (:mod:`.maintenance`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .records import PackInfo

__all__ = [
    "FORMAT",
    "MANIFEST_KEY",
    "Selection",
    "compaction",
    "held",
    "holds",
    "make_manifest",
    "manifest_of",
    "select",
]

MANIFEST_KEY = "manifest"
FORMAT = 1


def make_manifest(
    units: Sequence[Mapping[str, Any]], always: Iterable[str], digests: Mapping[str, str]
) -> dict[str, Any]:
    """A manifest (see the module doc); members without a digest are left out of it."""
    clean = []
    for unit in units:
        members = [m for m in unit["members"] if m in digests]
        if members:
            clean.append({"scope": str(unit["scope"]), "slot": str(unit["slot"]),
                          "members": sorted(set(members))})
    return {"format": FORMAT, "units": clean,
            "always": sorted({m for m in always if m in digests}), "digests": dict(digests)}


def manifest_of(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The pack's manifest if it has a well-formed one of this format, else None (apply whole)."""
    manifest = (metadata or {}).get(MANIFEST_KEY)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    digests = manifest.get("digests")
    units = manifest.get("units")
    always = manifest.get("always", [])
    if not isinstance(digests, dict) or not isinstance(units, list) or not isinstance(always, list):
        return None
    for unit in units:
        if not (isinstance(unit, dict) and isinstance(unit.get("members"), list)
                and isinstance(unit.get("scope"), str) and isinstance(unit.get("slot"), str)):
            return None
    return manifest


def _order(packs: Iterable[PackInfo]) -> list[PackInfo]:
    return sorted(packs, key=lambda p: (p.created, p.name))


def held(packs: Iterable[PackInfo]) -> dict[str, set[str | None]]:
    """Member name -> the digests the entry's packs hold it at (None: a pack with no manifest,
    whose content is unknown from its header)."""
    out: dict[str, set[str | None]] = {}
    for pack in packs:
        manifest = manifest_of(pack.metadata)
        digests = manifest["digests"] if manifest else {}
        for name in pack.member_names:
            out.setdefault(name, set()).add(digests.get(name))
    return out


def holds(held_members: Mapping[str, set[str | None]], name: str, digest: str) -> bool:
    """Whether the entry holds ``name`` with these bytes (or, from a pack without a manifest,
    under that name at all: such packs are what older publishers wrote)."""
    found = held_members.get(name)
    return bool(found) and (digest in found or None in found)


@dataclasses.dataclass
class Selection:
    """An entry's current generation."""

    wanted: dict[str, str | None]  # member -> digest (None: from a pack without a manifest)
    sources: dict[str, str]  # member -> the name of the newest pack that holds it so
    units: list[dict[str, Any]]  # the winning units, oldest pack first
    superseded_units: int = 0  # units an equal (scope, slot) of a newer pack replaced
    missing: list[str] = dataclasses.field(default_factory=list)  # wanted, held by no pack

    @property
    def packs(self) -> set[str]:
        """The packs restore reads members from."""
        return set(self.sources.values())


def select(packs: Iterable[PackInfo], scopes: Iterable[str] | None = None) -> Selection:
    """The current generation of an entry whose packs are ``packs`` (headers), limited to units
    of ``scopes`` (the region groups the model has; None: all)."""
    ordered = _order(packs)
    allowed = None if scopes is None else set(scopes)
    winners: dict[tuple[str, str], dict[str, Any]] = {}
    superseded = 0
    always: dict[str, str] = {}
    wanted: dict[str, str | None] = {}
    for pack in ordered:
        manifest = manifest_of(pack.metadata)
        if manifest is None:
            for name in pack.member_names:
                wanted[name] = None
            continue
        digests = manifest["digests"]
        for unit in manifest["units"]:
            if allowed is not None and unit["scope"] not in allowed:
                continue
            slot = (unit["scope"], unit["slot"])
            if slot in winners:
                superseded += 1
            winners[slot] = {**unit, "digests": {m: digests.get(m) for m in unit["members"]}}
        for name in manifest["always"]:
            if isinstance(digests.get(name), str):
                always[name] = digests[name]
    for unit in winners.values():
        for name, digest in unit["digests"].items():
            if isinstance(digest, str):
                wanted[name] = digest
    wanted.update(always)
    sources: dict[str, str] = {}
    for pack in reversed(ordered):  # the newest pack that holds each member at its digest
        manifest = manifest_of(pack.metadata)
        digests = manifest["digests"] if manifest else {}
        for name in pack.member_names:
            if name in wanted and name not in sources:
                if wanted[name] is None or digests.get(name) == wanted[name]:
                    sources[name] = pack.name
    for pack in reversed(ordered):  # else a pack without a manifest that holds the name
        if manifest_of(pack.metadata) is None:
            for name in pack.member_names:
                if name in wanted:
                    sources.setdefault(name, pack.name)
    units = [{k: v for k, v in u.items() if k != "digests"} for u in winners.values()]
    missing = sorted(name for name in wanted if name not in sources)
    return Selection(wanted, sources, units, superseded, missing)


def compaction(packs: Sequence[PackInfo]) -> tuple[list[PackInfo], Selection] | None:
    """``(packs to merge into one, the entry's selection)``, or None when the entry is compact.

    A pack with a manifest is stale when it holds a member that is not current, or that a newer
    pack holds too; then every pack with a manifest is merged into one that holds exactly the
    current members they provide. Packs without a manifest are left as they are: their content
    is not described, so what in them is current cannot be told.
    """
    selection = select(packs)
    described = [p for p in packs if manifest_of(p.metadata) is not None]
    stale = [p for p in described
             if any(selection.sources.get(name) != p.name for name in p.member_names)]
    if not stale:
        return None
    return described, selection
