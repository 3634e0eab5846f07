"""Pack members <-> files in torch's local caches: capture what a compile added, restore it elsewhere.

A *pack* is a plain ``dict[str, bytes]`` of members:

``inductor/<relative path>``
    a file under the local Inductor cache dir (``TORCHINDUCTOR_CACHE_DIR``, default
    ``/tmp/torchinductor_<user>``): FX-graph entries, AOTAutograd entries, compiled ``.so`` files,
    precompile (Dynamo) entries.
``triton/<relative path>``
    a file under ``TRITON_CACHE_DIR`` when it is set outside the Inductor dir (otherwise Triton's
    files sit under ``inductor/triton/...`` and travel as Inductor members).

Why files and not torch's Mega-Cache (``save_cache_artifacts``): on CPU it lacks the compiled
C++ ``.so`` files, so a fresh cache dir rebuilds them with g++; the local cache dir is
relocatable, so copying the files a compile added gives a full hit on a new node.

Permissions travel by rule, not in the pack: :func:`restore` writes shared libraries (``.so``,
``.dylib``, ``.pyd``, ``.dll``) with mode ``0o755`` and everything else with ``0o644`` (both
subject to the umask); a caller that knows better passes ``modes`` (member -> permission bits).

Where torch keeps its cache dir, and its ISA probe, are asked of :mod:`compile_cache.torch_compat`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from ._paths import atomic_write, check_member_name
from .errors import UnsafePathError
from .store.members import (
    PACK_LABELS,
    BadMemberError,
    check_member,
    is_complete_library,
    is_library_name,
    name_problem,
)
from .torch_compat import inductor_cache, isa

log = logging.getLogger("compile_cache.artifacts")

__all__ = [
    "LABELS",
    "BadMemberError",
    "Capture",
    "UnrestorableMemberError",
    "RestoreResult",
    "check_member",
    "check_restorable",
    "default_mode",
    "is_complete_library",
    "is_skipped",
    "library_sizes",
    "isa_probe_answers",
    "local_cache_dirs",
    "forget_restored",
    "read_members",
    "restore",
    "restored_files",
    "restored_origin",
    "trust_restored_isa_answers",
    "validate_member",
]

_EXECUTABLE_SUFFIXES = (".so", ".dylib", ".pyd", ".dll")
#: The first part of every member name: which local cache dir it restores into.
LABELS = PACK_LABELS
# Directories under a cache root whose content is never worth carrying: lock files, and Inductor's
# own temporary files.
_SKIP_DIRS = frozenset({"locks", "__pycache__"})
# File suffixes that are dropped from packs: locks and temporaries, and the C++ build intermediates
# (a fresh process loads the ``.so`` and never rebuilds once the FX entry hits; see the report).
_SKIP_SUFFIXES = (".lock", ".tmp", ".o", ".cpp", ".h", ".gch", ".json.tmp")
_SKIP_PREFIXES = ("tmp", ".tmp")


# --------------------------------------------------------------------------------------------
# Where torch caches


def local_cache_dirs() -> dict[str, Path]:
    """The local cache roots a compile writes to, by label: ``inductor`` and ``triton``.

    The Inductor dir honours ``TORCHINDUCTOR_CACHE_DIR`` (torch's own resolution, which also
    creates it). The Triton dir is ``TRITON_CACHE_DIR`` when set, else ``<inductor>/triton``,
    where Inductor points Triton (then it is nested and its files are captured as ``inductor/``).
    """
    dirs = inductor_cache.local_dirs(from_torch=True)
    return {"inductor": dirs.inductor, "triton": dirs.triton}


def _roots(dirs: Mapping[str, Path] | None) -> list[tuple[str, Path]]:
    """Label/root pairs, with a root nested inside another one dropped (its files go once)."""
    dirs = dict(local_cache_dirs() if dirs is None else dirs)
    out: list[tuple[str, Path]] = []
    for label, root in dirs.items():
        root = Path(os.path.abspath(root))
        nested = any(
            other_label != label and _is_within(root, Path(os.path.abspath(other)))
            for other_label, other in dirs.items()
        )
        if not nested:
            out.append((label, root))
    return out


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def is_skipped(relpath: str) -> bool:
    """True for files a pack never carries: locks, temporaries, C++ build intermediates.

    ``relpath`` is POSIX and relative to a cache root. What a fresh process needs for zero FX-graph
    misses and no g++ run on CPU is the FX-graph entry (``fxgraph/``), the AOTAutograd entry
    (``aotautograd/``) and the ``.so`` each one names; the ``.cpp``/``.o``/``.h``/``.gch`` files
    are kept by Inductor only as build inputs.
    """
    parts = relpath.split("/")
    if any(p in _SKIP_DIRS for p in parts[:-1]):
        return True
    name = parts[-1]
    if name.startswith(_SKIP_PREFIXES) or name.endswith(_SKIP_SUFFIXES):
        return True
    # Inductor's write_atomic temporaries: ".<pid>.<thread>.tmp"; other hidden partial files.
    return name.startswith(".")


# --------------------------------------------------------------------------------------------
# Capture


_Stamp = tuple[int, int]  # (size, mtime_ns)


def _scan(roots: Iterable[tuple[str, Path]]) -> dict[str, tuple[Path, _Stamp]]:
    """Member name -> (path, stamp) for every regular, non-skipped file under the roots."""
    found: dict[str, tuple[Path, _Stamp]] = {}
    roots = list(roots)
    root_paths = {r for _, r in roots}
    for label, root in roots:
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            here = Path(dirpath)
            # Don't descend into another label's root (a nested TRITON_CACHE_DIR) or skipped dirs.
            dirnames[:] = [
                d for d in dirnames if d not in _SKIP_DIRS and (here / d) not in root_paths
            ]
            rel_dir = here.relative_to(root).as_posix()
            for fn in filenames:
                rel = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                if is_skipped(rel):
                    continue
                path = here / fn
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                found[f"{label}/{rel}"] = (path, (st.st_size, st.st_mtime_ns))
    return found


class Capture:
    """What a compile adds to the local caches: snapshot before, :meth:`collect` after.

    The snapshot holds names, sizes and mtimes only (one directory walk). Start it before
    ``torch.compile``/``module.compile()`` and call :meth:`collect` after the first forward (the
    compile happens lazily there).
    """

    def __init__(self, dirs: Mapping[str, Path] | None = None) -> None:
        self._roots = _roots(dirs)
        self._before = {name: st for name, (_, st) in _scan(self._roots).items()}

    def changed(self) -> dict[str, Path]:
        """Member name -> path of every file added or changed since the snapshot."""
        now = _scan(self._roots)
        return {
            name: path for name, (path, st) in sorted(now.items()) if self._before.get(name) != st
        }

    def collect(self) -> dict[str, bytes]:
        """Member name -> bytes of every file added or changed since the snapshot.

        A file that vanished between the walk and the read is left out, and so is one torch has
        not finished: a file that changed while it was read, or a shared library that is not a
        complete ELF/Mach-O file yet (torch's linker writes each ``.so`` in place, at 0 bytes for
        a while). What a library member was
        captured from is recorded in :attr:`recorded` (``{"file_size": n}``), and checked
        again by every restore.
        """
        members: dict[str, bytes] = {}
        self.recorded: dict[str, dict[str, Any]] = {}
        for name, path in self.changed().items():
            try:
                data = _read_finished(path)
            except OSError as e:  # removed or replaced meanwhile: not ours to carry
                log.debug("capture: skipping %s: %s", path, e)
                continue
            if data is None or (is_library_name(name) and not is_complete_library(data)):
                log.info("capture: leaving out %s: torch has not finished writing it", path)
                continue
            members[name] = data
            if is_library_name(name):
                self.recorded[name] = {"file_size": len(data)}
        return members


def read_members(paths: Iterable[str | os.PathLike[str]],
                 dirs: Mapping[str, Path] | None = None) -> dict[str, bytes]:
    """Member name -> bytes of the given files under the local cache dirs (others are skipped).

    For files a compile is known to have written (a region group's Dynamo precompile entry).
    """
    roots = [(label, Path(os.path.realpath(root))) for label, root in _roots(dirs)]
    members: dict[str, bytes] = {}
    for path in paths:
        real = Path(os.path.realpath(path))
        for label, root in roots:
            if _is_within(real, root):
                try:
                    members[f"{label}/{real.relative_to(root).as_posix()}"] = real.read_bytes()
                except OSError as e:
                    log.debug("read_members: skipping %s: %s", path, e)
                break
    return members


def library_sizes(members: Mapping[str, bytes]) -> dict[str, dict[str, Any]]:
    """``{"file_size": n}`` per library member: what a pack's member table records of the
    finished file, checked again by every restore."""
    return {name: {"file_size": len(data)} for name, data in members.items() if is_library_name(name)}


def _read_finished(path: Path) -> bytes | None:
    """The bytes of ``path``, or None if it changed while read (someone is still writing it)."""
    before = path.lstat()
    data = path.read_bytes()
    after = path.lstat()
    stamp = (before.st_ino, before.st_size, before.st_mtime_ns)
    if stamp != (after.st_ino, after.st_size, after.st_mtime_ns) or len(data) != after.st_size:
        return None
    return data


# --------------------------------------------------------------------------------------------
# Restore


@dataclasses.dataclass
class RestoreResult:
    """What :func:`restore` did: files written, files already present, and bytes written."""

    written: list[str] = dataclasses.field(default_factory=list)
    present: list[str] = dataclasses.field(default_factory=list)
    bytes_written: int = 0
    #: member -> (real path, size, mtime_ns) of every file written or found present
    files: dict[str, tuple[str, int, int]] = dataclasses.field(default_factory=dict)


def validate_member(name: str) -> tuple[str, PurePosixPath]:
    """Split a member name into (label, relative path), or raise :class:`UnsafePathError`.

    The name must pass the store's own check (:func:`compile_cache._paths.check_member_name`:
    relative POSIX path, no ``..``/``.``/empty parts, no NUL or backslash) and have a path below
    its label.
    """
    parts = check_member_name(name).split("/")
    if len(parts) < 2:
        raise UnsafePathError(f"pack member {name!r} has no path below its label")
    return parts[0], PurePosixPath(*parts[1:])


def default_mode(name: str) -> int:
    """The permission bits restore gives a member: 0o755 for shared libraries, else 0o644."""
    return 0o755 if name.endswith(_EXECUTABLE_SUFFIXES) else 0o644


def _check_no_links(root: Path, rel: PurePosixPath, name: str) -> None:
    """Raise if an existing component of root/rel is a symlink, or the target is not a file."""
    cur = root
    for i, part in enumerate(rel.parts):
        cur = cur / part
        try:
            st = cur.lstat()
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(f"pack member {name!r} would write through a link at {cur}")
        last = i == len(rel.parts) - 1
        if not last and not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(f"pack member {name!r}: {cur} is not a directory")
        if last and not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"pack member {name!r}: {cur} exists and is not a regular file")


class UnrestorableMemberError(UnsafePathError, BadMemberError):
    """A member no restore can place: an unknown label, a name no filesystem holds. The pack is
    bad for everyone (quarantined), unlike a problem of this node's local dir."""


