"""Which blocks repeat and what happens to the rest (compile_cache.plan): nothing compiles here."""

from __future__ import annotations

import json

import torch
from _region_models import Head, MixedModel, Nested, SeqModel
from torch import nn

from compile_cache.plan import REASONS, RegionPlan, plan_regions


def _groups(plan: RegionPlan) -> dict[str, tuple[str, ...]]:
    return {g.class_name.rsplit(".", 1)[-1]: g.names for g in plan.groups}


def test_plan_sequential_and_rest():
    plan = plan_regions(SeqModel())
    assert _groups(plan) == {"Block": ("blocks.0", "blocks.1", "blocks.2")}
    rest = {p.name: p.compiled for p in plan.rest}
    # the custom head is compiled on its own; the lone Linear stays eager; ancestors are glue
    assert rest == {"": False, "inp": False, "blocks": False, "head": True}
    assert plan.expected_graphs == 2
    text = str(plan)
    assert "inp" in text and "single torch.nn op" in text and "contains regions" in text
    json.dumps(plan.to_dict())
    d = plan.to_dict()
    assert d["groups"][0]["fingerprint"] == plan.groups[0].fingerprint
    assert len(d["groups"][0]["fingerprint"]) == 32
    assert d["groups"][0]["class_name"].endswith("Block")


def test_plan_mixed_moduledict_attributes():
    plan = plan_regions(MixedModel())
    groups = {g.names for g in plan.groups}
    assert groups == {
        ("layers.0", "layers.2"),
        ("layers.1", "layers.3"),
        ("branches.a", "branches.b"),
        ("enc1", "enc2"),
    }
    # Linears inside the blocks are never regions of their own
    assert not any(n.endswith("fc1") for g in plan.groups for n in g.names)
    assert {p.name for p in plan.rest} == {"", "layers", "branches", "up"}
    assert plan.expected_graphs == 4


def test_plan_nested_stacks_are_maximal():
    plan = plan_regions(Nested())
    assert [g.names for g in plan.groups] == [("stages.0", "stages.1")]


def test_plan_no_repeats_compiles_whole_and_leaves_not_regions():
    plan = plan_regions(Head())
    assert plan.groups == () and [(p.name, p.compiled) for p in plan.rest] == [("", True)]
    # identical Linears / Dropouts repeat but are single torch.nn ops: no region
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(), nn.Linear(4, 4), nn.Dropout())
    assert plan_regions(m).groups == ()


def test_plan_gpt2(tiny_gpt2):
    plan = plan_regions(tiny_gpt2(n_layer=3))
    assert [g.names for g in plan.groups] == [
        ("transformer.h.0", "transformer.h.1", "transformer.h.2")
    ]
    eager = {p.name for p in plan.eager_rest}
    assert {"transformer.wte", "transformer.wpe", "transformer.drop", "transformer.ln_f"} <= eager
    assert "lm_head" in eager and plan.compiled_rest == ()


class _Positions(nn.Module):
    """Parameter-free (a buffer only), like Llama's rotary embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * self.scale)


class _WithPositions(SeqModel):
    def __init__(self) -> None:
        super().__init__()
        self.positions = _Positions()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.positions(self.inp(x))))


def test_a_part_without_parameters_stays_eager_and_says_why():
    plan = plan_regions(_WithPositions())
    rest = {p.name: p for p in plan.rest}
    assert not rest["positions"].compiled and rest["head"].compiled
    assert rest["positions"].reason == REASONS["no_parameters"]
    assert plan.expected_graphs == 2  # the group and the head, not the positions
    assert "holds no parameters" in str(plan)
