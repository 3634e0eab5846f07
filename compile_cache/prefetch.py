"""When to build what a cold CPU compile will wait for, in the background (the policy).

The first Inductor compile for CPU in a process asks which vector instruction sets work. For each
candidate it builds a small test library with g++ and loads it in a child process, one candidate
after another: about 7 s on a 2-core machine before the first kernel is built, whatever the
model. That is more than half of a regional compile's cold start on CPU, and the reason regional
compilation alone cannot reach half of a full compile's cold time there.

:func:`start_probe_builds` builds the same test libraries, side by side on spare cores, while
Dynamo traces. Torch's probe then finds them built and only loads them. The answer stays torch's:
each library is built by torch's own builder with torch's own arguments, into the path torch will
look at, under torch's own per-library lock (the mechanism, and why it changes nothing, is in
:mod:`compile_cache.torch_compat.isa`). A library that fails to build is simply not there, and
torch builds it again and draws its own conclusion.

Torch then loads each library in a child process, one after another (about 0.2 s each on torch
2.13, 1.5 s on torch 2.11, whose child imports torch). The background run also does those loads,
with torch's own load check on the same files, as soon as each library is built; torch's probe
gets that answer through the probe hook instead of starting its own child. A library whose build
or load did not finish here is probed by torch as before.

So the chosen instruction set, and with it every kernel key, is what torch alone would pick. (Two
earlier attempts did change it: forcing ``cpp.vec_isa_ok``, and running torch's probe itself in a
thread, which raced with torch's temporary edits of ``VecAVX512._arch_flags``.)

Who builds: :func:`compile_cache.compile_regions` starts the run when it compiles at the first
forward, and in a coordinated distributed warm-up only the rank that compiles does
(:func:`start_for`); a rank that will restore another's compile cancels what has not started
(:func:`cancel_pending`) and imports the compile stack while it waits
(:func:`import_compile_stack`). ``COMPILE_CACHE_PREFETCH=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from . import config
from .torch_compat import cpp_header, dynamo, isa

log = logging.getLogger("compile_cache")

ENV_SWITCH = config.PREFETCH.name


@dataclasses.dataclass
class ProbePrefetch:
    """What one background run did (its counts are filled in when every build has finished)."""

    planned: int = 0  # test libraries torch's probe would build
    built: int = 0  # built here
    present: int = 0  # already there (an earlier process, or a restored pack)
    failed: int = 0  # failed to build here: torch builds them again and decides
    busy: int = 0  # someone held torch's lock for it first: left to them
    cancelled: int = 0  # not started before cancel(): left to torch
    loads_answered: int = 0  # torch probes answered with a load done here
    seconds: float = 0.0
    stop: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Starts no further build: for a rank that will restore another rank's compile instead.

        Builds already running finish; torch probes the rest itself, if it ever needs them.
        """
        self.stop.set()


_lock = threading.Lock()
_started: ProbePrefetch | None = None  # one run per process: the libraries outlive any model


def enabled() -> bool:
    """``COMPILE_CACHE_PREFETCH`` (default on)."""
    return bool(config.PREFETCH.value())


def wants_cpu_inductor(tensors: Iterable[Any], compile_kwargs: dict[str, Any]) -> bool:
    """Whether a compile with ``compile_kwargs`` of a model holding ``tensors`` needs CPU kernels.

    True for Inductor (the default backend) unless every tensor lives on an accelerator.
    """
    if compile_kwargs.get("disable"):
        return False
    backend = compile_kwargs.get("backend", "inductor")
    if backend != "inductor":
        return False
    devices = {getattr(t, "device", None) for t in tensors}
    devices.discard(None)
    return not devices or any(d.type == "cpu" for d in devices)


