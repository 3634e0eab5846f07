"""Ranks and nodes share one compile: one process compiles, every other rank restores.

Used by :func:`compile_cache.compile_regions` when ``torch.distributed`` is initialized (and by
:func:`warm_up`, which a job may call itself). Nothing here ever blocks inside a forward: forwards
of DDP/FSDP models run collectives, and a rank waiting there for another rank's compile would
deadlock the job. All coordination happens in :func:`warm_up`, before the first training or
inference step, with example inputs the job provides.

Modes (``compile_regions(..., distributed=...)``, ``warm_up(..., mode=...)``, or the environment
variable ``COMPILE_CACHE_DISTRIBUTED``; the argument wins; default ``shared``):

``shared``
    ``COMPILE_CACHE_DIR`` is one directory every rank reaches (NFS, Lustre, GPFS...). Every rank
    restores what the store holds when ``compile_regions`` runs. With example inputs, when the
    store has no pack made by a warm-up with the same input signature, the lowest rank of each
    key takes the store's lock for the key, runs the warm-up (compiles) and publishes; the other
    ranks wait outside any forward (polling the job's c10d store, with ``COMPILE_CACHE_WAIT_TIMEOUT``,
    not a collective, so no NCCL watchdog fires), then restore and run their own warm-up forward,
    which hits the FX-graph cache. Without example inputs nothing blocks: ranks compile lazily
    at their first forward, the first to finish publishes, and the others publish only artifacts
    the key does not hold yet (see "Duplicates" below).

``broadcast``
    No shared filesystem: every rank (or node) has its own store. The compiling rank sends the
    key's packs over the default process group (``broadcast_object_list``); each receiver
    publishes them into its own store (content-addressed: the same pack name) and restores them
    into its local Inductor dir. ``COMPILE_CACHE_BROADCAST_SCOPE=node`` sends to one rank per host
    (the lowest, over a subgroup of those ranks); the other ranks of a host restore from the
    host's store, which they must share (a node-local ``COMPILE_CACHE_DIR``). Broadcasting needs
    example inputs; without them each rank compiles and publishes into its own store.

``off``
    No coordination: every rank warms up by itself (the final barrier still applies).

The store's lock (``store.lock(key)``) keeps two *jobs* sharing a store from compiling the same key
at once; correctness never depends on it: on :class:`~compile_cache.LockTimeoutError`
(``COMPILE_CACHE_LOCK_TIMEOUT``, 300 s) the leader compiles anyway. A leader that dies is noticed by
the waiters' timeout (or by the c10d store failing); they then compile themselves.

Warm-up compiles what the job will run: under ``torch.no_grad()`` for a model in eval mode, forward
and backward for a model in training mode (or ``train=True``). Training flags, gradients (params
whose grad was None get None again; others get their old values back in place), buffers (BatchNorm
statistics) and the RNG state are restored afterwards. A DDP-wrapped model is warmed through its
``.module`` (no all-reduce while one rank runs alone). A model with FSDP2 (``fully_shard``) modules
cannot run on one rank alone (its forward all-gathers), so all ranks warm up together: call
``compile_regions(model, example_inputs=...)`` *before* ``fully_shard`` for a single compile.

After the warm-up a barrier (``barrier=True``, default) holds every rank until all are ready, so a
warm rank does not race ahead of cold ones into collectives that time out (pytorch #108971).

Duplicates: two ranks that compile the same graph can produce byte-different files (two g++
runs, pickles with timestamps), so content addressing alone would store both. Torch names FX
entries and kernels by its own content keys, so a rank publishes only member *names* the key's
packs do not hold yet (``CacheSession.known_members``).

Hazards (``doctor`` material): on entry the ranks exchange their CPU thread count, device index
and environment key; ranks that differ would silently miss each other's compiled code, and a
warning (once per process) names the fix: ``torchrun --virtual-local-rank`` or one GPU per rank
via ``CUDA_VISIBLE_DEVICES`` (so every rank runs on ``cuda:0``), and ``torch.set_num_threads(N)`` /
``OMP_NUM_THREADS=N`` with one fixed N on every rank.

Recipes::

    # shared directory (NFS/Lustre), torchrun on every node
    export COMPILE_CACHE_DIR=/lustre/$USER/compile_cache OMP_NUM_THREADS=8
    torchrun --nnodes 8 --nproc-per-node 8 --virtual-local-rank ... train.py
    # train.py
    compile_cache.compile_regions(model, example_inputs=(batch,))   # before DDP / fully_shard

    # no shared filesystem: ranks broadcast the packs; one receiver per node
    export COMPILE_CACHE_DISTRIBUTED=broadcast COMPILE_CACHE_BROADCAST_SCOPE=node
    export COMPILE_CACHE_DIR=/local/scratch/compile_cache
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from . import _warnings, config, prefetch
from .cache import CacheSession, session_for
from .environment import environment
from .errors import LockTimeoutError
from .regions import get_plan
from .torch_compat import c10d, dynamo

logger = logging.getLogger("compile_cache")

__all__ = [
    "MODES",
    "WarmUpReport",
    "check_hazards",
    "is_active",
    "last_warm_up",
    "note_lazy",
    "resolve_mode",
    "warm_up",
]

MODES: tuple[str, ...] = ("shared", "broadcast", "off")
_PREFIX = "compile_cache"
_warned_hazards = False
_lazy_note_logged = False
_subgroups: dict[tuple[int, ...], Any] = {}
_last_warm_up: WarmUpReport | None = None


# --------------------------------------------------------------------------------------------
# Configuration


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


# --------------------------------------------------------------------------------------------
# Report


@dataclasses.dataclass
class WarmUpReport:
    """What :func:`warm_up` did on this rank.

    ``role``: ``single`` (no distributed job), ``alone`` (mode ``off``), ``all`` (every rank warmed
    up at once: the store already had it, or FSDP2), ``leader`` (compiled for the others),
    ``follower`` (waited, restored, then warmed up), ``source``/``receiver`` (broadcast).
    ``fxgraph_misses`` counts graphs this rank's warm-up compiled; zero on a follower means it
    compiled nothing.
    """

    mode: str
    role: str
    key: str | None = None
    seconds: float = 0.0
    waited_seconds: float = 0.0
    fxgraph_hits: int = 0
    fxgraph_misses: int = 0
    received_packs: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, for logs and JSON."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# The warm-up itself (one rank)


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _tensors(value: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    if depth > 8:
        return out
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _tensors(v, out, depth + 1)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, out, depth + 1)
    elif hasattr(value, "to_tuple"):
        _tensors(value.to_tuple(), out, depth + 1)
    return out


def _loss(output: Any) -> torch.Tensor | None:
    parts = [t.float().sum() for t in _tensors(output, []) if t.requires_grad and t.is_floating_point()]
    if not parts:
        return None
    return torch.stack(parts).sum()


def signature(example_inputs: Any, train: bool) -> str:
    """A digest of what a warm-up compiles for: train flag, grad mode and input metadata."""

    def describe(value: Any, depth: int = 0) -> Any:
        if depth > 8:
            return "..."
        if isinstance(value, torch.Tensor):
            return ["T", list(value.shape), str(value.dtype), value.device.type, value.requires_grad]
        if isinstance(value, Mapping):
            return {str(k): describe(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
        if isinstance(value, (tuple, list)):
            return [describe(v, depth + 1) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return type(value).__qualname__

    blob = json.dumps({"train": bool(train), "inputs": describe(example_inputs)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _preserved(model: nn.Module, train: bool) -> Iterator[None]:
    """Runs a warm-up without leaving a trace: modes, grads, buffers and RNG state come back."""
    modes = {m: m.training for m in model.modules()}
    grads: dict[nn.Parameter, torch.Tensor | None] = {}
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
    if train:
        for p in model.parameters():
            grads[p] = None if p.grad is None else p.grad.detach().clone()
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices: list[int] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [torch.cuda.current_device()]
    try:
        with torch.random.fork_rng(devices=devices):
            if model.training != train:
                model.train(train)
            yield
    finally:
        for m, flag in modes.items():
            m.training = flag
        with torch.no_grad():
            for p, old in grads.items():
                if old is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == old.shape:
                    p.grad.copy_(old)  # in place: DDP's bucket views stay valid
                else:
                    p.grad = old
            for b, old in buffers:
                b.copy_(old)


def _run_local(
    model: nn.Module, example_inputs: Any, train: bool, session: CacheSession | None
) -> tuple[int, int, float]:
    """One warm-up on this rank: (FX-graph hits, FX-graph misses, seconds)."""
    before = dynamo.CompileCounters.snapshot()
    start = time.perf_counter()
    with _preserved(model, train):
        if train:
            loss = _loss(_call(model, example_inputs))
            if loss is None:
                logger.warning(
                    "compile_cache: warm-up output has no tensor requiring grad; backward skipped"
                )
            else:
                loss.backward()
        else:
            with torch.no_grad():
                _call(model, example_inputs)
    seconds = time.perf_counter() - start
    if session is not None:
        session.after_forward(seconds)  # the backward compiled after the forward hook ran
    diff = dynamo.CompileCounters.snapshot().diff(before)
    return diff.fxgraph_hit, diff.fxgraph_miss, seconds


# --------------------------------------------------------------------------------------------
# Talking to the other ranks


def _c10d_store() -> Any | None:
    return c10d.default_store()  # None: no store (or torch moved it): fall back to collectives


def _wait_for(key: str, timeout: float, what: str) -> bool:
    """Poll the job's c10d store until ``key`` is set; False on timeout or a store failure.

    Polling (not ``store.wait``) so the wait can log who it waits for and never trips a
    collective watchdog.
    """
    import torch.distributed as dist

    store = _c10d_store()
    if store is None:  # no store to poll: a collective barrier is the only way left
        dist.barrier()
        return True
    start = time.monotonic()
    next_log = start + 30.0
    delay = 0.05
    while True:
        try:
            if store.check([key]):
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


def _signal(key: str, value: str = "ok") -> None:
    store = _c10d_store()
    if store is None:
        return
    try:
        store.set(key, value)
    except Exception as exc:
        logger.warning("compile_cache: could not signal %s: %s", key, exc)


def _barrier(name: str, timeout: float) -> bool:
    """Every rank arrives or ``timeout`` passes; a counter in the c10d store, not a collective."""
    import torch.distributed as dist

    store = _c10d_store()
    if store is None:
        dist.barrier()
        return True
    world = dist.get_world_size()
    try:
        if store.add(name, 1) >= world:
            store.set(name + "/all", "1")
    except Exception as exc:
        logger.warning("compile_cache: barrier %s failed: %s", name, exc)
        return False
    return _wait_for(name + "/all", timeout, "every rank to finish its warm-up")


def _device_index(model: nn.Module, example_inputs: Any) -> str | None:
    for t in _tensors(example_inputs, []) + list(model.parameters()):
        if t.device.type != "cpu":
            return f"{t.device.type}:{t.device.index if t.device.index is not None else 0}"
        return None
    return None


def _gather(
    model: nn.Module, session: CacheSession | None, example_inputs: Any, sig: str | None
) -> list[dict[str, Any]]:
    """One ``all_gather_object`` of what each rank has: key, readiness, environment."""
    import torch.distributed as dist

    packs: list[str] = []
    ready = False
    if session is not None:
        entry = session.store.entry(session.key)
        if entry is not None:
            packs = [p.name for p in entry.packs]
            ready = sig is not None and any(p.metadata.get("warm_up") == sig for p in entry.packs)
    env = environment()
    mine = {
        "rank": dist.get_rank(),
        "host": socket.gethostname(),
        "key": session.key if session is not None else None,
        "store": str(session.store.root) if session is not None else None,
        "ready": ready,
        "packs": packs,
        "threads": torch.get_num_threads(),
        "device": _device_index(model, example_inputs),
        "env": env,
        "nonce": secrets.token_hex(8),
    }
    infos: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(infos, mine)
    return infos


def check_hazards(infos: list[dict[str, Any]]) -> list[str]:
    """The silent-miss hazards between ranks in ``infos`` (``threads``, ``device``, ``env``);
    warns once per process with the fix. Returns the messages (empty when none)."""
    global _warned_hazards
    hazards: list[str] = []
    threads = sorted({i.get("threads") for i in infos if i.get("threads") is not None})
    if len(threads) > 1:
        hazards.append(
            f"ranks run with different CPU thread counts {threads}: torch.get_num_threads() is in "
            "torch's FX-graph key, so they never share compiled CPU code. Fix: a fixed "
            "torch.set_num_threads(N) (or OMP_NUM_THREADS=N) on every rank."
        )
    devices = sorted({i["device"] for i in infos if i.get("device")})
    if len(devices) > 1:
        hazards.append(
            f"ranks compile on different device indices {devices}: the index is in torch's "
            "FX-graph key, so ranks never share compiled code. Fix: `torchrun "
            "--virtual-local-rank`, or CUDA_VISIBLE_DEVICES=<local rank> per rank so every rank "
            "uses cuda:0."
        )
    envs = [i.get("env") or {} for i in infos]
    fields = sorted(
        {k for e in envs for k in e if k != "cpu_threads" and len({x.get(k) for x in envs}) > 1}
    )
    if fields:
        hazards.append(
            f"ranks differ in environment-key fields {fields}: their cache keys differ and each "
            "compiles for itself. Fix: the same torch build, configs and settings on every rank."
        )
    if hazards and not _warned_hazards:
        _warned_hazards = True
        for message in hazards:
            msg = f"compile_cache: {message}"
            _warnings.warn(msg, RuntimeWarning)
    return hazards


def note_lazy(model: nn.Module, mode: str | None = None) -> None:
    """``compile_regions`` without example inputs in a distributed job: compare this rank's
    key material with the ranks that got here first (c10d store, never blocks), warn on hazards."""
    global _lazy_note_logged
    if not is_active():
        return
    import torch.distributed as dist

    mode = resolve_mode(mode)
    store = _c10d_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    if not _lazy_note_logged:
        _lazy_note_logged = True
        logger.info(
            "compile_cache: distributed mode %s without example inputs: ranks compile lazily; %s",
            mode,
            "the first to finish publishes" if mode == "shared" else "each into its own store",
        )
    if store is None:
        return
    mine = {"threads": torch.get_num_threads(), "device": _device_index(model, None)}
    try:
        mine["env"] = environment()
        store.set(f"{_PREFIX}/lazy/{rank}", json.dumps(mine))
        infos = [mine]
        for other in range(world):
            key = f"{_PREFIX}/lazy/{other}"
            if other != rank and store.check([key]):
                infos.append(json.loads(store.get(key)))
    except Exception as exc:  # never break compile_regions over a diagnostic
        logger.debug("compile_cache: lazy hazard check skipped: %s", exc)
        return
    check_hazards(infos)


# --------------------------------------------------------------------------------------------
# The protocol


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
        return _remember(report)

    sig = signature(example_inputs, train)
    infos = _gather(target, session, example_inputs, sig)
    check_hazards(infos)
    ns = f"{_PREFIX}/{infos[0]['nonce']}"
    report = WarmUpReport(mode=mode, role="all", key=key)
    collective = _has_fsdp(target)
    if collective:
        report.notes.append("FSDP2 modules present: every rank warms up (collectives in forward)")
    previous = dict(session.extra_metadata) if session is not None else {}
    if session is not None:
        session.extra_metadata["warm_up"] = sig
    try:
        if mode == "shared":
            _shared(report, infos, ns, target, example_inputs, train, session, wait, collective)
        else:
            _broadcast(report, infos, ns, target, example_inputs, train, session, wait, collective)
    finally:
        if session is not None:
            session.extra_metadata = previous
    if barrier:
        _final_barrier(report, ns, wait)
    report.seconds = time.perf_counter() - start
    logger.info("compile_cache: warm-up %s", report.to_dict())
    return _remember(report)


def _reset() -> None:
    """Forget the last warm-up and the one-time hazard warning and note (tests)."""
    global _last_warm_up, _warned_hazards, _lazy_note_logged
    _last_warm_up = None
    _warned_hazards = False
    _lazy_note_logged = False


def _remember(report: WarmUpReport) -> WarmUpReport:
    global _last_warm_up
    _last_warm_up = report
    return report


def last_warm_up() -> WarmUpReport | None:
    """The report of this process's most recent :func:`warm_up` (also run by compile_regions)."""
    return _last_warm_up