def check_restorable(name: str, roots: Mapping[str, Path] | None = None) -> tuple[Path, PurePosixPath]:
    """``(root, relative path)`` a member restores to, or raise :class:`UnsafePathError` for a
    name that could escape, :class:`UnrestorableMemberError` for an unknown label or a name no
    filesystem holds (over ``COMPILE_CACHE_MAX_MEMBER_NAME``, a part over 255 bytes)."""
    label, rel = validate_member(name)
    root = (roots if roots is not None else local_cache_dirs()).get(label)
    if root is None:
        raise UnrestorableMemberError(f"pack member {name!r} has unknown label {label!r}")
    problem = name_problem(name)
    if problem is not None:
        raise UnrestorableMemberError(problem)
    return Path(root), rel


def restore(
    members: Mapping[str, bytes],
    modes: Mapping[str, int] | None = None,
    dirs: Mapping[str, Path] | None = None,
    *,
    origin: Any = None,
) -> RestoreResult:
    """Write a pack's files into the current local cache dirs.

    Every member name is checked before anything is written (:func:`check_restorable` raises
    for the first bad one): it must be ``<label>/<relative path>`` with a known label, no
    absolute path, no ``..``/``.``/empty parts, fit the name limits, and no existing link on the
    way. A file that already exists with the same bytes is left alone (idempotent); otherwise
    the bytes go to a unique temporary name in the target dir and ``os.replace`` publishes them,
    so processes restoring the same pack concurrently never see a partial file. Members read
    from a store pack (:class:`~compile_cache.store.reader.PackMembers`, already checked by the
    store's load) are copied in chunks, never held whole. ``modes`` overrides
    :func:`default_mode` per member. ``origin`` (e.g. the pack) is remembered for each file
    (:func:`restored_origin`), to find the pack again if torch cannot load the file.
    """
    # The roots' real paths: a symlinked root is resolved once, here, never followed per file.
    roots = {label: Path(os.path.realpath(p)) for label, p in (dirs or local_cache_dirs()).items()}
    plan: list[tuple[str, Path]] = []
    result = RestoreResult()
    streamed = callable(getattr(members, "chunks", None))
    for name in members:
        root, rel = check_restorable(name, roots)
        if not streamed and not isinstance(members[name], (bytes, bytearray, memoryview)):
            raise UnsafePathError(f"pack member {name!r} is not bytes")
        _check_no_links(root, rel, name)
        plan.append((name, root.joinpath(*rel.parts)))

    umask = _umask()
    for name, target in plan:
        size, chunks = _source(members, name, streamed)
        if _same_file(target, size, chunks):
            result.present.append(name)
        else:
            mode = (modes or {}).get(name, default_mode(name)) & 0o777 & ~umask
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(target, chunks(), mode=mode, fsync=False)  # torch's cache is not fsynced either
            result.written.append(name)
            result.bytes_written += size
        real = os.path.realpath(target)
        if name.endswith(_EXECUTABLE_SUFFIXES):
            _restored_libraries[name] = real
        if origin is not None:
            _restored_origins[real] = origin
        try:
            st = os.lstat(real)
            result.files[name] = (real, st.st_size, st.st_mtime_ns)
        except OSError:
            pass
    return result


