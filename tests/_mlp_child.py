"""Child process shared by the artifact tests: compile a tiny MLP with Inductor, capture or restore.

    python _mlp_child.py capture PACK.pkl [--defer [--background]]  # compile, pickle what it added
    python _mlp_child.py restore PACK.pkl                 # restore the pickle, then compile
    python _mlp_child.py restore-store STORE KEY          # restore a store key's packs, then compile

``--defer``: with compile_cache's deferral of Inductor's precompiled header (``--background``:
and its background build). Prints one line
``RESULT {json}``: compile counters, the member names the compile added, how many files the
restore wrote, the output (a restored kernel must give exactly these values), and every compiler
command torch ran (``CppBuilder.build``) with what the header deferral did.
"""

import glob
import json
import pickle
import sys
import tempfile

import torch
from torch._inductor import cpp_builder

from compile_cache import artifacts
from compile_cache.torch_compat import cpp_header
from compile_cache.torch_compat.dynamo import CompileCounters

commands: list[str] = []
_build = cpp_builder.CppBuilder.build


def _logged_build(self: cpp_builder.CppBuilder) -> None:
    commands.append(self.get_command_line())
    return _build(self)


cpp_builder.CppBuilder.build = _logged_build
if "--defer" in sys.argv:
    assert cpp_header.install()
if "--background" in sys.argv:  # COMPILE_CACHE_PREFETCH_HEADER's build, started at once
    assert cpp_header.start_background_build() is not None

mode = sys.argv[1]
written = 0
if mode == "restore":
    with open(sys.argv[2], "rb") as f:
        written = len(artifacts.restore(pickle.load(f)).written)
elif mode == "restore-store":
    from compile_cache.store import Store

    for pack in Store(sys.argv[2]).load(sys.argv[3]):
        written += len(artifacts.restore(pack.members).written)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
x = torch.randn(4, 16)
with torch.no_grad():
    ref = model(x)
capture = artifacts.Capture()
before = CompileCounters.snapshot()
with torch.no_grad():
    out = torch.compile(model)(x)
counts = CompileCounters.snapshot().diff(before)
torch.testing.assert_close(out, ref)
added = capture.collect()
if mode == "capture":
    with open(sys.argv[2], "wb") as f:
        pickle.dump(added, f)
print("RESULT " + json.dumps({
    "counters": counts.as_dict(), "added": sorted(added), "written": written, "out": out.tolist(),
    "commands": commands, "header": cpp_header.counts(),
    "gch": glob.glob(f"{tempfile.gettempdir()}/**/*.gch", recursive=True),
}))