def start_for(
    model: Any, compile_kwargs: dict[str, Any], *, cold: bool = True
) -> ProbePrefetch | None:
    """:func:`start_probe_builds` if compiling ``model`` with ``compile_kwargs`` needs CPU kernels;
    on a ``cold`` start (nothing restored) also the background build of Inductor's precompiled
    header (``COMPILE_CACHE_PREFETCH_HEADER``, default on): torch builds it on the compiling
    thread at the first kernel, after the ISA probe, ~7 s of g++ on one core with nothing else
    to do; started here, it overlaps Dynamo's trace and the probe's builds (the paired runs are in
    benchmarks/RESULTS.md). A restored start builds none: its kernels are all there, and so are
    the probe's test libraries, which the restore answers as the publisher's probe did (planning
    their builds would only find them present: ~8 ms of the start's thread, issue 38)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    if not wants_cpu_inductor(tensors, compile_kwargs):
        return None
    if not cold:
        return None
    if config.PREFETCH_HEADER.value() and defer_header_for(model, compile_kwargs):
        cpp_header.start_background_build()
    return start_probe_builds()


def defer_header_for(model: Any, compile_kwargs: dict[str, Any]) -> bool:
    """Builds Inductor's precompiled CPU header only when a kernel is really compiled, if
    compiling ``model`` needs CPU kernels (``COMPILE_CACHE_DEFER_HEADER``, default on): a start
    whose kernels are all restored then runs no g++ at all. True when the deferral is on."""
    if not config.DEFER_HEADER.value():
        return False
    tensors = itertools.chain(model.parameters(), model.buffers())
    if not wants_cpu_inductor(tensors, compile_kwargs):
        return False
    return cpp_header.install()


def defer_header() -> bool:
    """:func:`defer_header_for` for every compile of the process (the process store's: it does
    not know the models), when the deferral is on. True when it is."""
    if not config.DEFER_HEADER.value():
        return False
    return cpp_header.install()


def cancel_pending() -> None:
    """Cancels this process's background builds that have not started (see ``cancel``)."""
    run = _started
    if run is not None:
        run.cancel()


def start_probe_builds() -> ProbePrefetch | None:
    """Starts building the vector-ISA test libraries torch's probe is about to need.

    Returns the run's record, or None when there is nothing to do: switched off, not Linux on
    x86-64, torch already probed in this process, ``cpp.vec_isa_ok`` set, or a torch without
    this probe. Idempotent: a second call returns the first call's record.
    """
    global _started
    with _lock:
        if _started is not None:
            return _started
        if not enabled():
            return None
        try:
            planned = isa.plan_probe_builds()
        except Exception as exc:  # another torch version: torch probes on its own, as before
            log.debug("compile_cache: no ISA probe prefetch (%s: %s)", type(exc).__name__, exc)
            return None
        if not planned:
            return None
        record = _started = ProbePrefetch(planned=len(planned))
        # Before the thread starts, so that torch's probe, whenever it runs, finds the answers.
        load = isa.torch_load_probe()
        if load is not None and not isa.add_answerer(_answer_from_prefetch):
            load = None
        work = []
        for key, builder, isa_object, target in planned:
            answer: Future[bool | None] = Future()
            if load is not None:
                _load_answers[os.path.realpath(target)] = answer
            work.append((key, builder, isa_object, answer))
    thread = threading.Thread(
        target=_build_all, args=(work, record, load), name="compile_cache-isa-prefetch", daemon=True
    )
    thread.start()
    return record


_load_answers: dict[str, Future[bool | None]] = {}  # realpath -> this run's load of it


def _build_all(
    planned: list[tuple[str, Any, Any, Future[bool | None]]],
    record: ProbePrefetch,
    load: Any,
) -> None:
    start = time.perf_counter()
    try:
        workers = max(1, min(len(planned), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="compile_cache-isa-build") as pool:
            outcomes = [
                pool.submit(isa.build_and_load, key, builder, isa_object, load, answer, record.stop)
                for key, builder, isa_object, answer in planned
            ]
            results = [o.result() for o in outcomes]
        record.built = results.count("built")
        record.present = results.count("present")
        record.failed = results.count("failed")
        record.busy = results.count("busy")
        record.cancelled = results.count("cancelled")
    finally:
        record.seconds = time.perf_counter() - start
        log.debug("compile_cache: ISA probe prefetch %s", record)


def _answer_from_prefetch(isa_object: Any, path: str) -> bool | None:
    """The probe-hook answerer: this run's load of ``path``, once done; None if it has none."""
    answer = _load_answers.get(path)
    if answer is None:
        return None
    try:
        loaded = answer.result(timeout=_LOAD_WAIT_S)
    except Exception:  # timed out here: torch probes for itself
        return None
    if loaded is not None and _started is not None:
        _started.loads_answered += 1
    return loaded


_LOAD_WAIT_S = 120.0  # torch's own child load gives up after 60 s; a build takes a few


def import_compile_stack() -> None:
    """Imports the compile stack ahead of the first compile, for a rank that would sit idle.

    A rank waiting for another rank's compile spends the time here instead of after the wait.
    Failures are only logged: the compile imports what it needs anyway.
    """
    dynamo.import_compile_stack()


def current() -> ProbePrefetch | None:
    """This process's background run, if one started."""
    return _started


def _reset() -> None:
    """Forget this process's run (tests): the next start plans again."""
    global _started
    with _lock:
        _started = None
        _load_answers.clear()
