"""Why a key missed: compare what a start used with the entries of the same model in the store.

A start's key is a hash, so a miss by itself says nothing. Every entry keeps the readable record
of its key (``entry.json``, :func:`compile_cache.keys.key_fields`), and so does a start. When a
key is not in the store, :func:`explain` finds the entries of the *same model* (same module
classes and parameter names and shapes: :func:`compile_cache.keys.model_structure`) and names
each field that differs, e.g. ``CPU threads: 2 here, 1 in the entry (set OMP_NUM_THREADS=1 ...)``,
a ``torch.compile`` keyword, precompile, the parameters' dtype or device, the torch build, the
CPU instruction set, a torch config. The closest entry (fewest differences) gives the one-line
reason of ``last_report().miss_reason``, of the warning ``compile_regions`` shows, and of
``python -m compile_cache explain``.

A start can also find its key and still compile: a *partial hit* (restored packs, then graphs
the store lacked). :func:`partial_causes` names why, per code object, from plain records: the
automatic-dynamic record the start restored against its own after compiling
(:mod:`compile_cache.torch_compat.dynamic_shapes`: a new size of a dimension, a code object no
publisher ran, such as a branch on a tensor value or another graph break) and Dynamo's failing
guards (a new shape, another dtype, another value); and whether a later node will hit. The
session records them in the store (:func:`compile_cache.store.misses.record_partial`), and
``python -m compile_cache explain`` shows them.

This module compares plain records: it imports neither torch nor the store's internals (the CLI
explains recorded misses without torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

__all__ = [
    "CacheMissWarning",
    "Candidate",
    "PartialCause",
    "Difference",
    "Explanation",
    "compare",
    "explain",
    "field_value",
    "partial_causes",
    "short_value",
]


class CacheMissWarning(UserWarning):
    """A start missed the store although entries of the same model are there: what differs."""


#: environment fields -> (label, hint); the hint may use {here} and {there}
_ENVIRONMENT: dict[str, tuple[str, str]] = {
    "cpu_threads": ("CPU threads (torch.get_num_threads())",
                    "set OMP_NUM_THREADS={there} or torch.set_num_threads({there}) to use the entry"),
    "devices": ("device kinds the graphs are compiled for (parameters' and buffers' devices)",
                "the entry's graphs are for other devices: CPU facts key CPU graphs, GPU facts "
                "GPU graphs"),
    "compile_on_one_rank": ("torch.compiler.config.compile_on_one_rank (torch 2.13: "
                            "torch.distributed.config's)",
                            "the entry was compiled with another compile_on_one_rank setting"),
    "cpu_capability": ("CPU instruction set", "the entry was compiled on another kind of CPU"),
    "torch": ("torch version", "the entry was compiled by another torch build"),
    "torch_git": ("torch build (git)", "the entry was compiled by another torch build"),
    "torch_debug": ("torch debug build", ""),
    "torch_cuda": ("torch's CUDA version", ""),
    "torch_hip": ("torch's HIP version", ""),
    "python": ("Python version", ""),
    "python_impl": ("Python implementation", ""),
    "triton": ("Triton version", ""),
    "machine": ("machine architecture", ""),
    "system": ("operating system", ""),
    "default_dtype": ("torch.get_default_dtype()", ""),
    "deterministic": ("deterministic algorithms (enabled/warn-only)", ""),
    "inductor_config": ("Inductor config (torch._inductor.config)",
                        "a setting differs: compare `python -m compile_cache doctor --json` on both"),
    "functorch_config": ("AOTAutograd config (torch._functorch.config)", ""),
    "dynamo_config": ("Dynamo config (torch._dynamo.config)", ""),
    "cuda_available": ("CUDA available", ""),
    "device_name": ("GPU model (GPU graphs only)", "the entry was compiled for another GPU"),
    "device_capability": ("GPU compute capability (GPU graphs only)", ""),
    "device_count": ("number of visible GPUs (key format 1 only; no longer keyed)", ""),
}


@dataclasses.dataclass(frozen=True)
class Difference:
    """One field that differs between this start and an entry."""

    field: str  # "environment.cpu_threads", "compile.mode", "precompile", "model.dtypes", ...
    label: str
    here: Any
    there: Any
    hint: str = ""

    def text(self) -> str:
        """``label: HERE here, THERE in the entry (hint)``."""
        def show(value: Any) -> str:  # a torch.compile string as the user writes it: 'max-autotune'
            return repr(value) if self.field.startswith("compile.") and isinstance(value, str) else _show(value)

        out = f"{self.label}: {show(self.here)} here, {show(self.there)} in the entry"
        return f"{out} ({self.hint})" if self.hint else out

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "text": self.text()}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """An entry of the same model, and what differs from this start."""

    key: str
    packs: int
    differences: tuple[Difference, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "packs": self.packs,
                "differences": [d.to_dict() for d in self.differences]}


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Whether a key is in the store and, when it is not, the entries of the same model and what
    differs (closest first). ``reason`` is the one line for people."""

    key: str
    store: str
    status: str  # "present", "unusable" (entry without packs), "miss"
    candidates: tuple[Candidate, ...]
    same_class: int  # entries of the same model class with other parameter shapes
    other_entries: int
    reason: str
    unrecorded: int = 0  # entries of the same class written without a key record (older versions)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "store": self.store, "status": self.status,
                "candidates": [c.to_dict() for c in self.candidates],
                "same_class": self.same_class, "other_entries": self.other_entries,
                "unrecorded": self.unrecorded, "reason": self.reason}


