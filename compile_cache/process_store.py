"""A process-wide store for compiles compile_cache does not own: ``compile_cache.enable(name)``.

``torch.compile(model)`` in the user's code, transformers' compiled ``generate``, a serving
engine's own compile: none of them goes through ``compile_regions``. :func:`enable` gives them
the store anyway, under one *name*:

- at once, before any compile, it restores the newest generation of the name's entry (its key:
  the name and the environment key, :func:`process_key`) into torch's local cache dirs;
- it names the process's main thread as the owner of every compile no region group claims, so
  capture by use records every FX-graph and AOTAutograd entry, kernel and autotune result
  those compiles looked up (hit or written), scoped by the program (:func:`program_id`: two
  programs under one name do not supersede each other's graphs; each start restores all);
- it publishes them in the background after each compile, at :func:`flush` and at exit (the
  bounded drain of :mod:`compile_cache.publisher`).

Torch's own content keys decide what hits: restoring an entry the process does not need is
harmless, and two programs under one name share an entry without a wrong hit (each graph's
files are named by torch's key of its code, inputs and config). Dynamo's precompile entries are
not restored this way (they are not keyed by content). Compiles in other threads than the one
that called :func:`enable` are not captured. ``python -m compile_cache run --name NAME -- CMD``
starts ``CMD`` with the store enabled through a ``sitecustomize`` (:mod:`compile_cache.cli.run`).

A store fault never stops the process: the store is skipped with a warning, and torch compiles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
from typing import Any

from torch import nn

from . import _warnings, config, local_dirs
from .errors import ConfigError
from .keys import KEY_FORMAT, environment, environment_digest
from .plan import RegionPlan, RestPart
from .session import CacheSession, open_session
from .store import misses
from .torch_compat import cache_use
from .torch_compat.cache_use import owner_stack

logger = logging.getLogger("compile_cache")

__all__ = ["ENV_DIR", "ENV_NAME", "NAME_PATTERN", "enable", "enable_from_env", "enabled",
           "explain_graphs", "flush", "process_key", "program_id"]

#: ``python -m compile_cache run`` passes the name to the child in this variable.
ENV_NAME = "COMPILE_CACHE_RUN_NAME"
#: ... and the store (``--cache-dir``) in this one.
ENV_DIR = "COMPILE_CACHE_RUN_DIR"
#: What a name may be (a path segment of nothing).
NAME_PATTERN = config.RUN_NAME_PATTERN

_lock = threading.Lock()
_session: CacheSession | None = None
_name: str | None = None


class _Process(nn.Module):
    """Stands for the process where the session wants a model (its entry's class comes from
    the key's record)."""


def process_key(name: str) -> tuple[str, dict[str, Any]]:
    """``(key, record)`` of the name's entry: the name and the environment key (every device
    fact of this machine, since the process's graphs may run anywhere)."""
    env = environment(None)
    env_key = environment_digest(env)
    material = {"format": KEY_FORMAT, "process": name, "environment": env_key}
    key = hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()
                         ).hexdigest()[:32]
    digest = hashlib.sha256(name.encode()).hexdigest()[:32]
    record = {
        "key_format": KEY_FORMAT,
        "model_class": f"process {name}",
        "name": name,
        "device": "any",
        "regions": "",
        "model": {"class": f"process {name}", "fingerprint": digest, "structure": digest,
                  "dtypes": [], "devices": []},
        "compile": {},
        "precompile": False,
        "environment": env,
        "environment_key": env_key,
        "plan": {"digest": digest, "groups": [], "compiled": ["<process>"], "eager": []},
    }
    return key, record


