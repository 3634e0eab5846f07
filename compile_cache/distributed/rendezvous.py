"""Talking to the other ranks through the job's c10d store: gather, wait, signal, agree, barrier.

Everything here polls or writes the store; nothing is a collective, so a rank that waits for
another rank's compile trips no watchdog, and no rank can be left inside a collective that
another rank skipped. Decisions that several ranks must share are taken with one
``compare_set`` on a decision key: the first proposal wins and every rank acts on the value it
reads back (:meth:`Ranks.decide`). So "go" (enter a collective) and "skip"/"abandon" can never
both be acted on, however the timeouts of the ranks fall.

The store comes from :mod:`compile_cache.torch_compat.c10d`; without one, coordination raises
:class:`~compile_cache.errors.DistributedSetupError` rather than falling back to a collective
(``dist.barrier()`` would pair with the job's own collectives, such as DDP's parameter broadcast).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from ..errors import DistributedSetupError
from ..torch_compat import c10d

__all__ = ["PREFIX", "Ranks", "optional_store", "store"]

logger = logging.getLogger("compile_cache")

#: The namespace of compile_cache's keys in the job's c10d store.
PREFIX = "compile_cache"
_subgroups: dict[tuple[int, ...], Any] = {}


def optional_store() -> Any | None:
    """The job's c10d store, or None (for diagnostics that may be skipped)."""
    return c10d.default_store()


def store() -> Any:
    """The job's c10d store; :class:`DistributedSetupError` naming the fix when there is none."""
    kv = c10d.default_store()
    if kv is None:
        raise DistributedSetupError(
            "compile_cache cannot coordinate the ranks of this job: "
            f"{c10d.why_no_store()}. Waiting with a collective instead could pair with the job's "
            "own collectives (DDP's parameter broadcast) and hang or corrupt them, so it does not. "
            "Fix: start the job with torchrun, or initialize the process group with a store "
            "(init_process_group(init_method='env://' or 'tcp://HOST:PORT', or store=...)); or "
            "leave out example_inputs (ranks then compile at their first forward, uncoordinated), "
            "or call warm_up(model, inputs, mode='off', barrier=False)."
        )
    return kv


