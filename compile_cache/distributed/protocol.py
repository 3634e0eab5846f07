"""The warm-up protocols: one rank compiles per key, the others restore (shared or broadcast).

:func:`warm_up` is the entry point (``compile_regions(..., example_inputs=...)`` calls it). It
gathers what every rank has (key, readiness, environment), checks the hazards, then runs the
mode's protocol: :func:`_shared` (leader and followers over one store) or :func:`_broadcast`
(the source sends its packs over the process group), and the final barrier. The rank that
compiles starts the ISA-probe builds ahead (:mod:`compile_cache.prefetch`); a rank that will
restore cancels them and imports the compile stack while it waits. Everything here talks to
the store through the session's public methods and to the other ranks through
:mod:`.rendezvous`.
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

from .. import config, prefetch, warmup
from ..errors import LockTimeoutError
from ..keys import environment
from ..regions import get_plan
from ..session import CacheSession, session_for
from . import rendezvous
from .hazards import check_hazards, device_index
from .report import WarmUpReport, is_active, remember, resolve_mode

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

    ``example_inputs``: a tuple/list (positional), a dict (keywords) or one tensor, shaped like
    the job's real batches. ``train``: default ``model.training``; inference runs under
    ``torch.no_grad()``, training runs forward and backward; the model's modes, grads, buffers
    and RNG state are left as they were. In a distributed job (every rank must call it, outside
    any forward) one rank per key compiles and the others restore (see the module docstring for
    ``mode``). ``barrier``: wait until every rank is done, so warm ranks don't race ahead.
    ``timeout``: seconds to wait for the compiling rank and the barrier (default
    ``COMPILE_CACHE_WAIT_TIMEOUT`` or 1800); past it a rank compiles itself / goes on.
    """
    target = _unwrap(model)
    session = session_for(target)
    train = target.training if train is None else bool(train)
    mode = resolve_mode(mode)
    wait = float(timeout) if timeout is not None else config.WAIT_TIMEOUT.value()
    key = session.key if session is not None else None
    start = time.perf_counter()
    if not is_active() or mode == "off":
        report = WarmUpReport(mode=mode if is_active() else "single", role="single", key=key)
        if is_active():
            report.role = "alone"
        _local(report, target, example_inputs, train, session)
        if is_active() and barrier:
            _final_barrier(report, secrets.token_hex(8), wait)
        report.seconds = time.perf_counter() - start
        return remember(report)

    sig = warmup.signature(example_inputs, train)
    infos = rendezvous.gather(_my_info(target, session, example_inputs, sig))
    check_hazards(infos)
    ns = f"{rendezvous.PREFIX}/{infos[0]['nonce']}"
    report = WarmUpReport(mode=mode, role="all", key=key)
    collective = _has_fsdp(target)
    if collective:
        report.notes.append("FSDP2 modules present: every rank warms up (collectives in forward)")
    with session.tagged(warm_up=sig) if session is not None else contextlib.nullcontext():
        if mode == "shared":
            _shared(report, infos, ns, target, example_inputs, train, session, wait, collective, sig)
        else:
            _broadcast(report, infos, ns, target, example_inputs, train, session, wait, collective, sig)
    if barrier:
        _final_barrier(report, ns, wait)
    report.seconds = time.perf_counter() - start
    logger.info("compile_cache: warm-up %s", report.to_dict())
    return remember(report)


def _local(
    report: WarmUpReport, model: nn.Module, inputs: Any, train: bool, session: CacheSession | None
) -> None:
    plan = get_plan(model)
    if plan is not None and not plan.disabled:  # a rank that compiles: probe libraries ahead
        prefetch.start_for(model, plan.compile_kwargs)
    result = warmup.run(model, inputs, train, session)
    if train and not result.backward:
        logger.warning("compile_cache: warm-up output has no tensor requiring grad; backward skipped")
    report.fxgraph_hits += result.fxgraph_hits
    report.fxgraph_misses += result.fxgraph_misses


