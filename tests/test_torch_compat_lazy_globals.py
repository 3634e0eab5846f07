"""compile_cache.torch_compat.precompile.lazy_globals: a precompile entry is read without importing
torch._inductor.decomposition, and nothing that reads, copies, calls or pickles it again sees
anything but torch's own ``select_decomp_table``.

What must hold: in a process that has not imported the module, :func:`lazy_globals.loads` gives
the stand-in and imports nothing; a deep copy (torch copies a loaded backend) is the stand-in
itself and imports nothing; calling it gives torch's own table; pickled again and read back by
plain ``pickle`` it is torch's function itself; where the module is imported the real function
comes back. Torch's own reads go lazy only inside :func:`lazy_entry_reads`, in that thread. No
file of torch's _inductor, _dynamo or _functorch compares the function by identity (the probe
checks the few that hand it on). The fresh node that restores everything without importing the
module is in tests/test_precompile.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fresh_node_env

from compile_cache import torch_compat
from compile_cache.torch_compat import TorchCompatWarning, available
from compile_cache.torch_compat.precompile import lazy_globals

CHILD = r"""
import copy, json, pickle, sys, threading
import torch
import torch._dynamo.package as package
from compile_cache.torch_compat.precompile import lazy_globals

MOD = "torch._inductor.decomposition"
out = {"before": MOD in sys.modules}
blob = bytes.fromhex(sys.argv[1])
got = lazy_globals.loads(blob)
fn = got["graph"]["get_decomp_fn"]
out["stand_in"] = isinstance(fn, lazy_globals.LazyGlobal)
out["other_values"] = got["graph"]["is_inference"] is True and got["n"] == 3
out["after_loads"] = MOD in sys.modules
# an entry saved by a process that had read one lazily spells the global pkgutil.resolve_name(...)
again = lazy_globals.loads(bytes.fromhex(sys.argv[2]))["f"]
out["resaved_stand_in"] = again is fn and MOD not in sys.modules
out["deepcopy_is_self"] = copy.deepcopy(got)["graph"]["get_decomp_fn"] is fn
out["copy_is_self"] = copy.copy(fn) is fn
out["after_copies"] = MOD in sys.modules
# torch's own read, inside and outside the context, here and in another thread
with lazy_globals.lazy_entry_reads():
    out["torch_read_inside"] = isinstance(package.pickle.loads(blob)["graph"]["get_decomp_fn"],
                                          lazy_globals.LazyGlobal)
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(v=package.pickle.loads(blob)))
    thread.start(); thread.join()
    out["other_thread_real"] = "v" in seen and MOD in sys.modules
# the other thread's plain read imported the module: the stand-in now resolves to torch's own
from torch._inductor.decomposition import select_decomp_table
out["other_thread_is_torchs"] = seen["v"]["graph"]["get_decomp_fn"] is select_decomp_table
out["call_gives_torchs_table"] = fn() == select_decomp_table() and fn.resolve() is select_decomp_table
again = pickle.loads(pickle.dumps(got, protocol=pickle.HIGHEST_PROTOCOL))
out["repickled_is_torchs"] = again["graph"]["get_decomp_fn"] is select_decomp_table
out["outside_real"] = package.pickle.loads(blob)["graph"]["get_decomp_fn"] is select_decomp_table
out["imported_module_real"] = lazy_globals.loads(blob)["graph"]["get_decomp_fn"] is select_decomp_table
print("LAZY " + json.dumps(out))
"""


def test_an_entry_reads_without_importing_the_decomposition_table(tmp_path: Path) -> None:
    from torch._inductor.decomposition import select_decomp_table

    blob = pickle.dumps({"graph": {"get_decomp_fn": select_decomp_table, "is_inference": True},
                         "n": 3}, protocol=pickle.HIGHEST_PROTOCOL)
    resaved = pickle.dumps({"f": lazy_globals.LAZY_GLOBALS[
        ("torch._inductor.decomposition", "select_decomp_table")]}, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"resolve_name" in resaved
    done = subprocess.run([sys.executable, "-c", CHILD, blob.hex(), resaved.hex()], env=fresh_node_env(tmp_path),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LAZY "))
    out = json.loads(line[len("LAZY "):])
    assert out == {
        "before": False, "stand_in": True, "other_values": True, "after_loads": False,
        "resaved_stand_in": True,
        "deepcopy_is_self": True, "copy_is_self": True, "after_copies": False,
        "torch_read_inside": True, "other_thread_real": True, "other_thread_is_torchs": True,
        "call_gives_torchs_table": True, "repickled_is_torchs": True, "outside_real": True,
        "imported_module_real": True,
    }


def test_the_capability_holds_for_this_torch() -> None:
    assert available(lazy_globals.CAPABILITY)


def test_no_torch_file_compares_the_table_by_identity() -> None:
    """The probe reads only the files that hand a graph's ``get_decomp_fn`` on; here all of
    _inductor, _dynamo and _functorch (the pattern itself finds an identity test: it can fail)."""
    for text in ("if get_decomp_fn is select_decomp_table:", "f is not get_decomp_fn",
                 "select_decomp_table is fn"):
        assert lazy_globals.IDENTITY.search(text), text
    assert not lazy_globals.IDENTITY.search("x = get_decomp_fn() if get_decomp_fn is not None else d")
    torch_dir = Path(torch.__file__).parent
    found = []
    for sub in ("_inductor", "_dynamo", "_functorch"):
        for path in (torch_dir / sub).rglob("*.py"):
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [f"{path}: {m.group(0)}" for m in lazy_globals.IDENTITY.finditer(text)]
            assert lazy_globals.identity_comparisons(text) == [], path  # what the probe reads
    assert found == []
    assert lazy_globals.identity_comparisons("a = 1\n    if fn is select_decomp_table:\n") == [
        "if fn is select_decomp_table:"]
    holders = {f"_inductor/{p.name}" for p in (torch_dir / "_inductor").glob("*.py")
               if re.search(r"\bget_decomp_fn\b", p.read_text(encoding="utf-8"))}
    assert holders <= set(lazy_globals._HOLDERS) | {"_inductor/decomposition.py"}, holders
    assert os.path.exists(torch_dir / "_inductor" / "decomposition.py")


def test_without_the_capability_entries_are_read_with_plain_pickle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Torch moved (here: DiskDynamoStore.read is gone): one warning, then torch's own reads and
    ours are plain ``pickle`` (the stand-in unpickler is never used)."""
    import torch._dynamo.package as package
    from torch._inductor.decomposition import select_decomp_table

    class Refused(pickle.Unpickler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("the lazy unpickler was used without the capability")

    monkeypatch.setattr(lazy_globals, "_LazyUnpickler", Refused)
    monkeypatch.delattr(package.DiskDynamoStore, "read")
    torch_compat._reset()
    try:
        blob = pickle.dumps({"get_decomp_fn": select_decomp_table, "n": 1})
        with pytest.warns(TorchCompatWarning, match="dynamo.lazy_decomp_table"):
            assert lazy_globals.loads(blob) == {"get_decomp_fn": select_decomp_table, "n": 1}
        pickle_before = package.pickle
        with lazy_globals.lazy_entry_reads():
            assert package.pickle is pickle_before
            assert package.pickle.loads(blob)["n"] == 1
        assert lazy_globals.CAPABILITY in torch_compat.degraded()
    finally:
        monkeypatch.undo()
        torch_compat._reset()
    assert available(lazy_globals.CAPABILITY)
