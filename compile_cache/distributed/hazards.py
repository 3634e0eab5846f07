"""Silent-miss hazards between ranks: settings that make torch's cache keys differ per rank.

Two hazards are torch's (its FX-graph key holds them): a CUDA device index other than 0
(``cuda:3`` never hits entries compiled on ``cuda:0``), and on CPU the thread count
(``torch.get_num_threads()``), whose default follows the cores each process sees. A third is
compile_cache's own: ranks whose environment keys differ compile for themselves. Ranks compare
their material (:func:`check_hazards`: at ``warm_up``, or through the c10d store without one,
:func:`note_lazy`) and one warning per process names the fix: ``torchrun --virtual-local-rank``
or one GPU per rank via ``CUDA_VISIBLE_DEVICES``, and one fixed ``torch.set_num_threads(N)`` /
``OMP_NUM_THREADS=N`` everywhere. :func:`cross_rank_hazards` is the single-process check
``doctor`` shows.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

from .. import _warnings
from ..keys import environment
from ..warmup import output_tensors
from . import rendezvous
from .warm_up_report import is_active, resolve_mode

__all__ = ["check_hazards", "cross_rank_hazards", "device_index", "note_lazy"]

logger = logging.getLogger("compile_cache")

_warned_hazards = False
_lazy_note_logged = False


def device_index(model: nn.Module, example_inputs: Any) -> str | None:
    """``cuda:N`` (the device index in torch's key) of the first tensor, or None on CPU."""
    for t in output_tensors(example_inputs) + list(model.parameters()):
        if t.device.type != "cpu":
            return f"{t.device.type}:{t.device.index if t.device.index is not None else 0}"
        return None
    return None


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
    store = rendezvous.optional_store()
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
    mine = {"threads": torch.get_num_threads(), "device": device_index(model, None)}
    try:
        mine["env"] = environment()
        store.set(f"{rendezvous.PREFIX}/lazy/{rank}", json.dumps(mine))
        infos = [mine]
        for other in range(world):
            key = f"{rendezvous.PREFIX}/lazy/{other}"
            if other != rank and store.check([key]):
                infos.append(json.loads(store.get(key)))
    except Exception as exc:  # never break compile_regions over a diagnostic
        logger.debug("compile_cache: lazy hazard check skipped: %s", exc)
        return
    check_hazards(infos)


def cross_rank_hazards() -> list[str]:
    """Settings that make torch's cache keys differ between ranks: each a message with its fix.

    Two silent-miss hazards: (1) a CUDA device index other than 0 is part of the FX-graph key
    (inputs on ``cuda:3`` never hit entries compiled on ``cuda:0``); (2) on CPU the thread count
    (``torch.get_num_threads()``) is part of the key, and its default follows the cores the process
    sees. Never raises; returns [] when nothing is at risk.
    """
    hazards: list[str] = []
    try:
        import torch

        local_rank = os.environ.get("LOCAL_RANK")
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        device_index: int | None = None
        try:
            if torch.cuda.is_available():
                device_index = torch.cuda.current_device()
        except Exception:
            device_index = None
        if device_index is not None and device_index != 0:
            hazards.append(
                f"CUDA device index {device_index} is in use: torch's FX-graph key holds the "
                "device index, so ranks on different indices never share compiled code. Fix: "
                "`torchrun --virtual-local-rank`, or set CUDA_VISIBLE_DEVICES per rank so each "
                "rank sees its GPU as cuda:0."
            )
        elif (
            device_index is not None
            and local_rank not in (None, "0")
            and (cvd is None or "," in cvd)
        ):
            hazards.append(
                f"LOCAL_RANK={local_rank} with CUDA_VISIBLE_DEVICES={cvd!r}: if this rank moves "
                f"to cuda:{local_rank} its cache keys will differ from rank 0's. Fix: "
                "`torchrun --virtual-local-rank`, or one GPU per rank via CUDA_VISIBLE_DEVICES."
            )
        omp = os.environ.get("OMP_NUM_THREADS")
        threads = torch.get_num_threads()
        if omp is None:
            hazards.append(
                f"CPU thread count ({threads}) is not pinned: it is part of torch's FX-graph key "
                "for CPU code and its default follows the cores each process sees, so ranks or "
                "nodes with different core counts miss each other's entries. Fix: set "
                "OMP_NUM_THREADS or call torch.set_num_threads(N) with a fixed N before compiling."
            )
        elif omp.strip().isdigit() and int(omp) != threads:
            hazards.append(
                f"torch.get_num_threads() is {threads} but OMP_NUM_THREADS={omp}: the thread count "
                "in torch's key is not the one configured. Fix: call torch.set_num_threads(N) "
                "with one fixed N everywhere before compiling."
            )
    except Exception as e:  # pragma: no cover - a sketch must never break the caller
        hazards.append(f"could not check cross-rank hazards: {e}")
    return hazards


def _reset() -> None:
    """Forget the one-time hazard warning and lazy-mode note (tests)."""
    global _warned_hazards, _lazy_note_logged
    _warned_hazards = False
    _lazy_note_logged = False
