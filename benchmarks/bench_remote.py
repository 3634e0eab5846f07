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
  gcs node     COMPILE_CACHE_DIR=gs://bench/cache (the small GCS client, on gcp-storage-emulator;
               compressed)
  azure node   COMPILE_CACHE_DIR=az://bench/cache (the small Azure Blob client, on Azurite's blob
               service; compressed)

The two emulators are the tests' (tests/_object_emulators.py: gcp-storage-emulator from the test
extra, Azurite from ``make install``); ``--no-emulators`` leaves them out.

It reports each one's median TTFO (compile call to end of first forward) and whole-process time,
the FX-graph misses (0 on a real hit), the bytes each start moved (S3: downloaded + uploaded,
from the local tier's counters; directory: the pack bytes restored) and the ratio s3 / dir.
Each store's ratio to the directory store is given as the ratio of medians and as the median of
the paired ratios (node i of a store / dir node i, run back to back: steadier on a loaded machine).
``server_cpu_s``: the CPU seconds the emulator serving a node used during that node's process
(median): the emulators share this machine's cores with the node, as a real store's servers do
not. It also times, in a fresh process, importing each client and making it (``client_import``):
the small clients, and gcsfs and adlfs (``COMPILE_CACHE_REMOTE_CLIENT=fsspec``) for comparison.
Goals (issue 39): object storage / dir <= 1.05; bytes moved per fresh node raw / compressed >= 3.
The package is byte-compiled first, as an install is (``--no-byte-compile``: not, as before).

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
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from _common import build_gpt2, machine, parse_model_spec, prime_precompiled_header, run_child  # noqa: E402

GOAL = 1.05
BYTES_GOAL = 3.0
URL = "s3://bench/cache"
RAW_URL = "s3://bench/raw"
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
          "AWS_DEFAULT_REGION": "us-east-1"}
GCS_URL = "gs://bench/cache"
AZ_URL = "az://bench/cache"
#: The emulators' client settings (STORAGE_EMULATOR_HOST, AZURE_STORAGE_CONNECTION_STRING...),
#: given to every node once they run.
EMULATOR_ENV: dict[str, str] = {}


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


class MotoServer:
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


def node_env(base: str, server: MotoServer, store: str) -> dict[str, str]:
    """A fresh node: everything machine-wide torch keeps is new and empty."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILE_CACHE_", "AWS_"))}
    for name in ("tmp", "home", "xdg", "inductor", "triton", "tier"):
        os.makedirs(os.path.join(base, name), exist_ok=True)
    env.update(S3_ENV, **EMULATOR_ENV, AWS_ENDPOINT_URL=server.endpoint, TMPDIR=os.path.join(base, "tmp"),
               HOME=os.path.join(base, "home"), XDG_CACHE_HOME=os.path.join(base, "xdg"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(base, "inductor"),
               TRITON_CACHE_DIR=os.path.join(base, "triton"),
               COMPILE_CACHE_LOCAL_TIER=os.path.join(base, "tier"), COMPILE_CACHE_DIR=store)
    return env


def start_node(args: argparse.Namespace, model: str, base: str, server: MotoServer, store: str) -> dict:
    layers, width = parse_model_spec(model)
    argv = [os.path.abspath(__file__), "--child", "--layers", str(layers), "--width", str(width),
            "--seq", str(args.seq), "--store", store]
    result = run_child(argv, node_env(base, server, store), timeout=args.timeout)
    if "://" in store:
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


def copy_store(directory: str, server: MotoServer, work: str, url: str = URL, level: str = "3") -> None:
    """The directory store's entries into ``url`` (export, then import: both CLIs' code), packs
    compressed at zstd ``level`` (0: as they are)."""
    from compile_cache.store import Store

    archive = os.path.join(work, f"entries-{level}.tar")
    saved = {k: os.environ.get(k) for k in (*S3_ENV, *EMULATOR_ENV, "AWS_ENDPOINT_URL",
                                            "COMPILE_CACHE_LOCAL_TIER", "COMPILE_CACHE_PACK_COMPRESSION")}
    os.environ["COMPILE_CACHE_PACK_COMPRESSION"] = level
    Store(directory).export(archive)
    os.environ.update(S3_ENV, **EMULATOR_ENV, AWS_ENDPOINT_URL=server.endpoint,
                      COMPILE_CACHE_LOCAL_TIER=os.path.join(work, f"import-tier-{level}-{url.split(':')[0]}"))
    try:
        Store(url).import_archive(archive)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _server_cpu_s(proc: subprocess.Popen | None) -> float:
    """CPU seconds (user + system) the emulator ``proc`` and its children used so far: the
    emulators run on this machine's cores, beside the node they serve (a real object store's
    servers do not)."""
    if proc is None or proc.poll() is not None:
        return 0.0
    import psutil

    total = 0.0
    try:
        root = psutil.Process(proc.pid)
        for p in (root, *root.children(recursive=True)):
            times = p.cpu_times()
            total += times.user + times.system
    except psutil.Error:
        pass
    return total


def _summary(runs: list[dict]) -> dict:
    ttfo = [r["ttfo_s"] for r in runs]
    return {"ttfo_s": statistics.median(ttfo), "ttfo_samples": [round(t, 3) for t in ttfo],
            "server_cpu_s": statistics.median(r.get("server_cpu_s", 0.0) for r in runs),
            "process_s": statistics.median(r["process_s"] for r in runs),
            "fxgraph_miss": max(r["fxgraph_miss"] for r in runs),
            "fxgraph_hit": min(r["fxgraph_hit"] for r in runs),
            "bytes_moved": statistics.median(r["bytes_moved"] for r in runs),
            "remote_errors": sum(r.get("remote_errors", 0) for r in runs),
            "s3fs_imported": any(r.get("s3fs_imported") for r in runs)}


def _paired(runs: list[dict], dirs: list[dict]) -> dict:
    """Node i of a store over dir node i (run back to back): the median and every pair."""
    pairs = [r["ttfo_s"] / d["ttfo_s"] for r, d in zip(runs, dirs, strict=True) if d["ttfo_s"]]
    return {"paired_ratio": statistics.median(pairs) if pairs else None,
            "paired_ratios": [round(p, 3) for p in pairs]}


_IMPORT_PROBE = """
import time, json
import sys
t0 = time.perf_counter()
from compile_cache.store.backends.clients import open_backend
t1 = time.perf_counter()
backend = open_backend(sys.argv[1])
t2 = time.perf_counter()
backend.list("v1/stats")
t3 = time.perf_counter()
import sys
print(json.dumps({"client": backend.client, "import_s": t1 - t0, "make_s": t2 - t1,
                  "first_request_s": t3 - t2, "s3fs_imported": "s3fs" in sys.modules,
                  "fsspec_imported": "fsspec" in sys.modules}))
