"""Multi-rank jobs for tests/test_distributed_protocol.py: the harness and each rank's scenarios.

A job is ``world`` plain subprocesses (this file run as a script) joined through a TCPStore that
the test process hosts (as torchrun's agent does). Each rank runs the job's scenarios one after
another in one process group, as a training script calling ``compile_regions`` several times
would, and after each one an ``all_reduce`` shows that the ranks' collectives still pair. Every
warm-up gets a small explicit timeout; the harness bounds the whole job, so a hang fails fast.
Backends are ``eager``/``aot_eager`` (the protocol is the point, not Inductor); where packs
must travel, a rank seeds its store with a small pack tagged with the warm-up's signature, as a
store warmed by an earlier job would be.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

JOB_TIMEOUT = 240.0  # seconds for a whole job: far above its expected ~30 s
T = 30.0  # the timeout of a warm-up that must not time out
SHORT = 3.0  # the timeout of a warm-up whose partner never comes


class Job:
    """``world`` ranks running ``scenarios``, started now; :meth:`results` waits, bounded."""

    def __init__(self, root: Path, world: int, scenarios: list[str]) -> None:
        import torch.distributed as dist

        self.root, self.world, self.scenarios = root, world, scenarios
        root.mkdir(parents=True)
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=JOB_TIMEOUT))
        self.started = time.monotonic()
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(world):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILE_CACHE_", "TORCH"))}
            env.update(
                TORCHINDUCTOR_CACHE_DIR=str(root / f"inductor{rank}"),
                COMPILE_CACHE_WAIT_TIMEOUT=str(T),
                COMPILE_CACHE_PREFETCH="0",
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(Path(__file__).resolve().parents[1]),
            )
            with open(root / f"log{rank}.txt", "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, __file__, str(rank), str(world), str(self.store.port), str(root),
                     ",".join(scenarios)],
                    env=env, stdout=log, stderr=subprocess.STDOUT,
                ))

    def results(self) -> list[dict[str, Any]]:
        """Every rank's results by scenario; fails (killing the ranks) past JOB_TIMEOUT."""
        deadline = self.started + JOB_TIMEOUT
        for rank, proc in enumerate(self.procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in self.procs:
                    p.kill()
                raise AssertionError(f"ranks still running after {JOB_TIMEOUT} s (a hang?)\n"
                                     + self.tail()) from None
            assert code == 0, f"rank {rank} exited {code}\n{self.tail()}"
        return [json.loads((self.root / f"result{r}.json").read_text()) for r in range(self.world)]

    def tail(self) -> str:
        return "\n".join(f"--- rank {r}\n" + (self.root / f"log{r}.txt").read_text()[-4000:]
                         for r in range(self.world))


# ---------------------------------------------------------------------------------------------
# Rank side


class Ctx:
    """What a scenario gets: this rank, the world, the job's directory and the job's store."""

    def __init__(self, rank: int, world: int, root: Path, kv: Any) -> None:
        self.rank, self.world, self.root, self.kv = rank, world, root, kv


def _model(width: int) -> Any:
    import torch

    from compile_cache.demo import TinyTransformer

    torch.manual_seed(width)
    return TinyTransformer(layers=2, width=width, heads=2, vocab=64).eval()


def _tokens() -> Any:
    import torch

    return torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))


