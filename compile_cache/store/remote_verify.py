"""Verify of a store on object storage: every pack object downloaded and checked as a load checks
it (and its content name), every entry.json and counters object parsed. The report's ``fix()``
moves the corrupt packs it listed to the URL's quarantine and removes the garbage objects."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from .._paths import temp_path
from ..errors import CorruptPackError
from ._io import MAX_JSON_BYTES, errno_name, json_object
from .backends import TooLargeError
from .maintenance import QUARANTINE_KEEP
from .pack import IncompatiblePackError, SignatureMismatchError
from .records import VerifyReport
from .remote import RemoteTier

__all__ = ["verify"]


def _garbage(data: bytes | None) -> bool:
    return data is not None and json_object(data)[0] is None


def verify(tier: RemoteTier, temp_age: float, labels: Any) -> VerifyReport:
    """``Store.verify`` on the URL: the scan (nothing changed); its ``fix()`` fixes what it lists."""
    report = VerifyReport()
    fixes: list[Callable[[], None]] = []
    now = time.time()
    backend, layout, shown = tier.backend, tier.layout, tier.display
    for key, entry in tier.listing().items():
        report.checked_entries += 1
        if entry.entry_json is not None and _garbage(backend.get(layout.entry_json(key), MAX_JSON_BYTES)):
            report.bad_entries.append(f"{shown}/{layout.entry_json(key)}")  # type: ignore[arg-type]
            fixes.append(lambda k=key: backend.delete([layout.entry_json(k)]))
        for name in entry.packs:
            report.checked_packs += 1
            obj = layout.pack_object_of(entry, name)
            where = f"{shown}/{obj}"
            try:
                problem = _check_object(tier, key, name, obj, labels)
            except OSError as exc:  # this node's error: counted; the bucket's pack is kept
                report.unchecked.append((where, f"{errno_name(exc)}: {exc}"))  # type: ignore[arg-type]
                tier.local.counters.bump(errors=1, errors_by_kind={errno_name(exc): 1})
                continue
            if isinstance(problem, IncompatiblePackError):
                report.incompatible_packs.append(where)  # type: ignore[arg-type]
            elif isinstance(problem, SignatureMismatchError):
                report.other_signer_packs.append(where)  # type: ignore[arg-type]
            elif problem is not None:
                report.corrupt_packs.append((where, str(problem)))  # type: ignore[arg-type]
                fixes.append(lambda k=key, n=name, o=obj: _quarantine(tier, k, n, o))
        if not entry.packs and now - entry.newest > temp_age:
            report.empty_entries.append(f"{shown}/{layout.entry_dir(key)}")  # type: ignore[arg-type]
            fixes.append(lambda k=key: backend.delete(tier.objects(k)))
    for full in backend.list(layout.stats_dir):
        if _garbage(backend.get(full, MAX_JSON_BYTES)):
            report.bad_stats.append(f"{shown}/{full}")  # type: ignore[arg-type]
            fixes.append(lambda f=full: backend.delete([f]))

    def fix(_report: VerifyReport) -> None:
        tier.local.fs.require_writable("fix the store")
        for action in fixes:
            action()
        tier.prune_quarantine(QUARANTINE_KEEP)

    report.fixer = fix
    return report


def _download(tier: RemoteTier, obj: str, name: str, body: Callable[[str, Any], Any]) -> Any:
    """Download the pack object ``obj`` (of pack ``name``) to a temp file of the local tier (bounded by the pack size
    limit: what is over it is a :class:`TooLargeError`), call ``body`` with its path, delete it.
    None when the object is gone."""
    local = tier.local
    local.fs.mkdirs(local.layout.tmp_dir)
    tmp = temp_path(local.layout.tmp_dir / f"verify-{name}.pack")
    too_large: TooLargeError | None = None
    try:
        with local.fs.create(tmp) as out:
            try:
                tier.backend.download(obj, out,
                                      local.checker.limits.max_pack_size)
            except FileNotFoundError:
                return None
            except TooLargeError as exc:
                too_large = exc
        return body(str(tmp), too_large)
    finally:
        with contextlib.suppress(FileNotFoundError):
            local.fs.unlink(tmp)


def _check_object(tier: RemoteTier, key: str, name: str, obj: str, labels: Any) -> BaseException | None:
    """Download one pack object to a temp file and check it: its problem, or None. A local I/O
    error raises OSError and touches nothing in the bucket."""
    def check(tmp: str, too_large: BaseException | None) -> BaseException | None:
        if too_large is not None:
            return CorruptPackError(str(too_large))
        return tier.local.checker.check_file(tier.local.fs, tmp, key, name, labels,  # type: ignore[arg-type]
                                             keep_other=False)

    return _download(tier, obj, name, check)


def _quarantine(tier: RemoteTier, key: str, name: str, obj: str) -> None:
    """Move a corrupt pack object to the URL's quarantine (what a download of it gives)."""
    def move(tmp: str, _too_large: BaseException | None) -> None:
        tier.backend.put_file(tier.layout.quarantine_object(key, name), tmp)
        tier.backend.delete([obj])
        tier.local.counters.bump(corrupt=1)

    _download(tier, obj, name, move)
