"""Small nn models shared by the plan and regions tests: repeats in every kind of container."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


class OtherBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * 0.5 + x


class Head(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(x))


class SeqModel(nn.Module):
    """Repeats in a Sequential; an embedding leaf, a custom head outside the regions."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class MixedModel(nn.Module):
    """Alternating block types in a ModuleList, repeats in a ModuleDict and plain attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), OtherBlock(), Block(), OtherBlock()])
        self.branches = nn.ModuleDict({"a": Block(16), "b": Block(16)})
        self.up = nn.Linear(8, 16)
        self.enc1 = Head(16)
        self.enc2 = Head(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        y = self.up(x)
        y = self.branches["a"](y) + self.branches["b"](y)
        return self.enc1(y) - self.enc2(y)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            [nn.Sequential(Block(), Block(), Block()), nn.Sequential(Block(), Block(), Block())]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = s(x)
        return x
