"""The distributed warm-up's modes (which one, whether a job coordinates) and its WarmUpReport."""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import config

__all__ = ["MODES", "WarmUpReport", "coordinates", "is_active", "last_warm_up", "resolve_mode"]

MODES: tuple[str, ...] = ("shared", "broadcast", "off")
_last_warm_up: WarmUpReport | None = None


def resolve_mode(mode: str | None = None) -> str:
    """``mode`` if given, else ``COMPILE_CACHE_DISTRIBUTED``, else ``shared``; checked."""
    if mode is not None and mode.strip():
        return config.DISTRIBUTED.parse(mode, "distributed")
    return config.DISTRIBUTED.value()


def is_active() -> bool:
    """Whether ``torch.distributed`` is initialized with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def coordinates(mode: str | None = None) -> bool:
    """Whether :func:`warm_up` would have one rank compile for the others (``mode`` as there)."""
    return is_active() and resolve_mode(mode) != "off"


@dataclasses.dataclass
class WarmUpReport:
    """What :func:`warm_up` did on this rank.

    ``role``: ``single`` (no distributed job), ``alone`` (mode ``off``, or not every rank came to
    this warm-up within the wait timeout: see ``notes``), ``all`` (every rank warmed up at once:
    the store already had it, or FSDP2), ``leader`` (compiled for the others), ``follower``
    (waited, restored, then warmed up), ``source``/``receiver`` (broadcast). ``notes`` name every
    wait that ran out, every lock waited for past its timeout, and every broadcast not sent.
    ``fxgraph_misses`` counts graphs this rank's warm-up compiled; zero on a follower means it
    compiled nothing. ``precompile_hits`` counts the region groups whose precompiled Dynamo
    entry this start loaded (restored, so nothing traced, and no FX-graph lookup made).
    """

    mode: str
    role: str
    key: str | None = None
    seconds: float = 0.0
    waited_seconds: float = 0.0
    fxgraph_hits: int = 0
    fxgraph_misses: int = 0
    precompile_hits: int = 0
    received_packs: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, for logs and JSON."""
        return dataclasses.asdict(self)


def remember(report: WarmUpReport) -> WarmUpReport:
    """Keep ``report`` as this process's last warm-up."""
    global _last_warm_up
    _last_warm_up = report
    return report


def last_warm_up() -> WarmUpReport | None:
    """The report of this process's most recent :func:`warm_up` (also run by compile_regions)."""
    return _last_warm_up


def _reset() -> None:
    """Forget the last warm-up (tests)."""
    global _last_warm_up
    _last_warm_up = None
