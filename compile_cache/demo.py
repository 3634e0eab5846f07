"""`make demo`: a cold start, then a cached start on a "new node", on a small built-in model.

Runs ``python -m compile_cache warm compile_cache.demo:demo_model --cache-dir STORE`` twice, each
in a fresh process on a fresh node (new, empty temp dir, home and Inductor/Triton cache dirs, as a
new container or CI runner has them); both share one compile_cache store. The second run restores what the first compiled. Then ``ls`` shows the
entry. ``demo_model`` is also a ``warm`` TARGET of its own.
"""

from __future__ import annotations

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


def demo_model() -> tuple[nn.Module, torch.Tensor]:
    """``warm`` TARGET ``compile_cache.demo:demo_model``: the demo model and one batch of tokens."""
    torch.manual_seed(0)
    return TinyTransformer().eval(), torch.randint(0, 512, (1, 64))


def _run(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "compile_cache", *args], env=env,
                          capture_output=True, text=True, check=False)
    return proc, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Cold warm, cached warm on a "new node", then ``ls``; prints times and their ratio."""
    with tempfile.TemporaryDirectory(prefix="compile_cache_demo_") as work:
        store = os.path.join(work, "store")
        print("compile_cache demo: TinyTransformer (4 blocks, width 128), CPU, batch 1 x 64")
        print(f"store: {store}\n")
        runs = []
        for label in ("cold start   (empty store, a fresh node)",
                      "cached start (same store, another fresh node)"):
            # A fresh node: new temp dir and home too (torch keeps its precompiled header there).
            node = tempfile.mkdtemp(dir=work)
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(node, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(node, "triton"))
            for name, sub in (("TMPDIR", "tmp"), ("HOME", "home"), ("XDG_CACHE_HOME", "xdg")):
                env[name] = os.path.join(node, sub)
                os.makedirs(env[name])
            proc, wall = _run(["warm", "compile_cache.demo:demo_model", "--cache-dir", store, "--json"], env)
            if proc.returncode != 0:
                print(proc.stdout + proc.stderr, file=sys.stderr)
                return proc.returncode
            result = json.loads(proc.stdout)
            runs.append((wall, result["first_output_seconds"]))
            verdict = "hit" if result["hit"] else f"{result['fxgraph_misses']} graph(s) compiled"
            print(f"{label}: process {wall:5.1f} s, compile + first output {result['first_output_seconds']:5.1f} s"
                  f"  [{verdict}, {result['restored_packs']} pack(s) restored, "
                  f"{result['published_packs']} published]")
        (cold_wall, cold_first), (warm_wall, warm_first) = runs
        print(f"\ncached / cold: whole process {warm_wall / cold_wall:.2f} ({cold_wall / warm_wall:.1f}x faster), "
              f"compile + first output {warm_first / cold_first:.2f} ({cold_first / warm_first:.1f}x faster)\n")
        proc, _ = _run(["ls", "--cache-dir", store], dict(os.environ))
        print(f"$ python -m compile_cache ls --cache-dir {store}")
        print(proc.stdout.rstrip())
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