def _show(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "none"
    if isinstance(value, str):
        return value or "none"
    return repr(value)


def _section(record: dict[str, Any], name: str) -> dict[str, Any]:
    value = record.get(name)
    return value if isinstance(value, dict) else {}


def compare(here: dict[str, Any], there: dict[str, Any]) -> list[Difference]:
    """Every field of two key records (:func:`compile_cache.keys.key_fields`) that differs."""
    out: list[Difference] = []
    here_model, there_model = _section(here, "model"), _section(there, "model")
    for name, label in (("dtypes", "parameter dtypes"), ("devices", "parameter devices")):
        if here_model.get(name) != there_model.get(name):
            out.append(Difference(f"model.{name}", label, here_model.get(name), there_model.get(name)))
    here_compile, there_compile = _section(here, "compile"), _section(there, "compile")
    for name in sorted(set(here_compile) | set(there_compile)):
        if here_compile.get(name) != there_compile.get(name):
            out.append(Difference(f"compile.{name}", f"torch.compile {name}",
                                  here_compile.get(name), there_compile.get(name)))
    if bool(here.get("precompile")) != bool(there.get("precompile")):
        out.append(Difference("precompile", "precompile", bool(here.get("precompile")),
                              bool(there.get("precompile"))))
    here_env, there_env = _section(here, "environment"), _section(there, "environment")
    for name in sorted(set(here_env) | set(there_env), key=lambda n: (n not in _ENVIRONMENT, n)):
        a, b = here_env.get(name), there_env.get(name)
        if a != b:
            label, hint = _ENVIRONMENT.get(name, (f"environment {name}", ""))
            out.append(Difference(f"environment.{name}", label, a, b,
                                  hint.format(here=a, there=b) if hint else ""))
    same_tensors = not any(d.field.startswith("model.") for d in out)
    fingerprint_differs = here_model.get("fingerprint") != there_model.get("fingerprint")
    if same_tensors and fingerprint_differs:
        out.append(Difference("model.fingerprint",
                              "model fingerprint (forward code, requires_grad, strides or attributes)",
                              here_model.get("fingerprint"), there_model.get("fingerprint")))
    here_plan, there_plan = _section(here, "plan"), _section(there, "plan")
    if not fingerprint_differs and here_plan.get("digest") != there_plan.get("digest"):
        out.append(Difference("plan", "region plan", here_plan.get("groups"), there_plan.get("groups")))
    return out


#: short names of fields for one-line listings (``ls``)
_SHORT = {"environment.cpu_threads": "threads", "environment.cpu_capability": "isa",
          "environment.devices": "devices", "environment.device_name": "gpu",
          "model.dtypes": "dtype", "model.devices": "device", "model.fingerprint": "fingerprint"}


def field_value(record: dict[str, Any], field: str) -> Any:
    """The value of a :attr:`Difference.field` (``"compile.mode"``, ...) in a key record."""
    if field == "plan":
        return _section(record, "plan").get("groups")
    if field == "precompile":
        return bool(record.get("precompile"))
    section, _, name = field.partition(".")
    return _section(record, section).get(name)


def short_value(record: dict[str, Any], field: str) -> str:
    """``threads=2``, ``mode='max-autotune'``, ``dtype=float64``: a field for a table cell."""
    name = _SHORT.get(field) or field.partition(".")[2] or field
    value = field_value(record, field)
    if field == "model.fingerprint" and isinstance(value, str):
        value = value[:8]
    if isinstance(value, str) and field.startswith("environment.") and len(value) > 16:
        value = value[:8]  # config digests
    shown = repr(value) if field.startswith("compile.") and isinstance(value, str) else _show(value)
    return f"{name}={shown}"


def _same_model(here: dict[str, Any], there: dict[str, Any]) -> bool:
    a, b = _section(here, "model"), _section(there, "model")
    return bool(a.get("structure")) and a.get("structure") == b.get("structure")


def _model_class(record: dict[str, Any]) -> str | None:
    return _section(record, "model").get("class") or record.get("model_class")


def explain(
    key: str, record: dict[str, Any], entries: Iterable[tuple[str, dict[str, Any], int]],
    store: str = "",
) -> Explanation:
    """Explain ``key`` (with its ``record``) against the store's ``entries``:
    ``(key, entry record, number of packs)`` as :func:`compile_cache.store.misses.entry_records`
    gives them."""
    status = "miss"
    candidates: list[Candidate] = []
    same_class = others = unrecorded = 0
    cls = _model_class(record)
    for entry_key, entry_record, packs in entries:
        if entry_key == key:
            status = "present" if packs else "unusable"
            continue
        if _same_model(record, entry_record):
            candidates.append(Candidate(entry_key, packs, tuple(compare(record, entry_record))))
        elif cls and _model_class(entry_record) == cls:
            if _section(entry_record, "model").get("structure"):
                same_class += 1
            else:
                unrecorded += 1
        else:
            others += 1
    candidates.sort(key=lambda c: (len(c.differences), -c.packs, c.key))
    reason = _reason(key, status, candidates, same_class, others, cls)
    if status == "miss" and not candidates and unrecorded:
        reason += (f"; {unrecorded} entr{'y' if unrecorded == 1 else 'ies'} of this model class "
                   "have no key record to compare (written by an older compile_cache)")
    return Explanation(key=key, store=store, status=status, candidates=tuple(candidates),
                       same_class=same_class, other_entries=others, reason=reason,
                       unrecorded=unrecorded)


def _reason(key: str, status: str, candidates: list[Candidate], same_class: int, others: int,
            cls: str | None) -> str:
    short = key[:12]
    name = (cls or "the model").rsplit(".", 1)[-1]
    if status == "present":
        return f"key {short} is in the store"
    if status == "unusable":
        return (f"key {short} has an entry in the store but no pack that could be restored "
                "(corrupt, or written by another torch: see `python -m compile_cache stats`)")
    if candidates:
        best = candidates[0]
        what = "; ".join(d.text() for d in best.differences) or (
            "nothing explain compares (an entry of another compile_cache version?)")
        more = f" ({len(candidates)} entries of this model in all)" if len(candidates) > 1 else ""
        return (f"key {short} is not in the store; the closest entry of the same {name} model, "
                f"{best.key[:12]}, differs in: {what}{more}")
    if same_class:
        return (f"key {short} is not in the store; {same_class} entr{'y' if same_class == 1 else 'ies'} "
                f"of {name} with other parameter names or shapes (another config) are there")
    if others:
        return (f"key {short} is not in the store, and no entry of this {name} model is "
                f"({others} entr{'y' if others == 1 else 'ies'} of other models)")
    return f"key {short} is not in the store, which is empty"


# ----------------------------------------------------------------------------- partial hits

#: kind -> how it reads
_PARTIAL_KINDS = {"shape": "a new shape", "path": "a path not taken before", "dtype": "another dtype",
                  "value": "another value", "guard": "a failing guard", "other": "graphs the store lacked"}


@dataclasses.dataclass(frozen=True)
class PartialCause:
    """Why a start that restored its key still compiled: what was new, and whether a later node hits."""

    kind: str  # one of _PARTIAL_KINDS
    code: str  # the code object that compiled (a region group's function, a resume function)
    detail: str
    later: str

    def text(self) -> str:
        """``a new shape in CODE: DETAIL; LATER``."""
        return f"{_PARTIAL_KINDS.get(self.kind, self.kind)} in {self.code}: {self.detail}; {self.later}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "text": self.text()}


def _guard_kind(reason: str) -> str:
    low = reason.lower()
    if "dtype" in low:
        return "dtype"
    if "size mismatch" in low or "stride mismatch" in low or "expected size" in low or ".size()" in low:
        return "shape"
    if "==" in reason or "check_obj_id" in low or "id_match" in low:
        return "value"
    return "guard"


def _code_records(state: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    codes = (state or {}).get("codes")
    return {k: v for k, v in codes.items() if isinstance(v, dict)} if isinstance(codes, dict) else {}


def _new_sizes(before: Any, after: Any) -> list[tuple[int | None, Any, Any]]:
    """(dim or None for a scalar, before, after) where ``after`` differs from ``before``."""
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [(d, b, a) for d, (b, a) in enumerate(zip(before, after, strict=True))
                if b != a and b is not None and a is not None]
    return []


def _varying(state: dict[str, Any] | None) -> dict[str, list[str]]:
    """Per code name, its inputs with a varying ("dyn") dimension or int."""
    out: dict[str, list[str]] = {}
    for code in _code_records(state).values():
        for input_name, entry in sorted((code.get("inputs") or {}).items()):
            if not isinstance(entry, dict):
                continue
            size = entry.get("size")
            if isinstance(size, list) and "dyn" in size:
                dims = ", ".join(str(d) for d, v in enumerate(size) if v == "dyn")
                out.setdefault(str(code.get("name", "?")), []).append(f"{input_name} (dim {dims})")
            elif not isinstance(size, list) and entry.get("scalar") == "dyn":
                out.setdefault(str(code.get("name", "?")), []).append(input_name)
    return out


def partial_causes(restored: dict[str, Any] | None, now: dict[str, Any] | None,
                   guards: dict[str, list[str]], *, graphs: int, dynamic_false: bool,
                   publishes: bool) -> list[PartialCause]:
    """Why a start that restored its key compiled ``graphs`` graph(s) the store lacked.

    ``restored``: the automatic-dynamic record the start restored (None: none); ``now``: its
    record after compiling (both :func:`compile_cache.torch_compat.dynamic_shapes.snapshot`
    form); ``guards``: the failing guards Dynamo gave per code name; ``dynamic_false``: the
    model was compiled with ``dynamic=False``; ``publishes``: the start can publish what it
    compiled (a read-only store cannot).
    """
    same = ("a later node with the same inputs hits (this start publishes what it compiled)"
            if publishes else "a later node compiles it again (a read-only store: nothing published)")
    out: list[PartialCause] = []
    before_codes = _code_records(restored)
    for key, code in sorted(_code_records(now).items()):
        name = str(code.get("name", "?"))
        if restored is not None and key not in before_codes:
            out.append(PartialCause(
                "path", name, "no start that published to the store ran this code (a branch on a "
                "tensor value, another graph break, or a call with other arguments)",
                same + " when it takes this path too"))
            continue
        before_inputs = before_codes.get(key, {}).get("inputs") or {}
        # one cause per (code, size in the store, what it is now): its dimensions listed together
        grouped: dict[tuple[Any, Any], list[str]] = {}
        for input_name, entry in sorted((code.get("inputs") or {}).items()):
            had = before_inputs.get(input_name)
            if not isinstance(had, dict) or not isinstance(entry, dict):
                continue
            changes = _new_sizes(had.get("size"), entry.get("size"))
            if not changes and had.get("scalar") != entry.get("scalar") and not isinstance(entry.get("size"), list):
                changes = [(None, had.get("scalar"), entry.get("scalar"))]
            for dim, was, is_now in changes:
                where = input_name if dim is None else f"{input_name} dim {dim}"
                grouped.setdefault((was, is_now), []).append(where)
        for (was, is_now), wheres in grouped.items():
            them = "it" if len(wheres) == 1 else "them"
            if is_now == "dyn" and not dynamic_false:
                later = (f"now recorded as varying: a later node compiles {them} dynamic and hits at "
                         f"any size of {them}" if publishes else same)
                detail = f"{', '.join(wheres)}: {was} in the store, another size here"
            else:
                later = (f"{same} at this size only (dynamic=False pins static graphs)"
                         if dynamic_false else same)
                detail = f"{', '.join(wheres)}: {was} in the store, {is_now} here"
            out.append(PartialCause("shape", name, detail, later))
    shaped = {c.code for c in out if c.kind == "shape"}
    for name, reasons in sorted(guards.items()):
        for reason in dict.fromkeys(reasons):  # each distinct reason once, in order
            kind = _guard_kind(reason)
            if kind == "shape" and name in shaped:
                continue  # the record already says which dimension
            later = {"dtype": same + " with this dtype", "value": same + " with this value"}.get(kind, same)
            out.append(PartialCause(kind, name, " ".join(reason.split())[:300], later))
    varying = _varying(restored)
    if not out and graphs and varying and not dynamic_false:
        # The record said these vary, so this start compiled them dynamic from its first call;
        # the starts that published had compiled their first size static, then went on.
        later = ("a later node hits at any size of them (this start publishes the dynamic graphs)"
                 if publishes else same)
        for name, inputs in sorted(varying.items()):
            out.append(PartialCause(
                "shape", name, f"{', '.join(inputs)} compiled dynamic here: the store's record has "
                "them varying, but no start had compiled that graph dynamic yet", later))
    if not out and graphs:
        out.append(PartialCause(
            "other", "-", f"{graphs} graph(s) compiled with no new shape, path or failing guard seen "
            "(another torch setting, or graphs compiled later, such as the backward)", same))
    return out
