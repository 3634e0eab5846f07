"""Store stress: N processes x R rounds of publish/load/restore, plus K SIGKILLed publishers.

    .venv/bin/python benchmarks/stress_store.py --processes 6 --rounds 20 --kills 40

Store layer only (synthetic 1-3 MiB members, no torch.compile). Prints what was lost: packs that
a reader saw half-written or corrupt, worker exceptions, verify findings after fix (goal: 0).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compile_cache import artifacts  # noqa: E402
from compile_cache.store import Store, StoreWarning  # noqa: E402

CTX = mp.get_context("fork")


def members_for(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"inductor/fx/{seed}/{i}": rng.randbytes(rng.randrange(1 << 20, 3 << 20)) for i in range(2)}


def worker(root: str, n: int, rounds: int, scratch: str) -> None:
    warnings.simplefilter("error", StoreWarning)
    store = Store(root)
    for r in range(rounds):
        seed = (n + r) % 4  # 4 contents shared by everyone: heavy same-content races
        key = f"{seed:02x}" * 16
        content = members_for(seed)
        with store.lock(key, timeout=60):
            for pack in store.load(key):
                assert pack.members == content
                artifacts.restore(pack.members, dirs={"inductor": Path(scratch) / f"{n}-{r}"})
            store.publish(key, content)


def publisher(root: str, seed: int) -> None:
    store = Store(root)
    for i in range(10_000):
        key = f"{(seed + i) % 4 + 4:02x}" * 16
        with store.lock(key, timeout=60):
            store.publish(key, {f"inductor/k{seed}/{i}": os.urandom(2 << 20)})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--kills", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "store")
        Store(root)
        t0 = time.time()
        procs = [CTX.Process(target=worker, args=(root, n, args.rounds, tmp)) for n in range(args.processes)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        failed = sum(p.exitcode != 0 for p in procs)
        rng = random.Random(7)
        for k in range(args.kills):
            p = CTX.Process(target=publisher, args=(root, k))
            p.start()
            time.sleep(rng.uniform(0.02, 0.5))
            os.kill(p.pid, signal.SIGKILL)
            p.join(30)
        store = Store(root)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            packs = sum(len(store.load(e.key)) for e in store.entries())
        s = store.stats()
        store.verify(fix=True, temp_age=0)
        after = store.verify(temp_age=0)
        print(f"processes={args.processes} rounds={args.rounds} kills={args.kills} "
              f"seconds={time.time() - t0:.1f}")
        print(f"worker failures={failed} visible packs={packs} corrupt={s['corrupt']} "
              f"store warnings={len(record)} errors={s['errors']} verify-after-fix ok={after.ok}")
        lost = failed + s["corrupt"] + len(record) + (not after.ok)
        print(f"lost={lost}")
        return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