def _eager(model: Any, x: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(x)


def _diff(model: Any, x: Any, ref: Any) -> float:
    return float((_eager(model, x) - ref).abs().max())


def _warm(model: Any, x: Any, **kw: Any) -> dict[str, Any]:
    import compile_cache

    return compile_cache.warm_up(model, (x,), **kw).to_dict()


def _seed(model: Any, x: Any, name: str) -> str:
    """Put a pack tagged with this warm-up's signature into the model's store: the store is then
    'ready' for the warm-up, as one an earlier job filled would be. Returns the pack's name."""
    from compile_cache import warmup
    from compile_cache.session import session_for

    session = session_for(model)
    info = session.store.publish(session.key, {f"inductor/seeded/{name}": name.encode() * 50},
                                 metadata={"warm_up": warmup.signature((x,), False)})
    return info.name


def _packs(store: Path) -> list[str]:
    return sorted(p.stem for p in store.rglob("*.pack"))


def off_mode(ctx: Ctx) -> dict[str, Any]:
    import compile_cache

    model, x = _model(32), _tokens()
    ref = _eager(model, x)
    compile_cache.compile_regions(model, cache_dir=ctx.root / f"off{ctx.rank}", backend="eager",
                                  example_inputs=(x,), distributed="off")
    from compile_cache import distributed as ccd

    return {"warm_up": ccd.last_warm_up().to_dict(), "max_diff": _diff(model, x, ref)}


def different_models(ctx: Ctx) -> dict[str, Any]:
    """Every rank its own model (one key each): nobody waits for anybody, in either mode."""
    import compile_cache
    from compile_cache import distributed as ccd

    out: dict[str, Any] = {}
    for mode in ("shared", "broadcast"):
        model, x = _model(24 + 8 * ctx.rank), _tokens()
        ref = _eager(model, x)
        store = ctx.root / mode / ("store" if mode == "shared" else f"store{ctx.rank}")
        compile_cache.compile_regions(model, cache_dir=store, backend="aot_eager",
                                      example_inputs=(x,), distributed=mode)
        out[mode] = {"warm_up": ccd.last_warm_up().to_dict(), "max_diff": _diff(model, x, ref)}
    return out


def _raise_once(model: Any) -> Any:
    def boom(module: Any, args: Any) -> None:
        handle.remove()
        raise RuntimeError("boom: the leader's forward raised")

    handle = model.register_forward_pre_hook(boom)
    return handle


def leader_raises(ctx: Ctx) -> dict[str, Any]:
    """The compiling rank's forward raises, in shared and in broadcast mode: it gets the error,
    the others neither hang nor wait out a timeout, and every rank computes right after."""
    import compile_cache

    out: dict[str, Any] = {}
    for mode, width in (("shared", 40), ("broadcast", 44)):
        model, x = _model(width), _tokens()
        ref = _eager(model, x)
        store = ctx.root / f"raise-{mode}" / ("store" if mode == "shared" else f"store{ctx.rank}")
        compile_cache.compile_regions(model, cache_dir=store, backend="aot_eager")
        if ctx.rank == 0:
            _raise_once(model)
        result: dict[str, Any] = {}
        try:
            result["warm_up"] = _warm(model, x, mode=mode, timeout=T)
        except RuntimeError as exc:
            result["raised"] = str(exc)
        result["max_diff"] = _diff(model, x, ref)
        out[mode] = result
    return out


def twice_then_extra(ctx: Ctx) -> dict[str, Any]:
    """Every rank calls compile_regions twice on one model; then rank 0 alone warms up one more
    model (its partner never comes); then all ranks warm up another model together again."""
    import compile_cache

    out: dict[str, Any] = {"twice": []}
    model, x = _model(36), _tokens()
    ref = _eager(model, x)
    for _ in range(2):
        compile_cache.compile_regions(model, cache_dir=ctx.root / "twice", backend="aot_eager")
        out["twice"].append({"warm_up": _warm(model, x, timeout=T), "max_diff": _diff(model, x, ref)})
    if ctx.rank == 0:
        extra = _model(20)
        ref_extra = _eager(extra, x)
        compile_cache.compile_regions(extra, cache_dir=ctx.root / "extra", backend="aot_eager")
        out["extra"] = {"warm_up": _warm(extra, x, timeout=SHORT), "max_diff": _diff(extra, x, ref_extra)}
        ctx.kv.set("test/extra_done", "1")
    else:
        ctx.kv.wait(["test/extra_done"], datetime.timedelta(seconds=T))
    again = _model(28)
    ref_again = _eager(again, x)
    compile_cache.compile_regions(again, cache_dir=ctx.root / "again", backend="aot_eager")
    out["again"] = {"warm_up": _warm(again, x, timeout=T), "max_diff": _diff(again, x, ref_again)}
    return out


def abandon(ctx: Ctx) -> dict[str, Any]:
    """Rank scope, two keys: ranks 0 and 1 hold model A, ranks 2 and 3 model B; ranks 0 and 2
    have the packs. Rank 1's wait for A 'times out' just as the source votes to send: A is not
    sent to anybody, B still goes from rank 2 to rank 3 (and only B)."""
    import compile_cache
    from compile_cache.distributed import rendezvous

    width = 32 if ctx.rank < 2 else 48
    model, x = _model(width), _tokens()
    ref = _eager(model, x)
    store = ctx.root / "abandon" / f"store{ctx.rank}"
    compile_cache.compile_regions(model, cache_dir=store, backend="aot_eager")
    seeded = _seed(model, x, f"rank{ctx.rank}") if ctx.rank in (0, 2) else None
    if ctx.rank == 1:
        real = rendezvous.Ranks.wait_for

        def times_out_as_the_broadcast_starts(self, key, timeout, what, abort=()):
            got = real(self, key, timeout, what, abort)
            if "/done/" in key:  # the source is done: wait until it voted to send, then give up
                ns, k = key.rsplit("/done/", 1)
                real(self, f"{ns}/send/{k}/ok", timeout, "the source's vote")
                return False
            return got

        rendezvous.Ranks.wait_for = times_out_as_the_broadcast_starts  # type: ignore[method-assign]
    report = _warm(model, x, mode="broadcast", timeout=T)
    return {"warm_up": report, "max_diff": _diff(model, x, ref), "seeded": seeded,
            "packs": _packs(store)}


def node_scope(ctx: Ctx) -> dict[str, Any]:
    """Node scope on two (pretend) hosts: A = ranks 0, 1; B = ranks 2, 3, one store per host.
    Rank 0, A's lowest rank, holds no key; ranks 1 to 3 hold one model, and host B's store has
    its packs. Rank 0 receives them for rank 1 anyway and always signals it."""
    import compile_cache
    from compile_cache.distributed import protocol

    host = "hostA" if ctx.rank < 2 else "hostB"
    protocol._host = lambda: host  # type: ignore[assignment]
    os.environ["COMPILE_CACHE_BROADCAST_SCOPE"] = "node"
    store = ctx.root / "node" / f"store-{host}"
    x = _tokens()
    if ctx.rank == 0:  # e.g. a pipeline stage without compiled regions, or no store
        model = _model(16)
        compile_cache.compile_regions(model, cache_dir=False, backend="aot_eager")
    else:
        model = _model(32)
        compile_cache.compile_regions(model, cache_dir=store, backend="aot_eager")
    ref = _eager(model, x)
    seeded = None
    if ctx.rank == 2:
        seeded = _seed(model, x, "hostB")
        ctx.kv.set("test/seeded", "1")
    else:
        ctx.kv.wait(["test/seeded"], datetime.timedelta(seconds=T))
    report = _warm(model, x, mode="broadcast", timeout=T)
    del os.environ["COMPILE_CACHE_BROADCAST_SCOPE"]
    last = compile_cache.last_report()
    return {"warm_up": report, "max_diff": _diff(model, x, ref), "seeded": seeded,
            "packs_A": _packs(ctx.root / "node" / "store-hostA"),
            "restored_packs": last.restored_packs if last is not None and ctx.rank else 0}


SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    f.__name__: f for f in (off_mode, different_models, leader_raises, twice_then_extra, abandon,
                            node_scope)
}


def _main(rank: int, world: int, port: int, root: Path, scenarios: list[str]) -> None:
    import torch
    import torch.distributed as dist

    kv = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                       timeout=datetime.timedelta(seconds=JOB_TIMEOUT))
    dist.init_process_group("gloo", store=kv, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=JOB_TIMEOUT))
    results: dict[str, Any] = {}
    for name in scenarios:
        started = time.monotonic()
        results[name] = SCENARIOS[name](Ctx(rank, world, root, kv))
        results[name]["seconds"] = time.monotonic() - started
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)  # the ranks' own collectives still pair after the warm-up
        results[name]["all_reduce"] = float(total)
    (root / f"result{rank}.json").write_text(json.dumps(results))
    os._exit(0)  # skip process-group teardown


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]),
          sys.argv[5].split(","))
