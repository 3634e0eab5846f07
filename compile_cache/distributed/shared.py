"""Shared mode: ``COMPILE_CACHE_DIR`` is one directory every rank reaches (NFS, Lustre, GPFS...).

Per key the lowest rank with the key compiles under the store's lock and signals ``done`` with
the names of the packs it published; the other ranks with the key poll the c10d store for it
(bounded, no collective), then restore. A follower that cannot see the announced packs yet lists
the store again with a short backoff (NFS attribute caching hides new files for a while) before
it compiles itself.
"""

from __future__ import annotations

import json
import time
from typing import Any

from torch import nn

from .. import prefetch
from ..session import CacheSession
from .rendezvous import Ranks
from .steps import compile_under_lock, local, note, pack_names
from .warm_up_report import WarmUpReport

__all__ = ["RELIST_DELAYS", "restore_announced", "run"]

#: A follower that finds none of the leader's packs after "done" lists the store again after
#: these pauses (about 5 s in all): NFS attribute caching can hide a new file for a while.
RELIST_DELAYS: tuple[float, ...] = (0.1, 0.2, 0.4, 0.8, 1.6, 1.9)


def run(
    report: WarmUpReport, ranks: Ranks, infos: list[dict[str, Any]], ns: str, model: nn.Module,
    inputs: Any, train: bool, session: CacheSession | None, wait: float, collective: bool, sig: str,
) -> None:
    """This rank's part: per key the lowest rank compiles, the others wait, then restore."""
    if session is None:
        local(report, model, inputs, train, session)
        return
    same = [i for i in infos if i["key"] == session.key]
    if collective or all(i["ready"] for i in same):
        local(report, model, inputs, train, session)
        return
    leader = min(i["rank"] for i in same)
    done = f"{ns}/done/{session.key}"
    if ranks.rank == leader:
        report.role = "leader"
        before = pack_names(session)
        try:
            compile_under_lock(report, model, inputs, train, session, sig, wait)
        finally:  # also on failure: the others stop waiting and compile for themselves
            ranks.signal(done, json.dumps(sorted(pack_names(session) - before)))
        return
    report.role = "follower"
    prefetch.cancel_pending()  # the leader's packs bring the probe libraries
    prefetch.import_compile_stack()  # idle time: the leader compiles meanwhile
    t0 = time.perf_counter()  # what follows is waiting; the import above is work
    ok = ranks.wait_for(done, wait, f"rank {leader} ({infos[leader]['host']}) to compile")
    report.waited_seconds += time.perf_counter() - t0
    if not ok:
        note(report, f"rank {leader} did not finish compiling within {wait:.0f} s; compiling here",
             warn=True)
    announced = set(json.loads(ranks.get(done) or "[]")) if ok else set()
    restore_announced(report, session, announced, leader)
    local(report, model, inputs, train, session)


def restore_announced(report: WarmUpReport, session: CacheSession, announced: set[str], leader: int) -> None:
    """Restore the key's packs once those the leader ``announced`` are visible: a follower that
    does not see them yet lists the store again with a short backoff (NFS attribute caching)
    before it gives up and compiles."""
    missing = announced - pack_names(session)
    t0 = time.perf_counter()
    relists = 0
    for delay in RELIST_DELAYS:
        if not missing:
            break
        time.sleep(delay)
        relists += 1
        missing = announced - pack_names(session)
    report.waited_seconds += time.perf_counter() - t0
    if relists and not missing:
        note(report, f"rank {leader}'s packs appeared after listing the store {relists} more "
             f"time(s) ({time.perf_counter() - t0:.1f} s; NFS attribute caching?)")
    elif missing:
        note(report, f"rank {leader} published {len(announced)} pack(s) but this rank cannot see "
             f"{len(missing)} of them in {session.location}, even after listing it again for "
             f"{sum(RELIST_DELAYS):.0f} s: is COMPILE_CACHE_DIR one directory shared by all "
             "ranks? Without a shared filesystem use COMPILE_CACHE_DISTRIBUTED=broadcast.",
             warn=True)
    session.restore(count=False)
