"""Memory a job pays when the store holds a hostile pack, measured with /usr/bin/time -v.

    .venv/bin/python benchmarks/bench_reliability.py                 # 2 GiB, as in issue 15
    .venv/bin/python benchmarks/bench_reliability.py --size 256M     # a quick smoke
    .venv/bin/python benchmarks/bench_reliability.py --real-pack     # + the largest real pack

Each scenario runs in its own process under ``/usr/bin/time -v`` (its "Maximum resident set
size"), side by side with the same job facing a normal store (the baseline), so the figure that
counts is the difference:

* ``job``: a restoring job (``compile_regions`` on a small model, ``backend="eager"``): the store
  holds the key's normal pack, plus in the hostile rows a sparse pack whose valid 84-byte prefix
  claims ``--size`` bytes (4 KB on disk): under the default ``COMPILE_CACHE_MAX_PACK_SIZE``
  (refused from the prefix when larger), and with the limit raised past it: a zero header
  (refused at the header), or a valid header listing one ``--size`` member (the whole body is
  read to check the checksum, in chunks). Rows ``naive``: what reading such a pack whole costs
  (the code before issue 15).
* ``import``: ``python -m compile_cache import`` of a normal export archive, and of a gzip bomb
  (a few MB of ``.tar.gz`` holding one ``--size`` member), with the default limit (refused from
  the member's declared size) and with it raised (refused at the member's first bytes);
  ``naive``: extracting that member whole.

Goal (issue 15): every hostile row stays under 300 MB above its baseline. ``--real-pack``
compiles GPT-2 12x768 per block with Inductor (eval and one training step) and reports the
largest pack and member count it publishes: what the limits' defaults must stay far above.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _common import machine  # noqa: E402

from compile_cache import config  # noqa: E402
from compile_cache._sizes import format_size, parse_size  # noqa: E402

GOAL_MB = 300.0

# The restoring job: a small model, compile_regions with the store, one forward.
JOB = r"""
import sys, torch, compile_cache
torch.manual_seed(0)
block = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
model = torch.nn.Sequential(*[block() for _ in range(2)]).eval()
with torch.no_grad():
    compile_cache.compile_regions(model, cache_dir=sys.argv[1], backend="eager")
    model(torch.randn(2, 64))
r = compile_cache.last_report()
print("KEY", r.key, r.restored_packs)
"""
NAIVE_PACK = r"""
import hashlib, sys
data = open(sys.argv[1], "rb").read()   # what Store.load did before issue 15: read, then check
print(hashlib.sha256(memoryview(data)[84:]).hexdigest()[:8], len(data))
"""
NAIVE_TAR = r"""
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    for member in tar:
        data = tar.extractfile(member).read()   # what import did before: read, then validate
        print(member.name, len(data))
