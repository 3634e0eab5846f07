"""The package's layout as a contract: layers, no import cycles, torch's private API only behind
torch_compat, and no torch import where none is needed (``import compile_cache``, the store CLI).

The import graph is read from the source with ``ast`` (module-level and function-level imports;
``if TYPE_CHECKING:`` blocks are not imports).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "compile_cache"

#: Lowest first. A module may import its own layer or lower ones, never a higher one.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "redact", "_paths", "_sizes", "_warnings", "config", "_testing"),
    ("torch_compat",),
    ("fingerprint", "_reference", "plan", "keys", "explain", "store", "locks", "artifacts", "local_dirs",
     "capture", "publisher", "report"),
    ("session", "session_publish", "regions", "prefetch", "recovery", "precompiled"),
    ("warmup",),
    ("distributed",),
    ("api",),
    ("cli", "integrations", "demo", "__init__", "__main__"),
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
#: The native extension: a leaf (it imports nothing of the package).
EXTENSIONS = {"compile_cache._C"}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom) -> list[str]:
    """The compile_cache modules an ``ImportFrom`` names (submodules where ``from x import y``
    names one)."""
    if node.level:
        base = importer.split(".")
        base = base if _is_package(importer) else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        if sub in EXTENSIONS:
            continue
        if sub in MODULES:
            out.append(sub)
        elif module in MODULES:
            out.append(module)
    return out


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in ast.walk(node):
                skip.add(id(child))
    return skip


def _imports(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    skip = _type_checking_blocks(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            found.update(_resolve(name, node))
    found.discard(name)
    return found


GRAPH: dict[str, set[str]] = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> int:
    parts = name.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    if key not in LAYER_OF:
        raise AssertionError(f"{name} is in no layer of tests/test_layout.py: place it")
    return LAYER_OF[key]


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    upward = [
        f"{src} (layer {_layer(src)}) imports {dst} (layer {_layer(dst)})"
        for src, targets in GRAPH.items()
        for dst in targets
        if _layer(dst) > _layer(src)
    ]
    assert upward == []


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert cycles == []


_PRIVATE_MODULE = re.compile(r"^torch(\.\w+)*\._[a-z]\w*")


def _private_torch_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [a.name for a in node.names if _PRIVATE_MODULE.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if _PRIVATE_MODULE.match(module):
                uses.append(module)
            elif module.startswith("torch"):
                uses += [f"{module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            text = ast.unparse(node)
            if text.startswith("torch."):
                uses.append(text)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and _PRIVATE_MODULE.match(node.value)):
            uses.append(repr(node.value))
    return uses


def test_only_torch_compat_touches_torchs_private_api() -> None:
    offenders = {
        name: uses
        for name, path in MODULES.items()
        if not name.startswith("compile_cache.torch_compat")
        and (uses := _private_torch_uses(path))
    }
    assert offenders == {}
    assert _private_torch_uses(PACKAGE / "torch_compat" / "dynamo.py")  # the check can fail


def test_only_regions_touches_compiled_call_impl() -> None:
    owners = sorted(name for name, path in MODULES.items() if "_compiled_call_impl" in path.read_text())
    assert owners == ["compile_cache._reference", "compile_cache.regions"]  # the reference: to skip it


def test_only_the_store_knows_the_disk_layout() -> None:
    """Paths into the store (``root / "v1" / "entries"``...) are built in store/ (and the lock
    suffixes in locks/), nowhere else."""
    joins = re.compile(r"/ '(v1|entries|packs|quarantine|stats|locks|tmp|entry\.json|used)'|'v1'|'\.lockdir'")
    outside = sorted(
        name for name, path in MODULES.items()
        if not name.startswith(("compile_cache.store", "compile_cache.locks"))
        and joins.search(ast.unparse(ast.parse(path.read_text())))
    )
    assert outside == []
    assert joins.search(ast.unparse(ast.parse((PACKAGE / "store" / "layout.py").read_text())))


#: Functions over LONG_FUNCTION lines: each is a place to look at, and the list only shrinks. A
#: module's length is no rule (a per-module line cap split cohesive classes into free functions
#: that reach back into their privates: DESIGN.md section 3).
LONG_FUNCTION = 80
LONG_FUNCTIONS_ALLOWED = {
    "compile_cache.cli.doctor:cmd_doctor",
    "compile_cache.store.maintenance:verify",
    "compile_cache.api:compile_regions",
    "compile_cache.plan:plan_regions",
    "compile_cache.cli.main:build_parser",
    "compile_cache.distributed.protocol:warm_up",
    "compile_cache.store.safety:trust_problem",
}


def test_no_new_function_over_80_lines_and_the_allow_list_only_shrinks() -> None:
    long = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > LONG_FUNCTION:  # type: ignore[operator]
                    long.add(f"{name}:{node.name}")
    assert long - LONG_FUNCTIONS_ALLOWED == set(), "split these, or say why they cannot be"
    assert LONG_FUNCTIONS_ALLOWED - long == set(), "no longer long: take them off the list"


# ------------------------------------------------------------------------------ no torch needed


def _imported_modules(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime ARGS`` and return the modules it imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_CACHE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines() if line.startswith("import time:") and "|" in line
    }
    return done, modules


def _torch_modules(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m == "torch" or m.startswith("torch."))


def test_import_compile_cache_imports_no_torch(tmp_path: Path) -> None:
    code = ("import compile_cache; compile_cache.ConfigError; compile_cache.Fingerprint; "
            "compile_cache.Store; import compile_cache.config, compile_cache.cli")
    done, modules = _imported_modules(["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compile_cache.store.core" in modules  # the check sees what was imported
    assert _torch_modules(modules) == []


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A store with one entry, and an export of it (no torch: the store knows only bytes)."""
    from compile_cache.store import Store

    base = tmp_path_factory.mktemp("no_torch")
    store = Store(base / "store")
    store.publish("ab" * 16, {"inductor/fxgraph/x/entry": b"entry"}, entry_info={"model_class": "M"})
    store.export(base / "cache.tar")
    return base / "store", base / "cache.tar"


@pytest.mark.parametrize(
    "command",
    [
        ["ls"], ["ls", "--json"], ["stats"], ["verify"], ["prune", "--max-size", "0", "--dry-run"],
        ["prune", "--older-than", "30d", "-y"], ["export", "{out}"], ["import", "{archive}"],
        ["clear", "-y"], ["explain"], ["explain", "--json"],
    ],
    ids=lambda c: " ".join(c),
)
def test_store_commands_import_no_torch(command: list[str], archive: tuple[Path, Path], tmp_path: Path) -> None:
    store, tar = archive
    target = tmp_path / "store"
    import shutil

    shutil.copytree(store, target)
    args = [a.format(out=tmp_path / "out.tar", archive=tar) for a in command]
    done, modules = _imported_modules(["-m", "compile_cache", *args, "--cache-dir", str(target)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "compile_cache.cli.store_cmds" in modules
    assert _torch_modules(modules) == []
