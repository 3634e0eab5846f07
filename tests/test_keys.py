"""compile_cache.keys: the store key (model, plan, keywords, environment, precompile) and the
environment key (fields, digest stability across processes, sensitivity)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import child_pythonpath

import compile_cache
from compile_cache import keys as envmod
from compile_cache.demo import TinyTransformer

REPO = Path(__file__).resolve().parents[1]


def test_fields_present() -> None:
    env = envmod.environment()
    for key in (
        "torch",
        "torch_git",
        "torch_debug",
        "torch_cuda",
        "python",
        "triton",
        "machine",
        "cpu_threads",
        "cpu_capability",
        "default_dtype",
        "inductor_config",
        "functorch_config",
        "dynamo_config",
        "cuda_available",
    ):
        assert key in env, key
        assert isinstance(env[key], str)
    assert env["torch"] == torch.__version__
    assert env["cpu_threads"] == str(torch.get_num_threads())


def test_cheap_once_torch_configs_loaded() -> None:
    envmod.environment()
    t0 = time.perf_counter()
    envmod.environment()
    assert time.perf_counter() - t0 < 0.5  # measured ~6 ms; generous for a shared machine


def _digest_in_subprocess(seed: str, cwd: Path) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    env["PYTHONPATH"] = child_pythonpath(env=env)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from compile_cache.keys import environment_digest; print(environment_digest())",
        ],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_digest_stable_across_processes(tmp_path: Path) -> None:
    a = _digest_in_subprocess("1", tmp_path)
    b = _digest_in_subprocess("12345", REPO)
    assert a == b
    assert len(a) == 32 and int(a, 16) >= 0


def test_digest_changes_with_threads() -> None:
    before = envmod.environment_digest()
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(n + 1)
        assert envmod.environment_digest() != before
    finally:
        torch.set_num_threads(n)
    assert envmod.environment_digest() == before


def test_digest_changes_with_inductor_config() -> None:
    import torch._inductor.config as ic

    before = envmod.environment_digest()
    with ic.patch({"cpp.vec_isa_ok": not ic.cpp.vec_isa_ok}):
        assert envmod.environment_digest() != before
    with ic.patch(max_autotune=not ic.max_autotune):
        assert envmod.environment_digest() != before
    assert envmod.environment_digest() == before


def test_digest_of_given_env_is_order_independent() -> None:
    assert envmod.environment_digest({"a": "1", "b": "2"}) == envmod.environment_digest(
        {"b": "2", "a": "1"}
    )


def _model(width: int = 32, dtype: torch.dtype = torch.float32) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(layers=2, width=width, heads=2, vocab=64).eval().to(dtype)


def test_key_changes_with_shape_dtype_and_compile_kwargs() -> None:
    def key(model: TinyTransformer, **kwargs: object) -> str:
        return envmod.entry_key(model, compile_cache.plan_regions(model), kwargs, False)

    base = key(_model())
    assert key(_model()) == base
    assert key(_model(width=16)) != base
    assert key(_model(dtype=torch.float64)) != base
    assert key(_model(), mode="max-autotune") != base
    assert key(_model(), dynamic=True) != base
    assert envmod.entry_key(_model(), compile_cache.plan_regions(_model()), {}, True) != base


# -- one compile, one key ------------------------------------------------------------------------
EQUAL_COMPILES: list[dict[str, object]] = [
    {}, {"backend": "inductor"}, {"mode": "default"}, {"fullgraph": False}, {"dynamic": None},
    {"mode": None, "options": {}, "disable": False, "backend": None},
]


def test_equal_compiles_give_one_key() -> None:
    model = _model()
    plan = compile_cache.plan_regions(model)
    keys = {envmod.entry_key(model, plan, kwargs, False) for kwargs in EQUAL_COMPILES}
    assert len(keys) == 1
    assert envmod.entry_key(model, plan, {"mode": "max-autotune"}, False) not in keys
    assert envmod.entry_key(model, plan, {"fullgraph": True}, False) not in keys
    assert envmod.entry_key(model, plan, {"dynamic": False}, False) not in keys
    assert envmod.entry_key(model, plan, {"backend": "eager"}, False) not in keys


def test_defaults_come_from_torchs_own_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose torch.compile changes a default is handled without a change in keys.py."""

    def compile_with_other_defaults(model=None, *, fullgraph=True, dynamic=None, backend="inductor",
                                    mode=None, options=None, disable=False):  # noqa: ANN001, ANN202
        raise AssertionError("never called")

    assert envmod.canonical_compile_kwargs({"fullgraph": True}) == {"fullgraph": True}
    monkeypatch.setattr(torch, "compile", compile_with_other_defaults)
    assert envmod.canonical_compile_kwargs({"fullgraph": True}) == {}
    assert envmod.canonical_compile_kwargs({"fullgraph": False}) == {"fullgraph": False}


