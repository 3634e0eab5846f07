"""The regions' automatic-dynamic decisions carried by the store
(compile_cache/torch_compat/dynamic_shapes.py; published by compile_cache/capture.py, put in place
by compile_cache/session.py before the first compile).

Logic tests use a recording backend in this process; the fresh-node chain runs real Inductor in
child processes (tests/_dynamic_child.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import drop_precompiled_headers
from torch import nn

from compile_cache import compile_regions, get_plan
from compile_cache.store import Store, misses
from compile_cache.torch_compat import dynamic_shapes
from compile_cache.torch_compat.precompile import names

pytestmark = pytest.mark.usefixtures("dynamo_reset")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _owners(model: nn.Module) -> list[str]:
    plan = get_plan(model)
    return [g.code_name for g in plan.groups] + [p.code_name for p in plan.compiled_rest]


def _record_at(backend, *lengths: int) -> dict:
    """The record of a process that ran the model at ``lengths`` (then forgotten: a new node)."""
    model = _Stack()
    compile_regions(model, backend=backend, cache_dir=False)
    for n in lengths:
        model(torch.randn(2, n, 8))
    state = dynamic_shapes.snapshot(_owners(model))
    torch._dynamo.reset()  # Dynamo's record too: the next "process" starts without it
    backend.graphs.clear()
    return state


def test_a_record_says_which_dimension_varied_and_round_trips_as_json(counting_backend):
    one = _record_at(counting_backend, 5)
    assert dynamic_shapes.summary(one) == {}  # one length: nothing dynamic
    two = _record_at(counting_backend, 5, 7)
    (group,) = two["codes"].values()
    assert group["name"].startswith("region__Block_")
    assert dynamic_shapes.summary(two) == {group["name"]: ["L['args'][0] (dim 1)"]}
    # the decisions a record-only pack needs: none at one length (sizes seen once), one at two
    (key,) = two["codes"]
    assert dynamic_shapes.decisions(one) == set()
    assert dynamic_shapes.decisions(two) == {(key, "L['args'][0]", "size", 1)}
    again = json.loads(dynamic_shapes.encode_state(two))
    assert again == two and dynamic_shapes.encode_state(again) == dynamic_shapes.encode_state(two)
    # merged across nodes: a dimension seen to vary anywhere is dynamic
    merged = dynamic_shapes.merge(one, _record_at(counting_backend, 9))
    assert dynamic_shapes.summary(merged) == dynamic_shapes.summary(two)
    assert dynamic_shapes.merge(one, one) == one


def test_a_precompiled_groups_record_travels_too(counting_backend):
    """With precompile a group compiles as its precompiled function, named after the group and
    the key (the same name on every node): its record is the group's and is carried; another
    model's function is not."""
    model = _Stack()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    owners = _owners(model)

    def template(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2

    ours = names.region_function(template, f"{owners[0]}{names.INFIX}{'a' * 20}")
    theirs = names.region_function(template, f"region_Other_0{names.INFIX}{'b' * 20}")
    for fn in (ours, theirs):
        compiled = torch.compile(fn, backend=counting_backend)
        for n in (5, 7):
            compiled(torch.randn(2, n))
    state = dynamic_shapes.snapshot(owners)
    assert dynamic_shapes.summary(state) == {ours.__name__: ["L['x'] (dim 1)"]}
    torch._dynamo.reset()  # a fresh node: its first call of that function compiles dynamic
    graphs, symbolic = len(counting_backend.graphs), counting_backend.symbolic
    assert dynamic_shapes.install(state) == 1
    torch.compile(ours, backend=counting_backend)(torch.randn(2, 9))
    assert len(counting_backend.graphs) == graphs + 1 and counting_backend.symbolic == symbolic + 1


def test_a_restored_record_makes_the_first_compile_dynamic(counting_backend):
    merged = dynamic_shapes.merge(_record_at(counting_backend, 5), _record_at(counting_backend, 7))
    model = _Stack()
    ref = [model(torch.randn(2, n, 8, generator=torch.Generator().manual_seed(n))) for n in (9, 11, 4)]
    assert dynamic_shapes.install(merged) == 1  # one dimension new to this process
    compile_regions(model, backend=counting_backend, cache_dir=False)
    out = [model(torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(9)))]
    first = len(counting_backend.graphs)
    # the first call at a length no process saw compiled dynamic graphs only
    assert first and counting_backend.symbolic == first
    out += [model(torch.randn(2, n, 8, generator=torch.Generator().manual_seed(n))) for n in (11, 4)]
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want)
    assert len(counting_backend.graphs) == first  # nothing compiled since


