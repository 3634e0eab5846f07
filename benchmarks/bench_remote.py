"""Fresh-node time to first output restoring from object storage vs from a local directory store.

GPT-2 from transformers (random weights), CPU, batch 1 x ``--seq``, ``torch.no_grad()``,
``compile_cache.compile_regions``. One cold start publishes into a directory store; its entries
are exported and imported into ``s3://bench/cache`` on moto's S3 server (started here on
127.0.0.1), so both stores hold the same packs. Then, alternately, ``--repeats`` fresh nodes
restore from each (every node: new TMPDIR, HOME, XDG_CACHE_HOME, Inductor and Triton dirs, and a
new, empty local tier for the S3 store), side by side in one run:

  dir node     COMPILE_CACHE_DIR=<directory>      (NFS/Lustre-style shared directory)
  s3 node      COMPILE_CACHE_DIR=s3://bench/cache (packs zstd-compressed, the default; the local
               tier starts empty: every pack is downloaded)
  s3 raw node  COMPILE_CACHE_DIR=s3://bench/raw   (the same packs uncompressed, as before issue 39)

It reports each one's median TTFO (compile call to end of first forward) and whole-process time,
the FX-graph misses (0 on a real hit), the bytes each start moved (S3: downloaded + uploaded,
from the local tier's counters; directory: the pack bytes restored) and the ratio s3 / dir.
It also times, in a fresh process, importing the S3 client and making it (``client_import_s``).
Goals (issue 39): s3 / dir <= 1.05; bytes moved per fresh node raw / compressed >= 3.

    python benchmarks/bench_remote.py                         # GPT-2 4x256
    python benchmarks/bench_remote.py --models 2x64 --seq 16 --repeats 1   # smoke test
    python benchmarks/bench_remote.py --levels /path/to/a/store            # zstd level table
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import build_gpt2, machine, parse_model_spec, prime_precompiled_header, run_child  # noqa: E402

GOAL = 1.05
BYTES_GOAL = 3.0
URL = "s3://bench/cache"
RAW_URL = "s3://bench/raw"
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
          "AWS_DEFAULT_REGION": "us-east-1"}


def _child(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    import torch

    import compile_cache

    model, tokens = build_gpt2(args.layers, args.width, max(1, args.width // 64), args.seq)
    setup_s = time.perf_counter() - started
    with torch.no_grad():
        t0 = time.perf_counter()
        compile_cache.compile_regions(model, cache_dir=args.store)
        model(tokens, use_cache=False)
        ttfo = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    report = compile_cache.last_report()
    return {"ttfo_s": ttfo, "setup_s": setup_s, "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
            "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
            "restored_bytes": report.restored_bytes if report else 0,
            "published_packs": report.published_packs if report else 0,
            "s3fs_imported": "s3fs" in sys.modules}  # the small S3 client needs none of it


class _Moto:
    """moto's S3 server on a free port of 127.0.0.1, in its own process group."""

    def __init__(self, log: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self._log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start (see {log})") from None
                time.sleep(0.1)
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/bench", method="PUT"), timeout=10).close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        self._log.close()


def _node_env(base: str, server: _Moto, store: str) -> dict[str, str]:
    """A fresh node: everything machine-wide torch keeps is new and empty."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILE_CACHE_", "AWS_"))}
    for name in ("tmp", "home", "xdg", "inductor", "triton", "tier"):
        os.makedirs(os.path.join(base, name), exist_ok=True)
    env.update(S3_ENV, AWS_ENDPOINT_URL=server.endpoint, TMPDIR=os.path.join(base, "tmp"),
               HOME=os.path.join(base, "home"), XDG_CACHE_HOME=os.path.join(base, "xdg"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(base, "inductor"),
               TRITON_CACHE_DIR=os.path.join(base, "triton"),
               COMPILE_CACHE_LOCAL_TIER=os.path.join(base, "tier"), COMPILE_CACHE_DIR=store)
    return env


def _start(args: argparse.Namespace, model: str, base: str, server: _Moto, store: str) -> dict:
    layers, width = parse_model_spec(model)
    argv = [os.path.abspath(__file__), "--child", "--layers", str(layers), "--width", str(width),
            "--seq", str(args.seq), "--store", store]
    result = run_child(argv, _node_env(base, server, store), timeout=args.timeout)
    if store.startswith("s3://"):
        from compile_cache.store import Store
        from compile_cache.store.remote import local_tier_dir

        previous = os.environ.get("COMPILE_CACHE_LOCAL_TIER")
        os.environ["COMPILE_CACHE_LOCAL_TIER"] = os.path.join(base, "tier")
        try:
            counts = Store(local_tier_dir(store)).stats()
        finally:
            if previous is None:
                os.environ.pop("COMPILE_CACHE_LOCAL_TIER")
            else:
                os.environ["COMPILE_CACHE_LOCAL_TIER"] = previous
        result["bytes_moved"] = counts["bytes_downloaded"] + counts["bytes_uploaded"]
        result["remote_errors"] = counts["remote_errors"]
        result["downloads"] = counts["remote_downloads"]
    else:
        result["bytes_moved"] = result["restored_bytes"]
    return result


def _copy_to_s3(directory: str, server: _Moto, work: str, url: str = URL, level: str = "3") -> None:
    """The directory store's entries into ``url`` (export, then import: both CLIs' code), packs
    compressed at zstd ``level`` (0: as they are)."""
    from compile_cache.store import Store

    archive = os.path.join(work, f"entries-{level}.tar")
    saved = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL", "COMPILE_CACHE_LOCAL_TIER",
                                            "COMPILE_CACHE_PACK_COMPRESSION")}
    os.environ["COMPILE_CACHE_PACK_COMPRESSION"] = level
    Store(directory).export(archive)
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=server.endpoint,
                      COMPILE_CACHE_LOCAL_TIER=os.path.join(work, f"import-tier-{level}"))
    try:
        Store(url).import_archive(archive)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _summary(runs: list[dict]) -> dict:
    ttfo = [r["ttfo_s"] for r in runs]
    return {"ttfo_s": statistics.median(ttfo), "ttfo_samples": [round(t, 3) for t in ttfo],
            "process_s": statistics.median(r["process_s"] for r in runs),
            "fxgraph_miss": max(r["fxgraph_miss"] for r in runs),
            "fxgraph_hit": min(r["fxgraph_hit"] for r in runs),
            "bytes_moved": statistics.median(r["bytes_moved"] for r in runs),
            "remote_errors": sum(r.get("remote_errors", 0) for r in runs),
            "s3fs_imported": any(r.get("s3fs_imported") for r in runs)}


_IMPORT_PROBE = """
import time, json
t0 = time.perf_counter()
from compile_cache.store.backends.clients import open_backend
t1 = time.perf_counter()
backend = open_backend("s3://bench/cache")
t2 = time.perf_counter()
backend.list("v1/stats")
t3 = time.perf_counter()
import sys
print(json.dumps({"client": backend.client, "import_s": t1 - t0, "make_s": t2 - t1,
                  "first_request_s": t3 - t2, "s3fs_imported": "s3fs" in sys.modules}))
