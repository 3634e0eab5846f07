"""Child process for tests/test_prefetch.py: a cold regional Inductor compile in fresh dirs.

    python _prefetch_child.py

Prints one line ``RESULT {json}``: the vector ISA torch picked and its compiler flags, what the
background prefetch did (None when COMPILE_CACHE_PREFETCH=0), the g++ builds torch itself ran for
its ISA probe, and every file the compile left in the Inductor cache dir (names are content
hashes, so two runs that generated the same kernels with the same flags list the same names).
"""

import json
import os
import sys
import threading

import torch
from torch._inductor import cpp_builder, cpu_vec_isa

import compile_cache
from compile_cache import prefetch

probe_builds_by_torch = []  # test libraries torch's own ISA probe had to build
_in_probe = threading.local()
_original_check_build = cpu_vec_isa.VecISA.check_build
_original_build = cpp_builder.CppBuilder.build


def _check_build(self, code):
    _in_probe.active = True
    try:
        return _original_check_build(self, code)
    finally:
        _in_probe.active = False


def _build(self):
    if getattr(_in_probe, "active", False):
        probe_builds_by_torch.append(os.path.basename(self.get_target_file_path()))
    return _original_build(self)


cpu_vec_isa.VecISA.check_build = _check_build
cpp_builder.CppBuilder.build = _build

torch.manual_seed(0)
model = torch.nn.Sequential(
    *[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(2)]
)
x = torch.randn(4, 32)
with torch.no_grad():
    ref = model(x)
    compile_cache.compile_regions(model, cache_dir=False)
    out = model(x)
torch.testing.assert_close(out, ref)

isa = cpu_vec_isa.pick_vec_isa()
root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
files = set()
for d, _, names in os.walk(root):
    for f in names:
        rel = os.path.relpath(os.path.join(d, f), root)
        if rel.startswith(("fxgraph", "aotautograd")):
            rel = os.path.dirname(rel)  # the entry's key; the entry's own name varies run to run
        if not rel.endswith(".lock"):
            files.add(rel)
run = prefetch.current()
print("RESULT " + json.dumps({
    "isa": str(isa),
    "flags": isa.build_arch_flags(),
    "prefetch": None if run is None else {
        "planned": run.planned, "built": run.built, "loads_answered": run.loads_answered,
        "failed": run.failed, "busy": run.busy,
    },
    "torch_builds": probe_builds_by_torch,
    "files": sorted(files),
}))
sys.stdout.flush()