@dataclasses.dataclass
class Ranks:
    """This rank's view of the job: the c10d store (``kv``), its rank and the world size."""

    kv: Any
    rank: int
    world: int

    @classmethod
    def current(cls) -> Ranks:
        """The default process group's ranks (raises :class:`DistributedSetupError` without a store)."""
        import torch.distributed as dist

        return cls(store(), dist.get_rank(), dist.get_world_size())

    # -- single keys --------------------------------------------------------------------------
    def get(self, key: str) -> str | None:
        """The value of ``key``, or None when unset (or the store is unreachable)."""
        try:
            if not self.kv.check([key]):
                return None
            return bytes(self.kv.get(key)).decode()
        except Exception as exc:
            logger.debug("compile_cache: could not read %s from the c10d store: %s", key, exc)
            return None

    def signal(self, key: str, value: str = "ok") -> None:
        """Set ``key`` (what :meth:`wait_for` waits for)."""
        try:
            self.kv.set(key, value)
        except Exception as exc:
            logger.warning("compile_cache: could not signal %s: %s", key, exc)

    def wait_for(self, key: str, timeout: float, what: str, abort: Iterable[str] = ()) -> bool:
        """Poll until ``key`` is set: True; False on timeout, on a store failure, or as soon as
        one of the ``abort`` keys is set (a rank we wait for gave up)."""
        abort = list(abort)
        start = time.monotonic()
        next_log = start + 30.0
        delay = 0.02
        while True:
            try:
                if self.kv.check([key]):
                    return True
                if any(self.kv.check([k]) for k in abort):
                    logger.info("compile_cache: stopped waiting for %s: it gave up", what)
                    return False
            except Exception as exc:  # the store's host died (rank 0 in plain init_process_group)
                logger.warning("compile_cache: lost the job's c10d store while waiting for %s: %s", what, exc)
                return False
            now = time.monotonic()
            if now - start >= timeout:
                return False
            if now >= next_log:
                logger.info("compile_cache: still waiting for %s (%.0f s of %.0f s)", what, now - start, timeout)
                next_log = now + 30.0
            time.sleep(min(delay, max(0.0, timeout - (now - start))))
            delay = min(delay * 1.5, 0.5)

    # -- decisions ----------------------------------------------------------------------------
    def decide(self, key: str, proposal: str) -> str:
        """Propose ``proposal`` for the decision ``key``; the decision taken (the first proposal).

        One ``compare_set``: every rank that asks gets the same answer, so a rank that timed out
        and one that did not can never act differently. A store failure reads as ``"skip"``.
        """
        try:
            return bytes(self.kv.compare_set(key, "", proposal)).decode()
        except Exception as exc:
            logger.warning("compile_cache: could not take decision %s: %s", key, exc)
            return "skip"

    def agree(self, name: str, members: int, ok: bool, timeout: float, what: str,
              abort: Iterable[str] = ()) -> bool:
        """Whether all ``members`` ranks (each calling this once with its ``ok``) agree to go on.

        The last of ``members`` ok-votes decides ``go``; any rank that votes not-ok, or whose
        wait for the decision times out (or is aborted), proposes ``skip``. Every member gets
        the same answer: True only if the decision is ``go``.
        """
        decision = f"{name}/decision"
        if not ok:
            return self.decide(decision, "skip") == "go"
        try:
            count = int(self.kv.add(f"{name}/ok", 1))
        except Exception as exc:
            logger.warning("compile_cache: could not vote on %s: %s", name, exc)
            return self.decide(decision, "skip") == "go"
        if count >= members:
            return self.decide(decision, "go") == "go"
        if self.wait_for(decision, timeout, what, abort):
            taken = self.get(decision)
            if taken is not None:
                return taken == "go"
        return self.decide(decision, "skip") == "go"

    # -- all ranks ----------------------------------------------------------------------------
    def gather(self, mine: dict[str, Any], timeout: float, what: str) -> tuple[list[dict[str, Any]] | None, str]:
        """Every rank's ``mine`` (by rank) and the round's namespace; None when not every rank
        came within ``timeout`` (then every rank that came gets None too: the round is abandoned).

        Each call of a rank joins the next round it has not joined, skipping rounds already
        decided without it, so a rank that calls once more than the others (a second model on
        rank 0 only) waits for ``timeout`` once and the ranks' next calls meet again.
        """
        joined = f"{PREFIX}/joined/{self.rank}"
        last = self.get(joined)
        r = int(last) + 1 if last is not None and last.isdigit() else 0
        while self.get(f"{PREFIX}/round/{r}/decision") is not None:
            r += 1
        ns = f"{PREFIX}/round/{r}"
        decision = f"{ns}/decision"
        try:
            self.kv.set(joined, str(r))
            self.kv.set(f"{ns}/info/{self.rank}", json.dumps(mine))
            arrived = int(self.kv.add(f"{ns}/arrived", 1))
        except Exception as exc:
            logger.warning("compile_cache: could not join the ranks' round %d: %s", r, exc)
            return None, ns
        if arrived >= self.world:
            go = self.decide(decision, "go") == "go"
        elif self.wait_for(decision, timeout, what):
            go = self.get(decision) == "go"
        else:
            go = self.decide(decision, "abandon") == "go"
        if not go:
            return None, ns
        infos = []
        for r_ in range(self.world):
            text = self.get(f"{ns}/info/{r_}")
            if text is None:  # the store failed under us: treat the round as abandoned here
                return None, ns
            infos.append(json.loads(text))
        return infos, ns

    def arrive(self, name: str) -> None:
        """Count this rank in at barrier ``name`` without waiting (a rank that leaves early)."""
        try:
            if int(self.kv.add(name, 1)) >= self.world:
                self.kv.set(name + "/all", "1")
        except Exception as exc:
            logger.warning("compile_cache: barrier %s failed: %s", name, exc)

    def barrier(self, name: str, timeout: float) -> bool:
        """Every rank arrives, or ``timeout`` passes (False); a counter in the store."""
        self.arrive(name)
        return self.wait_for(name + "/all", timeout, "every rank to finish its warm-up")

    # -- groups -------------------------------------------------------------------------------
    def subgroups(self, sets: list[tuple[int, ...]], timeout: float) -> dict[tuple[int, ...], Any]:
        """The process group of each rank set (None for all ranks: the default group).

        Every rank of the job must call this with the same sets in the same order (it creates
        each group once per process with ``new_group``, which every rank calls; the names stay
        in step on every rank, so the job's own later groups are not shifted apart). Called
        right after a round every rank joined, before anyone waits for a compile.
        """
        import torch.distributed as dist

        out: dict[tuple[int, ...], Any] = {}
        for ranks in sets:
            if len(ranks) == self.world:
                out[ranks] = None
                continue
            if ranks not in _subgroups:
                _subgroups[ranks] = dist.new_group(
                    list(ranks), timeout=datetime.timedelta(seconds=max(1.0, timeout))
                )
            out[ranks] = _subgroups[ranks]
        return out


def _reset() -> None:
    """Forget the subgroups made (tests that create process groups again)."""
    _subgroups.clear()
