"""Ranks never stall, never hang and never pair collectives wrongly (issue #14).

Two multi-rank jobs (tests/_dist_jobs.py: gloo on CPU, 2 and 4 ranks, every warm-up with a small
explicit timeout, the whole job bounded) run their scenarios one after another, as a training
script would; an ``all_reduce`` after each scenario shows the ranks' own collectives still pair.
The decisions themselves (the round of :meth:`Ranks.gather`, :meth:`Ranks.agree`) and the
broadcast plans are checked in-process against a ``HashStore``, with threads as ranks.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from _dist_jobs import SHORT, Job, T

TWO = ["off_mode", "different_models", "leader_raises", "twice_then_extra"]
FOUR = ["abandon", "node_scope"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both jobs, started at once; each test collects its job's results (bounded)."""
    root = tmp_path_factory.mktemp("protocol")
    started = {"two": Job(root / "two", 2, TWO), "four": Job(root / "four", 4, FOUR)}

    class Lazy(dict):
        def __missing__(self, name: str) -> Any:
            job = started[name]
            self[name] = (job, job.results())
            return self[name]

    return Lazy()


def _no_timeouts(report: dict[str, Any]) -> None:
    """No wait of this warm-up ran into its timeout (each would leave a note)."""
    assert not [n for n in report["notes"] if "within" in n], report["notes"]


def _scenario(jobs: dict[str, Any], job: str, name: str) -> list[dict[str, Any]]:
    _, results = jobs[job]
    out = [r[name] for r in results]
    world = len(out)
    for r in out:
        assert r["all_reduce"] == world * (world + 1) / 2  # collectives after it still pair
    return out


def test_off_mode_with_example_inputs_does_not_wait_out_the_barrier(jobs: dict[str, Any]) -> None:
    for r in _scenario(jobs, "two", "off_mode"):
        report = r["warm_up"]
        assert report["mode"] == "off" and report["role"] == "alone"
        _no_timeouts(report)  # the barrier filled: both ranks used the round's name for it
        assert report["waited_seconds"] < T
        assert r["max_diff"] < 1e-5


def test_ranks_holding_different_models_compile_side_by_side(jobs: dict[str, Any]) -> None:
    out = _scenario(jobs, "two", "different_models")
    for mode, role in (("shared", "leader"), ("broadcast", "source")):
        keys = {r[mode]["warm_up"]["key"] for r in out}
        assert len(keys) == 2  # one key per rank
        for r in out:
            report = r[mode]["warm_up"]
            assert report["role"] == role, report
            _no_timeouts(report)
            assert report["waited_seconds"] < T  # nobody waited for another rank's compile
            assert r[mode]["max_diff"] < 1e-5


@pytest.mark.parametrize("mode", ["shared", "broadcast"])
def test_a_leader_whose_forward_raises_gets_the_error_and_nobody_hangs(
    jobs: dict[str, Any], mode: str
) -> None:
    leader, other = (r[mode] for r in _scenario(jobs, "two", "leader_raises"))
    assert "boom" in leader["raised"]
    report = other["warm_up"]
    assert report["role"] == ("follower" if mode == "shared" else "receiver")
    _no_timeouts(report)  # neither the leader's signal nor the barrier was waited out
    if mode == "broadcast":
        assert any("were not sent" in n for n in report["notes"]), report["notes"]
    assert leader["max_diff"] < 1e-5 and other["max_diff"] < 1e-5


def test_a_rank_that_calls_compile_regions_twice_or_once_more_than_the_others(
    jobs: dict[str, Any]
) -> None:
    out = _scenario(jobs, "two", "twice_then_extra")
    for r in out:
        for call in r["twice"]:
            assert call["warm_up"]["role"] in ("leader", "follower")
            _no_timeouts(call["warm_up"])
            assert call["max_diff"] < 1e-5
    extra = out[0]["extra"]  # rank 0 alone: one bounded wait, then it warms up by itself
    assert extra["warm_up"]["role"] == "alone" and extra["max_diff"] < 1e-5
    notes = extra["warm_up"]["notes"]  # it waited its own short timeout, not the default one
    assert any(f"not every rank reached warm_up within {SHORT:.0f} s" in n for n in notes), notes
    # ... and the next call of every rank meets again, with no timeout
    roles = sorted(r["again"]["warm_up"]["role"] for r in out)
    assert roles == ["follower", "leader"]
    for r in out:
        _no_timeouts(r["again"]["warm_up"])
        assert r["again"]["max_diff"] < 1e-5


