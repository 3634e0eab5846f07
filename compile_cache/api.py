"""compile_cache's API, the pipeline in order: ``compile_regions``, ``warm_up`` and ``warm``.

``compile_regions(model)`` reads top to bottom as the data flows:

1. **validate** the model and the ``torch.compile`` keywords;
2. **plan** which blocks repeat (:mod:`.plan`);
3. **key** the compile: model fingerprint, plan, keywords, environment (:mod:`.keys`);
4. **session**: open the store and restore the key's packs before anything compiles
   (:mod:`.session`);
5. **prefetch**: start building Inductor's CPU ISA-probe libraries in the background, unless a
   coordinated distributed warm-up will decide which rank compiles (:mod:`.prefetch`);
6. **install** the compiled call paths in place (:mod:`.regions`);
7. **attach** the session, so the end of each forward publishes what it compiled;
8. **coordinate** the ranks of a distributed job (:mod:`.distributed`).

``warm(model, [inputs, ...])`` is the ahead-of-time grid behind ``python -m compile_cache warm``: it runs
``compile_regions`` and then each example input through the one runner (:mod:`.warmup`).

**compile_regions in detail.**

*Hooks.* Hooks and instance-bound ``forward``s present at ``compile_regions`` are traced into the
compiled code; blocks that differ in them are planned apart (Dynamo does not guard on hooks). A
hook added later where the traced code had none (on a block, a submodule or globally) makes that
block run eagerly while it is registered, so the hook fires (``RegionEagerWarning``, counted in
``region_stats``); register hooks before ``compile_regions`` to keep the block compiled. See
``plan_regions`` for what is compiled and what stays eager.

*The store and precompile.* With a store, matching packs are restored before compiling, and what
the forwards compile is published. With ``precompile``, every guard Dynamo can save is kept
(attribute values, ``training``, argument counts, optional arguments, tensor metadata); only
identity checks the key covers are dropped, and a group whose guards cannot be saved faithfully
(or another backend than Inductor) compiles without precompile, with a
``RegionPrecompileWarning``; ``precompile=False`` caches the compiled graphs only.
``compile_cache.last_report()`` says per group whether precompile was used.

*The key and misses.* Equal ``torch.compile`` settings give one key: keywords equal to torch's
defaults (``backend="inductor"``, ``mode="default"``, ``fullgraph=False``, ...) are dropped. When
the key was not in the store, the report says why (``miss_reason``: each field that differs from
the closest entry of the same model; a ``CacheMissWarning`` says it too when such entries exist).

*The ISA prefetch.* For Inductor on CPU, the test libraries of Inductor's vector-ISA probe that
are not already there start building in the background, so the first compile does not wait for
them one by one; torch's probe still makes its own choice (``compile_cache.prefetch``,
``COMPILE_CACHE_PREFETCH=0`` turns it off).

*Example inputs and distributed jobs.* ``example_inputs`` (a tuple of positional inputs, a dict of
keywords, or one tensor, shaped like the real batches) compiles now with
:func:`compile_cache.warm_up` (forward only under ``no_grad`` for a model in eval mode, forward
and backward in training mode). In a ``torch.distributed`` job, one rank per key compiles and
the others restore its artifacts; ``distributed`` (default ``COMPILE_CACHE_DISTRIBUTED`` or
``shared``) says how they get them (see ``compile_cache.distributed``). Every rank must then call
``compile_regions`` at the same point; apply DDP or ``fully_shard`` afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _warnings, config, local_dirs, prefetch, regions, warmup
from . import distributed as _distributed
from .errors import ConfigError
from .keys import KeyFields, key_fields
from .plan import REASONS, RegionPlan, check_module, plan_regions, whole_plan
from .precompiled import PrecompileReviewWarning
from .session import CacheReport, last_report, open_session, precompile_requested, session_for
from .torch_compat import restored_code
from .torch_compat.inductor_backend import config_without_compile_stack
from .torch_compat.precompile import usable as precompile_available

logger = logging.getLogger("compile_cache")

__all__ = ["WarmResult", "compile_regions", "key_for", "warm", "warm_up"]


#: Compile now, once per job: one rank per key compiles, the others restore.
warm_up = _distributed.warm_up


def check_cache_dir(cache_dir: object) -> None:
    """TypeError unless ``cache_dir`` is None, False, a str or a PathLike."""
    if cache_dir is None or cache_dir is False or isinstance(cache_dir, (str, os.PathLike)):
        return
    raise TypeError(f"cache_dir must be None, False, a str or a PathLike, got {cache_dir!r}")


def compile_regions(
    model: nn.Module,
    *,
    cache_dir: str | os.PathLike[str] | bool | None = None,
    precompile: bool | None = None,
    example_inputs: Any = None,
    distributed: str | None = None,
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """Compile ``model``'s repeated blocks and other parts in place; returns ``model`` itself.

    A drop-in for ``accelerate.utils.compile_regions`` and ``torch.compile`` (every
    ``torch.compile`` keyword is accepted): identical blocks share one compiled graph, so a model
    of N identical layers compiles one, and the model object, its class, ``state_dict()`` keys,
    parameters and hooks stay as they are. Calling it again re-plans and keeps what is already
    compiled with the same keywords.

    ``cache_dir``: the artifact store that lets a fresh process or node restore compiled code
    instead of compiling it (``None``: ``COMPILE_CACHE_DIR`` or the default; ``False``: no store;
    a path: that store). ``precompile``: also cache Dynamo's traced bytecode and guards per group,
    so a hit skips tracing (``None``: ``COMPILE_CACHE_PRECOMPILE``, else
    ``config.PRECOMPILE_DEFAULT``: off while it is under review; asked for, it warns once).
    ``example_inputs``: compile now, with :func:`compile_cache.warm_up`, instead of at the first
    forward. ``distributed``: how the ranks
    of a job share one compile (``shared``, ``broadcast`` or ``off``).

    ``compile_cache.last_report()`` says what was restored, compiled and published. Hooks,
    precompile's guards, the key and cache misses, the ISA prefetch and distributed jobs in
    detail: the module doc of :mod:`compile_cache.api`.
    """
    return compile_planned(model, plan_regions, "compile_regions", cache_dir=cache_dir,
                           precompile=precompile, example_inputs=example_inputs,
                           distributed=distributed, **torch_compile_kwargs)


def compile_planned(
    model: nn.Module,
    planner: Callable[[nn.Module], RegionPlan],
    what: str,
    *,
    cache_dir: str | os.PathLike[str] | bool | None = None,
    precompile: bool | None = None,
    example_inputs: Any = None,
    distributed: str | None = None,
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """``compile_regions``' pipeline with another plan: ``planner(model)`` says what is compiled
    (``compile_cache.compile`` plans the whole model as one part). ``what``: the caller's name,
    for errors."""
    # 1. validate (a bad COMPILE_CACHE_* value fails here, not when a rank first waits)
    check_module(model, what)
    regions.validate_kwargs(torch_compile_kwargs)
    check_cache_dir(cache_dir)
    config.check_all()
    kwargs = dict(torch_compile_kwargs)
    # 2. plan
    plan = dataclasses.replace(
        planner(model), disabled=bool(kwargs.get("disable", False)), compile_kwargs=kwargs
    )
    session = None
    use_precompile = False
    if not plan.disabled:
        local_dirs.secure_local_dirs()  # torch's local dirs: ours, or a private one instead
        use_precompile = precompile_requested(precompile, kwargs) and cache_dir is not False
        if use_precompile:
            _warn_precompile_under_review()
        if precompile and cache_dir is False:
            _warnings.warn("compile_cache: precompile=True needs a store (cache_dir=False): "
                           "compiling without precompile", regions.RegionPrecompileWarning)
        if cache_dir is not False:
            # 3. key, 4. session: restore before compiling (Dynamo looks for precompiled
            # entries when torch.compile wraps a function)
            fields = key_fields(model, plan, kwargs, use_precompile)
            session = open_session(model, plan, fields.key, cache_dir, use_precompile,
                                   record=fields.record)
        # 5. prefetch, after the restore (restored test libraries need no build); in a
        # coordinated warm-up only the rank that compiles builds them (distributed.protocol).
        # Restored code loads without the code generator (first: the header's probe builds a
        # kernel command line). Every rank defers Inductor's precompiled header: a restored
        # start needs none.
        restored_code.install_for(kwargs)
        prefetch.defer_header_for(model, kwargs)
        if example_inputs is None or not _distributed.coordinates(distributed):
            cold = session is None or session.report.restored_packs == 0
            prefetch.start_for(model, kwargs, cold=cold)
    # 6. install (with precompile: one precompiled function per group, named by the key)
    setup = None
    if use_precompile and session is not None and precompile_available():
        setup = regions.PrecompileSetup(
            session.key, session.precompiled.event, session.precompiled.records,
            explicit=precompile is not None or config.PRECOMPILE.raw() is not None)
    with config_without_compile_stack():  # a start that loads every group compiles nothing
        precompiled = regions.install(model, plan, precompile=setup)
    # 7. attach
    if session is not None:
        session.attach(model)
        session.precompiled.track(precompiled)
        regions.observe_calls(model, session.after_forward)
    # 8. coordinate
    if example_inputs is not None:
        _distributed.warm_up(model, example_inputs, mode=distributed)
    else:
        _distributed.note_lazy(model, distributed)
    return model


_precompile_review_warned = False


def _warn_precompile_under_review() -> None:
    """Warn once per process that precompile, asked for explicitly, is under review
    (``config.PRECOMPILE_DEFAULT`` says why it is off by default)."""
    global _precompile_review_warned
    if not _precompile_review_warned:
        _precompile_review_warned = True
        _warnings.warn(config.PRECOMPILE_UNDER_REVIEW, PrecompileReviewWarning)


def key_for(model: nn.Module, *, precompile: bool | None = None, **torch_compile_kwargs: Any) -> KeyFields:
    """The store key (and its record) ``compile_regions(model, precompile=..., **kwargs)`` would
    use now, computed the same way, compiling nothing (``explain``)."""
    check_module(model, "key_for")
    regions.validate_kwargs(torch_compile_kwargs)
    kwargs = dict(torch_compile_kwargs)
    plan = dataclasses.replace(
        plan_regions(model), disabled=bool(kwargs.get("disable", False)), compile_kwargs=kwargs
    )
    return key_fields(model, plan, kwargs, precompile_requested(precompile, kwargs))


# --------------------------------------------------------------------------------------------
# warm: the ahead-of-time grid


@dataclasses.dataclass
class WarmResult:
    """What warming one input shape did.

    ``status``: ``"hit"`` (nothing compiled; code came from the store or the local cache: FX
    graphs, or, with precompile, a group's whole Dynamo entry, counted in ``precompile_hits``),
    ``"compiled"`` (Inductor compiled at least one graph for this shape), or ``"none"`` (nothing
    went through Inductor's cache at all: a non-Inductor backend such as ``eager``, or code this
    process had already compiled). ``seconds`` is the wall time of this shape's forward (and
    backward); the first shape's also includes ``compile_regions`` (the store restore), so it is
    the time to first output. The counters are this shape's share of :func:`last_report`.
    """

    shape: str
    status: str
    seconds: float
    fxgraph_hits: int = 0
    fxgraph_misses: int = 0
    precompile_hits: int = 0
    published_packs: int = 0
    published_bytes: int = 0
    restored_packs: int = 0
    restored_bytes: int = 0
    key: str | None = None
    errors: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``warm --json``)."""
        return dataclasses.asdict(self)