def _final_barrier(report: WarmUpReport, ns: str, wait: float) -> None:
    t0 = time.perf_counter()
    if not rendezvous.barrier(f"{ns}/ready", wait):
        msg = f"not every rank reached the warm-up barrier within {wait:.0f} s; going on"
        report.notes.append(msg)
        logger.warning("compile_cache: %s", msg)
    report.waited_seconds += time.perf_counter() - t0


def _compile_under_lock(
    report: WarmUpReport, model: nn.Module, inputs: Any, train: bool, session: CacheSession, sig: str
) -> None:
    """The leader's compile: under the store's lock, unless another job did it meanwhile."""
    lock_timeout = config.LOCK_TIMEOUT.value()
    lock = session.lock(lock_timeout)
    held = False
    try:
        lock.acquire()
        held = True
    except LockTimeoutError as exc:
        report.notes.append(f"lock timeout, compiling anyway: {exc}")
        session.lock_failed(exc)
    except OSError as exc:  # a lock file another user made (EACCES), ENOLCK, EROFS: bounded too
        report.notes.append(f"lock error, compiling anyway: {type(exc).__name__}: {exc}")
        session.lock_failed(exc)
    try:
        if held and any(m.get("warm_up") == sig for m in session.pack_metadata()):
            session.restore(count=False)  # another job published while we waited for the lock
            report.notes.append("another process published while we waited for the lock")
        _local(report, model, inputs, train, session)
    finally:
        if held:
            with contextlib.suppress(OSError):
                lock.release()


def _shared(
    report: WarmUpReport,
    infos: list[dict[str, Any]],
    ns: str,
    model: nn.Module,
    inputs: Any,
    train: bool,
    session: CacheSession | None,
    wait: float,
    collective: bool,
    sig: str,
) -> None:
    import torch.distributed as dist

    if session is None:
        _local(report, model, inputs, train, session)
        return
    same = [i for i in infos if i["key"] == session.key]
    if collective or all(i["ready"] for i in same):
        _local(report, model, inputs, train, session)
        return
    leader = min(i["rank"] for i in same)
    done = f"{ns}/done/{session.key}"
    if dist.get_rank() == leader:
        report.role = "leader"
        published = session.report.published_packs
        try:
            _compile_under_lock(report, model, inputs, train, session, sig)
        finally:  # also on failure: the others stop waiting and compile for themselves
            rendezvous.signal(done, str(session.report.published_packs - published))
        return
    report.role = "follower"
    t0 = time.perf_counter()
    prefetch.cancel_pending()  # the leader's packs bring the probe libraries
    prefetch.import_compile_stack()  # idle time: the leader compiles meanwhile
    ok = rendezvous.wait_for(done, wait, f"rank {leader} ({infos[leader]['host']}) to compile")
    report.waited_seconds += time.perf_counter() - t0
    if not ok:
        msg = f"rank {leader} did not finish compiling within {wait:.0f} s; compiling here"
        report.notes.append(msg)
        logger.warning("compile_cache: %s", msg)
    before = session.report.restored_packs
    session.restore(count=False)
    if ok and rendezvous.published_count(done) > 0 and session.report.restored_packs <= before:
        msg = (
            f"rank {leader} compiled but this rank found nothing new in {session.location}: is "
            "COMPILE_CACHE_DIR one directory shared by all ranks? Without a shared filesystem "
            "use COMPILE_CACHE_DISTRIBUTED=broadcast."
        )
        report.notes.append(msg)
        logger.warning("compile_cache: %s", msg)
    _local(report, model, inputs, train, session)


def _node_leaders(infos: list[dict[str, Any]]) -> dict[str, int]:
    """host -> its lowest rank."""
    leaders: dict[str, int] = {}
    for i in infos:
        leaders[i["host"]] = min(leaders.get(i["host"], i["rank"]), i["rank"])
    return leaders


