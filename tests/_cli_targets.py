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
