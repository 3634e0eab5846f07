"""Ranks share one compile (issue #5): 2 gloo ranks on CPU, each with its own empty Inductor dir.

Every job runs as plain subprocesses (this file with ``--child``) joined through a TCPStore that
the test process hosts (as torchrun's agent does), so a rank that dies does not take the store
with it. All jobs start together in one module fixture to share the machine's two cores; every
wait has a timeout so a deadlock fails instead of hanging CI. Real Inductor compiles: one per
mode (shared, broadcast), on one tiny model; DDP/FSDP2 and the dying rank use ``aot_eager``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

JOB_TIMEOUT = 420  # seconds per job; far above the expected ~60 s, far below CI's patience
WAIT = 6  # COMPILE_CACHE_WAIT_TIMEOUT of the job whose leader dies


# ---------------------------------------------------------------------------------------------
# Child side: runs in a fresh process, TORCHINDUCTOR_CACHE_DIR already set by the parent.


def _child(scenario: str, rank: int, world: int, port: int, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import compile_cache
    from compile_cache import distributed as ccd
    from compile_cache import prefetch
    from compile_cache.demo import TinyTransformer
    from compile_cache.distributed import steps
    from compile_cache.torch_compat.dynamo import CompileCounters

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    result: dict[str, Any] = {"rank": rank}
    if scenario in ("shared", "broadcast"):
        torch.manual_seed(0)
        model = TinyTransformer(layers=2, width=64, heads=2, vocab=128).eval()
        x = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(x)
        compile_cache.compile_regions(model, example_inputs=(x,), distributed=scenario)
        with torch.no_grad():
            out1 = model(x)
        result["max_diff"] = (out1 - ref).abs().max().item()
        result["warm_up"] = ccd.last_warm_up().to_dict()
        result["report"] = compile_cache.last_report().to_dict()
        result["counters"] = CompileCounters.snapshot().as_dict()
        result["stats"] = compile_cache.region_stats(model)
        run = prefetch.current()
        result["prefetch"] = None if run is None else {"built": run.built, "planned": run.planned}
    elif scenario == "parallel":
        result.update(_train_ddp_fsdp(rank, world))
    elif scenario == "die":
        torch.manual_seed(0)
        model = TinyTransformer(layers=2, width=32, heads=2, vocab=64).eval()
        x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(x)
        if rank == 0:  # the leader dies while it holds the store's lock for the key
            def die(*args: Any, **kwargs: Any) -> None:
                os._exit(17)

            steps.local = die
        start = time.monotonic()
        compile_cache.compile_regions(model, example_inputs=(x,), backend="aot_eager")
        with torch.no_grad():
            result["max_diff"] = (model(x) - ref).abs().max().item()
        result["seconds"] = time.monotonic() - start
        result["warm_up"] = ccd.last_warm_up().to_dict()
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # skip process-group teardown (a dead peer would make it wait)


def _train_ddp_fsdp(rank: int, world: int) -> dict[str, Any]:
    """One SGD-free training step (loss.backward) under DDP and under FSDP2, compiled regions
    applied *before* the wrapper (with a training warm-up), against the same uncompiled setup."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import compile_cache
    from compile_cache.demo import TinyTransformer

    out: dict[str, Any] = {}
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 + rank))

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return m(x).float().pow(2).mean()

    # DDP
    torch.manual_seed(0)
    model = TinyTransformer(layers=2, width=32, heads=2, vocab=64).train()
    ref = copy.deepcopy(model)
    compile_cache.compile_regions(model, backend="aot_eager", example_inputs=(x,))
    out["grads_none_after_warm_up"] = all(p.grad is None for p in model.parameters())
    ddp, ddp_ref = DDP(model), DDP(ref)
    loss_of(ddp).backward()
    loss_of(ddp_ref).backward()
    out["ddp_grad_diff"] = max(
        (a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    )
    out["ddp_eager_calls"] = sum(s["eager_calls"] for s in compile_cache.region_stats(model).values())
    out["ddp_groups"] = len(compile_cache.region_stats(model))

    # FSDP2
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = TinyTransformer(layers=2, width=32, heads=2, vocab=64).train()
    ref = copy.deepcopy(model)
    compile_cache.compile_regions(model, backend="aot_eager", example_inputs=(x,))
    for m in (model, ref):
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    hooks_fired = []
    model.blocks[0].register_forward_pre_hook(lambda mod, args: hooks_fired.append(1))
    loss_of(model).backward()
    loss_of(ref).backward()
    out["fsdp_grad_diff"] = max(
        (a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    )
    out["fsdp_eager_calls"] = sum(s["eager_calls"] for s in compile_cache.region_stats(model).values())
    out["fsdp_cache_entries"] = sum(s["cache_entries"] for s in compile_cache.region_stats(model).values())
    return out


# ---------------------------------------------------------------------------------------------
# Parent side


class Job:
    """Two ranks of one scenario, started now; :meth:`results` waits with a timeout."""

    def __init__(self, root: Path, scenario: str, env: dict[str, str], shared_store: bool) -> None:
        import datetime

        import torch.distributed as dist

        self.root = root
        self.scenario = scenario
        root.mkdir(parents=True)
        # The rendezvous store lives here (as torchrun's agent hosts it), port chosen by the OS.
        self.store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=JOB_TIMEOUT))
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        self.started = time.monotonic()
        for rank in range(2):
            child_env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILE_CACHE_", "TORCH"))}
            child_env.update(
                TORCHINDUCTOR_CACHE_DIR=str(root / f"inductor{rank}"),
                COMPILE_CACHE_DIR=str(root / ("store" if shared_store else f"store{rank}")),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(Path(__file__).resolve().parents[1]),
                **env,
            )
            log = open(root / f"log{rank}.txt", "w")  # noqa: SIM115 - closed in results()
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "--child", scenario, str(rank), "2", str(self.store.port),
                 str(root / f"result{rank}.json")],
                env=child_env, stdout=log, stderr=subprocess.STDOUT,
            ))

    def results(self) -> list[dict[str, Any] | None]:
        deadline = self.started + JOB_TIMEOUT
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for p in self.procs:
                    p.kill()
                raise AssertionError(f"{self.scenario}: ranks still running after {JOB_TIMEOUT} s "
                                     f"(deadlock?)\n{self.tail()}") from None
        for log in self.logs:
            log.close()
        self.codes = codes
        out = []
        for rank in range(2):
            path = self.root / f"result{rank}.json"
            out.append(json.loads(path.read_text()) if path.exists() else None)
        return out

    def tail(self) -> str:
        return "\n".join(
            f"--- rank {r}\n" + (self.root / f"log{r}.txt").read_text()[-3000:] for r in range(2)
        )


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """All two-rank jobs, started at once; each test collects its own (with its timeout)."""
    root = tmp_path_factory.mktemp("dist")
    started = {
        "shared": Job(root / "shared", "shared", {}, shared_store=True),
        "broadcast": Job(root / "broadcast", "broadcast", {}, shared_store=False),
        "parallel": Job(root / "parallel", "parallel", {}, shared_store=True),
        "die": Job(root / "die", "die", {"COMPILE_CACHE_LOCK": "mkdir",
                                         "COMPILE_CACHE_WAIT_TIMEOUT": str(WAIT)}, shared_store=True),
    }
    class Lazy(dict):
        def __missing__(self, name: str) -> Any:
            job = started[name]
            self[name] = (job, job.results())
            return self[name]

    return Lazy()


