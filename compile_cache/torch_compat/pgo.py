"""Dynamo's profile-guided state (``code_state_*``): which inputs a job's frames found dynamic.

With ``torch.compiler.config.job_id`` set, Dynamo keeps one profile per job in
``<inductor dir>/dynamo/code_state_<job key>.pkl`` (``torch._dynamo.pgo.code_state_path``,
written after each successful frame compile, read at the first compile of a process). A fresh
node without it compiles static shapes first and recompiles once per input that turned dynamic;
with it, the first compile is already dynamic where the job's was, and matches the carried
graphs. :func:`code_state_file` names the file, for capture by use to carry it as a unit of the
model's first region group (a newer profile supersedes the older one).
"""

from __future__ import annotations

import logging

from . import available, capability

__all__ = ["code_state_file"]

log = logging.getLogger("compile_cache")


@capability(
    "pgo.code_state",
    needs="torch.compiler.config.job_id, torch._dynamo.pgo (get_cache_key, code_state_path)",
    breaks="Dynamo's job profile (code_state_*) is not carried: a fresh node of the job "
    "recompiles once for each input that turned dynamic",
)
def _probe() -> str | None:
    import torch
    from torch._dynamo import pgo

    if not hasattr(torch.compiler.config, "job_id"):
        return "torch.compiler.config has no job_id"
    for name in ("get_cache_key", "code_state_path"):
        if not callable(getattr(pgo, name, None)):
            return f"torch._dynamo.pgo has no {name}"
    return None


def code_state_file() -> str | None:
    """This job's Dynamo profile path when ``torch.compiler.config.job_id`` is set and local PGO
    is on; else None (no job id: torch keeps no local profile)."""
    import torch

    if getattr(torch.compiler.config, "job_id", None) is None or not available("pgo.code_state"):
        return None
    from torch._dynamo import pgo

    try:
        key = pgo.get_cache_key()
        return None if key is None else pgo.code_state_path(key)
    except Exception as exc:  # a reserved job id, a torch that changed: not carried
        log.debug("compile_cache: Dynamo profile not located: %s", exc)
        return None