def _progress(items: Sequence[Any], enabled: bool) -> Iterator[tuple[Any, Callable[[str], None]]]:
    """Iterate ``items`` under a tqdm bar on stderr (if enabled and tqdm is installed)."""
    bar = None
    if enabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(items), file=sys.stderr, unit="shape", desc="warming")
        except ImportError:
            bar = None
    try:
        for item in items:
            def note(text: str) -> None:
                if bar is not None:
                    bar.set_postfix_str(text, refresh=True)

            yield item, note
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _status(misses: int, hits: int, restored: int) -> str:
    if misses:
        return "compiled"
    if hits or restored:
        return "hit"
    return "none"


def warm(
    model: nn.Module,
    example_inputs_list: Sequence[Any],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    train: bool = False,
    grad: bool | None = None,
    precompile: bool | None = None,
    progress: bool = False,
    whole_model: bool = False,
    **compile_kwargs: Any,
) -> list[WarmResult]:
    """Compile ``model`` for every example input in ``example_inputs_list``; publish to the store.

    ``model`` is compiled in place with :func:`compile_regions` (``cache_dir``, ``precompile`` and
    ``compile_kwargs`` such as ``backend``, ``mode``, ``dynamic``, ``fullgraph`` go to it: use the
    same ones as the job you warm for, they are part of the cache key). Inference runs under
    ``torch.no_grad()`` with ``model.eval()``; ``train=True`` uses ``model.train()`` and runs a
    backward too, so the backward graphs are cached as well. ``grad`` (default: ``train``)
    overrides whether autograd records the forward: torch compiles different graphs with and
    without it, so mirror the job (an eval job that forgot ``no_grad`` needs ``grad=True``).
    ``progress=True`` shows a tqdm bar on stderr; ``whole_model=True`` compiles it whole, as
    ``compile_cache.compile(model)`` (the same key). Returns one :class:`WarmResult` per input.
    (``compile_cache.warm`` also takes a function: :func:`compile_cache.whole.warm`.)
    """
    inputs_list = _warm_inputs(model, example_inputs_list)
    model.train(train)
    before = last_report()
    start = time.perf_counter()
    compile_planned(model, _whole_model_plan if whole_model else plan_regions, "warm",
                    cache_dir=cache_dir, precompile=precompile, **compile_kwargs)
    setup_seconds = time.perf_counter() - start
    report: CacheReport | None = last_report()
    if report is before:
        report = None  # no store this time (unusable, or cache_dir=False): nothing to count
    if report is not None:
        logger.info("compile_cache warm: %s", report.summary())

    results: list[WarmResult] = []
    # The first shape is the time to first output: it owns the restore and the groups'
    # precompiled entries that compile_regions loaded.
    seen = _snapshot(report)._replace(precompile_hits=0)
    seen_errors = 0
    restored = (report.restored_packs, report.restored_bytes) if report else (0, 0)
    for index, (inputs, note) in enumerate(_progress(inputs_list, progress)):
        label = warmup.describe_inputs(inputs)
        note(label)
        t0 = time.perf_counter()
        run = warmup.run(model, inputs, train, session_for(model), grad=grad)
        if train and grad is not False and not run.backward:
            raise ConfigError("--train: the model's output has no tensor that requires grad")
        seconds = time.perf_counter() - t0 + (setup_seconds if index == 0 else 0.0)
        now = _snapshot(report)
        delta, seen = now.minus(seen), now
        errors = list(report.errors[seen_errors:]) if report else []
        seen_errors += len(errors)
        result = WarmResult(
            shape=label,
            status=_status(delta.fxgraph_misses, delta.fxgraph_hits + delta.precompile_hits,
                           restored[0] if index == 0 else 0),
            seconds=seconds,
            fxgraph_hits=delta.fxgraph_hits,
            fxgraph_misses=delta.fxgraph_misses,
            precompile_hits=delta.precompile_hits,
            published_packs=delta.published_packs,
            published_bytes=delta.published_bytes,
            restored_packs=restored[0] if index == 0 else 0,
            restored_bytes=restored[1] if index == 0 else 0,
            key=report.key if report else None,
            errors=errors,
        )
        logger.info("compile_cache warm: %s %s in %.2f s", label, result.status, seconds)
        results.append(result)
    return results