def _ok(job: Job, results: list[dict[str, Any] | None], ranks: tuple[int, ...] = (0, 1)) -> None:
    for r in ranks:
        assert job.codes[r] == 0 and results[r] is not None, f"rank {r} failed\n{job.tail()}"


def test_shared_directory_one_rank_compiles_the_other_restores(jobs: dict[str, Any]) -> None:
    job, (r0, r1) = jobs["shared"]
    _ok(job, [r0, r1])
    assert r0["warm_up"]["role"] == "leader" and r1["warm_up"]["role"] == "follower"
    assert r0["counters"]["fxgraph_miss"] >= 1
    assert r0["report"]["published_packs"] >= 1
    assert r1["counters"]["fxgraph_miss"] == 0, r1  # rank 1 compiled nothing
    # ...and ran the leader's code: every graph it traced was a hit in the restored FX-graph
    # cache (precompile is off by default, so Dynamo traces)
    assert r1["counters"]["fxgraph_hit"] >= 1 and r1["report"]["precompile_hits"] == 0, r1
    assert r1["report"]["restored_packs"] >= 1 and r1["report"]["published_packs"] == 0
    for r in (r0, r1):
        assert r["max_diff"] < 1e-4
        assert all(s["eager_calls"] == 0 for s in r["stats"].values())
    # Only the compiling rank builds Inductor's ISA probe libraries ahead; the follower's come
    # with the leader's packs, so it spends no CPU on them while the leader compiles.
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        assert r0["prefetch"] is not None and r0["prefetch"]["built"] >= 1, r0["prefetch"]
    assert r1["prefetch"] is None, r1["prefetch"]


