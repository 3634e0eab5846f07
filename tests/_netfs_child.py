"""Child process of tests/test_store_network_fs.py: one job start on a node whose store is a
FUSE mount (the caller gives it a fresh node's environment).

    python _netfs_child.py STORE

Runs tests/_fault_helpers.run_job (compile_regions with a counting backend, one forward checked
against eager, the publish flushed) and prints ``RESULT {json}``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fault_helpers import run_job  # noqa: E402

report, backend = run_job(sys.argv[1])
print("RESULT " + json.dumps({"key": report.key, "hit": report.hit, "restored": report.restored_packs,
                              "published": report.published_packs, "misses": backend.misses}))
