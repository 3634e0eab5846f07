"""Verify: a scan of every pack, entry.json, stats file, temp file and lock, and its fixes.

:func:`scan` lists what it finds in a :class:`~.records.VerifyReport` and changes nothing; the
report's :meth:`~.records.VerifyReport.fix` then fixes what the scan listed, in the order found:
corrupt packs quarantined (an entry they leave empty removed), superseded packs compacted, the
rest removed, old quarantine pruned, the size counter set exact.
"""

from __future__ import annotations

import contextlib
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import config
from .._paths import is_temp_name
from ..errors import CorruptPackError, UnsafeStorePathError
from ..locks.base import LOCKDIR_SUFFIX
from ..locks.scan import break_stale_lock_at, is_lock_leftover, is_lock_name, is_stale_at
from ._io import check_seconds, errno_name
from .counters import bad_counts
from .maintenance import QUARANTINE_KEEP, compact, prune_quarantine, remove_entry_dir, total_size
from .pack import IncompatiblePackError, SignatureMismatchError
from .parts import StoreParts
from .records import VerifyReport
from .safety import trust_problem

__all__ = ["scan"]

Fix = Callable[[VerifyReport], None]


class _Scan:
    """One verify run over the store ``parts``: the report, and the fixes of what it lists."""

    def __init__(self, parts: StoreParts, temp_age: float, lock_stale_after: float, labels: Any) -> None:
        self.parts, self.fs, self.layout = parts, parts.fs, parts.layout
        self.temp_age, self.lock_stale_after, self.labels = temp_age, lock_stale_after, labels
        self.report = VerifyReport()
        self.fixes: list[Fix] = []
        self.now = time.time()

    def old(self, path: Path) -> bool:
        try:
            return self.now - self.fs.lstat(path).st_mtime > self.temp_age
        except OSError:
            return False

    def remove_later(self, path: Path) -> None:
        self.fixes.append(lambda _report: _remove_path(self.fs, path))

    # -- entries ---------------------------------------------------------------------------------
    def entry(self, key: str) -> None:
        report, layout, fs = self.report, self.layout, self.fs
        report.checked_entries += 1
        entry = layout.entry_dir(key)
        _data, garbage = fs.read_json(layout.entry_json(key))
        if garbage:
            report.bad_entries.append(layout.entry_json(key))
            self.remove_later(layout.entry_json(key))
        for directory in (entry, layout.packs_dir(key)):
            with contextlib.suppress(OSError):
                for name in fs.listdir(directory):
                    if is_temp_name(name) and self.old(directory / name):
                        report.orphaned_temp.append(directory / name)
                        self.remove_later(directory / name)
        self.trust(entry, key)
        packs = layout.pack_paths(key)
        quarantined = [path for path in packs if self.pack(key, path)]
        compacted = self.compaction(key, entry)
        anchor = layout.packs_dir(key) if fs.is_dir(layout.packs_dir(key)) else entry
        if not packs and self.old(anchor):
            report.empty_entries.append(entry)
            self.fixes.append(lambda _report: remove_entry_dir(self.parts, entry))
        elif quarantined or compacted:  # fixing may leave it empty: then it goes too
            self.fixes.append(lambda r: self.left_empty(r, key, entry))

    def left_empty(self, report: VerifyReport, key: str, entry: Path) -> None:
        """After its corrupt packs went: an entry with no pack left is removed too."""
        layout = self.layout
        anchor = layout.packs_dir(key) if self.fs.is_dir(layout.packs_dir(key)) else entry
        if not layout.pack_paths(key) and self.old(anchor):
            report.empty_entries.append(entry)
            remove_entry_dir(self.parts, entry)

    def trust(self, entry: Path, key: str) -> None:
        for directory in (entry.parent, entry, self.layout.packs_dir(key)):
            try:
                st = self.fs.lstat(directory)
            except OSError:
                continue
            problem = trust_problem(st, directory, self.fs.group_mode)
            if not stat.S_ISDIR(st.st_mode):
                self.report.untrusted.append((directory, f"{directory} is a symlink or not a "
                                              "directory: compile_cache follows no link in its store"))
            elif problem is not None:
                self.report.untrusted.append((directory, problem.message))

    def pack(self, key: str, path: Path) -> bool:
        """Check one pack as a restoring job's load does; whether fixing quarantines it."""
        report = self.report
        report.checked_packs += 1
        try:
            # The same checks as a restoring job's load (limits, checksum, signature, members).
            self.parts.checker.check(self.fs.open_read(path), key, self.labels).close()
        except FileNotFoundError:
            return False
        except UnsafeStorePathError as exc:
            if exc.reason != "type":
                report.untrusted.append((path, str(exc)))
                return False
            report.corrupt_packs.append((path, str(exc)))  # a FIFO, a device, a directory
        except IncompatiblePackError:
            report.incompatible_packs.append(path)
            return False
        except SignatureMismatchError:
            report.other_signer_packs.append(path)
            return False
        except CorruptPackError as exc:  # only a content check sets a pack aside
            report.corrupt_packs.append((path, str(exc)))
        except OSError as exc:  # this node's error (EMFILE, EIO): counted, the pack kept
            report.unchecked.append((path, f"{errno_name(exc)}: {exc}"))
            self.parts.counters.bump(errors=1, errors_by_kind={errno_name(exc): 1})
            return False
        else:
            return False
        self.fixes.append(lambda _report: self.quarantine(path, key))
        return True

    def quarantine(self, path: Path, key: str) -> None:
        self.parts.keeper.quarantine(path, key)
        self.parts.counters.bump(corrupt=1)

    def compaction(self, key: str, entry: Path) -> bool:
        """Superseded generations: listed (whether any), and the fix merges them away."""
        try:
            planned = compact(self.parts, key, dry_run=True)
        except OSError as exc:  # said so, never "OK"
            self.report.not_fixed.append((entry, f"could not compact: {errno_name(exc)}: {exc}"))
            self.parts.counters.bump(errors=1, errors_by_kind={errno_name(exc): 1})
            return False
        except CorruptPackError:  # a pack changed under us: the next run compacts
            return False
        if planned is None:
            return False
        index = len(self.report.compactable)
        self.report.compactable.append(planned)
        self.fixes.append(lambda r: self.compact(r, key, entry, index))
        return True

    def compact(self, report: VerifyReport, key: str, entry: Path, index: int) -> None:
        try:
            done = compact(self.parts, key, dry_run=False)
        except OSError as exc:  # ENOSPC mid-merge: said so, never "OK"
            report.not_fixed.append((entry, f"could not compact: {errno_name(exc)}: {exc}"))
            self.parts.counters.bump(errors=1, errors_by_kind={errno_name(exc): 1})
            return
        except CorruptPackError:  # a pack changed under us: the next run compacts
            return
        if done is not None:
            report.compactable[index] = done

    # -- the store's own directories -------------------------------------------------------------
    def temp_files(self) -> None:
        tmp_dir = self.layout.tmp_dir
        with contextlib.suppress(OSError):
            for name in self.fs.listdir(tmp_dir):
                if self.old(tmp_dir / name):
                    self.report.orphaned_temp.append(tmp_dir / name)
                    self.remove_later(tmp_dir / name)

    def locks(self) -> None:
        locks_dir = self.layout.locks_dir
        with contextlib.suppress(OSError):
            for name in self.fs.listdir(locks_dir):
                path = locks_dir / name
                if is_lock_leftover(name) or is_temp_name(name):
                    if self.old(path):
                        self.report.orphaned_temp.append(path)
                        self.remove_later(path)
                elif is_lock_name(name) and _odd_lock(self.fs, path):
                    self.report.orphaned_temp.append(path)  # a FIFO: no lock of ours, never opened
                    self.remove_later(path)
                elif is_lock_name(name):
                    # A lockdir is stale by its holder's heartbeat; an unheld lock file is only
                    # garbage, kept as long as a temp file (copying a store must not flag its locks).
                    age = (self.lock_stale_after if path.name.endswith(LOCKDIR_SUFFIX)
                           else max(self.lock_stale_after, self.temp_age))
                    with self.fs.directory(locks_dir) as dfd:
                        stale = is_stale_at(dfd, path, stale_after=age, one_look=True)
                    if stale:
                        self.report.stale_locks.append(path)
                        self.fixes.append(lambda _r, p=path, a=age: self._break_lock(p, a))

    def _break_lock(self, path: Path, age: float) -> None:
        """Break the stale lock ``path``, in the locks directory reached without a link."""
        with contextlib.suppress(OSError), self.fs.directory(path.parent) as dfd:
            break_stale_lock_at(dfd, path, stale_after=age, one_look=True)

    def stats_files(self) -> None:
        stats_dir = self.layout.stats_dir
        with contextlib.suppress(OSError):
            for name in self.fs.listdir(stats_dir):
                path = stats_dir / name
                if is_temp_name(name):
                    if self.old(path):
                        self.report.orphaned_temp.append(path)
                        self.remove_later(path)
                    continue
                data, garbage = self.fs.read_json(path)
                if garbage or (data is not None and bad_counts(data)):
                    self.report.bad_stats.append(path)
                    self.remove_later(path)

    def fix(self, report: VerifyReport) -> None:
        """Every fix of what the scan listed, in order; then old quarantine, the size exact."""
        self.fs.require_writable("fix the store")
        for fix in self.fixes:
            fix(report)
        report.old_quarantine = prune_quarantine(self.parts, QUARANTINE_KEEP)
        exact = total_size(self.parts)
        report.size_drift = self.parts.counters.tracked_size()[0] - exact
        if not self.fs.read_only:
            self.parts.counters.correct_size(exact)


