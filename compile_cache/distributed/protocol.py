"""The warm-up: the ranks meet, one rank per key compiles, the others restore (:mod:`.shared`,
:mod:`.broadcast`; what one rank does is in :mod:`.steps`), and a final barrier.

:func:`warm_up` is the entry point (``compile_regions(..., example_inputs=...)`` calls it). The
ranks meet in a round of the job's c10d store (:meth:`~.rendezvous.Ranks.gather`: no
collective, bounded by the wait timeout); every key, barrier and decision of the warm-up is
named after that round and its nonce, so no two calls and no two ranks' random names can mix.
A rank that fails (its forward raises) still arrives at the barrier and marks itself gone, so
the others neither wait for it nor for its vote. The rank that compiles starts the ISA-probe
builds ahead (:mod:`compile_cache.prefetch`); a rank that will restore cancels them and imports
the compile stack while it waits.

**warm_up in detail.** Every rank must call it, outside any forward; one rank per key compiles
and the others restore (``mode``: :mod:`compile_cache.distributed`). ``timeout`` bounds every
wait: for the other ranks to arrive, for the compiling rank, for a lock whose holder is alive,
for the barrier; past it a rank compiles itself or goes on. It needs the job's c10d store
(raises :class:`~compile_cache.errors.DistributedSetupError` without one), except with
``mode="off", barrier=False``. Outside a distributed job, a process that compiles holds the
store's lock of the key, so a second process warming the same key waits for it (while its
heartbeat is fresh) and restores instead of compiling again.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import time
from typing import Any

import torch
from torch import nn

from .. import config, warmup
from ..keys import environment
from ..session import CacheSession, session_for
from . import broadcast, shared
from .hazards import check_hazards, device_index
from .rendezvous import Ranks
from .steps import compile_under_lock, gone_key, local, note, ready
from .warm_up_report import WarmUpReport, is_active, remember, resolve_mode

__all__ = ["warm_up"]

logger = logging.getLogger("compile_cache")

def _unwrap(model: nn.Module) -> nn.Module:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover
        return model
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def _has_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _host() -> str:
    """The name ranks on one machine share (node scope groups ranks by it)."""
    return socket.gethostname()


def warm_up(
    model: nn.Module,
    example_inputs: Any,
    *,
    train: bool | None = None,
    barrier: bool = True,
    mode: str | None = None,
    timeout: float | None = None,
) -> WarmUpReport:
    """Compile ``model`` (after ``compile_regions``) for ``example_inputs`` now, once per job.

    So that N ranks (or processes) pay for one compile, not N: one compiles, the others restore.
    ``example_inputs``: a tuple/list (positional), a dict (keywords) or one tensor, shaped like
    the job's real batches. ``train``: default ``model.training`` (inference under
    ``torch.no_grad()``, training forward and backward); the model's modes, grads, buffers and
    RNG state are left as they were. ``mode``: ``shared``, ``broadcast`` or ``off``.
    ``barrier``: wait until every rank is done, so warm ranks don't race ahead. ``timeout``:
    seconds any wait may last (default ``COMPILE_CACHE_WAIT_TIMEOUT`` or 1800).

    Every rank must call it, outside any forward; the protocol, the waits and what a process
    outside a distributed job does: the module doc of :mod:`compile_cache.distributed.protocol`.
    """
    target = _unwrap(model)
    session = session_for(target)
    train = target.training if train is None else bool(train)
    mode = resolve_mode(mode)
    wait = float(timeout) if timeout is not None else config.WAIT_TIMEOUT.value()
    key = session.key if session is not None else None
    sig = warmup.signature(example_inputs, train)
    start = time.perf_counter()
    tags = session.tagged(warm_up=sig) if session is not None else contextlib.nullcontext()

    if not is_active() or (mode == "off" and not barrier):
        report = WarmUpReport(mode=mode if is_active() else "single",
                              role="alone" if is_active() else "single", key=key)
        with tags:
            if not is_active() and session is not None and not ready(session, sig):
                compile_under_lock(report, target, example_inputs, train, session, sig, wait)
            else:
                local(report, target, example_inputs, train, session)
        return _finish(report, session, start)

    ranks = Ranks.current()
    infos, ns = ranks.gather(
        _my_info(target, session, example_inputs, sig, mode), wait,
        "every rank to reach warm_up (compile_regions with example_inputs)",
    )
    if infos is None:
        report = WarmUpReport(mode=mode, role="alone", key=key)
        note(report, f"not every rank reached warm_up within {wait:.0f} s (do all ranks call "
             "compile_regions with example_inputs at the same point?); warming up alone, "
             "without a barrier", warn=True)
        with tags:
            local(report, target, example_inputs, train, session)
        return _finish(report, session, start)

    check_hazards(infos)
    ns = f"{ns}/{infos[0]['nonce']}"
    report = WarmUpReport(mode=mode, role="alone" if mode == "off" else "all", key=key)
    modes = sorted({i["mode"] for i in infos})
    if len(modes) > 1:  # what the ranks do together must be the same on every rank
        note(report, f"the ranks asked for different distributed modes {modes}: every rank warms "
             "up alone (set one COMPILE_CACHE_DISTRIBUTED / distributed= everywhere)", warn=True)
        mode, report.role = "off", "alone"
    collective = any(i["fsdp"] for i in infos)
    if collective and mode != "off":
        report.notes.append("FSDP2 modules present: every rank warms up (collectives in forward)")
    try:
        with tags:
            if mode == "off":
                local(report, target, example_inputs, train, session)
            elif mode == "shared":
                shared.run(report, ranks, infos, ns, target, example_inputs, train, session, wait,
                           collective, sig)
            else:
                broadcast.run(report, ranks, infos, ns, target, example_inputs, train, session,
                              wait, collective, sig, node=infos[0]["scope"] == "node")
    except BaseException:
        ranks.signal(gone_key(ns, ranks.rank))  # nobody waits for this rank's votes any more
        if barrier:
            ranks.arrive(f"{ns}/ready")  # ... nor for it at the barrier
        raise
    if barrier:
        _final_barrier(report, ranks, ns, wait)
    _finish(report, session, start)
    logger.info("compile_cache: warm-up %s", report.to_dict())
    return report


def _finish(report: WarmUpReport, session: Any, start: float) -> WarmUpReport:
    """Times the warm-up and keeps it as this process's last one."""
    report.seconds = time.perf_counter() - start
    if session is not None:
        report.precompile_hits = session.report.precompile_hits
    return remember(report)


