"""The checks of a store on object storage: a downloaded pack's (:func:`check_downloaded`), and
``verify`` (every pack object downloaded and checked as a load checks it, and its content name;
every entry.json and counters object parsed; with ``fix`` corrupt packs go to the URL's
quarantine and garbage objects are removed)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._paths import temp_path
from ..errors import CorruptPackError
from . import maintenance
from ._io import MAX_JSON_BYTES, errno_name, parse_json
from .backend import TooLargeError
from .pack import IncompatiblePackError, SignatureMismatchError
from .records import VerifyReport

if TYPE_CHECKING:
    from .core import Store
    from .remote import RemoteTier

__all__ = ["check_downloaded", "json_ok", "verify"]


def verify(tier: RemoteTier, store: Store, fix: bool, temp_age: float, labels: Any) -> VerifyReport:
    """``Store.verify`` on the URL: every pack object downloaded and checked as a load checks
    it (and its content name), every entry.json and counters object parsed."""
    report = VerifyReport(fixed=bool(fix))
    now = time.time()
    for key, entry in tier.listing().items():
        report.checked_entries += 1
        if entry.entry_json is not None:
            data = tier.backend.get(tier.layout.entry_json(key), MAX_JSON_BYTES)
            if data is not None and not json_ok(data):
                report.bad_entries.append(f"{tier.display}/{tier.layout.entry_json(key)}")
                if fix:
                    tier.backend.delete([tier.layout.entry_json(key)])
        for name in entry.packs:
            report.checked_packs += 1
            try:
                problem = _check_object(tier, store, key, name, labels, fix)
            except OSError as exc:  # this node's error: counted; the bucket's pack is kept
                report.unchecked.append((f"{tier.display}/{tier.layout.pack_object(key, name)}",
                                         f"{errno_name(exc)}: {exc}"))
                store._bump(errors=1, errors_by_kind={errno_name(exc): 1})
                continue
            if isinstance(problem, IncompatiblePackError):
                report.incompatible_packs.append(f"{tier.display}/{tier.layout.pack_object(key, name)}")
            elif isinstance(problem, SignatureMismatchError):
                report.other_signer_packs.append(f"{tier.display}/{tier.layout.pack_object(key, name)}")
            elif problem is not None:
                report.corrupt_packs.append((f"{tier.display}/{tier.layout.pack_object(key, name)}", str(problem)))
        if not entry.packs and now - entry.newest > temp_age:
            report.empty_entries.append(f"{tier.display}/{tier.layout.entry_dir(key)}")
            if fix:
                tier.backend.delete(tier._objects(key))
    for full in tier.backend.list(tier.layout.stats_dir):
        data = tier.backend.get(full, MAX_JSON_BYTES)
        if data is not None and not json_ok(data):
            report.bad_stats.append(f"{tier.display}/{full}")
            if fix:
                tier.backend.delete([full])
    if fix:
        tier._prune_quarantine(maintenance.QUARANTINE_KEEP)
    return report  # type: ignore[return-value]

def _check_object(tier: RemoteTier, store: Store, key: str, name: str, labels: Any, fix: bool) -> BaseException | None:
    """Download one pack object to a temp file and check it; its problem, or None. With
    ``fix`` a corrupt one (a content check failed) goes to the URL's quarantine; a local I/O
    error raises OSError and touches nothing in the bucket."""
    store._mkdirs(store.layout.tmp_dir)
    tmp = temp_path(store.layout.tmp_dir / f"verify-{name}.pack")
    try:
        with store.fs.create(tmp, store.file_mode) as out:
            try:
                tier.backend.download(tier.layout.pack_object(key, name), out, store.limits.max_pack_size)
            except FileNotFoundError:
                return None
            except TooLargeError as exc:
                problem: BaseException | None = CorruptPackError(str(exc))
            else:
                problem = None
        if problem is None:
            problem = check_downloaded(store, tmp, key, name, labels, keep_other=False)
        if problem is not None and fix and not isinstance(problem, (IncompatiblePackError, SignatureMismatchError)):
            tier.backend.put_file(tier.layout.quarantine_object(key, name), str(tmp))
            tier.backend.delete([tier.layout.pack_object(key, name)])
            store._bump(corrupt=1)
        return problem
    finally:
        with contextlib.suppress(FileNotFoundError):
            store.fs.unlink(tmp)


def json_ok(data: bytes) -> bool:
    try:
        return isinstance(parse_json(data), dict)
    except ValueError:
        return False


def check_downloaded(store: Store, path: Path, key: str, name: str, labels: Any = None,
                      *, keep_other: bool = True) -> BaseException | None:
    """The checks a load makes, plus the content name; None if the pack may be used. A pack of
    another format version or signer is not corrupt (``keep_other``: None, the load skips it)."""
    try:
        fh = store.fs.open_read(path)
        checked = store._check_pack(path, fh, key, labels)
        try:
            if checked.content_hash() != name:
                return CorruptPackError(f"its content does not match its name {name}")
        finally:
            checked.close()
    except (IncompatiblePackError, SignatureMismatchError) as exc:
        return None if keep_other else exc
    except CorruptPackError as exc:  # a content check (checksum, signature, member, name)
        return exc
    return None  # an OSError (EMFILE, EIO: this node's) propagates: never a reason to delete
