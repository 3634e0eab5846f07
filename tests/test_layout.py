"""The package's layout as a contract: layers, no import cycles, torch's private API only behind
torch_compat, no object reaching into another's privates, no function grown past 80 lines
unnoticed, and no torch import where none is needed (``import compile_cache``, the store CLI).

The import graph is read from the source with ``ast`` (module-level and function-level imports,
``if TYPE_CHECKING:`` blocks included: a type-only import is still a dependency, and a cycle
through one is a cycle). Every rule checks itself on a small example it must reject.
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
    ("session", "session_publish", "process_store", "regions", "prefetch", "recovery", "precompiled"),
    ("warmup",),
    ("distributed",),
    ("api",),
    ("whole",),
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
TREES: dict[str, ast.Module] = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}

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


def _imports(name: str, tree: ast.Module | None = None) -> set[str]:
    tree = TREES[name] if tree is None else tree
    found: set[str] = set()
    for node in ast.walk(tree):
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_import_cycles_type_checking_imports_included() -> None:
    assert _cycles(GRAPH) == []
    # The check can fail, and sees an import made for type hints only.
    hinted = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .session import CacheSession\n")
    assert _imports("compile_cache.recovery", hinted) == {"compile_cache.session"}
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


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


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _names_in_code(tree: ast.AST, name: str) -> bool:
    """Whether the code (not its docs) uses ``name``: as an attribute or a string."""
    docs = _docstrings(tree)
    return any(
        (isinstance(node, ast.Attribute) and node.attr == name)
        or (isinstance(node, ast.Constant) and node.value == name and id(node) not in docs)
        for node in ast.walk(tree)
    )


def test_only_module_calls_touches_compiled_call_impl() -> None:
    owners = sorted(name for name, tree in TREES.items() if _names_in_code(tree, "_compiled_call_impl"))
    # torch_compat.module_calls installs there (for regions); the reference: to skip it.
    assert owners == ["compile_cache._reference", "compile_cache.torch_compat.module_calls"]
    assert _names_in_code(ast.parse("m._compiled_call_impl = None"), "_compiled_call_impl")
    assert not _names_in_code(ast.parse('"""m._compiled_call_impl"""'), "_compiled_call_impl")


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


# ------------------------------------------------------------------------------ privates stay private

#: Private names of the standard library's API, used as documented: each with where and why.
STDLIB_PRIVATE = {
    "sys._getframe": "the caller's frame, to point a warning at the user's line (_warnings)",
}
#: namedtuple's public API: its methods start with "_" only so as not to clash with field names.
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_names(trees: dict[str, ast.Module]) -> frozenset[str]:
    """The private names compile_cache itself defines: its classes' methods, class attributes,
    slots and ``self._x`` attributes, and its modules' top-level names. Inside torch_compat an
    access ``x._y`` is to torch's objects unless ``_y`` is one of these."""
    names: set[str] = set()
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names.update(n.id for tg in targets for n in ast.walk(tg) if isinstance(n, ast.Name))
                        if any(isinstance(tg, ast.Name) and tg.id == "__slots__" for tg in targets):
                            names.update(c.value for c in ast.walk(item.value)
                                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return frozenset(n for n in names if _is_private(n))


OWN_PRIVATE = _own_private_names(TREES)


def _torch_names(tree: ast.Module) -> frozenset[str]:
    """The names a module binds to torch's modules and objects (``import torch``, ``import
    torch.x as y``, ``from torch.x import Z``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            names.update(a.asname or a.name for a in node.names)
    return frozenset(names)


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_accesses(name: str, tree: ast.Module) -> list[str]:
    """``x._y`` where ``x`` is not ``self``/``cls``: another object's private attribute. Inside
    torch_compat, torch's objects are excepted: reached from a name bound by an import from
    torch, or ``_y`` not a name of compile_cache's own."""
    torch_side = name.startswith("compile_cache.torch_compat")
    from_torch = _torch_names(tree) if torch_side else frozenset()
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        text = ast.unparse(node)
        if text in STDLIB_PRIVATE or node.attr in NAMEDTUPLE_API:
            continue
        if torch_side and (node.attr not in OWN_PRIVATE or _root_name(node.value) in from_torch):
            continue
        found.append(f"{name}:{node.lineno}: {text}")
    return found


def test_no_access_to_another_objects_private_attributes() -> None:
    found = [use for name, tree in TREES.items() for use in _private_accesses(name, tree)]
    assert found == [], "add a public method or property for what the caller needs"
    used = {ast.unparse(node) for tree in TREES.values() for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert set(STDLIB_PRIVATE) <= used, "an allow-list entry nothing uses any more: take it off"
    # The check can fail: on another object, and on one of ours inside torch_compat, not torch's.
    code = ast.parse("def f(a, b):\n    self._x, sys._getframe, b._replace\n    return a._lock, a._codes\n")
    assert _private_accesses("compile_cache.session", code) == [
        "compile_cache.session:3: a._lock", "compile_cache.session:3: a._codes"]
    assert _private_accesses("compile_cache.torch_compat.x", code) == ["compile_cache.torch_compat.x:3: a._lock"]
    # Reached from torch (a name imported from it), a private name of ours too is torch's.
    torch_code = ast.parse("from torch.x import Cache\nimport torch.y as ty\nCache._lock, ty.z._lock, other._lock\n")
    assert _private_accesses("compile_cache.torch_compat.x", torch_code) == ["compile_cache.torch_compat.x:3: other._lock"]


def _private_imports(name: str, tree: ast.Module) -> list[str]:
    """``from .x import _y`` of a private name of another module (a private *module* of the
    package, ``from . import _warnings``, is the package's own and fine)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = name.split(".") if name in MODULES and _is_package(name) else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module.split(".")[0] != "compile_cache":
            continue
        for alias in node.names:
            if _is_private(alias.name) and f"{module}.{alias.name}" not in MODULES | dict.fromkeys(EXTENSIONS):
                found.append(f"{name}:{node.lineno}: from {module} import {alias.name}")
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    found = [use for name, tree in TREES.items() for use in _private_imports(name, tree)]
    assert found == [], "make the name public (and say what it is for), or move the code that needs it"
    code = ast.parse("from .cache import _TLS, install\nfrom ... import _warnings\n")
    assert _private_imports("compile_cache.torch_compat.kv.calls", code) == [
        "compile_cache.torch_compat.kv.calls:1: from compile_cache.torch_compat.kv.cache import _TLS"]


#: Functions over LONG_FUNCTION lines: each is a place to look at, and the list only shrinks. A
#: module's length is no rule (a per-module line cap split cohesive classes into free functions
#: that reach back into their privates: DESIGN.md section 3).
LONG_FUNCTION = 80
LONG_FUNCTIONS_ALLOWED = {
    "compile_cache.cli.doctor:cmd_doctor",
    "compile_cache.plan:plan_regions",
    "compile_cache.cli.main:build_parser",
    "compile_cache.distributed.protocol:warm_up",
}


def _long_functions(name: str, tree: ast.Module) -> set[str]:
    return {
        f"{name}:{node.name}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > LONG_FUNCTION  # type: ignore[operator]
    }


def test_no_new_function_over_80_lines_and_the_allow_list_only_shrinks() -> None:
    long = set().union(*(_long_functions(name, tree) for name, tree in TREES.items()))
    assert long - LONG_FUNCTIONS_ALLOWED == set(), "split these, or say why they cannot be"
    assert LONG_FUNCTIONS_ALLOWED - long == set(), "no longer long: take them off the list"
    line = "    x = 1\n"
    assert _long_functions("m", ast.parse("def f():\n" + line * LONG_FUNCTION)) == {"m:f"}  # 81 lines
    assert _long_functions("m", ast.parse("def f():\n" + line * (LONG_FUNCTION - 1))) == set()  # 80


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


def test_run_imports_no_torch_in_its_own_process(tmp_path: Path) -> None:
    """``run`` checks its name and starts the command: torch is imported by the command (through
    its sitecustomize) when it is Python, never by ``run``'s own process (a second torch import
    per start). ``-X importtime`` is not passed on to the command."""
    done, modules = _imported_modules(["-m", "compile_cache", "run", "--name", "n", "--cache-dir",
                                       str(tmp_path / "store"), "--", "true"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compile_cache.cli.run" in modules  # the check sees what was imported
    assert _torch_modules(modules) == []
