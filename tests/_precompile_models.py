"""The models of the precompile adversarial suite (tests/test_precompile.py): blocks whose
forward reads what a lax guard filter would drop."""

from __future__ import annotations

import torch
from torch import nn

D = 16


class ValueBlock(nn.Module):
    """Reads a float, an int and a bool attribute."""

    def __init__(self, scale: float = 1.0, shift: int = 1, flag: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale, self.shift, self.flag = scale, shift, flag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.roll(torch.tanh(self.lin(x)), self.shift, dims=-1) * self.scale
        return torch.relu(y) if self.flag else torch.sigmoid(y)


class ScaleBlock(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


class GradBlock(ScaleBlock):
    """requires_grad toggled on the input (its own class: its own store key)."""


class MutateBlock(ScaleBlock):
    """An attribute changed after compiling."""


class ShapeBlock(ScaleBlock):
    """Called with new shapes after a restored entry (the unique-id regression)."""


class ShapeBlockFixed(ScaleBlock):
    """The same, with compile_cache's unique-id fix on."""


class LateBlock(ScaleBlock):
    """Its entry reaches the store only after the loading node compiled (another rank)."""


class PlainBlock(nn.Module):
    """Identical blocks, nothing per block: a precompile hit must trace nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class MaskBlock(nn.Module):
    """An optional tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        if mask is not None:
            y = y * mask
        return y


class DropBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x))) + 1.0


class NormBlock(nn.Module):
    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.lin(x))


def act_a(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


def act_b(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) * 3


def helper(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


def helper2(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


HELPER, HELPER2 = helper, helper2


class HelperBlock(nn.Module):
    """Calls a module-level function (rebound after compiling)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helper(self.lin(x))


class Helper2Block(HelperBlock):
    """Calls another module-level function (bound differently on another node)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helper2(self.lin(x))


class FnAttrBlock(nn.Module):
    """A function stored on the instance: not in the fingerprint, its identity not saveable."""

    def __init__(self, act=act_a) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


class BreakCountBlock(nn.Module):
    """Counts its calls in a buffer, then breaks the graph; the part after the break reads a
    function stored on the instance, so precompile declines in the second frame of a call,
    after the first frame (and its in-place update) already ran."""

    def __init__(self, act=act_a) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.act = act
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        y = self.lin(x)
        torch._dynamo.graph_break()
        return self.act(y)


class BuiltinAttrBlock(FnAttrBlock):
    """A torch builtin stored on the instance (its own class: its own store key)."""


class FlagFnBlock(FnAttrBlock):
    """The same, compiled while the process has caching_precompile on."""


class ArgFnBlock(nn.Module):
    """Calls the function it is given: an argument's identity is no block's, it cannot be pinned."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, fn) -> torch.Tensor:
        return fn(self.lin(x))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, *args, **kwargs)
        return x
