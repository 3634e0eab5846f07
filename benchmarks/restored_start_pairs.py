"""Eager against a restored start, alternating, each run on its own fresh node: the phase timer
(``restored_start_phases.py``) of both, medians, and the whole-process ratio.

One ``compile_regions`` run on a fresh node fills a store first (a cold start that publishes);
then eager and compile_cache take turns (the order flips every round, so a drift of the machine
lands on both), each in a new process on a new node (new TMPDIR, HOME, XDG_CACHE_HOME, Inductor
and Triton dirs). Wall time is taken from the launcher: interpreter start and exit included.

    python benchmarks/restored_start_pairs.py forward 4x256 6 --json-out pairs.json
    python benchmarks/restored_start_pairs.py train 12x768 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import compile_bytecode, fresh_node_env  # noqa: E402

PHASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "restored_start_phases.py")


def run(mode: str, model: str, strategy: str, store: str, node: str) -> dict[str, float]:
    """One start on the fresh node ``node``: its phases, interpreter exit and wall, seconds."""
    env = fresh_node_env(node)
    env["PHASES_MODEL"] = model
    env["PHASES_T0"] = repr(time.time())
    started = time.time()
    done = subprocess.run([sys.executable, PHASES, mode, strategy, store], env=env,
                          capture_output=True, text=True, timeout=900, check=True)
    wall = time.time() - started
    line = [x for x in done.stderr.splitlines() if x.startswith("PHASES ")][-1]
    phases = json.loads(line[len("PHASES "):])
    phases["exit"] = round(wall - sum(phases.values()), 4)
    phases["wall"] = round(wall, 4)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("forward", "train"))
    parser.add_argument("model", help="LAYERSxWIDTH of GPT-2, e.g. 4x256")
    parser.add_argument("rounds", type=int, help="runs of each, alternating")
    parser.add_argument("--json-out", help="write every sample and the medians here")
    args = parser.parse_args()
    compile_bytecode()
    samples: dict[str, list[dict[str, float]]] = {"eager": [], "regional": []}
    # Every node's dirs (the publisher's precompiled header alone is ~150 MB) go at the end.
    with tempfile.TemporaryDirectory(prefix="restored_start_pairs_") as root:
        store = os.path.join(root, "store")
        run(args.mode, args.model, "regional", store, os.path.join(root, "publisher"))
        for i in range(args.rounds):
            for strategy in ("eager", "regional") if i % 2 == 0 else ("regional", "eager"):
                samples[strategy].append(run(args.mode, args.model, strategy, store,
                                             os.path.join(root, f"{strategy}-{i}")))
    medians = {s: {k: round(statistics.median(x.get(k, 0.0) for x in rows), 3) for k in rows[0]}
               for s, rows in samples.items()}
    for strategy, row in medians.items():
        print(f"{strategy:<9} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    ratio = medians["regional"]["wall"] / medians["eager"]["wall"]
    print(f"{args.model} {args.mode}: whole process, ours / eager = {ratio:.3f} "
          f"(medians of {args.rounds} each)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"mode": args.mode, "model": args.model, "rows": samples,
                       "medians": medians, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
