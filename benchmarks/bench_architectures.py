"""Fresh-node time to first output per architecture: precompile vs ``precompile=False`` vs torch.

The tiny transformers models of tests/_architectures_child.py (BERT, ViT, Whisper, BART, T5,
Gemma, Mamba, Qwen2, Mixtral, CLIP; random weights, CPU), each scenario in its own process:

  eager        the first forward without compiling (a fresh node)
  cc node      compile_cache on a fresh node whose store a publisher filled (precompile on)
  cc plain     the same with ``precompile=False`` (its own publisher and store)
  torch warm   ``compile_regions(cache_dir=False)`` on a node that ran it once already: torch's
               own warm start (its local caches), the best a node can do without a store

TTFO is from ``compile_regions`` to the end of the first forward (``generate``: to the end of
the first ``generate()``, three new tokens). The goals (issue 35): cc node at most 0.8 x cc
plain; the first ``generate()`` on a fresh node at most 1.2 x eager + 2 s.

``--batched`` runs each scenario once for all the models, one after another in one process (six
processes in all instead of seven per model, for a loaded machine): the first model's time
then includes the process's one-time imports in every scenario alike, and ``torch warm`` runs
on the ``cc plain`` publisher's node (warm from that run) instead of a node of its own.

    python benchmarks/bench_architectures.py --archs bert,t5,qwen2 --json results/arch.json
    python benchmarks/bench_architectures.py --archs qwen2 --calls generate
    python benchmarks/bench_architectures.py --batched --json results/arch.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import fresh_node_env, machine, prime_precompiled_header  # noqa: E402

CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                     "_architectures_child.py")
ARCHS = ("bert", "vit", "whisper", "bart", "t5", "gemma", "mamba", "qwen2", "mixtral", "clip")
GOAL_VS_PLAIN = 0.8
GOAL_GENERATE = (1.2, 2.0)  # first generate() on a fresh node <= 1.2 x eager + 2 s


def _node(root: str, name: str) -> dict[str, str]:
    env = fresh_node_env(os.path.join(root, name))
    repo = os.path.dirname(os.path.dirname(CHILD))
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    return env


def _run_all(env: dict[str, str], store: str, phase: str, archs: str, calls: str) -> list[dict]:
    """One child process for the comma-separated ``archs``: their records, in order."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, CHILD, store, phase, archs, calls], env=env,
                          capture_output=True, text=True, timeout=3600, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ARCH ")]
    if done.returncode != 0 or len(lines) != len(archs.split(",")):
        raise RuntimeError(f"{archs} {phase} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    recs = [json.loads(line[5:]) for line in lines]
    for rec in recs:
        if "error" in rec:
            raise RuntimeError(f"{rec['arch']} {phase}: {rec['error']}\n{rec.get('traceback', '')}")
        rec["process_s"] = time.perf_counter() - start
    return recs


def _run(env: dict[str, str], store: str, phase: str, arch: str, calls: str) -> dict:
    return _run_all(env, store, phase, arch, calls)[0]


def _ttfo(rec: dict, calls: str) -> float:
    return rec["first_generate_s" if calls == "generate" else "first_output_s"]


def bench(arch: str, calls: str, root: str) -> dict:
    """Every scenario of one architecture (module doc), each on its own node."""
    tag = f"{arch}-{calls}"
    row: dict = {"arch": arch, "calls": calls}
    row["eager"] = _ttfo(_run(_node(root, f"{tag}-eager"), "off", "eager", arch, calls), calls)
    for name, phase in (("cc node", "load"), ("cc plain", "plain")):
        store = os.path.join(root, f"{tag}-{phase}-store")
        publish = _run(_node(root, f"{tag}-{phase}-publisher"), store,
                       "publish" if phase == "load" else "plain", arch, calls)
        row[f"{name} publish"] = _ttfo(publish, calls)
        node = _run(_node(root, f"{tag}-{phase}-node"), store, phase, arch, calls)
        row[name] = _ttfo(node, calls)
        row[f"{name} fx_misses"] = node["fx_misses"]
        row[f"{name} frames"] = node["frames"]
        if phase == "load":
            row["precompile"] = {k: g["status"] for k, g in (node.get("groups") or {}).items()}
    torch_node = _node(root, f"{tag}-torch")
    row["torch cold"] = _ttfo(_run(torch_node, "off", "plain", arch, calls), calls)
    row["torch warm"] = _ttfo(_run(torch_node, "off", "plain", arch, calls), calls)
    row["node_vs_plain"] = row["cc node"] / row["cc plain"]
    row["node_vs_warm"] = row["cc node"] / row["torch warm"]
    if calls == "generate":
        limit = GOAL_GENERATE[0] * row["eager"] + GOAL_GENERATE[1]
        row["generate_goal_s"] = limit
    return row


def bench_batched(archs: list[str], calls: str, root: str) -> list[dict]:
    """Every scenario once for all ``archs`` (module doc, ``--batched``)."""
    names = ",".join(archs)
    tag = f"all-{calls}"
    by: dict[str, list[dict]] = {}
    by["eager"] = _run_all(_node(root, f"{tag}-eager"), "off", "eager", names, calls)
    for name, phase in (("cc node", "load"), ("cc plain", "plain")):
        store = os.path.join(root, f"{tag}-{phase}-store")
        publisher = _node(root, f"{tag}-{phase}-publisher")
        by[f"{name} publish"] = _run_all(publisher, store, "publish" if phase == "load" else "plain",
                                         names, calls)
        by[name] = _run_all(_node(root, f"{tag}-{phase}-node"), store, phase, names, calls)
    by["torch warm"] = _run_all(publisher, "off", "plain", names, calls)  # the plain publisher's
    rows = []
    for i, arch in enumerate(archs):
        row: dict = {"arch": arch, "calls": calls, "batched": True}
        for name, recs in by.items():
            row[name] = _ttfo(recs[i], calls)
        for name in ("cc node", "cc plain"):
            row[f"{name} fx_misses"] = by[name][i]["fx_misses"]
            row[f"{name} frames"] = by[name][i]["frames"]
        row["precompile"] = {k: g["status"] for k, g in (by["cc node"][i].get("groups") or {}).items()}
        row["node_vs_plain"] = row["cc node"] / row["cc plain"]
        row["node_vs_warm"] = row["cc node"] / row["torch warm"]
        if calls == "generate":
            row["generate_goal_s"] = GOAL_GENERATE[0] * row["eager"] + GOAL_GENERATE[1]
        rows.append(row)
    return rows


def _print(row: dict) -> None:
    print(f"{row['arch']:>8} {row['calls']:<8} eager {row['eager']:6.2f}s  cc node {row['cc node']:6.2f}s"
          f"  cc plain {row['cc plain']:6.2f}s  torch warm {row['torch warm']:6.2f}s  "
          f"node/plain {row['node_vs_plain']:.2f}  node/warm {row['node_vs_warm']:.2f}"
          + (f"  goal <= {row['generate_goal_s']:.2f}s" if "generate_goal_s" in row else ""),
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated (default: all)")
    parser.add_argument("--calls", default="forward", choices=("forward", "generate"),
                        help="what is timed: the first forward, or the first generate()")
    parser.add_argument("--batched", action="store_true",
                        help="each scenario once for all the models, in one process (module doc)")
    parser.add_argument("--json", metavar="PATH", help="write the rows there")
    args = parser.parse_args(argv)
    prime_precompiled_header()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_arch_") as root:
        if args.batched:
            rows = bench_batched(args.archs.split(","), args.calls, root)
            for row in rows:
                _print(row)
        for arch in [] if args.batched else args.archs.split(","):
            row = bench(arch, args.calls, root)
            rows.append(row)
            _print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "goal_vs_plain": GOAL_VS_PLAIN, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
