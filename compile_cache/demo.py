"""`make demo`: a cold start, then a cached start on a "new node", on a small built-in model.

Each start runs in a fresh process with its own empty Inductor cache dir (as a new node would
have); both share one compile_cache store. The second start restores what the first compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm transformer block: the repeated region compile_regions finds."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """The demo's built-in model: embedding, N identical blocks, a head."""

    def __init__(self, layers: int = 4, width: int = 128, heads: int = 4, vocab: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _one_start(store: str) -> dict:
    """Runs in a child process: compile the demo model with the store, time the first output."""
    import compile_cache

    torch.manual_seed(0)
    model = TinyTransformer().eval()
    tokens = torch.randint(0, 512, (1, 64))
    start = time.perf_counter()
    compile_cache.compile_regions(model, cache_dir=store)
    with torch.no_grad():
        model(tokens)
    first_output = time.perf_counter() - start
    report = compile_cache.last_report()
    return {"seconds": first_output, "report": report.summary() if report else "no report"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", metavar="STORE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_one_start(args.child)))
        return 0

    with tempfile.TemporaryDirectory(prefix="compile_cache_demo_") as work:
        store = os.path.join(work, "store")
        print("compile_cache demo: TinyTransformer (4 blocks, width 128), CPU, batch 1 x 64")
        print(f"store: {store}\n")
        results = []
        for label in ("cold start (empty store, empty Inductor dir)",
                      "cached start (new empty Inductor dir, same store)"):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=work),
                       TRITON_CACHE_DIR=tempfile.mkdtemp(dir=work))
            child = subprocess.run(
                [sys.executable, "-m", "compile_cache.demo", "--child", store],
                env=env, capture_output=True, text=True, check=False,
            )
            if child.returncode != 0:
                print(child.stdout + child.stderr, file=sys.stderr)
                return child.returncode
            result = json.loads(child.stdout.strip().splitlines()[-1])
            results.append(result)
            print(f"{label}: first output after {result['seconds']:.1f} s")
            print(f"    {result['report']}")
        cold, cached = results[0]["seconds"], results[1]["seconds"]
        print(f"\ncached start / cold start = {cached / cold:.2f} ({cold / cached:.1f}x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