"""


def _client_import(server: _Moto, repeats: int) -> dict:
    """Importing and making the S3 client in a fresh process, then its first request (median)."""
    samples = []
    for _i in range(max(1, repeats)):
        with tempfile.TemporaryDirectory(prefix="bench_remote_import_") as base:
            env = _node_env(base, server, URL)
            done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], env=env, capture_output=True,
                                  text=True, timeout=120, check=True)
            samples.append(json.loads(done.stdout.strip().splitlines()[-1]))
    out = {k: statistics.median(s[k] for s in samples) for k in ("import_s", "make_s", "first_request_s")}
    out.update(client=samples[0]["client"], s3fs_imported=any(s["s3fs_imported"] for s in samples))
    return out


def levels(stores: list[str], count: int = 12) -> list[dict]:
    """Ratio and one-core speed of zstd levels (and zlib/lzma level 1 for reference) on the
    ``count`` largest packs under ``stores``: what chose COMPILE_CACHE_PACK_COMPRESSION's default."""
    import lzma
    import zlib
    from pathlib import Path

    from compile_cache.store import compression

    paths = sorted((p for d in stores for p in Path(d).rglob("*.pack") if p.is_file()),
                   key=lambda p: p.stat().st_size, reverse=True)[:count]
    data = [p.read_bytes() for p in paths]
    raw = sum(map(len, data))
    z = compression.zstd()
    codecs = [(f"zstd {lv}", lambda b, lv=lv: compression.compress(b, lv), z.decompress) for lv in (1, 3, 6, 9, 12, 19)]
    codecs += [("zlib 1", lambda b: zlib.compress(b, 1), zlib.decompress),
               ("lzma 1", lambda b: lzma.compress(b, preset=1), lzma.decompress)]
    rows = []
    for name, comp, decomp in codecs:
        t0 = time.perf_counter()
        packed = [comp(b) for b in data]
        t1 = time.perf_counter()
        for b in packed:
            decomp(b)
        t2 = time.perf_counter()
        rows.append({"codec": name, "packs": len(data), "raw_bytes": raw, "ratio": raw / sum(map(len, packed)),
                     "compress_mb_s": raw / (t1 - t0) / 1e6, "decompress_mb_s": raw / (t2 - t1) / 1e6})
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    prime_precompiled_header()
    with tempfile.TemporaryDirectory(prefix="bench_remote_") as work:
        server = _Moto(os.path.join(work, "moto.log"))
        try:
            for model in args.models:
                directory = os.path.join(work, model, "dir-store")
                print(f"[{model}] cold start publishing into a directory store", file=sys.stderr, flush=True)
                cold = _start(args, model, os.path.join(work, model, "cold"), server, directory)
                _copy_to_s3(directory, server, os.path.join(work, model))
                _copy_to_s3(directory, server, os.path.join(work, model), RAW_URL, "0")
                runs: dict[str, list[dict]] = {"dir node": [], "s3 node": [], "s3 raw node": []}
                for i in range(max(1, args.repeats)):
                    for scenario, store in (("dir node", directory), ("s3 node", URL), ("s3 raw node", RAW_URL)):
                        base = os.path.join(work, model, f"{scenario.replace(' ', '-')}-{i}")
                        result = _start(args, model, base, server, store)
                        print(f"[{model}] {scenario} #{i}: TTFO {result['ttfo_s']:.2f} s, "
                              f"{result['bytes_moved']} bytes moved", file=sys.stderr, flush=True)
                        runs[scenario].append(result)
                dir_row, s3_row = _summary(runs["dir node"]), _summary(runs["s3 node"])
                raw_row = _summary(runs["s3 raw node"])
                ratio = s3_row["ttfo_s"] / dir_row["ttfo_s"] if dir_row["ttfo_s"] else None
                fewer = raw_row["bytes_moved"] / s3_row["bytes_moved"] if s3_row["bytes_moved"] else None
                rows.append({"model": model, "cold_ttfo_s": cold["ttfo_s"], "dir": dir_row, "s3": s3_row,
                             "s3_raw": raw_row, "ratio": ratio,
                             "raw_ratio": raw_row["ttfo_s"] / dir_row["ttfo_s"] if dir_row["ttfo_s"] else None,
                             "goal_met": ratio is not None and ratio <= GOAL,
                             "bytes_fewer": fewer, "bytes_goal_met": fewer is not None and fewer >= BYTES_GOAL})
            rows.append({"client_import": _client_import(server, args.repeats)})
        finally:
            server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["4x256"], help="LAYERSxWIDTH GPT-2 shapes")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="fresh nodes per store (median)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--levels", nargs="+", metavar="STORE",
                        help="only measure zstd levels on the largest packs of these directory stores")
    args = parser.parse_args(argv)
    if args.levels:
        table = levels(args.levels)
        if args.json:
            print(json.dumps(table, indent=2))
        for r in table:
            print(f"{r['codec']:8} ratio {r['ratio']:6.2f}  compress {r['compress_mb_s']:7.0f} MB/s  "
                  f"decompress {r['decompress_mb_s']:7.0f} MB/s  ({r['packs']} packs, {r['raw_bytes']} bytes)")
        return 0
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    rows = run(args)
    probe = next((r["client_import"] for r in rows if "client_import" in r), None)
    rows = [r for r in rows if "client_import" not in r]
    data = {"benchmark": "remote", "machine": machine(), "seq": args.seq, "repeats": args.repeats,
            "goal": GOAL, "bytes_goal": BYTES_GOAL, "rows": rows, "client_import": probe}
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{'model':8} {'store':9} {'TTFO s':>8} {'process s':>10} {'FX miss':>8} {'bytes moved':>12}")
    for row in rows:
        for label in ("dir", "s3", "s3_raw"):
            r = row[label]
            print(f"{row['model']:8} {label:9} {r['ttfo_s']:8.2f} {r['process_s']:10.2f} "
                  f"{r['fxgraph_miss']:8d} {int(r['bytes_moved']):12d}")
        verdict = "met" if row["goal_met"] else "NOT met"
        print(f"{row['model']:8} ratio s3 / dir = {row['ratio']:.3f} (goal <= {GOAL}: {verdict})")
        print(f"{row['model']:8} bytes raw / compressed = {row['bytes_fewer']:.2f} (goal >= {BYTES_GOAL})")
    if probe:
        print(f"client {probe['client']}: import {probe['import_s']:.3f} s, make {probe['make_s']:.3f} s, "
              f"first request {probe['first_request_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