def enable(name: str, *, cache_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Give every ``torch.compile`` of this process the store, under ``name``; returns the key.

    Call it before the first compile (``python -m compile_cache run`` does, right after the
    program's import of torch). Restores
    the newest generation of the name's entry now, captures what the process's compiles use and
    publishes it in the background, at :func:`flush` and at exit. A second call with the same
    name does nothing; another name raises ConfigError. A store that cannot be used warns and
    returns None (torch compiles as without it).
    """
    global _session, _name
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ConfigError(f"compile_cache.enable: a name is 1-128 letters, digits, '.', '_' or '-' "
                          f"(starting with a letter or digit), got {name!r}")
    with _lock:
        if _name is not None:
            if _name != name:
                raise ConfigError(f"compile_cache.enable: already enabled as {_name!r}")
            return _session.key if _session is not None else None
        _name = name
        config.check_all()
        local_dirs.secure_local_dirs()
        key, record = process_key(name)
        program = hashlib.sha256(program_id().encode()).hexdigest()[:32]
        plan = RegionPlan(f"process {name}", (),
                          (RestPart("", f"process {name}", True, "process-wide store", program),))
        owner = plan.rest[0].code_name
        session = open_session(_Process(), plan, key, cache_dir, False, record=record)
        if session is None:
            return None
        # Every program's units, not only this one's: each program publishes under its own
        # scope, so one program's newer graphs never supersede another's (restore is idempotent).
        session.owners = ()
        try:
            session.restore(count=False)
        except OSError as exc:
            session.record_failure("restore", str(exc))
        finally:
            session.owners = (owner,)
        _session = session
        # A restored graph's kernels are all there: build Inductor's precompiled header only
        # when a kernel really compiles (any model's; a miss builds byte-identical commands).
        from . import prefetch

        # torch's key details of every FX graph looked up: published with the packs, compared
        # with a missed graph's own (explain --name: which field differs)
        cache_use.record_graph_fields(True)
        session.publishing.graph_fields = True
        prefetch.defer_header()  # (no ISA prefetch: the process may never compile at all)
        # Compiles that no region group claims belong to the process (this thread's stack base).
        stack = owner_stack()
        stack.insert(0, owner)
        from . import publisher

        publisher.get().at_exit(_count_at_exit)
        logger.info("compile_cache: process store %r enabled (key %s): %s", name, key[:12],
                    session.report.summary())
        return key


def program_id() -> str:
    """What names this program (its graphs' scope in the entry): the script's real path, the
    module of ``-m`` or the code of ``-c``, from the interpreter's own command line."""
    argv = list(getattr(sys, "orig_argv", sys.argv))[1:]
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in ("-m", "-c") and index + 1 < len(argv):
            return f"{arg} {argv[index + 1]}"
        if arg in ("-X", "-W", "--check-hash-based-pycs"):
            index += 2
            continue
        if arg.startswith("-"):
            index += 1
            continue
        return os.path.realpath(arg)
    return "<interactive>"


def enabled() -> str | None:
    """The name :func:`enable` was called with (None: not enabled)."""
    return _name


def flush(timeout: float | None = None) -> bool:
    """Publishes what the process's compiles used and is not published yet; waits at most
    ``timeout`` seconds. True when done (or nothing to do)."""
    session = _session
    if session is None:
        return True
    session.after_forward(0.0)  # counts the start's outcome and what compiled since
    _record_graph_misses(session)
    return session.flush(timeout)


def explain_graphs(lookups: dict[str, dict[str, Any]],
                   metadata: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Why each missed FX graph of ``lookups`` (:func:`cache_use.fx_lookups`) missed, from
    torch's own key details: the published graph (packs' ``fx_graphs``) with the same graph code
    (torch's ``gm`` field) and the fewest differing fields, and those fields with both values
    (``here``, ``there``). No graph with the same code: the nearest of all, ``same_code`` False
    (another program, model or code change)."""
    published: dict[str, dict[str, str]] = {}
    values: dict[str, str] = {}
    for md in metadata:
        if isinstance(md.get("fx_graphs"), dict):
            published.update(md["fx_graphs"])
        if isinstance(md.get("fx_values"), dict):
            values.update(md["fx_values"])
    out = []
    for key, lookup in sorted(lookups.items()):
        if lookup.get("hit"):
            continue
        here: dict[str, list[str]] = lookup.get("fields") or {}

        def differing(fields: dict[str, str], here: dict[str, list[str]] = here) -> list[str]:
            return sorted(n for n in set(here) | set(fields)
                          if (here.get(n) or [None])[0] != fields.get(n))

        code = (here.get("gm") or [None])[0]
        same = {k: f for k, f in published.items() if k != key and f.get("gm") == code}
        pool = same or {k: f for k, f in published.items() if k != key}
        item: dict[str, Any] = {"key": key, "same_code": bool(same), "nearest": None,
                                "differences": [], "different_fields": 0}
        if pool:
            nearest = min(pool, key=lambda k: (len(differing(pool[k])), k))
            names = differing(pool[nearest])
            item.update(nearest=nearest, different_fields=len(names), differences=[
                {"field": n, "here": (here.get(n) or [None, None])[1],
                 "there": values.get(pool[nearest].get(n, ""))} for n in names[:12]])
        elif key in published:
            item["reason"] = "published, but its files were not in the local dirs"
        out.append(item)
    return out


def _record_graph_misses(session: CacheSession) -> None:
    """Records this process's missed graphs and why (:func:`explain_graphs`) as the name's miss
    record in the store, for ``explain --name``; best effort."""
    lookups = cache_use.fx_lookups(session.owners)
    if not any(not v["hit"] for v in lookups.values()):
        return
    try:
        entry = session.store.entry(session.key)
        if entry is None or not entry.packs:
            return  # the name's key is not in the store: the start's own miss record says why
        metadata = [p.metadata for p in entry.packs]
        graphs = explain_graphs(lookups, metadata)
        missed = len(graphs)
        reason = (f"{missed} of {len(lookups)} FX graph(s) missed" + (
            f"; the first differs from the nearest published graph in {graphs[0]['different_fields']} "
            f"field(s): " + ", ".join(d["field"] for d in graphs[0]["differences"][:4])
            if graphs and graphs[0]["nearest"] else ""))
        misses.record_miss(session.store, session.key, {**session.entry_info, "graph_misses": graphs},
                           reason)
    except Exception as exc:  # never fail the program over a miss record
        logger.debug("compile_cache: could not record the graph misses: %s", exc)


def enable_from_env() -> None:
    """The ``sitecustomize`` entry of ``python -m compile_cache run``: :func:`enable` with the
    name in ``COMPILE_CACHE_RUN_NAME``; any failure warns and the program runs without it."""
    if not os.environ.get(ENV_NAME, "").strip():
        return
    try:
        enable(config.RUN_NAME.value(), cache_dir=config.RUN_DIR.value())
    except Exception as exc:  # never stop the user's program over the store
        _warnings.warn(f"compile_cache run: store not enabled, compiling without it: "
                       f"{type(exc).__name__}: {exc}")


def _count_at_exit() -> None:
    session = _session
    if session is not None:
        try:
            session.after_forward(0.0)
            _record_graph_misses(session)
        except Exception as exc:  # at exit: note it, never raise
            logger.warning("compile_cache: counting the process store's outcome failed: %s", exc)


def _reset() -> None:
    """Forget the enabled name (tests)."""
    global _session, _name
    with _lock:
        _session = None
        _name = None
