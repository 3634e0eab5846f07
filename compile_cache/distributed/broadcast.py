"""Broadcast mode: no shared filesystem; the packs travel over the process group.

Per key that some rank lacks, :func:`plan_keys` (pure: every rank computes the same plans from
the gathered infos) names a *source* (a rank with the key that has the warm-up's packs, or else
the lowest rank with the key, which compiles), a *sender* and the *receivers*:

``rank`` scope (``COMPILE_CACHE_BROADCAST_SCOPE=rank``, default)
    the source sends; every other rank with the key receives into its own store.
``node`` scope
    one rank per host receives: the host's lowest rank, whether or not it has the key itself
    (pipeline stages, one model per rank), publishes the packs into the store of its host's
    ranks that need them and always signals them, ``ok`` or ``skip``; they restore from that
    store. The sender is the lowest rank of the source's host; ranks on the source's host
    restore from the source's store once it signals ``done``.

Three phases, so that no rank ever waits inside a collective for another rank's compile:

1. every source that has to compile does (ranks compile different keys at the same time);
2. per key, in the same order on every rank, the sender and receivers agree (a vote in the c10d
   store, :meth:`~.rendezvous.Ranks.agree`) and only if all of them can go does each of them
   enter ``broadcast_object_list``, over a group of exactly those ranks (every rank made the
   groups together, right after the round); a receiver that timed out, a failed compile or a
   rank that is gone makes the decision ``skip`` for all of them;
3. ranks that restore from their host's store wait for its signal, bounded, then restore.

A rank that got nothing compiles itself in its own warm-up forward (and publishes into its own
store).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from torch import nn

from .. import prefetch
from ..session import CacheSession
from ..store import Store
from .rendezvous import Ranks
from .steps import compile_under_lock, gone_key, local, note
from .warm_up_report import WarmUpReport

__all__ = ["KeyPlan", "plan_keys", "publish_received", "run", "sender_payload"]

logger = logging.getLogger("compile_cache")

#: What of a store's entry.json a receiver's new entry gets (the rest is its own).
_ENTRY_FIELDS = ("model_class", "torch", "device", "regions")


@dataclasses.dataclass(frozen=True)
class KeyPlan:
    """Who does what for one key (the same on every rank)."""

    key: str
    src: int  #: has the packs (``src_ready``) or compiles them, then signals done
    src_ready: bool
    src_store: str  #: the source's store (the sender reads the packs there)
    sender: int  #: sends the packs: the source, or (node scope) its host's lowest rank
    receivers: tuple[int, ...]  #: get the packs over the wire
    stores: dict[int, tuple[str, ...]]  #: receiver -> the stores it publishes them into
    have: tuple[frozenset[str], ...]  #: the pack names each receiving store already holds
    after_done: tuple[int, ...]  #: restore from the source's store after its done (its host)
    after_host: dict[int, int]  #: rank -> the receiver of its host, whose signal it waits for
    node: bool = False  #: node scope: receivers signal their host's ranks

    @property
    def participants(self) -> tuple[int, ...]:
        """The ranks of the broadcast (none when nobody receives)."""
        return tuple(sorted({self.sender, *self.receivers})) if self.receivers else ()

    @property
    def involved(self) -> frozenset[int]:
        return frozenset({self.src, *self.participants, *self.after_done, *self.after_host})


def _leaders(infos: list[dict[str, Any]]) -> dict[str, int]:
    """host -> its lowest rank."""
    leaders: dict[str, int] = {}
    for i in infos:
        leaders[i["host"]] = min(leaders.get(i["host"], i["rank"]), i["rank"])
    return leaders


def plan_keys(infos: list[dict[str, Any]], node: bool) -> list[KeyPlan]:
    """The plan of every key some rank lacks, in key order (what every rank walks)."""
    leaders = _leaders(infos)
    plans = []
    for key in sorted({i["key"] for i in infos if i["key"] is not None}):
        holders = [i for i in infos if i["key"] == key]
        if all(i["ready"] for i in holders):
            continue
        ready = [i for i in holders if i["ready"]]
        pool = ready or holders
        if node:  # a host's lowest rank as the source saves a hop
            pool = [i for i in pool if leaders[i["host"]] == i["rank"]] or pool
        src = min(pool, key=lambda i: i["rank"])
        needing = [i for i in holders if not i["ready"] and i["rank"] != src["rank"]]
        if node:
            hosts = sorted({i["host"] for i in needing if i["host"] != src["host"]})
            receivers = tuple(leaders[h] for h in hosts)
            stores = {leaders[h]: tuple(sorted({i["store"] for i in needing if i["host"] == h}))
                      for h in hosts}
            have = tuple(frozenset(p for i in needing if i["host"] == h for p in i["packs"])
                         for h in hosts)
            after_done = tuple(i["rank"] for i in needing if i["host"] == src["host"])
            after_host = {i["rank"]: leaders[i["host"]] for i in needing
                          if i["host"] != src["host"] and i["rank"] != leaders[i["host"]]}
            sender = leaders[src["host"]]
        else:
            receivers = tuple(i["rank"] for i in needing)
            stores = {i["rank"]: (i["store"],) for i in needing}
            have = tuple(frozenset(i["packs"]) for i in needing)
            after_done, after_host, sender = (), {}, src["rank"]
        plans.append(KeyPlan(
            key=key, src=src["rank"], src_ready=bool(src["ready"]), src_store=src["store"],
            sender=sender, receivers=receivers, stores=stores, have=have,
            after_done=after_done, after_host=after_host, node=node,
        ))
    return plans


def run(
    report: WarmUpReport, ranks: Ranks, infos: list[dict[str, Any]], ns: str, model: nn.Module,
    inputs: Any, train: bool, session: CacheSession | None, wait: float, collective: bool, sig: str,
    *, node: bool,
) -> None:
    """This rank's part of the broadcast warm-up (see the module docstring); ``node``: the node
    scope (rank 0's ``COMPILE_CACHE_BROADCAST_SCOPE``, the same for all)."""
    plans = [] if collective else plan_keys(infos, node)
    me = ranks.rank
    mine = next((p for p in plans if session is not None and p.key == session.key), None)
    compiled = False
    receiving = mine is not None and mine.src != me and me in mine.involved
    # 0. every rank makes the groups of every broadcast now, in order (new_group is for all)
    sets = list(dict.fromkeys(p.participants for p in plans if p.participants))
    groups = ranks.subgroups(sets, wait)
    # 1. compile what this rank is the source of (or just say it has it)
    if mine is not None and mine.src == me:
        report.role = "source"
        compiled = _compile_source(report, ranks, ns, mine, model, inputs, train, session, wait, sig)
    elif receiving:
        prefetch.cancel_pending()  # the source's packs bring the probe libraries
        prefetch.import_compile_stack()  # idle time: the source compiles meanwhile
    # 2. send and receive, key by key, in the same order everywhere
    for plan in plans:
        if me in plan.participants:
            _exchange(report, ranks, ns, plan, session, wait, groups[plan.participants])
    # 3. restore what reached this rank's store
    if receiving:
        _restore(report, ranks, ns, mine, session, wait)  # type: ignore[arg-type]
    if not compiled:
        local(report, model, inputs, train, session)


def _compile_source(report: WarmUpReport, ranks: Ranks, ns: str, plan: KeyPlan, model: nn.Module,
                    inputs: Any, train: bool, session: CacheSession | None, wait: float, sig: str) -> bool:
    """The source's compile (unless its store has the packs); signals done either way."""
    done = f"{ns}/done/{plan.key}"
    assert session is not None
    if plan.src_ready:
        ranks.signal(done, "ok")
        return False
    try:
        compile_under_lock(report, model, inputs, train, session, sig, wait)
    except BaseException:
        ranks.signal(done, "failed")
        if plan.participants:
            ranks.decide(f"{ns}/send/{plan.key}/decision", "skip")
        raise
    ranks.signal(done, "ok")
    return True


def _exchange(report: WarmUpReport, ranks: Ranks, ns: str, plan: KeyPlan,
              session: CacheSession | None, wait: float, group: Any) -> None:
    """The broadcast of one key, for its sender and receivers: agree first, then all or none."""
    me, key = ranks.rank, plan.key
    done = f"{ns}/done/{key}"
    have = True  # the source got here after its compile (a failed one raised before)
    if me != plan.src:
        t0 = time.perf_counter()
        waited = ranks.wait_for(done, wait, f"rank {plan.src} to compile {key[:12]}",
                                abort=[gone_key(ns, plan.src)])
        have = waited and ranks.get(done) == "ok"
        report.waited_seconds += time.perf_counter() - t0
        if not waited and me in plan.receivers:
            note(report, f"rank {plan.src} did not finish compiling {key[:12]} within {wait:.0f} s",
                 warn=True)
    t0 = time.perf_counter()
    go = ranks.agree(
        f"{ns}/send/{key}", len(plan.participants), have, wait,
        f"ranks {list(plan.participants)} to agree on sending {key[:12]}",
        abort=[gone_key(ns, r) for r in plan.participants if r != me],
    )
    report.waited_seconds += time.perf_counter() - t0
    received = 0
    if go:
        import torch.distributed as dist

        payload: list[Any] = [sender_payload(plan, session) if me == plan.sender else None]
        dist.broadcast_object_list(payload, src=plan.sender, group=group)
        if me in plan.receivers:
            received, refused = publish_received(plan, me, payload[0] or {}, session)
            report.received_packs += received
            if refused:
                note(report, f"the packs of {key[:12]} came from rank {plan.sender}, which could "
                     "not verify them with this rank's COMPILE_CACHE_SIGNING_KEY; not published "
                     "(this rank compiles them itself)", warn=True)
    elif me in plan.receivers:
        note(report, f"the packs of {key[:12]} were not sent (a rank gave up or failed); "
             "ranks without them compile themselves")
    if me in plan.receivers and plan.node:
        ranks.signal(_host_key(ns, key, me), "ok" if go else "skip")  # always: nobody waits out a timeout


def _host_key(ns: str, key: str, receiver: int) -> str:
    return f"{ns}/host/{key}/{receiver}"


def _store_at(location: str, session: CacheSession | None) -> Store:
    if session is not None and session.location == location:
        return session.store
    return Store(location)


def sender_payload(plan: KeyPlan, session: CacheSession | None) -> dict[str, Any]:
    """The sender's message: the key's packs some receiving store lacks, and entry metadata."""
    store = _store_at(plan.src_store, session)
    packs = []
    for pack in store.load(plan.key):
        if plan.have and all(pack.info.name in h for h in plan.have):
            continue
        packs.append({
            "members": dict(pack.members),  # read now: the open pack file does not travel
            "metadata": dict(pack.header.get("metadata") or {}),
            "compile_seconds": pack.info.compile_seconds,
        })
    entry = store.entry(plan.key)
    info = {k: v for k, v in (entry.metadata if entry is not None else {}).items() if k in _ENTRY_FIELDS}
    logger.info("compile_cache: sending %d pack(s) of %s to ranks %s", len(packs), plan.key[:12],
                list(plan.receivers))
    # Whose key checked these packs when they were loaded here (None: nobody's, no key here).
    return {"packs": packs, "entry_info": info, "verified_by": store.signer}


def publish_received(plan: KeyPlan, me: int, payload: dict[str, Any],
             session: CacheSession | None) -> tuple[int, int]:
    """Publish the received packs into every store this receiver serves: ``(packs that came,
    stores that refused them)``. A store with a signing key takes only packs the sender loaded
    through the same key: a keyless sender loads any unsigned pack planted in its store, and
    publishing it here would sign it with this key (launder it)."""
    packs = payload.get("packs") or []
    refused = 0
    for location in plan.stores.get(me, ()):
        store = _store_at(location, session)
        if store.signer is not None and payload.get("verified_by") != store.signer:
            refused += 1
            continue
        for pack in packs:
            store.publish(plan.key, pack["members"], metadata=pack.get("metadata"),
                          entry_info=payload.get("entry_info"),
                          compile_seconds=float(pack.get("compile_seconds") or 0.0))
    return len(packs), refused


def _restore(report: WarmUpReport, ranks: Ranks, ns: str, plan: KeyPlan, session: CacheSession,
             wait: float) -> None:
    """A rank with the key that is not its source: restore what reached its store."""
    me = ranks.rank
    t0 = time.perf_counter()
    if me in plan.after_done:
        ranks.wait_for(f"{ns}/done/{plan.key}", wait, f"rank {plan.src} to compile",
                       abort=[gone_key(ns, plan.src)])
    elif me in plan.after_host:
        leader = plan.after_host[me]
        if not ranks.wait_for(_host_key(ns, plan.key, leader), wait,
                              f"rank {leader} to receive the packs for this host",
                              abort=[gone_key(ns, leader)]):
            note(report, f"rank {leader} did not pass on the packs within {wait:.0f} s", warn=True)
    report.waited_seconds += time.perf_counter() - t0
    report.role = "receiver"
    session.restore(count=False)