def test_a_receiver_that_gives_up_as_the_broadcast_starts_stops_it_for_all(
    jobs: dict[str, Any]
) -> None:
    r0, r1, r2, r3 = _scenario(jobs, "four", "abandon")
    assert r0["warm_up"]["role"] == "source" and r2["warm_up"]["role"] == "source"
    # key A was not sent: rank 1 gave up, so rank 0 did not enter the broadcast either
    assert r1["warm_up"]["received_packs"] == 0 and r0["seeded"] not in r1["packs"]
    assert any("were not sent" in n for n in r1["warm_up"]["notes"])
    # key B went from rank 2 to rank 3, and only B's pack: the broadcasts did not mix
    assert r3["warm_up"]["role"] == "receiver" and r3["warm_up"]["received_packs"] == 1
    assert r3["packs"] == [r2["seeded"]]
    _no_timeouts(r3["warm_up"])
    for r in (r0, r1, r2, r3):
        assert r["max_diff"] < 1e-5
        assert not [n for n in r["warm_up"]["notes"] if "barrier" in n]


def test_node_scope_where_the_hosts_lowest_rank_holds_no_key(jobs: dict[str, Any]) -> None:
    r0, r1, r2, r3 = _scenario(jobs, "four", "node_scope")
    assert r0["warm_up"]["key"] is None and r2["warm_up"]["role"] == "source"
    assert r0["packs_A"] == [r2["seeded"]]  # rank 0 published them into host A's store ...
    assert r1["warm_up"]["role"] == "receiver" and r1["restored_packs"] == 1  # ... for rank 1
    for r in (r0, r1, r2, r3):
        _no_timeouts(r["warm_up"])
        assert r["warm_up"]["waited_seconds"] < T
        assert r["max_diff"] < 1e-5


# ---------------------------------------------------------------------------------------------
# In process: the decisions, with threads as ranks and a HashStore as the job's store


def _ranks(world: int) -> list[Any]:
    import torch.distributed as dist

    from compile_cache.distributed.rendezvous import Ranks

    kv = dist.HashStore()
    return [Ranks(kv, r, world) for r in range(world)]


def _in_threads(*calls: Any) -> list[Any]:
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=T)
        assert not t.is_alive(), "a rank did not come back"
    return out


def test_agreement_is_all_or_nothing_whatever_the_timeouts() -> None:
    a, b = _ranks(2)
    assert _in_threads(lambda: a.agree("k1", 2, True, 5, "b"), lambda: b.agree("k1", 2, True, 5, "a")) == [True, True]
    assert _in_threads(lambda: a.agree("k2", 2, True, 5, "b"), lambda: b.agree("k2", 2, False, 5, "a")) == [False, False]
    # a member whose wait for the decision times out proposes skip, but a decision taken is
    # final: once every member voted ok it is "go" for all, also for the one that timed out
    assert a.agree("k3", 2, True, 0.05, "b") is False  # alone: it gave up, decided skip
    assert b.agree("k3", 2, True, 5, "a") is False  # the latecomer gets that same decision
    b.kv.add("k4/ok", 1)
    b.decide("k4/decision", "go")  # the other voted ok and decided go just as a timed out
    assert a.agree("k4", 2, True, 0.0, "b") is True


def test_a_round_is_abandoned_by_all_and_the_next_call_meets_again() -> None:
    a, b = _ranks(2)
    first = _in_threads(lambda: a.gather({"r": 0}, 5, "b"), lambda: b.gather({"r": 1}, 5, "a"))
    assert first[0] == first[1] and first[0][0] == [{"r": 0}, {"r": 1}]
    infos, _ = a.gather({"r": 0, "extra": True}, 0.1, "b")  # rank 0 calls once more, alone
    assert infos is None
    again = _in_threads(lambda: a.gather({"r": 0}, 5, "b"), lambda: b.gather({"r": 1}, 5, "a"))
    assert again[0][0] == [{"r": 0}, {"r": 1}] and again[0][1] == again[1][1] != first[0][1]


def test_barrier_counts_a_rank_that_left_early() -> None:
    a, b = _ranks(2)
    a.arrive("bar")  # rank 0's warm-up raised: it arrives and leaves
    assert b.barrier("bar", 5) is True


def test_without_a_c10d_store_warm_up_raises_instead_of_a_collective(
    monkeypatch: pytest.MonkeyPatch, fresh_state: None
) -> None:
    import torch

    import compile_cache
    from compile_cache import DistributedSetupError
    from compile_cache.demo import TinyTransformer
    from compile_cache.distributed import protocol
    from compile_cache.torch_compat import c10d

    model = TinyTransformer(layers=2, width=16, heads=2, vocab=32).eval()
    compile_cache.compile_regions(model, cache_dir=False, backend="eager")
    monkeypatch.setattr(protocol, "is_active", lambda: True)
    monkeypatch.setattr(c10d, "default_store", lambda: None)
    with pytest.raises(DistributedSetupError, match="init_process_group"):
        compile_cache.warm_up(model, torch.randint(0, 32, (1, 4)))


def _info(rank: int, host: str, key: str | None, ready: bool = False, store: str = "s") -> dict[str, Any]:
    return {"rank": rank, "host": host, "key": key, "ready": ready, "store": store, "packs": []}


