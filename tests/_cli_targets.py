"""TARGET factories for the CLI tests (``tests/_cli_targets.py:tiny`` and friends)."""

from __future__ import annotations

import torch

from compile_cache.demo import TinyTransformer


def tiny() -> tuple[torch.nn.Module, torch.Tensor]:
    """A 2-block, width-64 TinyTransformer and one batch of 1 x 16 tokens: the real-compile model."""
    torch.manual_seed(0)
    return TinyTransformer(layers=2, width=64, heads=2, vocab=128).eval(), torch.randint(0, 128, (1, 16))


def tiny_two_shapes() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The same model with a grid of two shapes (for eager-backend tests)."""
    torch.manual_seed(0)
    model = TinyTransformer(layers=2, width=64, heads=2, vocab=128).eval()
    return model, [torch.randint(0, 128, (1, 16)), torch.randint(0, 128, (2, 8))]


def tiny_kwargs() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Example inputs as a dict of keyword arguments."""
    torch.manual_seed(0)
    return TinyTransformer(layers=2, width=64, heads=2, vocab=128), {"tokens": torch.randint(0, 128, (1, 8))}


def not_a_model() -> str:
    """A factory that returns something else: the CLI must say so and exit 2."""
    return "not a model"


def model_only() -> torch.nn.Module:
    """A model without example inputs and without a config: the CLI asks for inputs."""
    return TinyTransformer(layers=2, width=64, heads=2, vocab=128)


class _Block(torch.nn.Module):
    """A residual MLP block: the smallest repeated region that still exercises Inductor."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class TinyMLP(torch.nn.Module):
    """Two identical blocks: one region group, one small compiled graph (fast cold compile)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    """The session fixture's real-compile target: TinyMLP and one 4 x 16 input."""
    torch.manual_seed(0)
    return TinyMLP().eval(), torch.randn(4, 16)


def mlp_two_shapes() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The same TinyMLP (same key) with a second, new shape: restored, then compiled (partial hit)."""
    model, x = mlp()
    return model, [x, torch.randn(8, 16)]


def mlp_wide() -> tuple[torch.nn.Module, torch.Tensor]:
    """Another model (width 24): a key of its own."""
    torch.manual_seed(0)
    return TinyMLP(width=24).eval(), torch.randn(4, 24)


#: what the Recorder saw at each call: (training, grad enabled, use_cache, input shape, dtype)
SEEN: list[tuple[bool, bool, bool, tuple[int, ...], str]] = []


class Recorder(torch.nn.Module):
    """A token model with a transformers-like config that records how ``warm`` calls it."""

    def __init__(self) -> None:
        super().__init__()
        import types

        self.config = types.SimpleNamespace(vocab_size=32, max_position_embeddings=16, use_cache=True)
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        out = self.head(self.embed(input_ids))
        _record(self.training, use_cache, input_ids, out)
        return out


@torch.compiler.disable
def _record(training: bool, use_cache: bool, input_ids: torch.Tensor, out: torch.Tensor) -> None:
    SEEN.append((training, torch.is_grad_enabled(), use_cache, tuple(input_ids.shape),
                 str(out.dtype).removeprefix("torch.")))


def recorder() -> torch.nn.Module:
    """A model alone: warm builds its token grid (batch, seq, use_cache) from the flags."""
    torch.manual_seed(0)
    return Recorder()


def _loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A function warmed as ``compile_cache.compile(fn)`` (the function factories below)."""
    return ((torch.tanh(x) - y) ** 2).mean()


def loss_fn() -> tuple[object, tuple[torch.Tensor, torch.Tensor]]:
    """A factory that returns a function and its example inputs (``warm`` compiles it whole)."""
    g = torch.Generator().manual_seed(0)
    return _loss, (torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))


def loss_fn_alone() -> object:
    """A function without example inputs: the CLI must ask for them and exit 2."""
    return _loss
