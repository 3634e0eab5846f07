"""When torch cannot load what a pack restored: remove the file, let torch build it, set the pack aside.

Restore checks every member before torch sees it (a shared library must be a complete ELF/Mach-O
file of the size the capture recorded), but a structurally complete library can still be one
``dlopen`` refuses (garbage inside, another machine's). The session registers every pack it
restored (:func:`restored`); the hook around torch's loads
(:func:`compile_cache.torch_compat.inductor_cache.guard_cache_loads`) calls
:func:`on_load_failure` with torch's error, which removes the restored files the error names (so
torch builds them, or compiles the graph: the job goes on), quarantines their pack once, counts
it (``load_failures``; the hit the restore counted becomes a miss) and warns once.
"""

from __future__ import annotations

import contextlib
import errno
import os

from . import artifacts
from .report import CacheReport
from .store import PackInfo, Store

__all__ = ["local_failure", "on_load_failure", "origin", "restored"]

# origin -> (store, the pack, the report of the session that restored it)
_restored_packs: dict[tuple[str, str, str], tuple[Store, PackInfo, CacheReport]] = {}
_failed_reports: set[int] = set()
_quarantined: set[tuple[str, str, str]] = set()


def origin(store: Store, info: PackInfo) -> tuple[str, str, str]:
    """What a restored file remembers of its pack (``artifacts.restore(..., origin=...)``)."""
    return (str(store.root), info.key, info.name)


def _paths_in(exc: BaseException) -> set[str]:
    """Every restored file an exception (or its causes) names: the library dlopen refused."""
    texts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts.append(str(current))
        texts.extend(str(getattr(current, a)) for a in ("path", "filename", "filename2")
                     if getattr(current, a, None))
        current = current.__cause__ or current.__context__
    text = "\n".join(texts)
    return {path for path in artifacts.restored_files() if path in text}


def on_load_failure(exc: BaseException) -> bool:
    """Torch could not load compiled code: if the error names files a pack restored, remove
    those files (torch then builds them again, or compiles the graph), quarantine the pack once,
    count it and warn once. Returns whether the failure was ours to handle."""
    handled = False
    for path in sorted(_paths_in(exc)):
        where = artifacts.restored_origin(path)
        artifacts.forget_restored(path)
        with contextlib.suppress(OSError):
            os.unlink(path)
        handled = True
        entry = _restored_packs.get(where)
        if entry is None:
            continue
        store, info, report = entry
        report.load_failures += 1
        if where in _quarantined:  # once per pack, however many of its files fail
            continue
        _quarantined.add(where)
        reason = f"torch could not load {path} ({type(exc).__name__}: {str(exc)[:300]})"
        local = local_failure(exc)
        if local is not None:  # this node's trouble, not the pack's: counted, the pack kept
            report.errors.append(f"load: pack {info.name}: {reason} (a local error: pack kept)")
            store.record_error(f"load-{local}")
            continue
        report.errors.append(f"load: pack {info.name}: {reason}")
        if id(report) not in _failed_reports:  # the hit this report counted becomes a miss, once
            _failed_reports.add(id(report))
            store.record_failed_hit(info.key)
        store.quarantine(info, reason, counter="load_failures")
    return handled


#: errno names of failures that are this node's, not a pack's (out of files, memory or disk).
_LOCAL_ERRNOS = {errno.EMFILE: "EMFILE", errno.ENFILE: "ENFILE", errno.ENOMEM: "ENOMEM",
                 errno.ENOSPC: "ENOSPC", errno.EIO: "EIO", errno.EAGAIN: "EAGAIN"}
_LOCAL_TEXTS = {"Too many open files": "EMFILE", "Cannot allocate memory": "ENOMEM",
                "No space left on device": "ENOSPC", "Input/output error": "EIO",
                "Resource temporarily unavailable": "EAGAIN"}


def local_failure(exc: BaseException) -> str | None:
    """The errno name if ``exc`` (or a cause) is this node's failure (EMFILE, ENOMEM, ENOSPC,
    EIO: the same library loads elsewhere), else None: only a failure of the content itself
    sets a shared pack aside."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _LOCAL_ERRNOS:
            return _LOCAL_ERRNOS[current.errno]
        text = str(current)
        for needle, name in _LOCAL_TEXTS.items():
            if needle in text:  # dlopen's errors are strings: "...: Too many open files"
                return name
        current = current.__cause__ or current.__context__
    return None


def restored(where: tuple[str, str, str], store: Store, info: PackInfo, report: CacheReport) -> None:
    """A session restored ``info`` (its files carry ``where`` as their origin)."""
    _restored_packs[where] = (store, info, report)


def _reset() -> None:
    """Forget the restored packs (tests)."""
    _restored_packs.clear()
    _failed_reports.clear()
    _quarantined.clear()
