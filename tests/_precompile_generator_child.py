"""Child process of tests/test_precompile_generator.py: generated models, one node.

    python _precompile_generator_child.py STORE PHASE CASES_JSON     PHASE: publish | load

``CASES_JSON`` is a list of ``{"id", "kind", "mutation"}`` (drawn by hypothesis in the test). Each
case's model reads one value, through the way its ``kind`` names (a module global, a class or
instance attribute, a closure, a builtin, a property, a descriptor, ``getattr`` with a default,
``hasattr``, ``os.environ.get``, torch's global state, a module loaded under another module's
name), and picks its activation from it. ``mutation`` changes that value: ``fresh`` on the loading
node before compiling, ``after`` after the first call (on both nodes), ``none`` never. Every call
of ``compile_regions(model, cache_dir=STORE, precompile=True)`` (Inductor) is compared with eager;
after an ``after`` change, plain ``torch.compile`` (Dynamo, eager backend) is too
(``torch_compile``: what torch itself does when a value changes after compiling). One line
``GEN {json}`` per case.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import sys
import traceback
import warnings

import torch

import compile_cache

STORE, PHASE, CASES = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
LOAD = PHASE == "load"
D = 8
X = torch.randn(2, D, generator=torch.Generator().manual_seed(0))
MODULES = os.path.join(os.environ["TMPDIR"], "cc_generated")
os.makedirs(MODULES, exist_ok=True)
sys.path.insert(0, MODULES)

HEADER = """
import os
import types

import torch
from torch import nn

D = {d}
ENV = "CC_GEN_{id}"
MODE = "tanh"
settings = types.ModuleType("cc_gen_settings_{id}")


class Registry:
    pass


class Desc:
    def __init__(self, v):
        self.v = v

    def __get__(self, obj, cls):
        return self.v


def make(v):
    return lambda: v


READ = make("tanh")


def make_cell():
    v = "tanh"

    def read():
        return v

    def set_(n):
        nonlocal v
        v = n

    return read, set_


READ_CELL, SET_CELL = make_cell()
"""

BLOCK = """

class Block(nn.Module):
{class_body}
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
{init_body}
    def forward(self, x):
        y = self.lin(x)
        v = {read}
        return torch.tanh(y) * 2 if v == "tanh" else torch.sigmoid(y) * 3