def _local(
    report: WarmUpReport, model: nn.Module, inputs: Any, train: bool, session: CacheSession | None
) -> None:
    plan = get_plan(model)
    if plan is not None and not plan.disabled:  # a rank that compiles: probe libraries ahead
        prefetch.start_for(model, plan.compile_kwargs)
    hits, misses, _ = _run_local(model, inputs, train, session)
    report.fxgraph_hits += hits
    report.fxgraph_misses += misses


def _final_barrier(report: WarmUpReport, ns: str, wait: float) -> None:
    t0 = time.perf_counter()
    if not _barrier(f"{ns}/ready", wait):
        msg = f"not every rank reached the warm-up barrier within {wait:.0f} s; going on"
        report.notes.append(msg)
        logger.warning("compile_cache: %s", msg)
    report.waited_seconds += time.perf_counter() - t0


def _compile_under_lock(
    report: WarmUpReport, model: nn.Module, inputs: Any, train: bool, session: CacheSession, sig: str
) -> None:
    """The leader's compile: under the store's lock, unless another job did it meanwhile."""
    lock_timeout = config.LOCK_TIMEOUT.value()
    lock = session.store.lock(session.key, timeout=lock_timeout)
    held = False
    try:
        lock.acquire()
        held = True
    except LockTimeoutError as exc:
        report.notes.append(f"lock timeout, compiling anyway: {exc}")
        logger.warning("compile_cache: %s; compiling without the lock", exc)
    try:
        if held and any(m.get("warm_up") == sig for m in session.pack_metadata()):
            session.restore(count=False)  # another job published while we waited for the lock
            report.notes.append("another process published while we waited for the lock")
        _local(report, model, inputs, train, session)
    finally:
        if held:
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
    sig = session.extra_metadata["warm_up"]
    if dist.get_rank() == leader:
        report.role = "leader"
        published = session.report.published_packs
        try:
            _compile_under_lock(report, model, inputs, train, session, sig)
        finally:  # also on failure: the others stop waiting and compile for themselves
            _signal(done, str(session.report.published_packs - published))
        return
    report.role = "follower"
    t0 = time.perf_counter()
    prefetch.cancel_pending()  # the leader's packs bring the probe libraries
    prefetch.import_compile_stack()  # idle time: the leader compiles meanwhile
    ok = _wait_for(done, wait, f"rank {leader} ({infos[leader]['host']}) to compile")
    report.waited_seconds += time.perf_counter() - t0
    if not ok:
        msg = f"rank {leader} did not finish compiling within {wait:.0f} s; compiling here"
        report.notes.append(msg)
        logger.warning("compile_cache: %s", msg)
    before = session.report.restored_packs
    session.restore(count=False)
    if ok and _published_by_leader(done) > 0 and session.report.restored_packs <= before:
        msg = (
            f"rank {leader} compiled but this rank found nothing new in {session.store.root}: is "
            "COMPILE_CACHE_DIR one directory shared by all ranks? Without a shared filesystem "
            "use COMPILE_CACHE_DISTRIBUTED=broadcast."
        )
        report.notes.append(msg)
        logger.warning("compile_cache: %s", msg)
    _local(report, model, inputs, train, session)


