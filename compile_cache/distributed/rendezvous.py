"""Talking to the other ranks through the job's c10d store: wait, signal, barrier, gather.

Polling the store (not a collective) lets a rank wait for another rank's compile without any
collective watchdog firing, and log who it waits for. The store comes from
:mod:`compile_cache.torch_compat.c10d`; without it, waits fall back to ``dist.barrier()``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..torch_compat import c10d

__all__ = ["PREFIX", "barrier", "gather", "published_count", "signal", "store", "subgroup", "wait_for"]

logger = logging.getLogger("compile_cache")

#: The namespace of compile_cache's keys in the job's c10d store.
PREFIX = "compile_cache"
_subgroups: dict[tuple[int, ...], Any] = {}


def store() -> Any | None:
    """The job's c10d store, or None (no store, or torch moved it: fall back to collectives)."""
    return c10d.default_store()


def wait_for(key: str, timeout: float, what: str) -> bool:
    """Poll the job's c10d store until ``key`` is set; False on timeout or a store failure.

    Polling (not ``store.wait``) so the wait can log who it waits for and never trips a
    collective watchdog.
    """
    import torch.distributed as dist

    kv = store()
    if kv is None:  # no store to poll: a collective barrier is the only way left
        dist.barrier()
        return True
    start = time.monotonic()
    next_log = start + 30.0
    delay = 0.05
    while True:
        try:
            if kv.check([key]):
                return True
        except Exception as exc:  # the store's host died (rank 0 in plain init_process_group)
            logger.warning("compile_cache: lost the job's c10d store while waiting for %s: %s", what, exc)
            return False
        now = time.monotonic()
        if now - start >= timeout:
            return False
        if now >= next_log:
            logger.info("compile_cache: still waiting for %s (%.0f s)", what, now - start)
            next_log = now + 30.0
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)


def signal(key: str, value: str = "ok") -> None:
    """Set ``key`` in the job's store (what :func:`wait_for` waits for)."""
    kv = store()
    if kv is None:
        return
    try:
        kv.set(key, value)
    except Exception as exc:
        logger.warning("compile_cache: could not signal %s: %s", key, exc)


def barrier(name: str, timeout: float) -> bool:
    """Every rank arrives or ``timeout`` passes; a counter in the c10d store, not a collective."""
    import torch.distributed as dist

    kv = store()
    if kv is None:
        dist.barrier()
        return True
    world = dist.get_world_size()
    try:
        if kv.add(name, 1) >= world:
            kv.set(name + "/all", "1")
    except Exception as exc:
        logger.warning("compile_cache: barrier %s failed: %s", name, exc)
        return False
    return wait_for(name + "/all", timeout, "every rank to finish its warm-up")


def published_count(key: str) -> int:
    """The number a rank signalled under ``key`` (packs its compile published); 0 if unknown."""
    kv = store()
    try:
        return int(kv.get(key)) if kv is not None else 0
    except Exception:
        return 0


def gather(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``mine``, by rank (one ``all_gather_object``)."""
    import torch.distributed as dist

    infos: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(infos, mine)
    return infos


def subgroup(ranks: tuple[int, ...]) -> Any:
    """The process group of ``ranks`` (made once; every rank must ask in the same order)."""
    import torch.distributed as dist

    group = _subgroups.get(ranks)
    if group is None:  # every rank of the default group must call new_group, in the same order
        group = _subgroups[ranks] = dist.new_group(list(ranks))
    return group