"""

#: kind -> (value read in forward, class body, __init__ body, mutation: Python run with ``mod``,
#: ``blocks`` (the blocks of the compiled model and of the eager reference) in scope).
KINDS: dict[str, tuple[str, str, str, str]] = {
    "module_global": ("MODE", "", "", "mod.MODE = 'sigmoid'"),
    "class_attr": ("self.mode", "    mode = 'tanh'\n", "", "mod.Block.mode = 'sigmoid'"),
    "instance_attr": ("self.mode", "", "        self.mode = 'tanh'\n",
                      "for b in blocks: b.mode = 'sigmoid'"),
    "closure": ("READ()", "", "", "mod.READ = mod.make('sigmoid')"),
    "closure_cell": ("READ_CELL()", "", "", "mod.SET_CELL('sigmoid')"),
    "builtin": ("'tanh' if max(1, 2) == 2 else 'sigmoid'", "", "", "mod.max = min"),
    "property": ("self.mode", "    @property\n    def mode(self):\n        return 'tanh'\n", "",
                 "mod.Block.mode = property(lambda s: 'sigmoid')"),
    "descriptor": ("self.mode", "    mode = Desc('tanh')\n", "",
                   "mod.Block.__dict__['mode'].v = 'sigmoid'"),
    "method": ("self.pick()", "    def pick(self):\n        return 'tanh'\n", "",
               "mod.Block.pick = lambda self: 'sigmoid'"),
    "getattr_module": ("getattr(settings, 'EXTRA', 'tanh')", "", "",
                       "mod.settings.EXTRA = 'sigmoid'"),
    "hasattr_module": ("'sigmoid' if hasattr(settings, 'FLAG') else 'tanh'", "", "",
                       "mod.settings.FLAG = 1"),
    "getattr_class": ("getattr(Registry, 'extra', 'tanh')", "", "",
                      "mod.Registry.extra = 'sigmoid'"),
    "hasattr_instance": ("'sigmoid' if hasattr(self, 'flag') else 'tanh'", "", "",
                         "for b in blocks: b.flag = 1"),
    "environ": ("os.environ.get(ENV, 'tanh')", "", "", "os.environ[mod.ENV] = 'sigmoid'"),
    "torch_state": ("'sigmoid' if torch.are_deterministic_algorithms_enabled() else 'tanh'", "",
                    "", "torch.use_deterministic_algorithms(True)"),
    "twin_module": ("MODE", "", "", ""),  # the second model's module holds MODE = 'sigmoid'
}


def write(name: str, source: str, folder: str = MODULES) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name + ".py")
    with open(path, "w") as f:
        f.write(source)
    return path


def load_module(name: str, path: str):
    """Imports ``path`` as ``name`` (registered in sys.modules, replacing what held the name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def model_of(mod):
    torch.manual_seed(0)
    model = torch.nn.Sequential(mod.Block(), mod.Block())
    return model, copy.deepcopy(model)


def run_case(case: dict) -> dict:
    kind, mutation = case["kind"], case["mutation"]
    read, class_body, init_body, mutate = KINDS[kind]
    name = f"cc_gen_{case['id']}"
    source = HEADER.format(d=D, id=case["id"]) + BLOCK.format(
        class_body=class_body or "    pass\n", init_body=init_body, read=read)
    rec: dict = {"id": case["id"], "kind": kind, "mutation": mutation, "diffs": {}, "groups": []}
    caught = warnings.catch_warnings(record=True)
    with caught as seen:
        warnings.simplefilter("always")
        try:
            mod = load_module(name, write(name, source))
            model, ref = model_of(mod)

            def apply() -> None:
                blocks = [*model, *ref]
                exec(mutate, {"mod": mod, "blocks": blocks, "os": os, "torch": torch})  # noqa: S102

            if mutation == "fresh" and LOAD:
                apply()
            compile_cache.compile_regions(model, cache_dir=STORE, precompile=True)
            rec["groups"] += [g["status"] for g in compile_cache.last_report().precompile_groups.values()]
            # plain torch.compile (Dynamo only), for what torch itself does with a change made
            # after compiling: precompile must behave as it does
            plain = torch.compile(copy.deepcopy(ref), backend="eager") if mutation == "after" else None
            with torch.no_grad():
                rec["diffs"]["first"] = float((model(X) - ref(X)).abs().max())
                if plain is not None:
                    plain(X)
                    apply()
                    want = ref(X)
                    rec["diffs"]["second"] = float((model(X) - want).abs().max())
                    rec["torch_compile"] = float((plain(X) - want).abs().max())
            if kind == "twin_module":  # another file under the same name, another MODE
                twin = load_module(name, write(name, source.replace('MODE = "tanh"', 'MODE = "sigmoid"'),
                                               os.path.join(MODULES, "twin")))
                model, ref = model_of(twin)
                compile_cache.compile_regions(model, cache_dir=STORE, precompile=True)
                with torch.no_grad():
                    rec["diffs"]["twin"] = float((model(X) - ref(X)).abs().max())
        except Exception as exc:  # noqa: BLE001 - reported, the batch goes on
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rec["traceback"] = traceback.format_exc()[-1500:]
        finally:
            os.environ.pop(f"CC_GEN_{case['id']}", None)
            torch.use_deterministic_algorithms(False)
    rec["warnings"] = sorted({str(w.message)[:160] for w in seen
                              if issubclass(w.category, compile_cache.RegionPrecompileWarning)})
    return rec


if __name__ == "__main__":
    for case in CASES:
        print("GEN " + json.dumps(run_case(case)), flush=True)
    compile_cache.session.flush(120)
