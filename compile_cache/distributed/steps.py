"""What one rank does in a warm-up, whatever the mode: run the example inputs, compile under the
store's lock, and the small helpers the protocols share (notes, pack names, the "gone" key)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from torch import nn

from .. import config, prefetch, warmup
from ..errors import LockTimeoutError
from ..regions import get_plan
from ..session import CacheSession
from .warm_up_report import WarmUpReport

__all__ = ["compile_under_lock", "gone_key", "local", "note", "pack_names", "ready"]

logger = logging.getLogger("compile_cache")


def gone_key(ns: str, rank: int) -> str:
    """Set by a rank whose warm-up failed: the others stop waiting for it."""
    return f"{ns}/gone/{rank}"


def note(report: WarmUpReport, message: str, *, warn: bool = False) -> None:
    report.notes.append(message)
    (logger.warning if warn else logger.info)("compile_cache: %s", message)


def ready(session: CacheSession, sig: str) -> bool:
    """Whether the key's packs hold a warm-up of this signature."""
    return any(m.get("warm_up") == sig for m in session.pack_metadata())


def local(
    report: WarmUpReport, model: nn.Module, inputs: Any, train: bool, session: CacheSession | None
) -> None:
    plan = get_plan(model)
    if plan is not None and not plan.disabled:  # a rank that compiles: probe libraries ahead
        prefetch.start_for(model, plan.compile_kwargs)
    result = warmup.run(model, inputs, train, session)
    if train and not result.backward:
        logger.warning("compile_cache: warm-up output has no tensor requiring grad; backward skipped")
    report.fxgraph_hits += result.fxgraph_hits
    report.fxgraph_misses += result.fxgraph_misses


def compile_under_lock(
    report: WarmUpReport, model: nn.Module, inputs: Any, train: bool, session: CacheSession,
    sig: str, wait: float,
) -> None:
    """The compile of the rank (or process) that compiles a key: under the store's lock of the
    key, so that another job compiling the same key now is waited for (while its heartbeat is
    fresh, up to ``wait``) and restored from, not compiled again. Correctness never depends on
    the lock: on a timeout this compiles anyway."""
    lock_timeout = config.LOCK_TIMEOUT.value()
    lock = session.lock(lock_timeout, wait_alive=max(wait, lock_timeout))
    held = False
    try:
        lock.acquire()
        held = True
    except LockTimeoutError as exc:
        report.notes.append(f"lock timeout, compiling anyway: {exc}")
        session.lock_failed(exc)
    except OSError as exc:  # a lock file another user made (EACCES), ENOLCK, EROFS: bounded too
        report.notes.append(f"lock error, compiling anyway: {type(exc).__name__}: {exc}")
        session.lock_failed(exc)
    report.waited_seconds += lock.waited
    if held and lock.waited_past_timeout:
        note(report, f"waited {lock.waited:.1f} s for the store's lock of this key: its holder's "
             f"heartbeat stayed fresh past the {lock_timeout:g} s lock timeout")
    try:
        if held and ready(session, sig):
            session.restore(count=False)  # another process published while we waited for the lock
            report.notes.append("another process published while we waited for the lock")
        local(report, model, inputs, train, session)
    finally:
        if held:
            with contextlib.suppress(OSError):
                lock.release()


def pack_names(session: CacheSession) -> set[str]:
    """The names of the key's packs in the store now (headers only)."""
    entry = session.entry()
    return {p.name for p in entry.packs} if entry is not None else set()