def _published_by_leader(done: str) -> int:
    store = _c10d_store()
    try:
        return int(store.get(done)) if store is not None else 0
    except Exception:
        return 0


def _node_leaders(infos: list[dict[str, Any]]) -> dict[str, int]:
    """host -> its lowest rank."""
    leaders: dict[str, int] = {}
    for i in infos:
        leaders[i["host"]] = min(leaders.get(i["host"], i["rank"]), i["rank"])
    return leaders


def _subgroup(ranks: tuple[int, ...]) -> Any:
    import torch.distributed as dist

    group = _subgroups.get(ranks)
    if group is None:  # every rank of the default group must call new_group, in the same order
        group = _subgroups[ranks] = dist.new_group(list(ranks))
    return group


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
        group = _subgroup(members) if len(members) > 1 else None
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
                    _compile_under_lock(report, model, inputs, train, session, key_sig(session))
                    done_local = True
            finally:
                _signal(done)
        elif mine or rank in members:
            t0 = time.perf_counter()
            prefetch.cancel_pending()  # the source's packs bring the probe libraries
            prefetch.import_compile_stack()  # idle time: the source compiles meanwhile
            ok = _wait_for(done, wait, f"rank {src} to compile")
            report.waited_seconds += time.perf_counter() - t0
            if not ok:
                _signal(f"{ns}/abandon/{key}")
                if mine:
                    report.notes.append(f"rank {src} did not finish within {wait:.0f} s; compiling here")
                continue
        if rank not in members and not mine:
            continue
        if rank in members and src in members and len(members) > 1:
            store = _c10d_store()
            if rank == src and store is not None and store.check([f"{ns}/abandon/{key}"]):
                continue  # a receiver gave up waiting: nobody listens any more
            payload: list[Any] = [None]
            if rank == src:
                payload[0] = _packs_to_send(session, [set(i["packs"]) for i in receivers])  # type: ignore[arg-type]
            dist.broadcast_object_list(payload, src=src, group=group)
            if mine and rank != src and session is not None:
                report.role = "receiver"
                report.received_packs += _publish_received(session, payload[0] or [])
        if node and mine and session is not None:
            host = infos[rank]["host"]
            host_done = f"{ns}/host/{host}/{key}"
            if rank == leaders[host]:
                _signal(host_done)
            else:  # restore from the host's store once its leader received the packs
                report.role = "receiver"
                t0 = time.perf_counter()
                _wait_for(host_done, wait, f"rank {leaders[host]} to receive the packs")
                report.waited_seconds += time.perf_counter() - t0
        if mine and rank != src and session is not None:
            session.restore(count=False)
    if not done_local:
        _local(report, model, inputs, train, session)


def key_sig(session: CacheSession) -> str:
    """The warm-up signature the session tags its packs with now ("" outside a warm-up)."""
    return str(session.extra_metadata.get("warm_up", ""))


def _packs_to_send(session: CacheSession, receiver_packs: list[set[str]]) -> list[dict[str, Any]]:
    """The source's packs of the key that at least one receiver lacks, as plain data."""
    out = []
    for pack in session.store.load(session.key):
        if receiver_packs and all(pack.info.name in have for have in receiver_packs):
            continue
        out.append(
            {
                "members": pack.members,
                "metadata": dict(pack.header.get("metadata") or {}),
                "compile_seconds": pack.info.compile_seconds,
            }
        )
    logger.info("compile_cache: broadcasting %d pack(s) of %s", len(out), session.key[:12])
    return out


def _publish_received(session: CacheSession, packs: list[dict[str, Any]]) -> int:
    count = 0
    for pack in packs:
        session.store.publish(
            session.key,
            pack["members"],
            metadata=pack.get("metadata"),
            entry_info=session._entry_info,
            compile_seconds=float(pack.get("compile_seconds") or 0.0),
        )
        count += 1
    return count
