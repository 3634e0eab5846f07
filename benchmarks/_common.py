"""Shared pieces of the benchmarks: the GPT-2 they measure and running one scenario per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any


def build_gpt2(layers: int, width: int, heads: int, seq: int) -> tuple[Any, Any]:
    """A transformers GPT-2 from its config (random weights, eval) and one batch of 1 x ``seq``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gpt2", n_layer=layers, n_embd=width, n_head=heads, n_positions=max(1024, seq)
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.randint(0, config.vocab_size, (1, seq))
    return model, tokens


# Llama-3.2-1B's proportions, scaled by width: heads of 64 channels, a quarter as many KV heads,
# an MLP four times as wide, Llama 3's vocabulary. 16x2048 gives Llama-3.2-1B's shape
# (32 heads, 8 KV heads, intermediate 8192, vocab 128256, tied embeddings).
LLAMA_VOCAB = 128256


def llama_shape(width: int) -> dict[str, int]:
    """Heads, KV heads and MLP width for a Llama of ``width`` (Llama-3.2-1B's proportions)."""
    heads = max(1, width // 64)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "intermediate_size": 4 * width,
    }


def parse_model_spec(spec: str) -> tuple[int, int]:
    """``"16x2048"`` -> (layers, width)."""
    try:
        layers, width = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"model spec {spec!r} is not LAYERSxWIDTH (e.g. 4x256)") from None
    if layers < 1 or width < 1:
        raise ValueError(f"model spec {spec!r}: layers and width must be positive")
    return layers, width