def _warm_inputs(model: Any, example_inputs_list: Any) -> list[Any]:
    """``warm``'s arguments checked (ConfigError): a module and a non-empty list of inputs."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"warm needs a torch.nn.Module or a function, got {type(model).__name__}")
    return warm_inputs(example_inputs_list)


def warm_inputs(example_inputs_list: Any) -> list[Any]:
    """``warm``'s list of example inputs checked (ConfigError): non-empty, each one valid."""
    if isinstance(example_inputs_list, (torch.Tensor, dict, tuple)):
        raise ConfigError("example_inputs_list must be a list of example inputs, one per shape")
    inputs_list = list(example_inputs_list)
    if not inputs_list:
        raise ConfigError("warm needs at least one example input")
    for inputs in inputs_list:
        warmup.check_inputs(inputs)
    return inputs_list


def _whole_model_plan(model: nn.Module) -> RegionPlan:
    """``compile_cache.compile(model)``'s plan (:func:`compile_cache.whole.whole_plan`)."""
    return whole_plan(model, REASONS["whole_model"])


class _Counts(NamedTuple):
    """What a warm-up shape adds to the report (the difference of two snapshots)."""

    fxgraph_hits: int = 0
    fxgraph_misses: int = 0
    published_packs: int = 0
    published_bytes: int = 0
    precompile_hits: int = 0

    def minus(self, other: _Counts) -> _Counts:
        return _Counts(*(a - b for a, b in zip(self, other, strict=True)))


def _snapshot(report: CacheReport | None) -> _Counts:
    if report is None:
        return _Counts()
    return _Counts(report.fxgraph_hits, report.fxgraph_misses, report.published_packs,
                   report.published_bytes, report.precompile_hits)