def test_the_record_says_readably_what_went_into_the_key() -> None:
    model = _model()
    fields = envmod.key_fields(model, compile_cache.plan_regions(model),
                               {"mode": "default", "dynamic": True}, True)
    record = json.loads(json.dumps(fields.record))  # JSON as entry.json keeps it
    assert record["compile"] == {"dynamic": True}  # the canonical settings, defaults dropped
    assert record["precompile"] is True
    assert record["environment"]["cpu_threads"] == str(torch.get_num_threads())
    assert record["environment_key"] == envmod.environment_digest(envmod.environment(["cpu"]))
    assert record["model"]["dtypes"] == ["float32"] and record["model"]["devices"] == ["cpu"]
    assert record["model"]["class"] == "compile_cache.demo.TinyTransformer"
    assert record["plan"]["groups"] and "x2" in record["plan"]["groups"][0]
    double = envmod.key_fields(_model(dtype=torch.float64), compile_cache.plan_regions(_model()), {}, True)
    # Another dtype is another fingerprint and key, but the same model (explain matches on it).
    assert double.record["model"]["structure"] == record["model"]["structure"]
    assert double.record["model"]["fingerprint"] != record["model"]["fingerprint"]
    assert double.record["model"]["dtypes"] == ["float64"]
    other = envmod.key_fields(_model(width=16), compile_cache.plan_regions(_model(width=16)), {}, True)
    assert other.record["model"]["structure"] != record["model"]["structure"]


