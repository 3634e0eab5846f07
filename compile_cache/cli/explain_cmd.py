"""``explain``: why a start missed the store, field by field.

Without a TARGET it reads the misses the store recorded (a start whose key was not there writes
one, :mod:`compile_cache.store.misses`) and explains each against the entries there now: no
torch import, well under a second. With a TARGET or ``--hf`` (and the job's flags, as for
``warm``) it builds the model, computes the key ``compile_regions`` would use
(:func:`compile_cache.api.key_for`) and explains that. The comparison is
:func:`compile_cache.explain.explain`.

Both also show the *partial hits* recorded (starts that found their key and still compiled):
how many graphs the store lacked, why (a new shape, a path not taken before, another dtype or
value: :func:`compile_cache.explain.partial_causes`) and whether a later node will hit.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from .output import UsageError, ago, print_json
from .store_cmds import open_store

__all__ = ["cmd_explain"]

_SHOWN = 3  # candidates printed per key (all of them in --json)


def _print_explanation(explanation: Any) -> None:
    if explanation.candidates:
        print(f"  key {explanation.key[:12]} is not in the store; entries of the same model are:")
    else:
        print(f"  {explanation.reason}")
    for candidate in explanation.candidates[:_SHOWN]:
        print(f"  entry {candidate.key[:12]} ({candidate.packs} pack(s)) differs in:")
        for difference in candidate.differences or ():
            print(f"    - {difference.text()}")
        if not candidate.differences:
            print("    - nothing explain compares")
    if len(explanation.candidates) > _SHOWN:
        print(f"  ... and {len(explanation.candidates) - _SHOWN} more entries of this model (--json)")


def _print_partials(partials: list[dict[str, Any]], now: float) -> None:
    for partial in partials:
        model = str((partial.get("record") or {}).get("model_class") or "-").rsplit(".", 1)[-1]
        print(f"partial hit of key {partial['key']} ({model}), {ago(float(partial.get('time') or 0), now)} "
              f"on {partial.get('host', '?')} (pid {partial.get('pid', '?')}): restored "
              f"{partial.get('restored_packs', '?')} pack(s), then compiled {partial.get('graphs_compiled', '?')} "
              f"graph(s) the store lacked ({partial.get('graphs_hit', 0)} hit)")
        for cause in partial.get("causes") or ():
            if isinstance(cause, dict):
                print(f"  - {cause.get('text', '?')}")


def _explain_job(args: argparse.Namespace) -> int:
    from torch import nn

    from ..api import key_for
    from ..explain import explain
    from ..store import misses
    from .job import build_job

    job = build_job(args)
    if isinstance(job.model, nn.Module):
        fields = key_for(job.model, precompile=job.precompile, **job.compile_kwargs)
    else:  # a factory's function: compile_cache.compile(fn)'s key
        from ..whole import function_key

        fields = function_key(job.model, job.compile_kwargs)
    store = open_store(args)
    explanation = explain(fields.key, fields.record, misses.entry_records(store), str(store.root))
    partials = misses.last_partials(store, key=fields.key)
    if args.json:
        print_json({**explanation.to_dict(), "mode": job.mode(), "record": fields.record,
                    "partials": partials})
    else:
        print(f"key {fields.key} ({job.mode_line()})")
        print(f"store: {store.root}")
        _print_explanation(explanation)
        _print_partials(partials, time.time())
    return 0 if explanation.status == "present" else 1


def _explain_process(args: argparse.Namespace) -> int:
    """``explain --name NAME``: the process store's key here and, when it is not in the store,
    the fields of this machine's environment that differ from the name's entries. Which of
    the process's graphs then missed is torch's to say (its keys cover code, inputs, config)."""
    from ..explain import explain
    from ..process_store import NAME_PATTERN, process_key
    from ..store import misses

    if not NAME_PATTERN.match(args.name):
        raise UsageError(f"--name is 1-128 letters, digits, '.', '_' or '-', got {args.name!r}")
    key, record = process_key(args.name)
    store = open_store(args)
    explanation = explain(key, record, misses.entry_records(store), str(store.root))
    # the graphs the last start under this key missed, and why (torch's key fields)
    recorded = [m for m in misses.last_misses(store) if m.get("key") == key]
    last = recorded[0] if recorded else {}
    graphs = (last.get("record") or {}).get("graph_misses") or []
    if args.json:
        print_json({**explanation.to_dict(), "name": args.name, "record": record,
                    "graph_misses": graphs, "graph_misses_host": last.get("host")})
    else:
        print(f"key {key} (process store {args.name!r})")
        print(f"store: {store.root}")
        _print_explanation(explanation)
        if graphs:
            print(f"\nthe last start on {last.get('host', '?')} missed {len(graphs)} FX graph(s):")
            for graph in graphs:
                print(f"  graph {graph['key'][:16]}: " + _graph_reason(graph))
                for diff in graph.get("differences", ()):
                    print(f"      {diff['field']}: {diff['here']!s:.100} here, "
                          f"{diff['there']!s:.100} in the store")
    return 0 if explanation.status == "present" else 1


def _graph_reason(graph: dict) -> str:
    """One line on why a graph missed (process_store.explain_graphs' item)."""
    if graph.get("reason"):
        return str(graph["reason"])
    if not graph.get("nearest"):
        return "no published graph to compare with"
    what = "the same code" if graph.get("same_code") else "other code (another program or model)"
    return (f"nearest published graph {graph['nearest'][:16]} ({what}) differs in "
            f"{graph.get('different_fields', 0)} field(s) of torch's key")


def _explain_recorded(args: argparse.Namespace) -> int:
    from ..explain import explain
    from ..store import misses

    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: must be 1 or more")
    store = open_store(args)
    recorded = misses.last_misses(store, args.limit)
    entries = list(misses.entry_records(store))
    partials = misses.last_partials(store, args.limit or misses.MISS_KEEP)
    out = []
    for miss in recorded:
        record = miss.get("record") if isinstance(miss.get("record"), dict) else {}
        explanation = explain(miss["key"], record, entries, str(store.root))
        out.append((miss, explanation))
    if args.json:
        print_json({"store": str(store.root), "misses": [
            {"key": m["key"], "time": m.get("time"), "host": m.get("host"), "pid": m.get("pid"),
             "reason_then": m.get("reason"), **e.to_dict()} for m, e in out], "partials": partials})
        return 0
    if not out and not partials:
        print(f"No misses recorded in {store.root}")
        return 0
    now = time.time()
    for miss, explanation in out:
        model = str((miss.get("record") or {}).get("model_class") or "-").rsplit(".", 1)[-1]
        print(f"miss of key {miss['key']} ({model}), {ago(float(miss.get('time') or 0), now)} "
              f"on {miss.get('host', '?')} (pid {miss.get('pid', '?')})")
        if explanation.status == "present":
            later = sum(p["key"] == miss["key"] for p in partials)
            print("  resolved: the key is in the store now" + (
                f"; {later} later start(s) still compiled graphs it lacked (partial hits below)"
                if later else ""))
        else:
            _print_explanation(explanation)
    _print_partials(partials, now)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """Why a start missed: a TARGET's key now, or the misses the store recorded."""
    if getattr(args, "name", None):
        if args.target or args.hf:
            raise UsageError("--name explains a process store: give no TARGET or --hf with it")
        return _explain_process(args)
    if args.target or args.hf:
        return _explain_job(args)
    if args.set:
        raise UsageError("--set only applies to --hf models")
    return _explain_recorded(args)