"""


def _client_import(server: MotoServer, repeats: int, url: str = URL, **extra: str) -> dict:
    """Importing and making ``url``'s client in a fresh process (``open_backend``: the client's
    package and what it imports), then its first request (median); ``extra``: more settings."""
    samples = []
    for _i in range(max(1, repeats)):
        with tempfile.TemporaryDirectory(prefix="bench_remote_import_") as base:
            env = {**node_env(base, server, url), **extra}
            done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, url], env=env, capture_output=True,
                                  text=True, timeout=300, check=True)
            samples.append(json.loads(done.stdout.strip().splitlines()[-1]))
    out = {k: statistics.median(s[k] for s in samples) for k in ("import_s", "make_s", "first_request_s")}
    out.update(client=samples[0]["client"], s3fs_imported=any(s["s3fs_imported"] for s in samples),
               fsspec_imported=any(s["fsspec_imported"] for s in samples))
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


def start_emulators(work: str) -> list:
    """gcp-storage-emulator and Azurite on 127.0.0.1 with a ``bench`` bucket each; their client
    settings go into :data:`EMULATOR_ENV`."""
    from pathlib import Path

    from _object_emulators import AzuriteServer, GcsEmulator

    gcs = GcsEmulator(Path(work) / "gcs.log")
    try:
        azurite = AzuriteServer(Path(work) / "azurite.log")
    except Exception:
        gcs.stop()
        raise
    gcs.make_bucket("bench")
    azurite.make_container("bench")
    EMULATOR_ENV.update(gcs.env(), **azurite.env())
    return [gcs, azurite]


def _row(model: str, cold: dict, runs: dict[str, list[dict]]) -> dict:
    """One model's summary: every store's medians, its ratio to the directory store (of medians
    and paired), and the bytes goal (s3 raw / s3 compressed)."""
    dirs = runs["dir node"]
    dir_row = _summary(dirs)
    row: dict = {"model": model, "cold_ttfo_s": cold["ttfo_s"], "dir": dir_row}
    for scenario, label in SCENARIO_LABELS.items():
        if scenario == "dir node" or not runs.get(scenario):
            continue
        summary = _summary(runs[scenario])
        summary["ratio"] = summary["ttfo_s"] / dir_row["ttfo_s"] if dir_row["ttfo_s"] else None
        summary.update(_paired(runs[scenario], dirs))
        summary["goal_met"] = summary["ratio"] is not None and summary["ratio"] <= GOAL
        row[label] = summary
    s3_row, raw_row = row["s3"], row["s3_raw"]
    fewer = raw_row["bytes_moved"] / s3_row["bytes_moved"] if s3_row["bytes_moved"] else None
    row.update(ratio=s3_row["ratio"], raw_ratio=raw_row["ratio"], goal_met=s3_row["goal_met"],
               bytes_fewer=fewer, bytes_goal_met=fewer is not None and fewer >= BYTES_GOAL)
    return row


#: Each fresh node's scenario and its key in a result row.
SCENARIO_LABELS = {"dir node": "dir", "s3 node": "s3", "s3 raw node": "s3_raw", "gcs node": "gcs",
                   "azure node": "azure"}


def byte_compile() -> None:
    """Byte-compile the package the nodes import, as installing it does (pip writes every
    module's ``.pyc``). Without it, under ``PYTHONDONTWRITEBYTECODE`` (set here) every node
    compiles each of compile_cache's modules from source as it imports it, inside its TTFO for
    the modules a start imports late: the object-storage clients' (``store.backends.s3``,
    ``rest``, ``s3_auth``: about 25 ms on an idle core) only on a node of an object store."""
    import compile_cache

    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.dirname(compile_cache.__file__)],
                   check=True, capture_output=True, timeout=600)


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    prime_precompiled_header()
    if not args.no_byte_compile:
        byte_compile()
    with tempfile.TemporaryDirectory(prefix="bench_remote_") as work:
        server = MotoServer(os.path.join(work, "moto.log"))
        emulators = [] if args.no_emulators else start_emulators(work)
        try:
            for model in args.models:
                directory = os.path.join(work, model, "dir-store")
                print(f"[{model}] cold start publishing into a directory store", file=sys.stderr, flush=True)
                cold = start_node(args, model, os.path.join(work, model, "cold"), server, directory)
                stores = [("dir node", directory), ("s3 node", URL), ("s3 raw node", RAW_URL)]
                copy_store(directory, server, os.path.join(work, model))
                copy_store(directory, server, os.path.join(work, model), RAW_URL, "0")
                if emulators:
                    copy_store(directory, server, os.path.join(work, model), GCS_URL)
                    copy_store(directory, server, os.path.join(work, model), AZ_URL)
                    stores += [("gcs node", GCS_URL), ("azure node", AZ_URL)]
                runs: dict[str, list[dict]] = {scenario: [] for scenario, _ in stores}
                serving = {"s3 node": server.proc, "s3 raw node": server.proc,
                           **({"gcs node": emulators[0].proc, "azure node": emulators[1].proc}
                              if emulators else {})}
                for i in range(max(1, args.repeats)):
                    for scenario, store in stores:
                        base = os.path.join(work, model, f"{scenario.replace(' ', '-')}-{i}")
                        cpu_before = _server_cpu_s(serving.get(scenario))
                        result = start_node(args, model, base, server, store)
                        result["server_cpu_s"] = _server_cpu_s(serving.get(scenario)) - cpu_before
                        print(f"[{model}] {scenario} #{i}: TTFO {result['ttfo_s']:.2f} s, "
                              f"{result['bytes_moved']} bytes moved, server CPU "
                              f"{result['server_cpu_s'] * 1000:.0f} ms", file=sys.stderr, flush=True)
                        runs[scenario].append(result)
                rows.append(_row(model, cold, runs))
            probes = {"s3": _client_import(server, args.repeats)}
            if emulators:
                probes["gcs"] = _client_import(server, args.repeats, GCS_URL)
                probes["azure"] = _client_import(server, args.repeats, AZ_URL)
                probes["gcs_gcsfs"] = _client_import(server, args.repeats, GCS_URL,
                                                     COMPILE_CACHE_REMOTE_CLIENT="fsspec")
                probes["azure_adlfs"] = _client_import(server, args.repeats, AZ_URL,
                                                       COMPILE_CACHE_REMOTE_CLIENT="fsspec")
            rows.append({"client_import": probes})
        finally:
            server.stop()
            for emulator in emulators:
                emulator.stop()
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
    parser.add_argument("--no-byte-compile", action="store_true",
                        help="leave the package's modules uncompiled (nodes compile them from source "
                             "under PYTHONDONTWRITEBYTECODE: the definition before 2026-12-03, commit 77841c0)")
    parser.add_argument("--no-emulators", action="store_true",
                        help="leave out the gs:// and az:// nodes (gcp-storage-emulator, Azurite)")
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
    probes = next((r["client_import"] for r in rows if "client_import" in r), {})
    rows = [r for r in rows if "client_import" not in r]
    data = {"benchmark": "remote", "machine": machine(), "seq": args.seq, "repeats": args.repeats,
            "byte_compiled": not args.no_byte_compile,
            "goal": GOAL, "bytes_goal": BYTES_GOAL, "rows": rows, "client_import": probes.get("s3"),
            "client_imports": probes}
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{'model':8} {'store':9} {'TTFO s':>8} {'process s':>10} {'FX miss':>8} {'bytes moved':>12} "
          f"{'/ dir':>6} {'paired':>7}")
    for row in rows:
        for label in SCENARIO_LABELS.values():
            r = row.get(label)
            if r is None:
                continue
            ratios = (f" {r['ratio']:6.3f} {r['paired_ratio']:7.3f}" if "ratio" in r and r["paired_ratio"]
                      else "")
            print(f"{row['model']:8} {label:9} {r['ttfo_s']:8.2f} {r['process_s']:10.2f} "
                  f"{r['fxgraph_miss']:8d} {int(r['bytes_moved']):12d}{ratios}")
        verdict = "met" if row["goal_met"] else "NOT met"
        print(f"{row['model']:8} ratio s3 / dir = {row['ratio']:.3f} (goal <= {GOAL}: {verdict})")
        print(f"{row['model']:8} bytes raw / compressed = {row['bytes_fewer']:.2f} (goal >= {BYTES_GOAL})")
    for label, p in probes.items():
        print(f"{label} client {p['client']}: import {p['import_s']:.3f} s, make {p['make_s']:.3f} s, "
              f"first request {p['first_request_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
