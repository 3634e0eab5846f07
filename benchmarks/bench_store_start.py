"""What a job's start costs against one big entry (issue 31.10): a store's ``load`` of the key.

* a directory store whose entry holds 1,100 packs, loaded under the default limit of 1,024 open
  files (``ulimit -n``; before issue 31 a load opened every pack at once);
* a store on object storage (moto's server on 127.0.0.1) whose entry holds 2 packs and 4,000
  use records, on a warm node (the local tier already has the packs: the start only lists).

Each figure is the median of ``--rounds`` loads, each with a fresh ``Store`` (as a new job's
start has). Usage: ``python benchmarks/bench_store_start.py [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the local S3 server of the tests

KEY = "be" * 16


def _timed_load(location: str) -> tuple[float, int, int]:
    """(seconds, packs loaded, errors counted) of one start's load."""
    from compile_cache.store import Store

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        store = Store(location)
        packs = store.load(KEY)
        for pack in packs:
            pack.close()
        seconds = time.perf_counter() - start
        errors = int(store.stats()["errors"])
    return seconds, len(packs), errors


def many_packs(root: Path, count: int, rounds: int) -> dict[str, object]:
    from compile_cache.store import Store

    store = Store(root)
    for n in range(count):
        store.publish(KEY, {f"inductor/graph-{n}": f"graph {n}".encode() * 8})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        runs = [_timed_load(str(root)) for _ in range(rounds)]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {"packs_in_entry": count, "seconds": statistics.median(r[0] for r in runs),
            "packs_loaded": runs[-1][1], "errors": runs[-1][2], "fd_limit": min(1024, hard)}


def many_uses(tmp: Path, count: int, rounds: int) -> dict[str, object]:
    from _s3_server import S3Server, make_bucket

    from compile_cache.store import Store

    server = S3Server(tmp / "moto.log")
    try:
        os.environ.update(server.env())
        os.environ["COMPILE_CACHE_LOCAL_TIER"] = str(tmp / "tier")
        make_bucket(server, "start")
        url = "s3://start/cache"
        store = Store(url)
        for n in range(2):
            store.publish(KEY, {f"inductor/graph-{n}": b"graph" * 64})
        backend, layout = store.remote.backend, store.remote.layout
        for _ in range(count):
            backend.put(layout.use_object(KEY), b"")
        _timed_load(url)  # the local tier gets the packs: a warm node from here on
        runs = [_timed_load(url) for _ in range(rounds)]
    finally:
        server.stop()
    return {"use_records": count, "seconds": statistics.median(r[0] for r in runs),
            "packs_loaded": runs[-1][1], "errors": runs[-1][2]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--packs", type=int, default=1100)
    parser.add_argument("--uses", type=int, default=4000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    for name in list(os.environ):
        if name.startswith(("COMPILE_CACHE_", "AWS_")):
            del os.environ[name]
    with tempfile.TemporaryDirectory(prefix="cc-start-") as tmp:
        out = {"many_packs": many_packs(Path(tmp) / "store", args.packs, args.rounds),
               "many_uses": many_uses(Path(tmp), args.uses, args.rounds)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, result in out.items():
            print(name, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
