"""What one ``compile_regions`` restored, compiled and published: :class:`CacheReport`.

``compile_cache.last_report()`` hands out the report of the latest session
(:mod:`compile_cache.session`); it is updated as the session runs, the background publisher
included, so the published counts of a forward's compile appear once its publish ran
(:meth:`~compile_cache.session.CacheSession.flush` waits for it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import torch_compat
from ._sizes import format_size

__all__ = ["CacheReport"]


@dataclasses.dataclass
class CacheReport:
    """What the last ``compile_regions`` restored, compiled and published (``last_report()``)."""

    key: str
    store: str
    precompile: bool = False
    restored_packs: int = 0
    restored_files: int = 0
    restored_bytes: int = 0
    restore_seconds: float = 0.0
    fxgraph_hits: int = 0
    fxgraph_misses: int = 0
    published_packs: int = 0
    published_bytes: int = 0
    #: how packs are captured: "by use", "directory diff" (a torch hook missing) or "" (none)
    capture: str = ""
    errors: list[str] = dataclasses.field(default_factory=list)
    #: why the key was not in the store (None when it was): the fields that differ from the
    #: closest entry of the same model (``compile_cache.explain``)
    miss_reason: str | None = None
    #: Restored files torch could not load (removed, built again; their packs quarantined).
    load_failures: int = 0
    #: With precompile, per group (code name): ``label``, ``status`` (``loaded``: its Dynamo
    #: entry came from the store, tracing skipped; ``new``: traced, saved for the next start;
    #: ``unused``: not called yet, nothing traced; ``declined`` / ``failed``: compiled without
    #: precompile) and ``reason``.
    precompile_groups: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    precompile_hits: int = 0
    precompile_declined: int = 0
    precompile_load_errors: int = 0
    #: Graphs of restored precompile entries not installed (traced again): their recorded
    #: values differ here, or could not be proven (the groups' ``reason`` says which).
    precompile_unproven: int = 0
    #: Groups that traced although the store held their entry (its graphs not installed here,
    #: or the entry unreadable): warned, and the outcome says "hit, traced again".
    precompile_traced_again: int = 0
    #: The automatic-dynamic decisions restored for the model's regions: per code name, the
    #: inputs (and dimensions) the store has seen vary, so this process compiles them dynamic.
    dynamic_inputs: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: A partial hit (restored, then compiled): why, one line per cause: a new shape, a path not
    #: taken before, another dtype or value; and whether a later node hits
    #: (:func:`compile_cache.explain.partial_causes`; ``python -m compile_cache explain``).
    partial_causes: list[str] = dataclasses.field(default_factory=list)

    @property
    def hit(self) -> bool:
        """True when packs were restored, torch loaded them, and no forward so far had to
        compile anything new."""
        return self.restored_packs > 0 and self.fxgraph_misses == 0 and self.load_failures == 0

    @property
    def outcome(self) -> str:
        """What this start got from the store: :attr:`counted_outcome`, except that a hit whose
        restored precompile entries did not load (their graphs not proven here, an entry torch
        could not read: Dynamo traced those groups again, which a precompiled start exists to
        skip; :attr:`precompile_traced_again`, warned) says so: ``hit, traced again``."""
        counted = self.counted_outcome
        if counted == "hit" and self.precompile_traced_again:
            return "hit, traced again"
        return counted

    @property
    def counted_outcome(self) -> str:
        """The one meaning of hit, as ``stats`` counts it: ``hit`` (restored, compiled nothing
        new), ``partial`` (restored, then compiled new graphs), ``miss`` (nothing restored from
        the store, compiled) or ``local`` (nothing restored, but torch's local cache had it all:
        FX graphs, or a group's precompiled entry, which loads without any FX-graph lookup)."""
        if self.restored_packs:
            return "hit" if self.fxgraph_misses == 0 else "partial"
        if (self.fxgraph_hits or self.precompile_hits) and not self.fxgraph_misses:
            return "local"
        return "miss"

    @property
    def degraded(self) -> list[str]:
        """The torch capabilities this process found missing (``torch_compat``; each warned
        once): what the compile ran without."""
        return torch_compat.degraded()

    def summary(self) -> str:
        """One line for logs and the demo."""
        parts = []
        if self.restored_packs:
            parts.append(
                f"restored {self.restored_packs} pack(s), {self.restored_files} files, "
                f"{format_size(self.restored_bytes)} in {self.restore_seconds * 1e3:.0f} ms"
            )
        else:
            parts.append("nothing to restore")
        source = "from the restored packs" if self.restored_packs else "from torch's local cache"
        parts.append(f"{self.fxgraph_misses} graph(s) compiled, {self.fxgraph_hits} {source}")
        if self.published_packs:
            parts.append(
                f"published {self.published_packs} pack(s), {format_size(self.published_bytes)}"
            )
        if self.precompile_groups:
            statuses = [g.get("status") for g in self.precompile_groups.values()]
            parts.append("precompile: " + ", ".join(
                f"{statuses.count(s)} {s}" for s in ("loaded", "new", "unused", "declined", "failed")
                if s in statuses))
        if self.errors:
            parts.append(f"{len(self.errors)} error(s): {'; '.join(self.errors)}")
        degraded = self.degraded
        if degraded:
            parts.append(f"without torch capabilities {', '.join(degraded)}")
        return f"key {self.key}: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["hit"] = self.hit
        data["outcome"] = self.outcome
        data["degraded"] = self.degraded
        return data
