"""``warm``: compile a model into the store ahead of a job, over a grid of input shapes.

The job to mirror (model, inputs, eval/train, grad, ``use_cache``, dtype, device, shapes and
the ``torch.compile`` settings) comes from :mod:`.job`; the work itself is
:func:`compile_cache.api.warm`. The summary shows the mode it ran and the full key, the same key
the job's ``compile_cache.last_report().key`` shows, and ``warm`` exits 1 when it leaves the store
without an entry for that key. Torch is imported when the command runs, not when the CLI starts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from .._sizes import format_size
from ..errors import CompileCacheError
from .job import build_job
from .output import PROG, UsageError, is_tty, print_json, table

__all__ = ["cmd_warm"]


def _store_problems(report: Any, key: str | None, compiled: int, published: int,
                    backend: str | None) -> list[str]:
    """Why the store may not hold what this warm compiled: read-only, or no entry for the key."""
    from ..store import Store

    problems: list[str] = []
    try:
        store = Store(report.store)
    except (CompileCacheError, OSError) as exc:
        return [f"the store {report.store} cannot be read back: {exc}"]
    if compiled and not published and store.read_only:
        problems.append(f"the store is read-only ({store.read_only_reason}): compiled code was not saved")
    entry = store.entry(key) if key else None
    if entry is None or not entry.packs:
        why = (f"backend {backend!r} produces no compiled artifacts to store"
               if backend not in (None, "inductor") else
               "nothing this run compiled was saved" if not problems else problems[-1])
        problems.append(f"the store has no entry for key {key} after warming: {why}")
    return problems


def cmd_warm(args: argparse.Namespace) -> int:
    """Compile a model into the store ahead of a job, over a grid of input shapes."""
    if args.cache_dir is not None:
        path = Path(args.cache_dir).expanduser()
        if os.path.lexists(path) and not path.is_dir():
            raise UsageError(f"--cache-dir {args.cache_dir}: exists and is not a directory")
    job = build_job(args)

    from ..session import last_report
    from ..whole import warm  # a module (api.warm) or a factory's function

    progress = not args.json and is_tty(sys.stderr)
    start = time.perf_counter()
    results = warm(job.model, job.inputs, cache_dir=args.cache_dir, train=job.train, grad=job.grad,
                   precompile=job.precompile, progress=progress,
                   whole_model=bool(getattr(args, "whole_model", False)), **job.compile_kwargs)
    seconds = time.perf_counter() - start
    report = last_report()
    key = results[0].key if results else None
    if report is not None and report.key != key:
        report = None
    problems = list(report.errors) if report else ["no store was used (see the warning above)"]
    compiled = sum(r.status == "compiled" for r in results)
    published = sum(r.published_bytes for r in results)
    if report is not None:
        with contextlib.suppress(CompileCacheError, OSError):
            problems += _store_problems(report, key, compiled, published,
                                        job.compile_kwargs.get("backend"))
    summary = {
        "key": key,
        "store": report.store if report else None,
        "mode": job.mode(),
        "compile": dict(job.compile_kwargs),
        "results": [r.to_dict() for r in results],
        "seconds": seconds,
        "first_output_seconds": results[0].seconds if results else 0.0,
        "compiled": compiled,
        "fxgraph_hits": sum(r.fxgraph_hits for r in results),
        "fxgraph_misses": sum(r.fxgraph_misses for r in results),
        "precompile_hits": sum(r.precompile_hits for r in results),
        "restored_packs": report.restored_packs if report else 0,
        "published_packs": sum(r.published_packs for r in results),
        "published_bytes": published,
        "hit": bool(report and report.hit),
        "outcome": report.outcome if report else None,
        "miss_reason": report.miss_reason if report else None,
        "errors": problems,
        "ok": not problems,
    }
    if args.json:
        print_json(summary)
    else:
        rows = [
            (r.shape, r.status, f"{r.seconds:.2f}", format_size(r.published_bytes) if r.published_bytes else "-")
            for r in results
        ]
        print(f"mode: {job.mode_line()}")
        settings = ", ".join(f"{k}={v!r}" for k, v in job.compile_kwargs.items()) or "defaults"
        print(f"torch.compile: {settings}" + (", precompile" if job.precompile else "") + "\n")
        print(table(("SHAPE", "RESULT", "SECONDS", "PUBLISHED"), rows, right={2, 3}))
        if report and report.restored_packs:
            restored = f"restored {report.restored_packs} pack(s)"
        else:
            restored = "nothing restored from the store"
        print(f"\nkey {key}: {restored}, {compiled} of {len(results)} shape(s) compiled, "
              f"{format_size(published)} published, {seconds:.1f} s in all")
        if report:
            print(f"store: {report.store}")
            if report.miss_reason and report.restored_packs == 0:
                print(f"why nothing was restored: {report.miss_reason}")
        print("a job with the same settings shows this key in compile_cache.last_report().key")
    if problems:
        for p in problems:
            print(f"{PROG} warm: not everything is in the store: {p}", file=sys.stderr)
        return 1
    return 0