def _broadcast(
    report: WarmUpReport,
    infos: list[dict[str, Any]],
    ns: str,
    model: nn.Module,
    inputs: Any,
    train: bool,
    session: CacheSession | None,
    wait: float,
    collective: bool,
    sig: str,
) -> None:
    """Per key that some rank lacks: the source compiles (if needed), then broadcasts its packs.

    Every rank walks the same list of keys (from ``infos``) and joins every broadcast, also for
    keys it does not hold; only ranks with the key use the bytes.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    node = config.BROADCAST_SCOPE.value() == "node"
    leaders = _node_leaders(infos)
    if node:
        members = tuple(sorted(leaders.values()))
        group = rendezvous.subgroup(members) if len(members) > 1 else None
    else:
        members = tuple(range(len(infos)))
        group = None
    done_local = False
    keys = sorted({i["key"] for i in infos if i["key"] is not None})
    for key in keys:
        holders = [i for i in infos if i["key"] == key]
        if collective or all(i["ready"] for i in holders):
            continue
        candidates = [i for i in holders if i["rank"] in members]
        ready = [i for i in candidates if i["ready"]]
        src = min(i["rank"] for i in (ready or candidates or holders))
        done = f"{ns}/done/{key}"
        receivers = [i for i in candidates if i["rank"] != src]
        mine = session is not None and session.key == key
        if rank == src:
            assert session is not None
            report.role = "source"
            try:
                if not infos[src]["ready"]:
                    _compile_under_lock(report, model, inputs, train, session, sig)
                    done_local = True
            finally:
                rendezvous.signal(done)
        elif mine or rank in members:
            t0 = time.perf_counter()
            prefetch.cancel_pending()  # the source's packs bring the probe libraries
            prefetch.import_compile_stack()  # idle time: the source compiles meanwhile
            ok = rendezvous.wait_for(done, wait, f"rank {src} to compile")
            report.waited_seconds += time.perf_counter() - t0
            if not ok:
                rendezvous.signal(f"{ns}/abandon/{key}")
                if mine:
                    report.notes.append(f"rank {src} did not finish within {wait:.0f} s; compiling here")
                continue
        if rank not in members and not mine:
            continue
        if rank in members and src in members and len(members) > 1:
            kv = rendezvous.store()
            if rank == src and kv is not None and kv.check([f"{ns}/abandon/{key}"]):
                continue  # a receiver gave up waiting: nobody listens any more
            payload: list[Any] = [None]
            if rank == src:
                payload[0] = session.packs_to_send([set(i["packs"]) for i in receivers])  # type: ignore[union-attr]
            dist.broadcast_object_list(payload, src=src, group=group)
            if mine and rank != src and session is not None:
                report.role = "receiver"
                report.received_packs += session.publish_received(payload[0] or [])
        if node and mine and session is not None:
            host = infos[rank]["host"]
            host_done = f"{ns}/host/{host}/{key}"
            if rank == leaders[host]:
                rendezvous.signal(host_done)
            else:  # restore from the host's store once its leader received the packs
                report.role = "receiver"
                t0 = time.perf_counter()
                rendezvous.wait_for(host_done, wait, f"rank {leaders[host]} to receive the packs")
                report.waited_seconds += time.perf_counter() - t0
        if mine and rank != src and session is not None:
            session.restore(count=False)
    if not done_local:
        _local(report, model, inputs, train, session)




def _my_info(
    model: nn.Module, session: CacheSession | None, example_inputs: Any, sig: str | None
) -> dict[str, Any]:
    """What this rank tells the others: key, readiness (a pack of this warm-up's signature),
    packs, environment and the hazard material."""
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
        "host": socket.gethostname(),
        "key": session.key if session is not None else None,
        "store": session.location if session is not None else None,
        "ready": ready,
        "packs": packs,
        "threads": torch.get_num_threads(),
        "device": device_index(model, example_inputs),
        "env": environment(),
        "nonce": secrets.token_hex(8),
    }