def _source(members: Mapping[str, bytes], name: str, streamed: bool) -> tuple[int, Callable[[], Iterable[bytes]]]:
    """``(size, chunks)`` of one member: streamed from a pack file, or the bytes in memory."""
    if streamed:
        return members.size(name), lambda: members.chunks(name)  # type: ignore[attr-defined]
    data = bytes(members[name])
    return len(data), lambda: (data,)


def _same_file(path: Path, size: int, chunks: Callable[[], Iterable[bytes]]) -> bool:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return False
    try:
        with open(path, "rb") as fh:
            for chunk in chunks():
                if fh.read(len(chunk)) != chunk:
                    return False
            return fh.read(1) == b""
    except OSError:
        return False


_restored_origins: dict[str, Any] = {}  # realpath of a file restore() wrote or found -> origin


def restored_origin(path: str | os.PathLike[str]) -> Any:
    """The ``origin`` that :func:`restore` was given for the file at ``path`` (None if it did
    not restore it)."""
    return _restored_origins.get(os.path.realpath(path))


def restored_files(origin: Any = None) -> list[str]:
    """The files :func:`restore` wrote or found (for ``origin``, or for any)."""
    return [path for path, o in _restored_origins.items() if origin is None or o == origin]


def forget_restored(path: str | os.PathLike[str]) -> None:
    """Forget that :func:`restore` put ``path`` in place (it was removed, or replaced)."""
    _restored_origins.pop(os.path.realpath(path), None)


