"""The job's default c10d store: how ranks wait for each other without a collective.

``c10d.default_store``: ``torch.distributed.distributed_c10d._get_default_store``. Polling the
store (not a collective) lets a rank wait for another rank's compile without tripping NCCL's
watchdog, and lets ranks take shared decisions (``compare_set``) before any collective. Without
it, a coordinated warm-up raises :class:`~compile_cache.errors.DistributedSetupError` (a
collective fallback could pair with the job's own collectives), and the lazy cross-rank hazard
check is skipped.
"""

from __future__ import annotations

from typing import Any

from . import available, capability

__all__ = ["default_store", "why_no_store"]


@capability(
    "c10d.default_store",
    needs="torch.distributed.distributed_c10d._get_default_store",
    breaks="a distributed warm-up (compile_regions with example_inputs, warm_up) raises "
    "DistributedSetupError instead of coordinating the ranks, and the lazy cross-rank hazard "
    "check is skipped",
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
    except Exception:  # no default group, or one made without a store (MPI)
        return None


def why_no_store() -> str:
    """Why :func:`default_store` gives None, in words for an error message."""
    if not available("c10d.default_store"):
        return ("this torch has no torch.distributed.distributed_c10d._get_default_store "
                "(`python -m compile_cache doctor` shows the capability)")
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        _get_default_store()
    except Exception as exc:
        return f"the default process group has no c10d store ({type(exc).__name__}: {exc})"
    return "the default process group's c10d store is unavailable"