# --------------------------------------------------------------------------------------------
# Per device kind: CPU facts for CPU graphs, GPU facts for GPU graphs, no device count


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """torch.cuda answering as a node with ``count["n"]`` GPUs of one model (no CUDA here)."""
    import types

    count = {"n": 8}
    props = types.SimpleNamespace(name="Stand-in H200", major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count["n"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx=0: props)
    return count


def test_gpu_graphs_key_gpu_facts_not_threads_nor_the_device_count(fake_gpus: dict[str, int]) -> None:
    gpu = envmod.environment(["cuda"])
    assert gpu["device_name"] == "Stand-in H200" and gpu["device_capability"] == "9.0"
    assert {"torch_cuda", "triton", "cuda_available"} <= set(gpu)
    assert "cpu_threads" not in gpu and "cpu_capability" not in gpu and "device_count" not in gpu
    before = envmod.environment_digest(gpu)
    cpu_before = envmod.environment_digest(envmod.environment(["cpu"]))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(n + 1)  # what OMP_NUM_THREADS=1 under torchrun changes
        fake_gpus["n"] = 1  # --virtual-local-rank: each rank sees one GPU
        assert envmod.environment_digest(envmod.environment(["cuda"])) == before
        assert envmod.environment_digest(envmod.environment(["cpu"])) != cpu_before
    finally:
        torch.set_num_threads(n)
    cpu = envmod.environment(["cpu"])
    assert "device_name" not in cpu and "triton" not in cpu and cpu["cpu_threads"] == str(n)
    whole = envmod.environment()  # doctor, the distributed hazard check: every fact
    assert {"cpu_threads", "device_name"} <= set(whole) and "device_count" not in whole


def _digests_in_subprocess(threads: str) -> dict[str, str]:
    code = ("import json, torch; from compile_cache import keys, plan_regions; "
            "from compile_cache.demo import TinyTransformer; out = {}\n"
            "for device in ('cpu', 'meta'):\n"
            "    torch.manual_seed(0)\n"
            "    m = TinyTransformer(layers=2, width=32, heads=2, vocab=64).eval().to(device)\n"
            "    out[device] = keys.entry_key(m, plan_regions(m), {}, False)\n"
            "print(json.dumps(out))")
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    env["PYTHONPATH"] = child_pythonpath(env=env)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_omp_num_threads_changes_the_key_of_cpu_graphs_only() -> None:
    """Two processes, OMP_NUM_THREADS=1 (torchrun's) and 2: a model whose tensors are on the CPU
    gets two keys; a model whose graphs are not CPU graphs (meta tensors stand in for a GPU)
    gets one."""
    one, two = _digests_in_subprocess("1"), _digests_in_subprocess("2")
    assert one["cpu"] != two["cpu"]
    assert one["meta"] == two["meta"]


def test_region_devices_come_from_parameters_and_buffers() -> None:
    model = _model()
    assert envmod.region_devices(model) == ["cpu"]
    assert envmod.region_devices(model.to("meta")) == ["meta"]
    assert envmod.region_devices(torch.nn.ReLU()) is None  # no tensors: every fact is keyed
    assert "cpu_threads" in envmod.key_fields(
        torch.nn.Sequential(torch.nn.ReLU()), compile_cache.plan_regions(torch.nn.ReLU()), {}, False
    ).record["environment"]
    record = envmod.key_fields(model, compile_cache.plan_regions(model), {}, False).record
    assert record["key_format"] == envmod.KEY_FORMAT == 2
    assert record["environment"]["devices"] == "meta" and "cpu_threads" not in record["environment"]


def test_compile_on_one_rank_is_in_the_key_only_when_set() -> None:
    import torch.distributed.config as dist_config

    before = envmod.environment(["cuda"])
    assert "compile_on_one_rank" not in before
    with dist_config.patch(compile_on_one_rank=True):  # a config module: patch(), not setattr
        after = envmod.environment(["cuda"])
    assert after["compile_on_one_rank"] == "True"
    assert envmod.environment_digest(after) != envmod.environment_digest(before)
    assert envmod.environment(["cuda"]) == before


def test_compile_on_one_rank_is_read_from_its_new_home_without_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch >= 2.14 moved compile_on_one_rank to torch.compiler.config; reading the old name
    in torch.distributed.config warns (FutureWarning) in every process. Here torch 2.13's
    modules get 2.14's shape: the setting is read from its new home, and nothing warns."""
    import types
    import warnings

    def deprecated_alias(name: str) -> bool:
        if name != "compile_on_one_rank":
            raise AttributeError(name)
        warnings.warn("torch.distributed.config.compile_on_one_rank is deprecated, use "
                      "torch.compiler.config.compile_on_one_rank instead", FutureWarning, stacklevel=2)
        return False

    new_home = types.ModuleType("torch.compiler.config")
    new_home.compile_on_one_rank = True  # type: ignore[attr-defined]
    old_home = types.ModuleType("torch.distributed.config")
    old_home.__getattr__ = deprecated_alias  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "torch.compiler.config", new_home)
    monkeypatch.setitem(sys.modules, "torch.distributed.config", old_home)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = envmod.environment(["cuda"])
    assert env["compile_on_one_rank"] == "True"
    new_home.compile_on_one_rank = False  # type: ignore[attr-defined]
    assert "compile_on_one_rank" not in envmod.environment(["cuda"])


def test_explain_names_the_new_environment_fields(fake_gpus: dict[str, int]) -> None:
    """A GPU entry against a start whose compile_on_one_rank differs, and a CPU entry of the same
    model: explain names the device kinds, the setting and the GPU model, with a label each."""
    from compile_cache import explain

    gpu = {"environment": envmod.environment(["cuda"])}
    other = {"environment": dict(gpu["environment"], compile_on_one_rank="True",
                                 device_name="Stand-in A100")}
    cpu = {"environment": envmod.environment(["cpu"])}
    fields = {d.field: d for d in explain.compare(gpu, other)}
    assert set(fields) == {"environment.compile_on_one_rank", "environment.device_name"}
    assert "compile_on_one_rank" in fields["environment.compile_on_one_rank"].label
    assert fields["environment.device_name"].label.startswith("GPU model")
    devices = {d.field: d for d in explain.compare(gpu, cpu)}["environment.devices"]
    assert (devices.here, devices.there) == ("cuda", "cpu") and "device kinds" in devices.label
    assert explain.short_value(gpu, "environment.devices") == "devices=cuda"
