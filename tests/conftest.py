"""Shared test fixtures: Dynamo reset, a graph-counting backend, tiny transformers models."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite never reads or writes the real home: the default store
    (``~/.cache/compile_cache``) and local dirs live in a home of this test run. A store left in the
    real home by an earlier run would turn a test's compile into a hit (with precompile, one that
    traces nothing), and the tests would depend on what ran before them."""
    home = tmp_path_factory.mktemp("home")
    saved = {name: os.environ.get(name) for name in ("HOME", "XDG_CACHE_HOME")}
    os.environ["HOME"], os.environ["XDG_CACHE_HOME"] = str(home), str(home / ".cache")
    yield home
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def fresh_state() -> Iterator[None]:
    """compile_cache's process-wide state (one-time warnings, probe answers, the prefetch run,
    capabilities, last reports) as a fresh process has it, before and after the test."""
    from compile_cache._testing import reset_process_state

    reset_process_state()
    yield
    reset_process_state()


@pytest.fixture
def dynamo_reset() -> Iterator[None]:
    """Clears Dynamo's caches and counters before and after the test."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


class CountingBackend:
    """A torch.compile backend that records every graph it gets and runs it as captured.

    ``graphs``: the FX GraphModules; ``symbolic``: how many graphs have a SymInt placeholder or a
    placeholder tensor with a symbolic size (dynamic shapes); ``calls``: graph executions.
    """

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.graphs.append(gm)

        def run(*args: Any) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return run

    @staticmethod
    def is_symbolic(gm: torch.fx.GraphModule) -> bool:
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.SymInt):
                return True
            if isinstance(value, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in value.shape
            ):
                return True
        return False

    @property
    def symbolic(self) -> int:
        return sum(self.is_symbolic(gm) for gm in self.graphs)


@pytest.fixture
def counting_backend(dynamo_reset: None) -> CountingBackend:
    return CountingBackend()


@pytest.fixture
def tiny_gpt2() -> Callable[..., torch.nn.Module]:
    """Builds a random-weight GPT-2 (2 layers, width 64 by default) from a config."""

    def build(n_layer: int = 2, n_embd: int = 64, n_head: int = 2, **kw: Any) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        cfg = AutoConfig.for_model(
            "gpt2",
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            vocab_size=128,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
            **kw,
        )
        return AutoModelForCausalLM.from_config(cfg)

    return build


@pytest.fixture
def tiny_llama() -> Callable[..., torch.nn.Module]:
    """Builds a random-weight Llama (2 layers, width 64 by default) from a config."""

    def build(layers: int = 2, hidden: int = 64, **kw: Any) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        cfg = AutoConfig.for_model(
            "llama",
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=128,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            attn_implementation="eager",
            **kw,
        )
        return AutoModelForCausalLM.from_config(cfg)

    return build


_MLP_CHILD = Path(__file__).with_name("_mlp_child.py")
REPO = Path(__file__).resolve().parents[1]


def _imports_this_tree() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("compile_cache")
    origin = getattr(spec, "origin", None)
    return origin is not None and Path(origin).resolve().parents[1] == REPO


def child_pythonpath(*first: str | os.PathLike[str], env: dict[str, str] | None = None) -> str:
    """A child's PYTHONPATH (``first``, then ``env``'s, default this process's) that has it import
    the compile_cache this test process imports: this tree where the package is installed in
    place (``pip install -e``: ``make test``), nothing more where it is an installed copy
    (``make test-compat`` with ``EDITABLE=``: each venv's copy has an extension built for its own
    torch; the tree's ``compile_cache/_C``, built for another, must not shadow it)."""
    paths = [str(p) for p in first]
    if _imports_this_tree():
        paths.append(str(REPO))
    paths.append((os.environ if env is None else env).get("PYTHONPATH", ""))
    return os.pathsep.join(p for p in paths if p)


def fresh_node_env(node: Path, **extra: str) -> dict[str, str]:
    """The environment of a process on a new machine (a new container, VM or CI runner): new
    TMPDIR, HOME, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, all under
    ``node``. Torch keeps machine-wide state outside its cache dir (the precompiled header under
    the temp dir, Triton's ~/.triton), so a new cache dir alone is not a new node. Reusing the
    same ``node`` is the same machine again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    node = Path(os.path.realpath(node))
    for sub in ("tmp", "home", "xdg"):
        (node / sub).mkdir(parents=True, exist_ok=True)
    env.update(
        TMPDIR=str(node / "tmp"), HOME=str(node / "home"), XDG_CACHE_HOME=str(node / "xdg"),
        TORCHINDUCTOR_CACHE_DIR=str(node / "inductor"), TRITON_CACHE_DIR=str(node / "triton"),
        PYTHONPATH=child_pythonpath(env=env),
    )
    env.update(extra)
    return env


def publisher_env(machine: Path, own: Path, **extra: str) -> dict[str, str]:
    """The environment of a publisher that must compile cold, on the build machine ``machine``
    (the ``build_machine`` fixture): the machine's TMPDIR, HOME and XDG_CACHE_HOME, so torch's
    precompiled header is built once per run, not once per publisher (it lives under the temp
    dir, outside the Inductor dir), and Inductor and Triton dirs of its own under ``own``, so no
    other publisher's local cache serves its graphs and torch's ISA probe runs in it as on a new
    machine."""
    own = Path(os.path.realpath(own))
    return fresh_node_env(machine, TORCHINDUCTOR_CACHE_DIR=str(own / "inductor"),
                          TRITON_CACHE_DIR=str(own / "triton"), **extra)


def run_child(script: str, node: Path, *args: str, own: Path | None = None,
              **env: str) -> dict[str, Any]:
    """Runs tests/SCRIPT on ``node`` (:func:`fresh_node_env`); its last ``RESULT {json}`` line.
    With ``own``, ``node`` is the build machine and the child a cold publisher with local cache
    dirs of its own under ``own`` (:func:`publisher_env`)."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), *args],
        env=fresh_node_env(node, **env) if own is None else publisher_env(node, own, **env),
        capture_output=True, text=True, timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def shared_by_workers(tmp_path_factory: pytest.TempPathFactory, name: str,
                      produce: Callable[[Path], Any]) -> Any:
    """The value of a session fixture made once per test run, not once per pytest-xdist worker.

    ``make test`` runs two workers (``-n 2 --dist loadfile``), each a pytest session of its own,
    so a session fixture that several test files use was made in both (a cold Inductor compile
    in a child process each time). The first worker to ask runs ``produce(directory)`` under a
    lock, in a directory under the run's shared temp root, and writes its JSON-able result
    there; the other waits for the lock and reads it. A ``produce`` that raises writes nothing
    (the next worker to ask runs it again, and fails on its own). Without xdist: ``produce``
    in a fresh temp dir, as before."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return produce(tmp_path_factory.mktemp(name))
    import fcntl

    root = tmp_path_factory.getbasetemp().parent  # pytest-<n>: the workers' temp dirs are in it
    result = root / f"shared-{name}.json"
    with open(root / f"shared-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.is_file():
            return json.loads(result.read_text())
        directory = root / f"shared-{name}"
        if directory.exists():  # a produce that raised, in the other worker
            shutil.rmtree(directory)
        directory.mkdir()
        value = produce(directory)
        result.write_text(json.dumps(value))
        return value


@pytest.fixture(scope="session")
def build_machine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One node for every publishing process of the test run (:func:`fresh_node_env` of it), as
    a CI runner builds on one machine: its TMPDIR, HOME and Inductor dirs are shared, so torch's
    precompiled header and ISA probe are built once per run, not once per publisher (8-15 s
    each) or per xdist worker (:func:`shared_by_workers`). Only a node that restores must be
    fresh. A publisher that must compile cold (not be served by torch's local cache) compiles
    models no other publisher here compiles, or runs with an Inductor dir of its own."""
    return Path(shared_by_workers(tmp_path_factory, "build-machine", str))


def run_records(child: Path, node: Path, store: Path, phase: str, tag: str,
                key: str) -> dict[str, dict[str, Any]]:
    """Runs the child script ``child`` with ``STORE PHASE`` on ``node`` (:func:`fresh_node_env`)
    and returns its ``TAG {json}`` lines, by each record's ``key`` field."""
    done = subprocess.run(
        [sys.executable, str(child), str(store), phase], env=fresh_node_env(node),
        capture_output=True, text=True, timeout=1500, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    prefix = f"{tag} "
    records = [json.loads(line[len(prefix):]) for line in done.stdout.splitlines()
               if line.startswith(prefix)]
    return {record[key]: record for record in records}


def drop_precompiled_headers(node: Path) -> None:
    """Deletes the 149 MB precompiled headers a node built (tests keep their temp dirs)."""
    for gch in Path(node).rglob("*.gch"):
        gch.unlink(missing_ok=True)


def run_mlp_child(local: Path, *args: str, **env: str) -> dict[str, Any]:
    """Runs tests/_mlp_child.py in a fresh process on the fresh node ``local``."""
    return run_child("_mlp_child.py", local, *args, **env)


@pytest.fixture(scope="session")
def mlp_capture(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One real Inductor compile of a tiny MLP in fresh dirs, captured: (its result, pack pickle)."""
    def produce(base: Path) -> list[Any]:
        pack = base / "pack.pkl"
        return [run_mlp_child(base / "node", "capture", str(pack)), str(pack)]

    result, pack = shared_by_workers(tmp_path_factory, "mlp_capture", produce)
    return result, Path(pack)


# -- the CLI tests (tests/test_cli_*.py) -------------------------------------------------------


@pytest.fixture
def no_env_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """No COMPILE_CACHE_* variable set, and stdin not a terminal (the CLI tests)."""
    for name in list(os.environ):
        if name.startswith("COMPILE_CACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # not a terminal


@pytest.fixture(scope="session")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A store populated by one real cold ``warm`` (Inductor) in a subprocess, and its --json."""
    from _cli_helpers import TARGET, run_cli

    def produce(tmp: Path) -> list[Any]:
        store = tmp / "store"
        proc = run_cli(tmp, "warm", TARGET, "--cache-dir", str(store), "--json")
        assert proc.returncode == 0, proc.stderr
        return [str(store), json.loads(proc.stdout)]

    store, data = shared_by_workers(tmp_path_factory, "warmed", produce)
    return Path(store), data


@pytest.fixture
def store_copy(warmed: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    """A private copy of the warmed store, for tests that change it."""
    copy = tmp_path / "store"
    shutil.copytree(warmed[0], copy)
    return copy


@pytest.fixture(scope="session")
def black_hole() -> Iterator[Any]:
    """A port on 127.0.0.1 that accepts connections and never answers
    (:class:`_object_emulators.BlackHole`)."""
    from _object_emulators import BlackHole

    hole = BlackHole()
    yield hole
    hole.close()
