"""Child process: one job start (tests/_cache_child.py) on a store on object storage.

    python _remote_child.py KILL_PGID STORE LAYERS WIDTH DTYPE

``KILL_PGID``: a process group (the S3 server's) killed when the first pack download starts, so
the server is gone mid-restore (0: no fault). Prints one JSON line: _cache_child's result, the
warnings shown, the counters of this node's local tier, and which of s3fs, aiobotocore,
botocore, fsspec, gcsfs and adlfs the job imported.
"""

import contextlib
import io
import json
import os
import runpy
import signal
import sys
import time
import warnings
from pathlib import Path

from compile_cache.store import Store
from compile_cache.store.backends import fsspec_backend as backend
from compile_cache.store.remote import local_tier_dir

CHILD = str(Path(__file__).with_name("_cache_child.py"))
kill, url = int(sys.argv[1]), sys.argv[2]
if kill:
    from compile_cache.store.backends import s3

    def killing(original):
        def download(self, *args, **kwargs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(kill, signal.SIGKILL)
            time.sleep(0.5)
            return original(self, *args, **kwargs)
        return download

    for cls in (backend.FsspecBackend, s3.S3Backend):  # whichever client the store chose
        cls.download = killing(cls.download)
sys.argv = [CHILD, *sys.argv[2:]]
out = io.StringIO()
with warnings.catch_warnings(record=True) as shown, contextlib.redirect_stdout(out):
    warnings.simplefilter("always")
    runpy.run_path(CHILD, run_name="__main__")
result = json.loads(out.getvalue().strip().splitlines()[-1])
result["warnings"] = [str(w.message) for w in shown]
result["imported"] = sorted(m for m in ("s3fs", "aiobotocore", "botocore", "fsspec", "gcsfs", "adlfs") if m in sys.modules)
local = Store(local_tier_dir(url)).stats()
result["local_tier"] = {k: local[k] for k in ("remote_errors", "remote_downloads", "bytes_downloaded", "corrupt")}
print(json.dumps(result))