def build_model(
    arch: str,
    layers: int,
    width: int,
    seq: int,
    *,
    heads: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> tuple[Any, Any]:
    """A random-weight transformers model (``arch`` ``gpt2`` or ``llama``) built directly on
    ``device`` in ``dtype``, in eval mode, and one batch of 1 x ``seq`` tokens on that device.

    ``gpt2`` with float32 on CPU is exactly ``build_gpt2``; ``llama`` follows ``llama_shape``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch == "gpt2":
        if device == "cpu" and dtype == "float32":
            return build_gpt2(layers, width, heads or max(1, width // 64), seq)
        config = AutoConfig.for_model(
            "gpt2", n_layer=layers, n_embd=width, n_head=heads or max(1, width // 64),
            n_positions=max(1024, seq),
        )
    elif arch == "llama":
        shape = llama_shape(width)
        if heads:
            shape["num_attention_heads"] = heads
            shape["num_key_value_heads"] = max(1, heads // 4)
        config = AutoConfig.for_model(
            "llama", num_hidden_layers=layers, hidden_size=width, vocab_size=LLAMA_VOCAB,
            max_position_embeddings=max(2048, seq), tie_word_embeddings=True,
            rope_theta=500000.0, **shape,
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; choose gpt2 or llama")
    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    # Built in place on the target device and dtype: a 1B model initialised on the CPU in
    # float32 and then moved would cost more than the compile we time.
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.to(device=device, dtype=torch_dtype)
    tokens = torch.randint(0, config.vocab_size, (1, seq), device=device)
    return model, tokens


def synchronize(device: str) -> None:
    """Waits for queued GPU work, so that a timer stopped next measures finished work."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def compile_bytecode() -> int:
    """Writes compile_cache's bytecode (``__pycache__``), as ``pip install`` does for a package.

    A tree used in place has none, or stale files, and with ``PYTHONDONTWRITEBYTECODE`` (set on
    the machines these benchmarks run on) every process then compiles compile_cache's ~24,000
    lines again at import: about 0.3 s of CPU a process that eager, whose packages are installed
    with their bytecode, never pays (benchmarks/RESULTS.md, issue 38). Returns the files written.
    """
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("compile_cache")
    if spec is None or not spec.submodule_search_locations:
        return 0
    written = 0
    for folder in spec.submodule_search_locations:
        before = _bytecode_count(folder)
        compileall.compile_dir(folder, quiet=2, workers=1)
        written += _bytecode_count(folder) - before
    return written


def _bytecode_count(folder: str) -> int:
    return sum(len([n for n in names if n.endswith(".pyc")]) for _, _, names in os.walk(folder))


def run_child(argv: list[str], env: dict[str, str], timeout: float = 1800) -> dict:
    """Runs ``python argv...`` in a fresh process; returns its last stdout line as JSON plus its
    whole-process wall time (start to exit, imports included) as ``process_s``."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def fresh_node_env(node: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process on a new machine (a new container, VM or CI runner): new
    TMPDIR, HOME, XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR under ``node``.

    Torch keeps machine-wide state outside its cache dir (the 149 MB precompiled header under
    the temp dir, the ISA probe's libraries, Triton's ~/.triton), so a new cache dir alone is
    not a new node. Passing the same ``node`` again is the same machine again (its dirs warm).
    """
    env = dict(os.environ if base is None else base)
    env = {k: v for k, v in env.items() if not k.startswith("COMPILE_CACHE_")}
    paths = {
        "TMPDIR": os.path.join(node, "tmp"),
        "HOME": os.path.join(node, "home"),
        "XDG_CACHE_HOME": os.path.join(node, "xdg"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(node, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(node, "triton"),
    }
    for name in ("TMPDIR", "HOME", "XDG_CACHE_HOME"):
        os.makedirs(paths[name], exist_ok=True)
    env.update(paths)
    return env


def prime_precompiled_header(timeout: float = 600) -> None:
    """Builds torch's machine-wide precompiled kernel header with a throwaway CPU compile.

    Inductor keeps it outside TORCHINDUCTOR_CACHE_DIR, once per machine and compiler flags
    (``<tmp>/torchinductor_<user>/precompiled_headers``, about 5 s to build on 2 cores). Without
    this, whichever scenario runs first on a fresh machine pays for it and the others do not.
    """
    code = "import torch\ntorch.compile(lambda x: (x.sin() + 1).relu())(torch.randn(64, 64))\n"
    with tempfile.TemporaryDirectory(prefix="bench_prime_") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tmp, COMPILE_CACHE_PREFETCH="0")
        subprocess.run([sys.executable, "-c", code], env=env, timeout=timeout, check=True,
                       capture_output=True)


def machine() -> str:
    """One line naming the machine, for the results tables."""
    import torch

    gpu = ""
    if torch.cuda.is_available():
        gpu = f", GPU {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}"
    )


#: The private torch names KernelCounters wraps (gpu_check checks they exist).
COUNTED_TORCH_NAMES = (
    "torch._inductor.triton_bundler.TritonBundler.read_and_emit",
    "torch._inductor.runtime.triton_heuristics.CachingAutotuner.benchmark_all_configs",
    "torch._inductor.runtime.cache_dir_utils.triton_cache_dir",
)

_KERNEL_BINARIES = (".cubin", ".hsaco", ".zebin", ".spv")


class KernelCounters:
    """Triton kernels compiled from source and autotune benchmarks in this process.

    Triton compiles in Inductor's worker processes too, so kernels are counted by their files:
    a kernel directory (one holding a ``.cubin``/``.hsaco``/``.zebin``) that appears in Triton's
    cache dir during the run and that torch's bundler did not write (``TritonBundler.
    read_and_emit``, the kernels an FX-graph entry carries) was compiled from source. Benchmarks:
    ``CachingAutotuner.benchmark_all_configs`` calls (a kernel's configs timed at its first run,
    in this process) and Inductor's ``select_algorithm_autotune``/``coordesc_tuning_bench``
    counters (max-autotune). Names torch lacks are listed in ``missing`` (counts then partial).
    """

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.emitted: set[str] = set()
        self.benchmarks = 0
        self.directory = self._triton_dir()
        self.before = self._kernel_dirs()
        self._install()

    def _triton_dir(self) -> str:
        """torch's ``triton_cache_dir`` rule (TRITON_CACHE_DIR, else the Inductor dir's
        ``triton/0``), without importing Inductor (``read`` checks it against torch's)."""
        directory = os.environ.get("TRITON_CACHE_DIR")
        if directory is not None:
            return directory
        inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), "torchinductor_" + os.environ.get("USER", "root"))
        return os.path.join(os.path.abspath(inductor), "triton", "0")

    def _kernel_dirs(self) -> set[str]:
        found = set()
        try:
            for entry in os.scandir(self.directory):
                if entry.is_dir() and not entry.name.startswith("tmp."):
                    if any(n.endswith(_KERNEL_BINARIES) for n in os.listdir(entry.path)):
                        found.add(entry.name)
        except OSError:
            pass
        return found

    def _install(self) -> None:
        """Wraps the two torch functions when their modules are imported (at once if they are
        already): importing them here would move Inductor's import cost out of the TTFO."""
        targets = {"torch._inductor.triton_bundler": self._wrap_bundler,
                   "torch._inductor.runtime.triton_heuristics": self._wrap_autotuner}
        pending = {}
        for name, wrap in targets.items():
            if name in sys.modules:
                wrap(sys.modules[name])
            else:
                pending[name] = wrap
        if pending:
            sys.meta_path.insert(0, _AfterImport(pending))

    def _wrap_bundler(self, module: Any) -> None:
        try:
            bundler = module.TritonBundler
            emit = bundler.read_and_emit

            def read_and_emit(*args: Any, **kwargs: Any) -> Any:
                before = self._kernel_dirs()
                try:
                    return emit(*args, **kwargs)
                finally:
                    self.emitted |= self._kernel_dirs() - before

            bundler.read_and_emit = staticmethod(read_and_emit)
        except Exception:
            self.missing.append(COUNTED_TORCH_NAMES[0])

    def _wrap_autotuner(self, module: Any) -> None:
        try:
            tuner_class = module.CachingAutotuner
            bench = tuner_class.benchmark_all_configs

            def benchmark_all_configs(tuner: Any, *args: Any, **kwargs: Any) -> Any:
                self.benchmarks += 1
                return bench(tuner, *args, **kwargs)

            tuner_class.benchmark_all_configs = benchmark_all_configs
        except Exception:
            self.missing.append(COUNTED_TORCH_NAMES[1])

    def read(self) -> dict[str, Any]:
        """``triton_compiled``, ``triton_restored``, ``autotune_benchmarks`` (and max-autotune's)."""
        from torch._dynamo.utils import counters

        try:
            from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

            if triton_cache_dir(0) != self.directory:
                self.missing.append(f"{COUNTED_TORCH_NAMES[2]} (is {triton_cache_dir(0)})")
        except Exception:
            self.missing.append(COUNTED_TORCH_NAMES[2])
        new = self._kernel_dirs() - self.before
        return {
            "triton_compiled": len(new - self.emitted),
            "triton_restored": len(self.emitted),
            "autotune_benchmarks": self.benchmarks,
            "select_algorithm_autotune": counters["inductor"]["select_algorithm_autotune"],
            "coordesc_tuning_bench": counters["inductor"]["coordesc_tuning_bench"],
            **({"counting_missing": self.missing} if self.missing else {}),
        }


class _AfterImport:
    """A meta-path finder that calls ``pending[name](module)`` right after ``name`` is imported."""

    def __init__(self, pending: dict[str, Any]) -> None:
        self.pending = pending

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        wrap = self.pending.get(name)
        if wrap is None:
            return None

        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        spec.loader = _WrappingLoader(spec.loader, lambda module: (self.pending.pop(name, None),
                                                                   wrap(module)))
        return spec


class _WrappingLoader:
    """The module's own loader (every other attribute delegated), calling ``after`` once the
    module has executed."""

    def __init__(self, loader: Any, after: Any) -> None:
        self._loader = loader
        self._after = after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._after(module)