def _final_barrier(report: WarmUpReport, ranks: Ranks, ns: str, wait: float) -> None:
    t0 = time.perf_counter()
    if not ranks.barrier(f"{ns}/ready", wait):
        note(report, f"not every rank reached the warm-up barrier within {wait:.0f} s; going on",
             warn=True)
    report.waited_seconds += time.perf_counter() - t0


def _my_info(
    model: nn.Module, session: CacheSession | None, example_inputs: Any, sig: str | None, mode: str
) -> dict[str, Any]:
    """What this rank tells the others: key, readiness (a pack of this warm-up's signature),
    packs, what it was asked to do (mode, broadcast scope, FSDP), environment and the hazard
    material."""
    packs: list[str] = []
    ready = False
    if session is not None:
        entry = session.entry()
        if entry is not None:
            packs = [p.name for p in entry.packs]
            ready = sig is not None and any(p.metadata.get("warm_up") == sig for p in entry.packs)
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "host": _host(),
        "key": session.key if session is not None else None,
        "store": session.location if session is not None else None,
        "ready": ready,
        "packs": packs,
        "mode": mode,
        "scope": config.BROADCAST_SCOPE.value(),
        "fsdp": _has_fsdp(model),
        "threads": torch.get_num_threads(),
        "device": device_index(model, example_inputs),
        "env": environment(),
        "nonce": secrets.token_hex(8),
    }