def test_broadcast_separate_stores(jobs: dict[str, Any]) -> None:
    job, (r0, r1) = jobs["broadcast"]
    _ok(job, [r0, r1])
    assert r0["warm_up"]["role"] == "source" and r1["warm_up"]["role"] == "receiver"
    assert r1["warm_up"]["received_packs"] >= 1
    assert r0["counters"]["fxgraph_miss"] >= 1
    assert r1["counters"]["fxgraph_miss"] == 0, r1
    assert r1["counters"]["fxgraph_hit"] >= 1 and r1["warm_up"]["precompile_hits"] == 0, r1
    for r in (r0, r1):
        assert r["max_diff"] < 1e-4
    # rank 1's own store now holds the same pack(s): content-addressed, same names
    packs = [sorted(p.name for p in (job.root / f"store{i}").rglob("*.pack")) for i in range(2)]
    assert packs[0] and packs[0] == packs[1]


def test_ddp_and_fsdp2_after_compile_regions_match_uncompiled(jobs: dict[str, Any]) -> None:
    job, results = jobs["parallel"]
    _ok(job, results)
    for r in results:
        assert r["grads_none_after_warm_up"]
        assert r["ddp_grad_diff"] < 1e-5 and r["ddp_eager_calls"] == 0 and r["ddp_groups"] >= 1
        assert r["fsdp_grad_diff"] < 1e-5 and r["fsdp_eager_calls"] == 0
        assert r["fsdp_cache_entries"] >= 1


def test_rank_dying_with_the_lock_does_not_hang_the_others(jobs: dict[str, Any]) -> None:
    job, (r0, r1) = jobs["die"]
    assert job.codes[0] == 17 and r0 is None  # died inside its compile, lock held
    _ok(job, [r0, r1], ranks=(1,))
    assert r1["warm_up"]["role"] == "follower"
    assert any("compiling here" in n for n in r1["warm_up"]["notes"])
    assert r1["max_diff"] < 1e-4
    # waited once for the leader and once at the barrier, then went on: bounded by the timeout
    assert r1["warm_up"]["waited_seconds"] < 2 * WAIT + 10
    assert list((job.root / "store").rglob("*.lockdir")), "the dead leader's lock stays on disk"


# ---------------------------------------------------------------------------------------------
# In-process checks (no subprocess)


