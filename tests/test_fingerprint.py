"""Fingerprints: the native backend matches the Python reference byte for byte, and a digest
changes exactly when a covered property of the module tree changes."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable

import pytest
import torch
from conftest import child_pythonpath
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import compile_cache
from compile_cache import Fingerprint, _reference, fingerprint, fingerprint_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    from compile_cache import _C
except ImportError:  # reported as a failure by native(), never as a skip: CI always builds it
    _C = None


def native():
    assert _C is not None, (
        "compile_cache._C is not built; run `pip install --no-build-isolation -e .`"
    )
    assert compile_cache.backend == "native"  # choosing it sets the extension up
    return _C


def both_backends(module: nn.Module, attributes: bool = True) -> list[tuple[str, bytes]]:
    """The digests of both backends, asserted equal; returns them."""
    expected = _reference.fingerprint_tree(module, attributes)
    got = native().fingerprint_tree(module, attributes)
    assert got == expected
    return got


BACKENDS: dict[str, Callable[[nn.Module, bool], list[tuple[str, bytes]]]] = {
    "python": _reference.fingerprint_tree,
    "native": lambda module, attributes: native().fingerprint_tree(module, attributes),
}


def root_digest(backend: str, module: nn.Module, attributes: bool = True) -> bytes:
    return BACKENDS[backend](module, attributes)[0][1]


# ---------------------------------------------------------------------------------------------
# Generated trees: both backends agree.


class Leaf(nn.Module):
    def forward(self, x):
        return x + 1


class Other(nn.Module):
    def forward(self, x):
        if x in {"a", "b", "c"}:  # a frozenset constant: iteration order depends on the hash seed
            return (1.5, -0.0, 2j, b"raw", ..., None)
        return x * 2


def bound_forward(self, x):
    return x - 1


surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
odd_text = st.text(st.characters() | surrogates, max_size=6)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([float("nan"), -0.0, 0.0, 1e-310, 1e300])
    | odd_text
)
primitives = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6)
non_primitives = st.sampled_from([[1, 2], {"a": 1}, {1, 2}, object(), b"bytes", 1j])
child_names = st.text(st.characters(exclude_characters=".") | surrogates, min_size=1, max_size=5)
attribute_names = odd_text.filter(lambda name: name not in _reference.MODULE_INTERNAL_ATTRIBUTES)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8,
          torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn]


@st.composite
def tensors(draw) -> torch.Tensor | None:
    if draw(st.integers(0, 7)) == 0:
        return None
    dtype = draw(st.sampled_from(DTYPES))
    device = draw(st.sampled_from(["meta", "cpu"]))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    tensor = torch.empty(shape, dtype=dtype, device=device)
    view = draw(st.sampled_from(["contiguous", "transpose", "step", "expand"]))
    if view == "transpose" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    elif view == "step" and tensor.dim() >= 1:
        tensor = tensor[..., ::2]
    elif view == "expand" and tensor.dim() >= 1:
        tensor = tensor.unsqueeze(0).expand(3, *tensor.shape)
    return tensor


@st.composite
def module_trees(draw, depth: int = 0, pool: list[nn.Module] | None = None) -> nn.Module:
    pool = [] if pool is None else pool
    kind = draw(st.sampled_from(["leaf", "other", "plain", "list", "seq", "dict", "linear"]))
    if kind == "linear":
        module = nn.Linear(draw(st.integers(1, 4)), draw(st.integers(1, 4)), device="meta")
    else:
        module = {"leaf": Leaf, "other": Other, "plain": nn.Module, "list": nn.ModuleList,
                  "seq": nn.Sequential, "dict": nn.ModuleDict}[kind]()
    pool.append(module)
    for _ in range(draw(st.integers(0, 3 if depth < 3 else 0))):
        name = draw(child_names)
        choice = draw(st.integers(0, 9))
        if choice == 0:
            child = None
        elif choice == 1:  # an existing module: shared, or an ancestor (a cycle)
            child = draw(st.sampled_from(pool))
        else:
            child = draw(module_trees(depth + 1, pool))
        module._modules[name] = child
    for tag in ("_parameters", "_buffers"):
        for _ in range(draw(st.integers(0, 2))):
            tensor = draw(tensors())
            if tag == "_parameters" and tensor is not None:
                grad = tensor.dtype.is_floating_point and draw(st.booleans())
                tensor = nn.Parameter(tensor, requires_grad=grad)
            getattr(module, tag)[draw(child_names)] = tensor
    for _ in range(draw(st.integers(0, 3))):
        module.__dict__[draw(attribute_names)] = draw(primitives | non_primitives)
    forward = draw(st.integers(0, 5))
    if forward == 0:
        module.forward = types.MethodType(bound_forward, module)
    elif forward == 1:
        module.forward = functools.partial(bound_forward, module)  # no __code__
    return module


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(module_trees(), st.booleans())
def test_native_matches_reference_on_generated_trees(module, attributes):
    first = both_backends(module, attributes)
    assert first == native().fingerprint_tree(module, attributes)  # deterministic


@pytest.mark.filterwarnings("ignore::UserWarning")  # experimental dtypes and sparse layouts
def test_every_dtype_and_layout_matches_reference():
    dtypes = {value for value in vars(torch).values() if isinstance(value, torch.dtype)}
    module = nn.Module()
    for index, dtype in enumerate(sorted(dtypes, key=str)):
        try:
            module.register_buffer(f"t{index}", torch.empty(2, 3, dtype=dtype, device="meta"))
        except (RuntimeError, TypeError):
            continue  # dtypes meta cannot allocate (none known today)
    dense = torch.eye(4)
    module.register_buffer("coo", dense.to_sparse())
    module.register_buffer("csr", dense.to_sparse_csr())
    module.register_buffer("csc", dense.to_sparse_csc())
    module.register_buffer("bsr", dense.to_sparse_bsr((2, 2)))
    module.register_buffer("bsc", dense.to_sparse_bsc((2, 2)))
    assert len(module._buffers) > 30
    both_backends(module)


# ---------------------------------------------------------------------------------------------
# What the digest covers, and what it does not.


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3, device="meta")
        self.register_buffer("scale", torch.ones(3, device="meta"))
        self.eps = 1e-5

    def forward(self, x):
        return self.proj(x) * self.scale


class RenamedBlock(Block):
    forward = Block.forward  # same code, different class


class OtherCodeBlock(Block):
    def forward(self, x):
        return self.proj(x) + self.scale


def _replace_weight(block: Block, tensor: torch.Tensor, requires_grad: bool = True) -> None:
    block.proj.weight = nn.Parameter(tensor, requires_grad=requires_grad)


CHANGES: dict[str, Callable[[Block], nn.Module]] = {
    "class": lambda b: RenamedBlock(),
    "forward code": lambda b: OtherCodeBlock(),
    "instance forward": lambda b: setattr(b, "forward", types.MethodType(bound_forward, b)),
    "child name": lambda b: b._modules.update(renamed=b._modules.pop("proj")),
    "param name": lambda b: b.proj._parameters.update(w=b.proj._parameters.pop("weight")),
    "param shape": lambda b: _replace_weight(b, torch.empty(3, 5, device="meta")),
    "param stride": lambda b: _replace_weight(b, torch.empty(4, 3, device="meta").t()),
    "param dtype": lambda b: _replace_weight(b, torch.empty(3, 4, dtype=torch.float16, device="meta")),
    "param device type": lambda b: _replace_weight(b, torch.empty(3, 4)),
    "requires_grad": lambda b: _replace_weight(b, torch.empty(3, 4, device="meta"), False),
    "None param": lambda b: b.proj.register_parameter("bias", None),
    "buffer": lambda b: b.register_buffer("scale", torch.ones(4, device="meta")),
    "extra buffer": lambda b: b.register_buffer("shift", None),
    "attribute value": lambda b: setattr(b, "eps", 1e-6),
    "attribute type": lambda b: setattr(b, "eps", "1e-05"),
    "new attribute": lambda b: setattr(b, "layer_idx", 3),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_covered_change_changes_digest(backend, change):
    block = Block()
    before = root_digest(backend, block)
    changed = CHANGES[change](block) or block
    assert root_digest(backend, changed) != before
    assert root_digest(backend, changed) == root_digest("python", changed)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_attribute_change_ignored_without_attributes(backend):
    block = Block()
    before = root_digest(backend, block, attributes=False)
    block.eps = 0.5
    block.note = "x"
    assert root_digest(backend, block, attributes=False) == before


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_tensor_values_and_device_index_not_covered(backend):
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    second = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    with torch.no_grad():
        second[0].weight.mul_(3)
    assert not torch.equal(first[0].weight, second[0].weight)
    assert root_digest(backend, first) == root_digest(backend, second)
    # 'cpu:0' names the same device type as 'cpu': the index is not part of the encoding.
    indexed = nn.Sequential(nn.Linear(8, 8, device="cpu:0"), nn.LayerNorm(8, device="cpu:0"))
    assert root_digest(backend, indexed) == root_digest(backend, first)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_cycle_is_finite_and_deterministic(backend):
    root = nn.Sequential(Leaf(), Leaf())
    root[1]._modules["back"] = root  # an ancestor registered as a child
    root[0]._modules["self"] = root[0]
    first = BACKENDS[backend](root, True)
    assert [name for name, _ in first] == ["", "0", "1"]
    assert BACKENDS[backend](root, True) == first
    assert first == BACKENDS["python"](root, True)
    plain = nn.Sequential(Leaf(), Leaf())
    assert root_digest(backend, plain) != first[0][1]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_shared_submodule_listed_once(backend):
    shared = Block()
    root = nn.Module()
    root.a = shared
    root.b = shared
    pairs = BACKENDS[backend](root, True)
    names = [name for name, _ in pairs]
    assert names == ["", "a", "a.proj"]
    assert pairs == BACKENDS["python"](root, True)
    twins = nn.Module()
    twins.a, twins.b = Block(), Block()
    assert dict(BACKENDS[backend](twins, True))["b"] == dict(pairs)["a"]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_gpt2_blocks_share_one_digest(backend):
    import transformers
    config = transformers.AutoConfig.for_model(
        "gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    tree = dict(BACKENDS[backend](model, False))
    blocks = [name for name, module in model.named_modules() if type(module).__name__ == "GPT2Block"]
    assert len(blocks) == 2
    assert len({tree[name] for name in blocks}) == 1
    assert tree == dict(BACKENDS["python"](model, False))
    with_attributes = dict(BACKENDS[backend](model, True))  # layer_idx tells blocks apart
    assert len({with_attributes[name] for name in blocks}) == 2


# ---------------------------------------------------------------------------------------------
# Errors: clear exceptions, never a crash.


def test_non_module_raises_type_error_naming_the_type():
    for call in (fingerprint, fingerprint_tree):
        with pytest.raises(TypeError, match="builtins.int"):
            call(42)
    with pytest.raises(TypeError, match="collections.OrderedDict"):
        native().fingerprint_tree(nn.Sequential().state_dict(), True)


def test_native_rejects_broken_modules_with_exceptions():
    module = nn.Module()
    module._parameters["weight"] = [1.0, 2.0]
    with pytest.raises(TypeError, match="weight.*list"):
        native().fingerprint_tree(module, True)
    module = nn.Module()
    module._modules["child"] = "not a module"
    with pytest.raises(TypeError, match="child.*str"):
        native().fingerprint_tree(module, True)
    module = nn.Module.__new__(nn.Module)  # __init__ never ran
    with pytest.raises(TypeError, match="_modules"):
        native().fingerprint_tree(module, True)


def test_native_deep_tree_raises_recursion_error():
    root = node = nn.Module()
    for _ in range(sys.getrecursionlimit() + 10):
        child = nn.Module()
        node._modules["c"] = child
        node = child
    with pytest.raises(RecursionError):
        native().fingerprint_tree(root, True)


# ---------------------------------------------------------------------------------------------
# The public objects and backend selection.


def test_fingerprint_object():
    digest = fingerprint(Block())
    assert isinstance(digest, Fingerprint)
    assert len(digest.hex) == 32 and str(digest) == digest.hex
    assert digest == fingerprint(Block()) and hash(digest) == hash(fingerprint(Block()))
    assert digest != fingerprint(OtherCodeBlock())
    assert Fingerprint.from_hex(digest.hex) == digest
    with pytest.raises(AttributeError):
        digest._digest = b"0" * 16
    tree = fingerprint_tree(nn.Sequential(Block()))
    assert list(tree) == ["", "0", "0.proj"] and all(isinstance(v, Fingerprint) for v in tree.values())


def test_backend_is_native_when_built():
    native()
    assert compile_cache.backend == "native"


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": child_pythonpath(env={}), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environment,
                          capture_output=True, text=True, timeout=120, cwd=REPO)


HASH_SEED_SCRIPT = f"""
    import json, sys
    sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
    import torch  # the extension links against torch's libraries: torch first
    import compile_cache
    from compile_cache import _C, _reference
    from test_fingerprint import Block, Other
    from torch import nn
    model = nn.Sequential(Block(), Other())
    model[1].label = "é\\udc80"
    model[1].sizes = (1, 2.5, None, True, 10**30)
    print(json.dumps({{
        "backend": compile_cache.backend,
        "native": _C.fingerprint_tree(model, True)[0][1].hex(),
        "python": _reference.fingerprint_tree(model, True)[0][1].hex(),
    }}))