def test_without_a_record_the_first_compile_is_static(counting_backend):
    model = _Stack()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    model(torch.randn(2, 9, 8))
    assert counting_backend.graphs and counting_backend.symbolic == 0


def test_dynamic_false_still_compiles_a_static_graph_per_length(counting_backend):
    merged = dynamic_shapes.merge(_record_at(counting_backend, 5), _record_at(counting_backend, 7))
    dynamic_shapes.install(merged)
    model = _Stack()
    compile_regions(model, backend=counting_backend, dynamic=False, cache_dir=False)
    model(torch.randn(2, 9, 8))
    first = len(counting_backend.graphs)
    for n in (11, 12):
        model(torch.randn(2, n, 8))
    assert first and len(counting_backend.graphs) == 3 * first and counting_backend.symbolic == 0


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        if mask is not None:
            y = y + mask
        return torch.relu(self.out(y))


class _Towers(nn.Module):
    """CLIP's shape: one group (two towers), called with keywords, for the text with a mask and
    for the image without one, at another length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.text = _Tower()
        self.vision = _Tower()

    def forward(self, t: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.text(x=t, mask=torch.zeros(t.shape[1], 8)), self.vision(x=v)


def _towers_at(backend, record: dict | None, *texts: int) -> tuple[list, Any, Any]:
    """A "process" that installs ``record``, then runs text at ``texts`` (image at 5 each time):
    (its graphs: symbolic or not, placeholder shapes; its record; torch's own, unfiltered)."""
    from compile_cache.torch_compat import dynamo

    if record is not None:
        dynamic_shapes.install(record)
    model = _Towers()
    compile_regions(model, backend=backend, cache_dir=False)
    for n in texts:
        model(torch.randn(1, n, 8), torch.randn(1, 5, 8))
    owners = _owners(model)
    state = dynamic_shapes.snapshot(owners)
    real = dynamo.guard_failures
    dynamo.guard_failures = dict  # no recompile known: torch's record as it is
    try:
        raw = dynamic_shapes.snapshot(owners)
    finally:
        dynamo.guard_failures = real
    graphs = [(backend.is_symbolic(gm), [str(getattr(n.meta.get("example_value"), "shape", n.name))
                                         for n in gm.graph.find_nodes(op="placeholder")])
              for gm in backend.graphs]
    torch._dynamo.reset()
    backend.graphs.clear()
    return graphs, state, raw


@pytest.mark.filterwarnings("ignore::compile_cache.regions.RegionRecompileWarning")
def test_a_recompile_for_other_arguments_carries_no_decision(counting_backend):
    """CLIP on a fresh node compiled a dynamic graph for its first (text) call that the store did
    not have: the publisher had compiled the text static, then the image (other arguments, another
    length) dynamic, and torch's record said the length varies. A decision made at a recompile
    for other arguments does not travel: the next node compiles what the publisher did."""
    first, state, raw = _towers_at(counting_backend, None, 7)
    assert [symbolic for symbolic, _ in first] == [False, True], first  # torch's own rule
    assert "(dim 1)" in str(dynamic_shapes.summary(raw)), raw  # what the branch used to carry
    assert dynamic_shapes.summary(state) == {} and dynamic_shapes.decisions(state) == set(), state
    again, state2, _ = _towers_at(counting_backend, state, 7)
    assert again == first and dynamic_shapes.summary(state2) == {}, (again, first)
    # the text at a new length on the same path (a failing size guard): that decision travels
    _, grown, _ = _towers_at(counting_backend, state, 7, 9)
    ((code, inputs),) = dynamic_shapes.summary(grown).items()
    assert code.startswith("region__Tower_") and "L['kwargs']['x'] (dim 1)" in inputs, grown
    # and a restored decision is kept, whatever this process's recompiles were
    _, kept, _ = _towers_at(counting_backend, grown, 7)
    assert dynamic_shapes.summary(kept) == dynamic_shapes.summary(grown), kept


class _Masked(nn.Module):
    """Two towers (one group) called with a mask, or without one (another path)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.towers = nn.ModuleList([_Tower(), _Tower()])

    def forward(self, x: torch.Tensor, masked: bool) -> torch.Tensor:
        with torch.no_grad():  # the second tower's input requires no grad either: one entry
            for tower in self.towers:
                x = tower(x=x, mask=torch.zeros(x.shape[1], 8)) if masked else tower(x=x)
        return x


@pytest.mark.filterwarnings("ignore::compile_cache.regions.RegionRecompileWarning")
def test_a_decision_of_the_first_compile_travels_whatever_recompiles_follow(counting_backend):
    """A precompiled group's ``__cache`` function on node 2: its first compile (a new prompt
    length against the restored record's) is dynamic, its next block's call recompiles on a path
    guard (the cache's ``is_initialized``). The first compile's decision came from a new size: it
    travels; what a path recompile alone would decide does not."""
    model = _Masked()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    model(torch.randn(1, 7, 8), True)
    record = dynamic_shapes.snapshot(_owners(model))
    assert dynamic_shapes.summary(record) == {} and record is not None  # one length: static 7
    torch._dynamo.reset()
    counting_backend.graphs.clear()
    assert dynamic_shapes.install(record) == 0
    model = _Masked()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    model(torch.randn(1, 9, 8), True)  # a new length: the first compile is dynamic
    model(torch.randn(1, 9, 8), False)  # another path: a recompile, not for a size
    assert [counting_backend.is_symbolic(gm) for gm in counting_backend.graphs] == [True, True]
    state = dynamic_shapes.snapshot(_owners(model))
    ((code, inputs),) = dynamic_shapes.summary(state).items()
    assert code.startswith("region__Tower_") and "L['kwargs']['x'] (dim 1)" in inputs, state
    # without the restored record the same calls compile static, then dynamic for the path:
    # that decision stays here (the CLIP rule)
    torch._dynamo.reset()
    counting_backend.graphs.clear()
    model = _Masked()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    model(torch.randn(1, 9, 8), True)
    model(torch.randn(1, 7, 8), False)
    assert [counting_backend.is_symbolic(gm) for gm in counting_backend.graphs] == [False, True]
    assert dynamic_shapes.summary(dynamic_shapes.snapshot(_owners(model))) == {}


def test_shape_reasons_are_size_changes_only():
    assert dynamic_shapes.shape_reason("0/0: tensor 'args[0]' size mismatch at index 1. expected 7, actual 9")
    assert dynamic_shapes.shape_reason("0/1: 2 <= args[0].size()[1]  # x.shape[1] (_dynamo/x.py:3)")
    assert dynamic_shapes.shape_reason("0/0: n == 5", ["L['n']"])
    assert not dynamic_shapes.shape_reason("0/0: n == 5", ["L['m']"])
    assert not dynamic_shapes.shape_reason("0/0: len(kwargs) == 1")
    assert not dynamic_shapes.shape_reason("0/0: tensor 'x' dtype mismatch. expected Float, actual Half")
    assert not dynamic_shapes.shape_reason("0/0: ___check_obj_id(kwargs['mask'], 94)")


def test_a_malformed_record_is_left_out(counting_backend, caplog):
    state = _record_at(counting_backend, 5, 7)
    (code,) = state["codes"].values()
    code["inputs"]["L['args'][0]"]["size"] = [2, "huge", 8]
    assert dynamic_shapes.install(state) == 0
    assert "malformed" in caplog.text
    assert dynamic_shapes.install({"version": 99, "codes": {}}) == 0


def test_a_record_round_trips_on_a_torch_whose_code_ids_have_no_closure_hash(
        counting_backend, monkeypatch):
    """torch 2.11's ``pgo.CodeId`` has four fields (2.13's adds ``closure_hash``): a record must
    still be taken and put in place there (reading the field broke every publish on 2.11)."""
    import dataclasses

    from torch._dynamo import pgo

    @dataclasses.dataclass(frozen=True)
    class CodeId211:  # torch 2.11's CodeId: no closure_hash; equal by file hash, line and name
        filename: str
        firstlineno: int
        name: str
        file_hash: str

        def __eq__(self, other: object) -> bool:
            return isinstance(other, CodeId211) and (self.file_hash, self.firstlineno, self.name) == (
                other.file_hash, other.firstlineno, other.name)

        def __hash__(self) -> int:
            return hash((self.file_hash, self.name, self.firstlineno))

        @staticmethod
        def make(code: Any, closure: Any = None) -> CodeId211:
            return CodeId211(code.co_filename, code.co_firstlineno, code.co_name,
                             pgo._hash_containing_file(code.co_filename))

    monkeypatch.setattr(pgo, "CodeId", CodeId211)
    merged = dynamic_shapes.merge(_record_at(counting_backend, 5), _record_at(counting_backend, 7))
    (code,) = merged["codes"].values()
    assert code["closure_hash"] is None
    assert dynamic_shapes.summary(merged) == {code["name"]: ["L['args'][0] (dim 1)"]}
    assert dynamic_shapes.install(merged) == 1
    model = _Stack()
    compile_regions(model, backend=counting_backend, cache_dir=False)
    model(torch.randn(2, 9, 8))
    assert counting_backend.graphs and counting_backend.symbolic == len(counting_backend.graphs)


# ------------------------------------------------------------- fresh nodes, real Inductor

CHILD = Path(__file__).with_name("_dynamic_child.py")


def _node(root: Path, store: Path, length: int | str, *args: str) -> dict:
    """One process on the node ``root`` (its own TMPDIR, HOME, XDG_CACHE_HOME, local cache dirs)."""
    from conftest import fresh_node_env

    # precompile on (off by default): the store holds the groups' precompiled entries
    env = fresh_node_env(root, COMPILE_CACHE_PRECOMPILE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(CHILD.parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(CHILD), str(store), str(length), *args], env=env,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.inductor
def test_new_prompt_lengths_on_fresh_nodes_compile_nothing_after_two_nodes(tmp_path, build_machine):
    """Four nodes sharing one store, against eager.

    generate() of a tiny Llama and GPT-2 at prompts of 16, 10, 12 and 24 tokens, one node each.
    Node 1 (the session's build machine: a publisher, it restores nothing) compiles static
    graphs and publishes what it saw; node 2 (fresh, as are 3 and 4) restores that, sees another
    length, so compiles the dynamic graphs and publishes them with the merged record; nodes 3
    and 4 compile nothing: their blocks' calls with the cache (the prefill, issue 35's traced
    update: the group's ``__cache`` function) run the dynamic entries node 2 published.

    A generate() prefill and forwards at new lengths after a warm over a range, in the same
    processes, on a tiny Qwen2 (another key, other code objects, so nothing the generates
    compiled serves them): node 1, after its generates, runs compile_cache.warm() of its forward
    with a KV cache (``warm --use-cache``) at 16, 32 and 64 tokens (graphs the store lacked: it
    compiles them); node 4 runs its generate() prefill at 48 tokens first (its code objects fresh
    in the process: what it needs comes from the store), then forwards at 24, 40 and 20 tokens,
    and compiles nothing. Costs four child processes, two with Inductor compiles."""
    store = tmp_path / "store"
    then = {16: ("warm=16,32,64",), 24: ("prefill=48", "forward=24,40,20")}
    roots = {16: build_machine, 10: tmp_path / "node-10", 12: tmp_path / "node-12", 24: tmp_path / "node-24"}
    nodes = {length: _node(roots[length], store, length, *then.get(length, ()))
             for length in (16, 10, 12, 24)}
    (tmp_path / "nodes.json").write_text(json.dumps(nodes))  # what each node did, for a failure
    drop_precompiled_headers(tmp_path)  # node 2's 149 MB header (the build machine's is shared)
    for length, result in nodes.items():
        for arch in ("llama", "gpt2"):
            got = result[arch]
            assert got["equal"] and not got["errors"], (length, arch, got)
    for arch in ("llama", "gpt2"):
        assert nodes[16][arch]["fx_misses"] > 0 and nodes[10][arch]["restored_packs"] > 0
        for length in (12, 24):
            got = nodes[length][arch]
            loaded = {g for g, status in got["precompile_groups"].items() if status == "loaded"}
            assert got["fx_misses"] == 0 and any(g.endswith("__cache") for g in loaded), (length, arch, got)
            # the regions' record said which dimensions vary: the prompt length
            dims = [d for inputs in got["dynamic_inputs"].values() for d in inputs]
            assert any("L['args'][0] (dim 1)" == d for d in dims), got["dynamic_inputs"]
    # node 2's partial hit (restored, then compiled) is explained: which dimension, a later hit
    recorded = misses.last_partials(Store(store))
    for arch in ("llama", "gpt2"):
        got = nodes[10][arch]
        assert any("dim 1" in c and "hits at any size" in c for c in got["partial_causes"]), got
        (mine,) = [p for p in recorded if p["key"] == got["key"] and p["pid"] == got["pid"]]
        kinds = {c["kind"] for c in mine["causes"]}
        assert "shape" in kinds and "path" not in kinds, mine  # node 1 took the same paths
    warm, prefill, later = nodes[16]["warm"], nodes[24]["prefill"], nodes[24]["forward"]
    assert warm["fx_misses"] > 0 and not warm["errors"], warm  # the store lacked these graphs
    # the prefill at a length the warm never ran: the warm's dynamic graphs, from the store
    assert prefill["equal"] == [True] and not prefill["errors"], prefill
    assert prefill["restored_packs"] > 0 and prefill["fx_misses"] == 0, prefill
    assert prefill["fx_hits"] + prefill["precompile_hits"] > 0, prefill  # the store served it
    assert later["equal"] == [True, True, True] and not later["errors"], later
    assert later["restored_packs"] > 0 and later["fx_misses"] == 0, later
    assert later["fx_hits"] + later["precompile_hits"] > 0, later
    # the blocks called with a cache compile through their group's ``__cache`` precompiled
    # function (issue 35): its record travelled, the length dynamic; so did the final norm's
    # (precompiled functions are named after the group or part and the key, the same on every node)
    for got in (prefill, later):
        records = got["dynamic_inputs"]
        assert any(code.startswith("region_") and names.owner_of(code).endswith("__cache")
                   and "dim 1" in " ".join(inputs) for code, inputs in records.items()), records
        assert any(code.startswith("part_") and names.INFIX in code for code in got["record_codes"]), got


@pytest.mark.inductor
def test_dynamic_false_compiles_a_static_graph_per_length_on_fresh_nodes(tmp_path, build_machine):
    """``dynamic=False`` on nodes sharing one store, against eager: a tiny Llama's generate() at
    20 tokens publishes; a fresh node at 14 tokens restores those packs, yet its prefill and decode
    steps at the new lengths compile static graphs of their own (no restored decision makes an
    input dynamic), and ``explain``'s partial-hit causes say the pin is why. (``dynamic=False``
    is part of the key: the store's dynamic entries of the same model are never this one's.)"""
    store = tmp_path / "store"
    first = _node(build_machine, store, 20, "static", "llama")["llama"]
    second = _node(tmp_path / "node-14", store, 14, "static", "llama")["llama"]
    drop_precompiled_headers(tmp_path)
    for got in (first, second):
        assert got["equal"] and not got["errors"] and got["dynamic_inputs"] == {}, got
    assert first["fx_misses"] > 0 and first["published_packs"] > 0, first
    assert second["key"] == first["key"] and second["restored_packs"] > 0, second
    assert second["fx_misses"] > 0, second  # the new lengths: graphs of their own
    assert any("dynamic=False pins static graphs" in cause for cause in second["partial_causes"]), second