def test_warm_up_restores_training_state(tmp_path: Path) -> None:
    import torch

    import compile_cache
    from compile_cache.demo import TinyTransformer

    model = TinyTransformer(layers=2, width=16, heads=2, vocab=32)
    model.add_module("bn", torch.nn.BatchNorm1d(4))  # a buffer a training forward would move
    model.eval()
    compile_cache.compile_regions(model, cache_dir=False, backend="eager")
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    grad_object = first.grad
    tokens = torch.randint(0, 32, (1, 4))
    rng = torch.get_rng_state()
    report = compile_cache.warm_up(model, tokens, train=True)
    assert report.role == "single"
    assert not model.training and not any(m.training for m in model.modules())
    assert first.grad is grad_object and torch.equal(first.grad, torch.ones_like(first))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    assert torch.equal(torch.get_rng_state(), rng)


def test_hazards_name_threads_devices_and_env_fields(fresh_state: None) -> None:
    from compile_cache import distributed as ccd

    infos = [
        {"threads": 8, "device": "cuda:0", "env": {"torch": "2.13", "cpu_threads": "8"}},
        {"threads": 4, "device": "cuda:3", "env": {"torch": "2.12", "cpu_threads": "4"}},
    ]
    with pytest.warns(RuntimeWarning):
        hazards = ccd.check_hazards(infos)
    text = " ".join(hazards)
    assert "set_num_threads" in text and "--virtual-local-rank" in text and "['torch']" in text
    assert ccd.check_hazards([infos[0], infos[0]]) == []


def test_mode_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    from compile_cache import ConfigError
    from compile_cache import distributed as ccd

    monkeypatch.delenv("COMPILE_CACHE_DISTRIBUTED", raising=False)
    assert ccd.resolve_mode() == "shared"
    monkeypatch.setenv("COMPILE_CACHE_DISTRIBUTED", "broadcast")
    assert ccd.resolve_mode() == "broadcast" and ccd.resolve_mode("off") == "off"
    with pytest.raises(ConfigError):
        ccd.resolve_mode("nfs")


def test_publish_skips_members_the_key_already_holds_by_content(tmp_path: Path) -> None:
    """A rank that compiled the same graphs adds no duplicate of what the store holds; a file
    of the same name with other bytes is a new version, kept (issue 12: dedupe by content)."""
    from compile_cache.demo import TinyTransformer
    from compile_cache.session import CacheSession
    from compile_cache.store import Store

    store = Store(tmp_path / "store")
    key = "ab" * 16
    session = CacheSession(store, key, TinyTransformer(layers=1, width=8, heads=1, vocab=8), False)

    class FakeCapture:
        def __init__(self, members: dict[str, bytes]) -> None:
            self.members = members

        def collect(self) -> dict[str, bytes]:
            return self.members

    first = {"inductor/fxgraph/aa/x/entry": b"rank0", "inductor/xx/k.so": b"so0"}
    session.publishing.publish_diff(FakeCapture(first))  # type: ignore[arg-type]
    session.publishing.publish_diff(FakeCapture(first))  # type: ignore[arg-type]
    assert session.report.published_packs == 1
    session.publishing.publish_diff(FakeCapture({"inductor/xx/k.so": b"so1", "inductor/yy/new.so": b"n"}))  # type: ignore[arg-type]
    assert session.report.published_packs == 2
    (pack,) = [p for p in store.entry(key).packs if "inductor/yy/new.so" in p.member_names]
    assert set(pack.member_names) == {"inductor/xx/k.so", "inductor/yy/new.so"}
    assert session.known_members() >= {"inductor/yy/new.so", "inductor/xx/k.so"}


def test_cross_rank_hazards_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from compile_cache.distributed import cross_rank_hazards

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    hazards = cross_rank_hazards()
    assert any("set_num_threads" in h for h in hazards)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    monkeypatch.setenv("LOCAL_RANK", "1")
    hazards = cross_rank_hazards()
    assert isinstance(hazards, list)
    if not torch.cuda.is_available():
        assert hazards == []
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads() + 3))
    assert any("OMP_NUM_THREADS" in h for h in cross_rank_hazards())


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--child":
    _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