"""


def test_digest_stable_across_processes_and_hash_seeds():
    results = []
    for seed in ("1", "2"):
        done = _run(HASH_SEED_SCRIPT, PYTHONHASHSEED=seed, COMPILE_CACHE_BACKEND="")
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert results[0] == results[1]
    assert results[0]["native"] == results[0]["python"]
    assert results[0]["backend"] == "native"


def test_backend_environment_variable():
    forced = _run("import compile_cache; print(compile_cache.backend)", COMPILE_CACHE_BACKEND="python")
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip().splitlines()[-1] == "python"
    # Read when a fingerprint is first needed, not at import: the import works, the use fails.
    bogus = _run("import compile_cache; print('imported', flush=True); compile_cache.backend",
                 COMPILE_CACHE_BACKEND="bogus")
    assert bogus.returncode != 0 and bogus.stdout.strip() == "imported"
    assert "ConfigError: COMPILE_CACHE_BACKEND='bogus'" in bogus.stderr
    assert "'native' or 'python'" in bogus.stderr


def test_unloadable_native_backend_falls_back_with_one_warning_and_a_counter(tmp_path):
    # sys.modules[name] = None makes `from . import _C` raise ImportError, as a broken build would.
    done = _run(
        f"""
        import sys, warnings, json
        sys.modules["compile_cache._C"] = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import compile_cache
            fp = sys.modules["compile_cache.fingerprint"]
            import torch
            compile_cache.compile_regions(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                                          cache_dir={str(tmp_path / "store")!r}, backend="eager")
        print(json.dumps({{
            "backend": compile_cache.backend,
            "fallbacks": fp.backend_fallbacks,
            "warnings": [str(w.message) for w in caught if "native fingerprint backend" in str(w.message)],
            "stats": compile_cache.Store({str(tmp_path / "store")!r}).stats()["backend_fallbacks"],
        }}))
        """,
        COMPILE_CACHE_BACKEND="",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "python"
    assert result["fallbacks"] == 1
    assert len(result["warnings"]) == 1 and "pure-Python backend" in result["warnings"][0]
    assert result["stats"] == 1

    forced = _run("import sys; sys.modules['compile_cache._C'] = None; import compile_cache; "
                  "compile_cache.backend", COMPILE_CACHE_BACKEND="native")
    assert forced.returncode != 0
    assert "BackendUnavailableError" in forced.stderr and "COMPILE_CACHE_BACKEND=native" in forced.stderr


# ---------------------------------------------------------------------------- class lineage

LINEAGE_SOURCE = '''
import torch
from torch import nn


class Base(nn.Module):
    def act(self, y):
        return torch.tanh(y)


class Block(Base):
    kind = "tanh"
    sizes = (1, 2)

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if self.kind in {"tanh", "relu", "gelu"}:  # a frozenset constant: its order varies by seed
            return self.act(self.lin(x))
        return [v * 2 for v in self.lin(x)][0]  # a nested code object
'''


def _lineage_module(tmp_path, name: str, source: str) -> types.ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = __import__("importlib.util").util.spec_from_file_location(name, path)
    module = __import__("importlib.util").util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_class_lineage_follows_the_mro_code_and_class_values(tmp_path):
    """A precompiled entry is named by the lineage: what a loaded entry matches by name only."""
    from compile_cache.fingerprint import class_lineage

    mod = _lineage_module(tmp_path, "cc_lineage_a", LINEAGE_SOURCE)
    base = class_lineage(mod.Block())
    assert base == class_lineage(mod.Block())
    changed = []
    mod.Block.kind = "relu"  # a class attribute set at run time
    changed.append(class_lineage(mod.Block()))
    mod.Block.kind = "tanh"
    mod.Base.act = lambda self, y: torch.relu(y)  # a base's function rebound
    changed.append(class_lineage(mod.Block()))
    edited = [
        LINEAGE_SOURCE.replace("class Block(Base):", "class Block(nn.Module):\n    act = Base.act"),
        LINEAGE_SOURCE + "\n\nBlock.helper = staticmethod(lambda y: y)\n",  # a class function added
        LINEAGE_SOURCE.replace("return torch.tanh(y)", "return torch.sigmoid(y)"),  # a base's code
        LINEAGE_SOURCE.replace("v * 2", "v * 3"),  # inside a comprehension of forward
    ]
    for i, source in enumerate(edited):
        other = _lineage_module(tmp_path, f"cc_lineage_b{i}", source.replace("cc_lineage_a", ""))
        # another module name would change the lineage anyway: compare under the same name
        other.Block.__module__ = other.Base.__module__ = "cc_lineage_a"
        changed.append(class_lineage(other.Block()))
    assert base not in changed and len(set(changed)) == len(changed)
    # torch's own classes are left to the environment key: a plain nn.Linear has no lineage
    assert class_lineage(nn.Linear(2, 2)) == class_lineage(nn.Sequential(nn.Linear(3, 3)))


def test_class_lineage_is_the_same_in_every_process_and_hash_seed(tmp_path):
    (tmp_path / "cc_lineage_p.py").write_text(LINEAGE_SOURCE)
    script = f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import cc_lineage_p
        from compile_cache.fingerprint import class_lineage
        print(class_lineage(cc_lineage_p.Block()))
    """
    results = set()
    for seed in ("1", "2", "3"):
        done = _run(script, PYTHONHASHSEED=seed)
        assert done.returncode == 0, done.stderr
        results.add(done.stdout.strip().splitlines()[-1])
    assert len(results) == 1


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_stand_in_forward_is_fingerprinted_as_the_forward_it_replaces(backend: str) -> None:
    """compile_cache replaces kernels' attention wrapper by a stand-in while regions run
    (torch_compat.kv.wrapped_forward): the key must not depend on whether it is installed yet."""

    class Layer(nn.Linear):
        def forward(self, x):  # noqa: ANN001, ANN201
            return super().forward(x) * 2

    import types

    before = root_digest(backend, Layer(2, 2))

    def stand_in(self, x):  # noqa: ANN001, ANN202
        return x

    unmarked = Layer(2, 2)
    unmarked.forward = types.MethodType(stand_in, unmarked)  # type: ignore[method-assign]
    assert root_digest(backend, unmarked) != before  # another function: another digest
    stand_in.__compile_cache_fingerprint_as__ = Layer.forward  # type: ignore[attr-defined]
    marked = Layer(2, 2)
    marked.forward = types.MethodType(stand_in, marked)  # type: ignore[method-assign]
    assert root_digest(backend, marked) == before
    both_backends(marked)