def scan(parts: StoreParts, temp_age: float, lock_stale_after: float | None, labels: Any = None) -> VerifyReport:
    """See :meth:`Store.verify` (``lock_stale_after`` None: ``COMPILE_CACHE_LOCK_STALE``): the
    report of what was found, nothing changed; its ``fix()`` fixes it."""
    stale = config.LOCK_STALE.value() if lock_stale_after is None else lock_stale_after
    run = _Scan(parts, temp_age, check_seconds("lock_stale_after", stale), labels)
    for key in list(parts.layout.keys()):
        run.entry(key)
    run.temp_files()
    run.locks()
    run.stats_files()
    report = run.report
    report.size_drift = parts.counters.tracked_size()[0] - total_size(parts)
    report.fixer = run.fix
    return report


def _remove_path(fs: Any, path: Path) -> None:
    with contextlib.suppress(OSError):
        fs.remove(path)


def _odd_lock(fs: Any, path: Path) -> bool:
    """Whether the lock name ``path`` holds something no lock of ours is (a FIFO, a device; a
    ``.lock`` that is not a regular file). A ``.lockdir`` is a link (or an older release's
    directory): its text is judged as a record, and a member's link is stale when old."""
    try:
        mode = fs.lstat(path).st_mode
    except OSError:
        return False
    if path.name.endswith(LOCKDIR_SUFFIX):
        return not (stat.S_ISDIR(mode) or stat.S_ISLNK(mode))
    return not stat.S_ISREG(mode)