def _umask() -> int:
    # os.umask has no read-only form; this pair is process-global but brief.
    current = os.umask(0o022)
    os.umask(current)
    return current


# --------------------------------------------------------------------------------------------
# Inductor's CPU instruction-set probe
#
# Every new process, Inductor checks each candidate vector ISA by building a test library (cached
# in the local dir, so a restore brings it) and loading it in a child Python (torch_compat/isa.py
# has the details): 0.2 s (torch 2.13) to 1.5 s (torch 2.11, whose child imports torch) per library.
# The publisher records the answer its own probe gave for each library (isa_probe_answers(), in
# the pack's metadata); a process that restored the pack gives exactly that answer for exactly
# those restored files, without the child process. The key pins the torch build and the CPU's
# instruction set (the environment key's cpu_capability), so the ISA Inductor picks, its flags, and
# with them every kernel key, are the same; a library the pack did not bring, or one the
# publisher's probe never saw, is still probed by torch.

_restored_libraries: dict[str, str] = {}  # member name -> realpath of a library restore() wrote
_trusted_answers: dict[str, bool] = {}  # realpath -> the publisher's probe answer for it


def isa_probe_answers(dirs: Mapping[str, Path] | None = None) -> dict[str, bool] | None:
    """The probe answers this process saw, by pack member name (None if it saw none).

    Only libraries inside the local cache dirs (``dirs``, default :func:`local_cache_dirs`), the
    ones a pack can carry.
    """
    answers: dict[str, bool] = {}
    roots = [(label, Path(os.path.realpath(root))) for label, root in _roots(dirs)]
    for path, answer in isa.observed().items():
        for label, root in roots:
            if _is_within(Path(path), root):
                answers[f"{label}/{Path(path).relative_to(root).as_posix()}"] = answer
                break
    return answers or None


def trust_restored_isa_answers(answers: Mapping[str, bool]) -> int:
    """Answers Inductor's ISA probe for restored libraries as the packs' publisher's probe did.

    ``answers``: member name -> answer, from :func:`isa_probe_answers` of the publisher. Returns
    how many restored libraries are now answered (0 if none, or torch has no probe to hook).
    """
    trusted = {
        _restored_libraries[name]: bool(answer)
        for name, answer in answers.items()
        if name in _restored_libraries and isinstance(answer, bool)
    }
    if not trusted or not isa.add_answerer(_answer_restored):
        return 0
    _trusted_answers.update(trusted)
    log.debug("Inductor's ISA probe: %d restored libraries answered as published", len(trusted))
    return len(trusted)


def _answer_restored(isa_object: Any, path: str) -> bool | None:
    return _trusted_answers.get(path)


def _reset() -> None:
    """Forget restored files and trusted probe answers (tests)."""
    _restored_libraries.clear()
    _trusted_answers.clear()
    _restored_origins.clear()