def test_plans_every_rank_computes_the_same_way() -> None:
    from compile_cache.distributed.broadcast import plan_keys

    # rank scope, one model per rank: nothing to send, nobody waits
    solo = plan_keys([_info(0, "h", "a"), _info(1, "h", "b")], node=False)
    assert [(p.src, p.participants) for p in solo] == [(0, ()), (1, ())]
    # node scope: host A's lowest rank holds no key but receives for rank 1
    infos = [_info(0, "A", None), _info(1, "A", "k", store="sA"),
             _info(2, "B", "k", True, "sB"), _info(3, "B", "k", True, "sB")]
    (plan,) = plan_keys(infos, node=True)
    assert (plan.src, plan.sender, plan.receivers) == (2, 2, (0,))
    assert plan.stores == {0: ("sA",)} and plan.after_host == {1: 0} and plan.after_done == ()
    # node scope, nobody ready: the lowest rank compiles; its host restores after its done
    infos = [_info(0, "A", "k"), _info(1, "A", "k"), _info(2, "B", "k"), _info(3, "B", "x")]
    (k, x) = plan_keys(infos, node=True)
    assert (k.src, k.receivers, k.after_done, k.after_host) == (0, (2,), (1,), {})
    assert x.src == 3 and x.participants == ()


def test_a_follower_lists_the_store_again_until_the_leaders_packs_show(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_state: None
) -> None:
    """NFS attribute caching hides a new pack for a while: the follower re-lists with a short
    backoff and restores it, instead of compiling."""
    from compile_cache.demo import TinyTransformer
    from compile_cache.distributed import WarmUpReport, shared
    from compile_cache.session import CacheSession
    from compile_cache.store import Store
    from compile_cache.store.layout import Layout

    store = Store(tmp_path / "store")
    key = "ab" * 16
    session = CacheSession(store, key, TinyTransformer(layers=1, width=8, heads=1, vocab=8), False)
    name = store.publish(key, {"inductor/test-relist/x": b"compiled"}).name
    real, hidden = Layout.pack_file_names, [3]

    def cached_listing(self: Layout, k: str, *, strict: bool = False) -> list[str]:
        if hidden[0] > 0:
            hidden[0] -= 1
            return []
        return real(self, k, strict=strict)

    monkeypatch.setattr(Layout, "pack_file_names", cached_listing)
    report = WarmUpReport(mode="shared", role="follower", key=key)
    shared.restore_announced(report, session, {name}, leader=0)
    assert session.report.restored_packs == 1
    assert any("appeared after listing the store" in n for n in report.notes), report.notes
    # a pack that never shows: bounded, then a warning naming the likely cause
    monkeypatch.setattr(shared, "RELIST_DELAYS", (0.01, 0.01))
    report = WarmUpReport(mode="shared", role="follower", key=key)
    shared.restore_announced(report, session, {"f" * 32}, leader=0)
    assert any("COMPILE_CACHE_DIR" in n for n in report.notes)
    json.dumps(report.to_dict())


@pytest.mark.parametrize("sender_key", [None, "other-key", "the-key"])
def test_a_keyed_receiver_takes_only_packs_its_own_key_verified_at_the_sender(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sender_key: str | None,
) -> None:
    """issue 31.7: a keyless sender loads an unsigned pack planted in its store; a receiver with
    a key must not publish (sign) it. Only a sender holding the receiver's key passes packs on."""
    from compile_cache.distributed.broadcast import KeyPlan, publish_received, sender_payload
    from compile_cache.store import Store

    for name in ("COMPILE_CACHE_SIGNING_KEY", "COMPILE_CACHE_DIR", "COMPILE_CACHE_SHARED"):
        monkeypatch.delenv(name, raising=False)
    key = "cd" * 16
    src, dst = str(tmp_path / "sender"), str(tmp_path / "receiver")
    Store(src, signing_key=sender_key).publish(key, {"inductor/planted": b"evil"})
    plan = KeyPlan(key=key, src=0, src_ready=True, src_store=src, sender=0, receivers=(1,),
                   stores={1: (dst,)}, have=(frozenset(),), after_done=(), after_host={})
    if sender_key is not None:
        monkeypatch.setenv("COMPILE_CACHE_SIGNING_KEY", sender_key)
    payload = sender_payload(plan, None)
    monkeypatch.setenv("COMPILE_CACHE_SIGNING_KEY", "the-key")  # the receiving rank's key
    came, refused = publish_received(plan, 1, payload, None)
    receiver = Store(dst)
    if sender_key == "the-key":
        assert (came, refused) == (1, 0) and len(receiver.load(key)) == 1
    else:
        assert refused == 1 and receiver.load(key) == []  # nothing laundered into a signed pack
        assert not receiver.has(key)
