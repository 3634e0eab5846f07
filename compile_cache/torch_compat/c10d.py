"""The job's default c10d store: how ranks wait for each other without a collective.

``c10d.default_store``: ``torch.distributed.distributed_c10d._get_default_store``. Polling the
store (not a collective) lets a rank wait for another rank's compile without tripping NCCL's
watchdog. Without it, waits fall back to ``dist.barrier()`` and the lazy cross-rank hazard check
is skipped.
"""

from __future__ import annotations

from typing import Any

from . import available, capability

__all__ = ["default_store"]


@capability(
    "c10d.default_store",
    needs="torch.distributed.distributed_c10d._get_default_store",
    breaks="ranks wait for the compiling rank with collective barriers instead of polling the "
    "job's store, and the lazy cross-rank hazard check is skipped",
)
def _probe_default_store() -> str | None:
    from torch.distributed import distributed_c10d

    if not callable(getattr(distributed_c10d, "_get_default_store", None)):
        return "torch.distributed.distributed_c10d has no _get_default_store"
    return None


def default_store() -> Any | None:
    """The default process group's store, or None (no store, or the capability is missing)."""
    if not available("c10d.default_store"):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except Exception:  # no default group / store: callers fall back to collectives
        return None
