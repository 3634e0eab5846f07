"""What a second thread of the same process costs a job thread that imports.

A fresh node's restore from object storage runs its requests, expansion and checks on a thread
of its own while the job's thread imports torch's code cache (``session.restore``): the two
overlap. This measures the overlap's price on this machine, without a store or a server: the
import of ``torch._inductor.codecache`` (after ``torch._dynamo``, as in a start), in a fresh
process per sample (new TMPDIR, HOME, XDG_CACHE_HOME, Inductor and Triton dirs), beside a
thread that does

  none      nothing (no thread)
  one       one SHA-256 of 3 MiB: one call, the GIL released inside
  chunks    the same hash in 48 calls of 64 KiB: 48 returns to the GIL
  sleeps    48 sleeps of 0.1 ms: 48 returns to the GIL, and next to no work
  python    5 ms of Python (it holds the GIL)

and prints, per mode, the import's wall and CPU time (medians) and their excess over ``none``.
Samples alternate between the modes.

    python benchmarks/gil_contention.py --repeats 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fresh_node_env  # noqa: E402

MODES = ("none", "one", "chunks", "sleeps", "python")
CALLS = 48


def _child(mode: str) -> None:
    import hashlib
    import threading
    import time

    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401

    blob = os.urandom(1 << 16) * CALLS

    def work() -> None:
        if mode == "one":
            hashlib.sha256(blob).digest()
        elif mode == "chunks":
            digest, view = hashlib.sha256(), memoryview(blob)
            for start in range(0, len(blob), 1 << 16):
                digest.update(view[start:start + (1 << 16)])
        elif mode == "sleeps":
            for _ in range(CALLS):
                time.sleep(0.0001)
        elif mode == "python":
            end = time.thread_time() + 0.005
            while time.thread_time() < end:
                pass

    thread = threading.Thread(target=work) if mode != "none" else None
    wall, cpu = time.perf_counter(), time.thread_time()
    if thread is not None:
        thread.start()
    import torch._inductor.codecache  # noqa: F401

    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    if thread is not None:
        thread.join()
    print("RESULT " + json.dumps({"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="samples per mode")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            base = tempfile.mkdtemp(prefix="gil_contention_")
            try:
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode],
                                      env=fresh_node_env(base), capture_output=True, text=True, timeout=600,
                                      check=True)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            samples[mode].append(json.loads(line[len("RESULT "):]))
    none_wall = statistics.median(s["wall_ms"] for s in samples["none"])
    none_cpu = statistics.median(s["cpu_ms"] for s in samples["none"])
    print(f"{'beside':8} {'wall ms':>8} {'cpu ms':>8} {'+wall':>7} {'+cpu':>7}   (import of torch's code "
          f"cache, medians of {args.repeats})")
    for mode in MODES:
        wall = statistics.median(s["wall_ms"] for s in samples[mode])
        cpu = statistics.median(s["cpu_ms"] for s in samples[mode])
        print(f"{mode:8} {wall:8.1f} {cpu:8.1f} {wall - none_wall:+7.1f} {cpu - none_cpu:+7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