"""


def timed(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``argv`` under /usr/bin/time -v: max RSS (MB), wall seconds, exit code, stdout."""
    time_bin = shutil.which("time") or "/usr/bin/time"
    if not os.path.exists(time_bin):
        raise SystemExit("bench_reliability needs GNU time (/usr/bin/time): apt-get install time")
    start = time.perf_counter()
    done = subprocess.run([time_bin, "-v", *argv], env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    if match is None:
        raise SystemExit(f"no RSS in /usr/bin/time output:\n{done.stderr[-2000:]}")
    return {"rss_mb": int(match.group(1)) / 1024, "wall_s": wall, "rc": done.returncode,
            "stdout": done.stdout.strip(), "stderr": done.stderr[-1500:] if done.returncode else ""}


def sparse_pack(path: Path, size: int, key: str | None) -> None:
    """A pack whose valid prefix claims a body of ``size`` bytes; sparse, so a few KB on disk.

    ``key`` None: the header is zeros too. Else a valid header listing one member of the rest
    (with a checksum that cannot match: only reading the whole body can tell).
    """
    header = b""
    if key is not None:
        table = {"format": 1, "created": time.time(), "torch": "unknown", "host": "bench", "pid": 0,
                 "key": key, "compile_seconds": 0.0, "metadata": {}, "members": []}
        for _ in range(2):  # the member's size depends on the header's length
            raw = json.dumps(table, sort_keys=True, separators=(",", ":")).encode()
            table["members"] = [{"name": "inductor/bomb/blob", "size": size - 4 - len(raw)}]
        raw = json.dumps(table, sort_keys=True, separators=(",", ":")).encode()
        header = struct.pack("<I", len(raw)) + raw
    prefix = struct.pack("<8sHHQ32s32s", b"CCPACK\r\n", 1, 0, size, hashlib.sha256(b"x").digest(), bytes(32))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(prefix + header)
        fh.truncate(len(prefix) + size)


def gzip_bomb(path: Path, size: int) -> None:
    """A .tar.gz with one pack member of ``size`` zero bytes."""
    import io

    class Zeros(io.RawIOBase):
        def __init__(self, n: int) -> None:
            self.left = n

        def readable(self) -> bool:
            return True

        def readinto(self, buf: Any) -> int:
            n = min(len(buf), self.left)
            buf[:n] = bytes(n)
            self.left -= n
            return n

    with tarfile.open(path, "w:gz", compresslevel=9) as tar:
        info = tarfile.TarInfo(f"entries/{'ab' * 16}/packs/{'0' * 32}.pack")
        info.size = size
        tar.addfile(info, io.BufferedReader(Zeros(size), 1 << 20))


def real_pack(work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Compile GPT-2 12x768 per block (eval forward, then a training step) on a fresh node;
    the largest pack and member count it published."""
    code = r"""
import json, sys, torch, compile_cache
from compile_cache.store import Store
sys.path.insert(0, sys.argv[2])
from _common import build_gpt2
model, tokens = build_gpt2(12, 768, 12, 128)
model.config.use_cache = False
compile_cache.compile_regions(model, cache_dir=sys.argv[1])
with torch.no_grad():
    model(tokens)
model.train()
model(tokens, labels=tokens).loss.backward()
packs = [p for e in Store(sys.argv[1]).entries() for p in e.packs]
print(json.dumps({"packs": len(packs), "largest_bytes": max(p.size for p in packs),
                  "most_members": max(p.members for p in packs),
                  "longest_name": max(len(n) for p in packs for n in p.member_names)}))
"""
    node_env = fresh_node(work / "real-node", env)
    done = subprocess.run([sys.executable, "-c", code, str(work / "real-store"), str(HERE)],
                          env=node_env, capture_output=True, text=True, check=False, timeout=3600)
    if done.returncode:
        raise SystemExit(f"real pack run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fresh_node(node: Path, env: dict[str, str]) -> dict[str, str]:
    """New TMPDIR, HOME, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR."""
    out = dict(env)
    for name in ("TMPDIR", "HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        path = node / name.lower()
        path.mkdir(parents=True, exist_ok=True)
        out[name] = str(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2G", help="what the hostile pack/member claims (default 2G)")
    parser.add_argument("--no-naive", action="store_true", help="skip the rows that read it whole")
    parser.add_argument("--real-pack", action="store_true", help="also measure the largest real pack")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-reliability-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env = fresh_node(work / "node", env)
    rows: list[dict[str, Any]] = []
    try:
        from compile_cache.store import Store

        store = work / "store"
        first = timed([sys.executable, "-c", JOB, str(store)], env)  # learns the key
        if first["rc"]:
            raise SystemExit(f"the job failed:\n{first['stderr']}")
        key = first["stdout"].split()[-2]
        blobs = {f"inductor/fxgraph/b{i}/entry": os.urandom(1 << 20) for i in range(8)}
        Store(store).publish(key, blobs)  # the key's normal pack: 8 MiB, restored by every row
        packs = Store(store).layout.packs_dir(key)

        (normal,) = Store(store).layout.pack_paths(key)

        raised = {**env, "COMPILE_CACHE_MAX_PACK_SIZE": str(2 * size + (1 << 20))}  # past the limit

        def job(case: str, scenario: str, note: str, prepare: Any = None, job_env: Any = None) -> None:
            bad = packs / ("f" * 32 + ".pack")
            if prepare is not None:
                prepare(bad)
            if case == "naive":  # the pre-issue-15 read of the hostile pack (or the normal one)
                result = timed([sys.executable, "-c", NAIVE_PACK, str(bad if prepare else normal)], env)
                result["outcome"] = "read whole"
            else:
                result = timed([sys.executable, "-c", JOB, str(store)], job_env or env)
                restored = result["stdout"].split()[-1] if result["stdout"] else "?"
                result["outcome"] = f"restored {restored} pack(s)"
            if bad.exists():
                bad.unlink()
            for path in Store(store).layout.quarantine_dir.glob("*"):
                path.unlink()
            rows.append({"case": case, "scenario": scenario, "note": note, **result})

        limit = format_size(parse_size(str(config.MAX_PACK_SIZE.default)))
        job("job", "baseline", "the key's normal 8 MiB pack")
        job("job", f"sparse {format_size(size)}", f"default limit ({limit}): refused from its "
            "first bytes" if size > config.MAX_PACK_SIZE.default else "refused at the header",
            lambda p: sparse_pack(p, size, None))
        job("job", f"sparse {format_size(size)}, zero header", "limit raised: refused at the header",
            lambda p: sparse_pack(p, size, None), raised)
        job("job", f"sparse {format_size(size)}, one member", "limit raised: whole body hashed in "
            "chunks, then refused", lambda p: sparse_pack(p, size, key), raised)
        if not args.no_naive:
            job("naive", "baseline", "read the normal 8 MiB pack whole")
            job("naive", f"sparse {format_size(size)}, one member", "read whole, as before issue 15",
                lambda p: sparse_pack(p, size, key))

        archive = work / "good.tar.gz"
        Store(store).export(archive, keys=[key])
        bomb = work / "bomb.tar.gz"
        gzip_bomb(bomb, size)
        bomb_note = f"{format_size(bomb.stat().st_size)} of .tar.gz"
        for scenario, path, note, import_env in (
            ("baseline", archive, f"a normal export ({format_size(archive.stat().st_size)})", env),
            (f"gzip bomb, one {format_size(size)} member", bomb, f"{bomb_note}, default limit", env),
            (f"gzip bomb, one {format_size(size)} member", bomb, f"{bomb_note}, limit raised", raised),
        ):
            target = work / f"import-{len(rows)}"
            result = timed([sys.executable, "-m", "compile_cache", "import", str(path),
                            "--cache-dir", str(target)], import_env)
            result["outcome"] = "imported" if result["rc"] == 0 else f"refused (exit {result['rc']})"
            rows.append({"case": "import", "scenario": scenario, "note": note, **result})
        if not args.no_naive:
            for scenario, path in (("baseline", archive), (f"gzip bomb, one {format_size(size)} member", bomb)):
                result = timed([sys.executable, "-c", NAIVE_TAR, str(path)], env)
                rows.append({"case": "naive-import", "scenario": scenario, "outcome": "extracted whole",
                             "note": "read each member whole, as before issue 15", **result})
        for row in rows:
            base = next(r for r in rows if r["case"] == row["case"] and r["scenario"] == "baseline")
            row["over_baseline_mb"] = row["rss_mb"] - base["rss_mb"]
            hostile = row["scenario"] != "baseline" and not row["case"].startswith("naive")
            row["goal_met"] = (row["over_baseline_mb"] < GOAL_MB) if hostile else None
        real = real_pack(work, env) if args.real_pack else None
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "benchmark": "reliability", "size": size, "goal_mb": GOAL_MB, "rows": rows, "real_pack": real,
        "run": {"command": "python benchmarks/bench_reliability.py " + " ".join(argv or sys.argv[1:]),
                "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                "wall_s": round(time.perf_counter() - started, 1)},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"bench_reliability: hostile {format_size(size)}, goal < {GOAL_MB:.0f} MB over the baseline")
    print(f"{'case':12} {'scenario':32} {'RSS MB':>8} {'over base':>10} {'wall s':>7}  goal    outcome; note")
    for row in rows:
        goal = {True: "met", False: "MISSED", None: "-"}[row["goal_met"]]
        print(f"{row['case']:12} {row['scenario']:32} {row['rss_mb']:8.1f} {row['over_baseline_mb']:10.1f} "
              f"{row['wall_s']:7.2f}  {goal:6}  {row['outcome']}; {row['note']}")
    if real:
        print(f"largest real pack (GPT-2 12x768 per block, eval + train): {format_size(real['largest_bytes'])}, "
              f"{real['most_members']} members, longest name {real['longest_name']} chars, "
              f"{real['packs']} packs")
    return 0 if all(r["goal_met"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
